"""Argument checks of the public data set functions: a clear error naming the argument, before anything is read."""

from __future__ import annotations

import os
from pathlib import Path


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
