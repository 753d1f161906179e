"""
Fetching a data set's published files from their original source into the user cache, verified by SHA-256.

Every file a set needs is listed in ``checksums.txt`` next to this module, in pooch's registry format: the path
inside a data directory, its SHA-256, and the raw URL pinned at the upstream commit the set's description names.
Downloads go through :mod:`pooch`, an optional dependency (``pip install "gpytorch_decoupled[data]"``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from . import locations
from ._checks import check_flag, check_mirror
from .locations import DATA_ENV_VAR, INSTALL_HINT, MIRROR_ENV_VAR
from .registry import DatasetInfo, info

CHECKSUMS_FILE = Path(__file__).resolve().parent / "checksums.txt"
_TIMEOUT_SECONDS = 60


class DownloadError(OSError):
    """
    A data set's files could not be fetched (no connection, an HTTP error) or did not match their published SHA-256
    checksum. The message names the URL and where to put the files by hand; nothing partly written is left behind.
    """


@functools.cache
def _checksums() -> dict[str, tuple[str, str]]:
    entries = {}
    for line in CHECKSUMS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, sha256, url = line.split()
            entries[path] = (sha256, url)
    return entries


def files(name: str, source: str | None = None) -> dict[str, tuple[str, str]]:
    """
    The files a data set needs, as ``{path inside a data directory: (sha256, upstream URL)}``, main file first.

    :param name: Data set name or alias (see :func:`available`).
    :param source: (Default: None) Which copy; ``None`` picks the default.
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If the name or source is unknown.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> list(datasets.files("kin40k"))
        ['kin40k/evans/data.csv.gz', 'kin40k/evans/test_mask.csv.gz']
    """
    entry = info(name, source)
    folder = Path(entry.file).parent.as_posix()
    needed = {path: value for path, value in _checksums().items() if path.rsplit("/", 1)[0] == folder}
    return {entry.file: needed.pop(entry.file), **needed}


def _import_pooch(entry: DatasetInfo):
    try:
        import pooch
    except ImportError as error:
        raise ModuleNotFoundError(
            f"Downloading data set {entry.name!r} needs the pooch package: {INSTALL_HINT}"
        ) from error
    return pooch


def _new_directories(path: Path) -> list[Path]:
    """``path`` and those of its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    return missing


def download(
    name: str,
    source: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    mirror: str | None = None,
    progress: bool = True,
) -> Path:
    """
    Download a data set's published files from their original source into the cache, verified by SHA-256.

    Each file is fetched from the raw URL of its upstream repository, pinned at a commit (see :func:`files`), into
    ``<cache>/<name>/<source>/`` (``<cache>/<name>/`` for the sets that have one copy). pooch logs every download
    (URL and target) and shows a progress bar. A file arrives under a temporary name and is moved into place only
    once its checksum matches, and the set's main file comes last, so a set in the cache is complete exactly when its
    main file is there. Files already in the cache are checked and not fetched again.

    :func:`load` calls this itself when a set is absent and downloading is allowed.

    :param name: Data set name or alias (see :func:`available`).
    :param source: (Default: None) Which copy; ``None`` picks the default.
    :param cache_dir: (Default: None) Where to put the files, laid out like a data directory; ``None`` uses
        :func:`cache_dir` (the :envvar:`GPYTORCH_DECOUPLED_CACHE` environment variable, else the per-user cache).
    :param mirror: (Default: None) Base URL of a server laid out like a data directory, used instead of the upstream
        URLs (``<mirror>/<name>/<source>/<file>``); ``None`` uses the :envvar:`GPYTORCH_DECOUPLED_MIRROR`
        environment variable where it is set.
    :param progress: (Default: True) Show a progress bar per file.
    :return: The path of the set's main file in the cache.
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If the name or source is unknown or the mirror is not an http(s) URL.
    :raises ModuleNotFoundError: If pooch is not installed (``pip install "gpytorch_decoupled[data]"``).
    :raises DownloadError: If a file cannot be fetched (offline, HTTP error) or its checksum does not match; the
        message names the URL and where to put the files by hand. Files verified before the failure are kept; no
        partial file and no folder left empty remains.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> path = datasets.download("kin40k")  # doctest: +SKIP
        >>> train_x, train_y, test_x, test_y = datasets.load("kin40k", split=0)  # doctest: +SKIP
    """
    entry = info(name, source)
    progress = check_flag("progress", progress)
    if mirror is None:
        mirror = check_mirror(MIRROR_ENV_VAR, os.environ.get(MIRROR_ENV_VAR) or None)
    else:
        mirror = check_mirror("mirror", mirror)
    pooch = _import_pooch(entry)
    folder = locations.cache_dir(cache_dir) / Path(entry.file).parent  # a default cache exists once pooch does
    created = _new_directories(folder)
    needed = files(entry.name, entry.source)
    main = needed.pop(entry.file)
    for path, (sha256, upstream) in [*needed.items(), (entry.file, main)]:
        url = f"{mirror.rstrip('/')}/{path}" if mirror else upstream
        try:
            # pooch streams into a temporary file beside the target and moves it into place only once its SHA-256
            # matches (and deletes it otherwise), so no file ever sits under its final name unverified.
            pooch.retrieve(
                url,
                known_hash=f"sha256:{sha256}",
                fname=Path(path).name,
                path=folder,
                downloader=pooch.HTTPDownloader(progressbar=progress, timeout=_TIMEOUT_SECONDS),
            )
        except (OSError, ValueError) as error:  # requests' errors are OSErrors; a checksum mismatch a ValueError
            for directory in created:
                if directory.is_dir() and not any(directory.iterdir()):
                    directory.rmdir()
            raise DownloadError(
                f"Could not download {path} of data set {entry.name!r} (source {entry.source!r}) from {url}: "
                f"{type(error).__name__}: {error} Without network access, fetch the files listed for it in "
                f"{CHECKSUMS_FILE} (the first: {main[1]}) and put them in {folder}, or in "
                f"<data directory>/{Path(entry.file).parent.as_posix()}/ of a directory given as "
                f"load(..., data_dir=...) or in the {DATA_ENV_VAR} environment variable."
            ) from error
    return (folder / Path(entry.file).name).resolve()
