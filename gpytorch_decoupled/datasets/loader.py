from __future__ import annotations

import os

import numpy as np
import torch

from ._checks import check_device, check_dtype, check_flag, check_split
from .downloads import download as download_set
from .locations import DOWNLOAD_ENV_VAR, env_flag, locate
from .readers import READERS
from .registry import info
from .split import Split


def _train_statistics(train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # An exactly constant column (naval has several) carries no information; scaling it by 1 keeps it finite.
    std = np.where(np.ptp(train, axis=0) == 0, 1.0, train.std(axis=0))
    return np.asarray(train.mean(axis=0)), std


def load(
    name: str,
    split: int = 0,
    data_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    source: str | None = None,
    download: bool | None = None,
) -> Split:
    r"""
    Load one train/test split of a benchmark data set, standardized with its training statistics.

    Inputs, and the targets of regression sets, are shifted and scaled by the mean and population standard deviation
    (``unbiased=False``) of the training rows only, so no test information leaks into the model; a column constant
    on the training rows is scaled by 1. Classification labels are float 0/1 and not standardized. Single-target
    sets return ``y`` of shape ``[n]``; multi-output sets (``"kuka"``, 14 outputs) ``[n, t]``.

    The splits are the published ones where they exist: the 20 (protein: 5) splits of Hernandez-Lobato & Adams
    (2015) for source ``"gal"``, the 10 splits of treforevans/uci_datasets for ``"evans"``. ``"kuka"`` holds out
    trajectory ``split + 1`` of 10, ``"co2"`` has one chronological split (first 80% of months train), and the
    classification sets ``"sonar"``, ``"ionosphere"`` and ``"pima"`` follow the t-SVGP paper's 5-fold
    cross-validation (fold ``split`` of a fixed permutation is the test set). See :func:`info` for each set.

    The set's files are looked up as :func:`locate` does: in ``data_dir``, else the directories of
    :envvar:`GPYTORCH_DECOUPLED_DATA`, else ``../shared/data``, then in the download cache. ``"elevators"`` ships with
    the package and falls back to that copy wherever it is not found, so that it always loads. A set found nowhere is
    downloaded from its original source into the cache (see :func:`download`) when ``download`` allows it.

    :param name: Data set name or alias (see :func:`available`).
    :param split: (Default: 0) Index of the train/test split, ``0 <= split < info(name, source).num_splits``.
    :param data_dir: (Default: None) Directory laid out like the project's ``shared/data`` folder.
    :param dtype: (Default: ``torch.get_default_dtype()``) Floating point dtype of all returned tensors.
    :param device: (Default: None, the CPU) Device of all returned tensors.
    :param source: (Default: None) Which copy and splits, e.g. ``"gal"`` or ``"evans"``; ``None`` picks the default.
    :param download: (Default: None) Whether to download a set that is found nowhere: ``None`` downloads unless the
        :envvar:`GPYTORCH_DECOUPLED_DOWNLOAD` environment variable is ``0`` (the test suite sets it).
    :raises TypeError: If an argument has the wrong type, e.g. a ``split`` that is not an int or a ``dtype`` that is
        not floating point (it would truncate the standardized data).
    :raises ValueError: If the name or source is unknown, the split is out of range or the device is unusable.
    :raises FileNotFoundError: If the set is found nowhere and may not be downloaded; the message lists where it
        looked and says how to get the files.
    :raises ModuleNotFoundError: If the set must be downloaded and pooch is not installed.
    :raises DownloadError: If the download fails (offline, HTTP error, checksum mismatch).

    Example:
        >>> import torch
        >>> from gpytorch_decoupled import datasets
        >>> train_x, train_y, test_x, test_y = datasets.load("elevators", split=3, dtype=torch.float64)
        >>> train_x.shape[1], len(train_x) + len(test_x)
        (18, 16599)
        >>> data = datasets.load("protein", split=2)  # doctest: +SKIP
        >>> mean_in_ppm = datasets.load("co2").unstandardize_y(torch.zeros(3))  # doctest: +SKIP
    """
    entry = info(name, source)
    split = check_split(split, entry.name, entry.source, entry.num_splits)
    dtype = check_dtype(dtype)
    device = check_device(device)
    download = env_flag(DOWNLOAD_ENV_VAR) if download is None else check_flag("download", download)
    try:
        path = locate(name, source, data_dir)
    except FileNotFoundError:
        if not download:
            raise
        path = download_set(entry.name, entry.source)
    x, y, train, test = READERS[entry.source](path, split, entry.num_splits)
    x_mean, x_std = _train_statistics(x[train])
    if entry.task == "regression":
        y_mean, y_std = _train_statistics(y[train])
    else:
        y_mean, y_std = np.zeros(y.shape[1:]), np.ones(y.shape[1:])

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, dtype=dtype, device=device)

    return Split(
        train_x=tensor((x[train] - x_mean) / x_std),
        train_y=tensor((y[train] - y_mean) / y_std),
        test_x=tensor((x[test] - x_mean) / x_std),
        test_y=tensor((y[test] - y_mean) / y_std),
        name=entry.name,
        task=entry.task,
        split=split,
        source=entry.source,
        x_mean=tensor(x_mean),
        x_std=tensor(x_std),
        y_mean=tensor(y_mean),
        y_std=tensor(y_std),
    )
