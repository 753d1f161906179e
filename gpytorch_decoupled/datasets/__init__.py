"""
Real benchmark data with standard train/test splits, standardized with training statistics only.

``"elevators"`` is embedded in the package. Every other set is looked for in a data directory, then in the download
cache, and a set found nowhere is downloaded from its original public source, verified by SHA-256 (this needs
``pip install "gpytorch_decoupled[data]"``). Environment variables:

- ``GPYTORCH_DECOUPLED_DATA``: data directories searched instead of ``../shared/data`` (several separated by
  ``os.pathsep``).
- ``GPYTORCH_DECOUPLED_SHARED_FALLBACK=0``: do not search ``../shared/data``.
- ``GPYTORCH_DECOUPLED_CACHE``: the download cache (default: pooch's per-user cache, ``~/.cache/gpytorch_decoupled``
  on Linux).
- ``GPYTORCH_DECOUPLED_DOWNLOAD=0``: :func:`load` does not download unless asked to (``download=True``).
- ``GPYTORCH_DECOUPLED_MIRROR``: base URL of a server laid out like a data directory, used instead of the upstream
  URLs.

Example:
    >>> from gpytorch_decoupled import datasets
    >>> train_x, train_y, test_x, test_y = datasets.load("elevators", split=0)
"""

from .downloads import DownloadError, download, files
from .loader import load
from .locations import (
    CACHE_ENV_VAR,
    DATA_ENV_VAR,
    DOWNLOAD_ENV_VAR,
    MIRROR_ENV_VAR,
    SHARED_FALLBACK_ENV_VAR,
    cache_dir,
    data_dirs,
    locate,
)
from .registry import DatasetInfo, available, info, sources
from .split import Split

__all__ = [
    "CACHE_ENV_VAR",
    "DATA_ENV_VAR",
    "DOWNLOAD_ENV_VAR",
    "MIRROR_ENV_VAR",
    "SHARED_FALLBACK_ENV_VAR",
    "DatasetInfo",
    "DownloadError",
    "Split",
    "available",
    "cache_dir",
    "data_dirs",
    "download",
    "files",
    "info",
    "load",
    "locate",
    "sources",
]
