"""
Where data sets are looked for: the configured data directories, the download cache, the embedded copy.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ._checks import check_path
from .registry import info

DATA_ENV_VAR = "GPYTORCH_DECOUPLED_DATA"
SHARED_FALLBACK_ENV_VAR = "GPYTORCH_DECOUPLED_SHARED_FALLBACK"
CACHE_ENV_VAR = "GPYTORCH_DECOUPLED_CACHE"
DOWNLOAD_ENV_VAR = "GPYTORCH_DECOUPLED_DOWNLOAD"
MIRROR_ENV_VAR = "GPYTORCH_DECOUPLED_MIRROR"
INSTALL_HINT = 'pip install "gpytorch_decoupled[data]"'
EMBEDDED_DATA_DIR = Path(__file__).resolve().parent / "data"
_FALSE_WORDS = ("0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """An on/off environment variable: unset, empty or anything but 0/false/no/off means on."""
    return os.environ.get(name, "").strip().lower() not in _FALSE_WORDS


def data_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """
    The data directories searched for data sets, in order; the download cache (:func:`cache_dir`) and the package's
    embedded copies are tried after these.

    An explicit ``data_dir`` is searched alone; otherwise the directories named by the :envvar:`GPYTORCH_DECOUPLED_DATA`
    environment variable (several separated by ``os.pathsep``), when it is set, are searched alone; otherwise
    ``../shared/data`` relative to the working directory and the ``shared/data`` folder next to the repository
    checkout this package was imported from. Setting :envvar:`GPYTORCH_DECOUPLED_SHARED_FALLBACK` to ``0`` turns
    that last fallback off (the test suite uses it to run as on a machine without any data).

    :param data_dir: (Default: None) A directory laid out like the project's ``shared/data`` folder:
        ``<dir>/<name>/<source>/...`` for the UCI sets, ``<dir>/<name>/...`` for the others
        (see :attr:`DatasetInfo.file`).
    :raises TypeError: If ``data_dir`` is neither None, a string nor a path.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> datasets.data_dirs("/data/benchmarks")
        [PosixPath('/data/benchmarks')]
    """
    if data_dir is not None:
        return [check_path("data_dir", data_dir)]
    if os.environ.get(DATA_ENV_VAR):
        return [Path(path) for path in os.environ[DATA_ENV_VAR].split(os.pathsep) if path]
    if not env_flag(SHARED_FALLBACK_ENV_VAR):
        return []
    candidates = [Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[2].parent / "shared" / "data"]
    return list(dict.fromkeys(candidate.resolve() for candidate in candidates))


def cache_dir(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """
    The directory downloaded data sets are kept in, laid out like a data directory.

    An explicit ``cache_dir`` wins; otherwise the :envvar:`GPYTORCH_DECOUPLED_CACHE` environment variable; otherwise
    pooch's per-user cache for this package (``~/.cache/gpytorch_decoupled`` on Linux,
    ``~/Library/Caches/gpytorch_decoupled`` on macOS). Without pooch installed and nothing set there is no cache
    (None), since nothing can have been downloaded.

    :param cache_dir: (Default: None) The directory to use instead of the default.
    :raises TypeError: If ``cache_dir`` is neither None, a string nor a path.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> datasets.cache_dir("/scratch/gp-data")
        PosixPath('/scratch/gp-data')
    """
    if cache_dir is not None:
        return check_path("cache_dir", cache_dir)
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    try:
        with warnings.catch_warnings():
            # pooch imports tqdm.auto, which warns in a Jupyter kernel without ipywidgets (with the path of the
            # environment); every data set lookup comes here, and only the cache path is needed.
            warnings.filterwarnings("ignore", message="IProgress not found")
            import pooch
    except ImportError:
        return None
    return Path(pooch.os_cache("gpytorch_decoupled"))


def locate(name: str, source: str | None = None, data_dir: str | os.PathLike | None = None) -> Path:
    """
    The path of a data set's main file (:attr:`DatasetInfo.file`), found as :func:`load` finds it, without reading
    or downloading it. Use it to check whether a set is present, or to read its raw files.

    The data directories (:func:`data_dirs`) are searched first, then the download cache (:func:`cache_dir`), whose
    sets are complete once their main file is there (a download moves it into place last), then the embedded copy.

    :param name: Data set name or alias (see :func:`available`).
    :param source: (Default: None) Which copy; ``None`` picks the default.
    :param data_dir: (Default: None) Directory laid out like the project's ``shared/data`` folder.
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If the name or source is unknown.
    :raises FileNotFoundError: If the set is found nowhere; the message lists where it looked and says how to get the
        files.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> datasets.locate("elevators").name  # embedded: always found
        'data.csv.gz'
    """
    entry = info(name, source)
    directories = data_dirs(data_dir)
    cache = cache_dir()
    candidates = [directory / entry.file for directory in dict.fromkeys([*directories, *([cache] if cache else [])])]
    if entry.embedded:
        candidates.append(EMBEDDED_DATA_DIR / entry.name / Path(entry.file).name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    looked_in = ", ".join(str(candidate.parent) for candidate in candidates) or "none configured"
    folder = Path(entry.file).parent
    source_argument = "" if source is None else f", source={entry.source!r}"
    raise FileNotFoundError(
        f"Data set {entry.name!r} (source {entry.source!r}) not found: {entry.file} is in none of the searched "
        f"directories ({looked_in}). Download it with datasets.download({entry.name!r}{source_argument}) or "
        f"`python -m gpytorch_decoupled datasets download {entry.name}"
        f"{'' if source is None else ' --source ' + entry.source}` (needs {INSTALL_HINT}), or put its files in "
        f"<data directory>/{folder.as_posix()}/ and name the data directory with load(..., data_dir=...) or the "
        f"{DATA_ENV_VAR} environment variable."
    )
