"""Argument checks of the public data set functions: a clear error naming the argument, before anything is read."""

from __future__ import annotations

import operator
import os
from pathlib import Path

import torch


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a data set name (str), got {type(name).__name__} {name!r}.")
    return name


def check_source(source: object) -> str | None:
    if source is not None and not isinstance(source, str):
        raise TypeError(f"source must be None or a source name (str), got {type(source).__name__} {source!r}.")
    return source


def check_path(argument: str, value: object) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a directory (str or os.PathLike), got {type(value).__name__} {value!r}.")
    return Path(value)


def check_flag(argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {type(value).__name__} {value!r}.")
    return value


def check_mirror(argument: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ValueError(f"{argument} must be an http:// or https:// base URL, got {value!r}.")
    return value


def check_split(split: object, name: str, source: str, num_splits: int) -> int:
    message = f"split must be an int, the index of a train/test split, got {type(split).__name__} {split!r}."
    if isinstance(split, bool):  # an int to Python, but split=True is a mistake, not split 1
        raise TypeError(message)
    try:
        split = operator.index(split)  # also numpy and one-element torch integers
    except TypeError:
        raise TypeError(message) from None
    if not 0 <= split < num_splits:
        raise ValueError(f"split must be in 0..{num_splits - 1} for {name!r} (source {source!r}), got {split}.")
    return split


def check_dtype(dtype: object) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float64, got {type(dtype).__name__} {dtype!r}.")
    if not dtype.is_floating_point:
        raise TypeError(
            f"dtype must be a floating point torch.dtype (standardized data are fractional: {dtype} would truncate "
            f"them), got {dtype}."
        )
    return dtype


def check_device(device: object) -> torch.device | None:
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"device must be None, a str, an int or a torch.device, got {type(device).__name__} {device!r}."
        )
    try:
        parsed = torch.device(device)
        torch.empty(0, device=parsed)  # an unavailable device fails here, before any file is read
    except (RuntimeError, AssertionError) as error:  # CPU-only builds raise AssertionError for "cuda"
        raise ValueError(f"device {device!r} is not a usable torch device here: {error}") from error
    return parsed
