from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .readers import READERS
from .registry import info
from .split import Split

DATA_ENV_VAR = "GPYTORCH_DECOUPLED_DATA"
SHARED_FALLBACK_ENV_VAR = "GPYTORCH_DECOUPLED_SHARED_FALLBACK"
EMBEDDED_DATA_DIR = Path(__file__).resolve().parent / "data"
_FALSE_WORDS = ("0", "false", "no", "off")


def _env_flag(name: str) -> bool:
    """An on/off environment variable: unset, empty or anything but 0/false/no/off means on."""
    return os.environ.get(name, "").strip().lower() not in _FALSE_WORDS


def data_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """
    The directories searched for data sets, in order (the package's embedded copies are tried after these).

    An explicit ``data_dir`` is searched alone; otherwise the directories named by the :envvar:`GPYTORCH_DECOUPLED_DATA`
    environment variable (several separated by ``os.pathsep``), when it is set, are searched alone; otherwise
    ``../shared/data`` relative to the working directory and the ``shared/data`` folder next to the repository
    checkout this package was imported from. Setting :envvar:`GPYTORCH_DECOUPLED_SHARED_FALLBACK` to ``0`` turns
    that last fallback off (the test suite uses it to run as on a machine without any data).

    :param data_dir: (Default: None) A directory laid out like the project's ``shared/data`` folder:
        ``<dir>/<name>/<source>/...`` for the UCI sets, ``<dir>/<name>/...`` for the others
        (see :attr:`DatasetInfo.file`).

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> datasets.data_dirs("/data/benchmarks")
        [PosixPath('/data/benchmarks')]
    """
    if data_dir is not None:
        return [Path(data_dir)]
    if os.environ.get(DATA_ENV_VAR):
        return [Path(path) for path in os.environ[DATA_ENV_VAR].split(os.pathsep) if path]
    if not _env_flag(SHARED_FALLBACK_ENV_VAR):
        return []
    candidates = [Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[2].parent / "shared" / "data"]
    return list(dict.fromkeys(candidate.resolve() for candidate in candidates))


def locate(name: str, source: str | None = None, data_dir: str | os.PathLike | None = None) -> Path:
    """
    The path of a data set's main file (:attr:`DatasetInfo.file`), found as :func:`load` finds it, without reading
    it. Use it to check whether a set is present, or to read its raw files.

    :param name: Data set name or alias (see :func:`available`).
    :param source: (Default: None) Which copy; ``None`` picks the default.
    :param data_dir: (Default: None) Directory laid out like the project's ``shared/data`` folder.
    :raises ValueError: If the name or source is unknown.
    :raises FileNotFoundError: If the set is in none of the searched directories; the message lists them and says
        how to get the data.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> datasets.locate("elevators").name  # embedded: always found
        'data.csv.gz'
    """
    entry = info(name, source)
    candidates = [directory / entry.file for directory in data_dirs(data_dir)]
    if entry.embedded:
        candidates.append(EMBEDDED_DATA_DIR / entry.name / Path(entry.file).name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    looked_in = ", ".join(str(candidate.parent) for candidate in candidates) or "none configured"
    raise FileNotFoundError(
        f"Data set {entry.name!r} (source {entry.source!r}) not found: {entry.file} is in none of the searched "
        f"directories ({looked_in}). Put the set's files there, as <data directory>/{Path(entry.file).parent}/, "
        f"and name the data directory with load(..., data_dir=...) or the {DATA_ENV_VAR} environment variable."
    )


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

    The set's files are looked up in the directories of :func:`data_dirs`. ``"elevators"`` ships with the package
    and falls back to that copy wherever it is not found, also when ``data_dir`` is given, so that it always loads.
    Nothing is ever downloaded.

    :param name: Data set name or alias (see :func:`available`).
    :param split: (Default: 0) Index of the train/test split, ``0 <= split < info(name, source).num_splits``.
    :param data_dir: (Default: None) Directory laid out like the project's ``shared/data`` folder.
    :param dtype: (Default: ``torch.get_default_dtype()``) Floating point dtype of all returned tensors.
    :param device: (Default: None, the CPU) Device of all returned tensors.
    :param source: (Default: None) Which copy and splits, e.g. ``"gal"`` or ``"evans"``; ``None`` picks the default.
    :raises ValueError: If the name or source is unknown or the split is out of range.
    :raises FileNotFoundError: If the set's files are in none of the searched directories (the message lists them).

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
    if not 0 <= split < entry.num_splits:
        raise ValueError(
            f"split must be in 0..{entry.num_splits - 1} for {entry.name!r} (source {entry.source!r}), got {split}."
        )
    x, y, train, test = READERS[entry.source](locate(entry.name, entry.source, data_dir), split, entry.num_splits)
    x_mean, x_std = _train_statistics(x[train])
    if entry.task == "regression":
        y_mean, y_std = _train_statistics(y[train])
    else:
        y_mean, y_std = np.zeros(y.shape[1:]), np.ones(y.shape[1:])

    dtype = torch.get_default_dtype() if dtype is None else dtype

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
