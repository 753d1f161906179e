"""
Real benchmark data with standard train/test splits, standardized with training statistics only.

Example:
    >>> from gpytorch_decoupled import datasets
    >>> train_x, train_y, test_x, test_y = datasets.load("elevators", split=0)
"""

from .loader import DATA_ENV_VAR, SHARED_FALLBACK_ENV_VAR, data_dirs, load, locate
from .registry import DatasetInfo, available, info, sources
from .split import Split

__all__ = [
    "DATA_ENV_VAR",
    "SHARED_FALLBACK_ENV_VAR",
    "DatasetInfo",
    "Split",
    "available",
    "data_dirs",
    "info",
    "load",
    "locate",
    "sources",
]
