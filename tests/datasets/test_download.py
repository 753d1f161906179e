"""
The download path against a local HTTP server on 127.0.0.1 (these tests never reach the internet): success, cache
reuse, checksum mismatch, HTTP errors and a server that is down, and the published checksums themselves.

Without the shared data folder the server serves the embedded elevators copy (real published files and checksums)
and a synthetic non-embedded set, so every test here but the one over the real shared copies runs on a fresh clone.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import logging
import re
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from gpytorch_decoupled import datasets
from gpytorch_decoupled.__main__ import main
from gpytorch_decoupled.datasets import downloads

EMBEDDED_ELEVATORS = Path(datasets.__file__).parent / "data" / "elevators"
ELEVATORS_FILES = ("elevators/evans/data.csv.gz", "elevators/evans/test_mask.csv.gz")


class _RecordingHandler(http.server.SimpleHTTPRequestHandler):
    def log_request(self, code="-", size="-"):
        self.server.requests.append((self.path, int(code)))

    def log_message(self, format, *args):  # the test output stays clean; requests are recorded above
        pass


class Mirror:
    """A directory laid out like a data directory, served over HTTP on a free port of 127.0.0.1."""

    def __init__(self, root: Path):
        self.root = root
        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(_RecordingHandler, directory=str(root))
        )
        self.server.requests = []
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self) -> list[tuple[str, int]]:
        return self.server.requests

    def add(self, path: str, content: bytes) -> None:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self._thread.join()


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """The server, set as the mirror of every download, with an empty cache and no data directories."""
    server = Mirror(tmp_path / "served")
    (tmp_path / "served").mkdir()
    monkeypatch.setenv(datasets.MIRROR_ENV_VAR, server.url)
    monkeypatch.setenv(datasets.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setenv(datasets.DATA_ENV_VAR, str(tmp_path / "no-data"))
    yield server
    server.stop()


@pytest.fixture
def pooch_log():
    """The lines pooch logs (it announces every download with its URL and target)."""
    pooch = pytest.importorskip("pooch")
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    pooch.get_logger().addHandler(handler)
    yield records
    pooch.get_logger().removeHandler(handler)


def _serve_elevators(mirror: Mirror, corrupt: str | None = None) -> None:
    for path in ELEVATORS_FILES:
        content = (EMBEDDED_ELEVATORS / Path(path).name).read_bytes()
        mirror.add(path, content[:-1] + bytes([content[-1] ^ 1]) if path == corrupt else content)


def _synthetic_pima(mirror: Mirror, monkeypatch) -> bytes:
    """A small CSV in the pima layout (header, 8 inputs, 0/1 label), published under a checksum of its own."""
    rows = np.random.default_rng(0).normal(size=(20, 8)).round(4)
    labels = np.arange(20) % 2
    text = "a,b,c,d,e,f,g,h,Outcome\n" + "".join(
        ",".join(map(str, row)) + f",{label}\n" for row, label in zip(rows, labels)
    )
    content = text.encode()
    url = f"{mirror.url}/pima/tsvgp_diabetes.csv"
    monkeypatch.setitem(downloads._checksums(), "pima/tsvgp_diabetes.csv", (_sha256(content), url))
    mirror.add("pima/tsvgp_diabetes.csv", content)
    return content


def _sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _cache_files(tmp_path: Path) -> list[str]:
    cache = tmp_path / "cache"
    return sorted(path.relative_to(cache).as_posix() for path in cache.rglob("*")) if cache.exists() else []


class TestDownload:
    def test_fetches_the_published_files_and_says_so(self, mirror, tmp_path, pooch_log):
        _serve_elevators(mirror)
        path = datasets.download("elevators", progress=False)
        assert path == (tmp_path / "cache" / "elevators" / "evans" / "data.csv.gz").resolve()
        for file in ELEVATORS_FILES:
            assert (tmp_path / "cache" / file).read_bytes() == (EMBEDDED_ELEVATORS / Path(file).name).read_bytes()
        # the main file comes last, so that a set whose main file is in the cache is complete
        assert mirror.requests == [(f"/{ELEVATORS_FILES[1]}", 200), (f"/{ELEVATORS_FILES[0]}", 200)]
        assert len(pooch_log) == 2
        assert f"{mirror.url}/{ELEVATORS_FILES[0]}" in pooch_log[1] and str(tmp_path / "cache") in pooch_log[1]

    def test_the_cache_is_reused_without_the_network(self, mirror, tmp_path):
        _serve_elevators(mirror)
        path = datasets.download("elevators", progress=False)
        mirror.stop()
        assert datasets.download("elevators", progress=False) == path
        assert datasets.locate("elevators") == path  # searched before the embedded copy
        assert len(mirror.requests) == 2

    def test_a_checksum_mismatch_leaves_nothing(self, mirror, tmp_path):
        _serve_elevators(mirror, corrupt=ELEVATORS_FILES[1])
        with pytest.raises(datasets.DownloadError) as error:
            datasets.download("elevators", progress=False)
        message = str(error.value)
        assert f"{mirror.url}/{ELEVATORS_FILES[1]}" in message and "hash" in message
        assert str(tmp_path / "cache" / "elevators" / "evans") in message and datasets.DATA_ENV_VAR in message
        assert _cache_files(tmp_path) == []  # no partial file and no folder made for it

    def test_files_verified_before_a_failure_stay_but_do_not_count_as_the_set(self, mirror, tmp_path):
        _serve_elevators(mirror, corrupt=ELEVATORS_FILES[0])
        with pytest.raises(datasets.DownloadError, match="data.csv.gz"):
            datasets.download("elevators", progress=False)
        assert _cache_files(tmp_path) == ["elevators", "elevators/evans", ELEVATORS_FILES[1]]
        assert datasets.locate("elevators").is_relative_to(EMBEDDED_ELEVATORS)
        _serve_elevators(mirror)  # fixed upstream: only the missing file is fetched
        datasets.download("elevators", progress=False)
        assert [path for path, _ in mirror.requests] == [f"/{ELEVATORS_FILES[1]}", *[f"/{ELEVATORS_FILES[0]}"] * 2]

    def test_a_server_that_is_down_gives_the_url_and_where_to_put_the_files(self, mirror, tmp_path):
        _serve_elevators(mirror)
        mirror.stop()
        with pytest.raises(datasets.DownloadError) as error:
            datasets.download("elevators", progress=False)
        message = str(error.value)
        assert f"{mirror.url}/{ELEVATORS_FILES[1]}" in message and "ConnectionError" in message
        upstream = datasets.files("elevators")[ELEVATORS_FILES[0]][1]
        assert upstream in message and str(tmp_path / "cache" / "elevators" / "evans") in message
        assert _cache_files(tmp_path) == []

    def test_an_http_error_names_the_url(self, mirror, tmp_path):
        with pytest.raises(datasets.DownloadError, match=re.escape(f"{mirror.url}/{ELEVATORS_FILES[1]}") + ".*404"):
            datasets.download("elevators", progress=False)
        assert _cache_files(tmp_path) == []

    def test_explicit_cache_dir_and_mirror_win(self, mirror, tmp_path, monkeypatch):
        _serve_elevators(mirror)
        monkeypatch.setenv(datasets.MIRROR_ENV_VAR, "http://127.0.0.1:9")  # nothing listens there
        path = datasets.download("elevators", cache_dir=tmp_path / "elsewhere", mirror=mirror.url, progress=False)
        assert path == (tmp_path / "elsewhere" / ELEVATORS_FILES[0]).resolve()

    def test_without_pooch_the_error_names_the_install_command(self, mirror, monkeypatch):
        monkeypatch.setitem(sys.modules, "pooch", None)
        with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "gpytorch_decoupled[data]"')):
            datasets.download("elevators")
        with pytest.raises(ModuleNotFoundError, match="pooch"):
            datasets.load("pima", download=True)
        monkeypatch.delenv(datasets.CACHE_ENV_VAR)
        assert datasets.cache_dir() is None  # nothing can have been downloaded
        with pytest.raises(FileNotFoundError, match=re.escape("pip install")):
            datasets.load("pima", download=False)

    @pytest.mark.parametrize(
        "kwargs,error,match",
        [
            ({"name": 3}, TypeError, "name must be"),
            ({"source": 1}, TypeError, "source must be"),
            ({"cache_dir": 3}, TypeError, "cache_dir must be"),
            ({"mirror": "ftp://example.org"}, ValueError, "mirror must be an http"),
            ({"progress": "yes"}, TypeError, "progress must be True or False"),
            ({"name": "kin41k"}, ValueError, "Available: .*kin40k"),
        ],
    )
    def test_bad_arguments(self, mirror, kwargs, error, match):
        with pytest.raises(error, match=match):
            datasets.download(**{"name": "elevators", **kwargs})
        assert mirror.requests == []

    def test_a_bad_mirror_variable_is_named(self, mirror, monkeypatch):
        monkeypatch.setenv(datasets.MIRROR_ENV_VAR, "127.0.0.1:8000")
        with pytest.raises(ValueError, match=f"{datasets.MIRROR_ENV_VAR} must be an http"):
            datasets.download("elevators")


class TestLoadDownloads:
    def test_load_downloads_a_missing_set_when_allowed(self, mirror, tmp_path, monkeypatch):
        content = _synthetic_pima(mirror, monkeypatch)
        with pytest.raises(FileNotFoundError, match=re.escape("datasets.download('pima')")):
            datasets.load("pima")  # the test suite turns downloads off by default
        monkeypatch.delenv(datasets.DOWNLOAD_ENV_VAR)
        with pytest.raises(FileNotFoundError, match="none of the searched directories"):
            datasets.load("pima", download=False)
        assert mirror.requests == []
        split = datasets.load("pima", split=1, dtype=torch.float64)  # downloads by default
        assert (tmp_path / "cache" / "pima" / "tsvgp_diabetes.csv").read_bytes() == content
        assert len(split.train_x) + len(split.test_x) == 20 and split.train_x.shape[1] == 8
        assert set(split.test_y.tolist()) <= {0.0, 1.0}
        mirror.stop()
        again = datasets.load("pima", split=1, dtype=torch.float64, download=True)  # from the cache
        assert torch.equal(again.test_x, split.test_x)
        assert len(mirror.requests) == 1

    def test_env_var_turns_downloads_off_and_argument_overrides_it(self, mirror, monkeypatch):
        _synthetic_pima(mirror, monkeypatch)
        monkeypatch.setenv(datasets.DOWNLOAD_ENV_VAR, "0")
        with pytest.raises(FileNotFoundError):
            datasets.load("pima")
        assert mirror.requests == []
        datasets.load("pima", download=True)
        assert len(mirror.requests) == 1

    def test_a_failed_download_from_load_is_a_download_error(self, mirror):
        with pytest.raises(datasets.DownloadError, match="404"):
            datasets.load("kin40k", download=True)


class TestCommandLine:
    def test_download_command(self, mirror, tmp_path, capsys):
        _serve_elevators(mirror)
        main(["datasets", "download", "elevators", "--cache-dir", str(tmp_path / "cli"), "--no-progress"])
        assert str((tmp_path / "cli" / ELEVATORS_FILES[0]).resolve()) in capsys.readouterr().out
        assert (tmp_path / "cli" / ELEVATORS_FILES[1]).is_file()

    def test_download_command_reports_failures(self, mirror, capsys):
        with pytest.raises(SystemExit) as exit_info:
            main(["datasets", "download", "elevators", "--no-progress"])
        assert exit_info.value.code != 0
        assert f"{mirror.url}/{ELEVATORS_FILES[1]}" in capsys.readouterr().err

    def test_listing_shows_the_cache(self, mirror, tmp_path, capsys):
        main(["datasets"])
        out = capsys.readouterr().out
        assert str(tmp_path / "cache") in out and "kin40k" in out


class TestPublishedChecksums:
    def test_every_set_lists_its_files_with_pinned_upstream_urls(self):
        for name in datasets.available():
            for source in datasets.sources(name):
                entry = datasets.info(name, source)
                listed = datasets.files(name, source)
                assert next(iter(listed)) == entry.file
                expected = {"evans": 2, "gal": 4 + 2 * entry.num_splits}.get(source, 1)
                assert len(listed) == expected, (name, source)
                for path, (sha256, url) in listed.items():
                    assert re.fullmatch(r"[0-9a-f]{64}", sha256)
                    match = re.fullmatch(r"https://raw\.githubusercontent\.com/([^/]+/[^/]+)/([0-9a-f]{40})/.+", url)
                    assert match, url
                    repository, commit = match.groups()
                    assert repository in entry.description and commit in entry.description, (name, url)
                    assert url.rsplit("/", 1)[1] == Path(path).name or source == "tsvgp"

    def test_no_file_is_listed_twice_or_for_no_set(self):
        listed = [
            path for name in datasets.available() for s in datasets.sources(name) for path in datasets.files(name, s)
        ]
        assert sorted(listed) == sorted(downloads._checksums())

    def test_the_embedded_copy_is_the_published_one(self):
        for path in ELEVATORS_FILES:
            content = (EMBEDDED_ELEVATORS / Path(path).name).read_bytes()
            assert _sha256(content) == datasets.files("elevators")[path][0]

    @pytest.mark.parametrize(
        "name,source",
        [
            pytest.param(name, source, marks=pytest.mark.data(name, source=source))
            for name in datasets.available()
            for source in datasets.sources(name)
        ],
    )
    def test_local_copies_match_the_published_checksums(self, name, source):
        root = datasets.locate(name, source)
        if root.is_relative_to(EMBEDDED_ELEVATORS):
            pytest.skip("only the embedded copy is present (test_the_embedded_copy_is_the_published_one checks it)")
        for _ in Path(datasets.info(name, source).file).parts:
            root = root.parent
        for path, (sha256, _) in datasets.files(name, source).items():
            assert _sha256((root / path).read_bytes()) == sha256, path

    @pytest.mark.data("yacht", source="gal")
    def test_a_real_set_downloads_from_a_mirror_of_the_shared_data(self, tmp_path, monkeypatch):
        shared = datasets.locate("yacht", "gal").parents[2]
        served = tmp_path / "served"
        shutil.copytree(shared / "yacht" / "gal", served / "yacht" / "gal")
        mirror = Mirror(served)
        try:
            path = datasets.download("yacht", "gal", cache_dir=tmp_path / "cache", mirror=mirror.url, progress=False)
        finally:
            mirror.stop()
        assert len(mirror.requests) == len(datasets.files("yacht", "gal")) == 44
        downloaded = datasets.load("yacht", split=7, data_dir=path.parents[2], dtype=torch.float64)
        original = datasets.load("yacht", split=7, data_dir=shared, dtype=torch.float64)
        for a, b in zip(downloaded, original):
            assert torch.equal(a, b)
