"""
Wiring shared by the tests, the doctests and the notebooks: no downloads, and the ``data`` marker.

A test that reads a data set the package does not embed carries ``@pytest.mark.data("kin40k")`` (several names, and
``source="gal"`` for a copy other than the default, are accepted). Where the set is not found as
``datasets.locate`` finds it, the test is skipped with the reason of that lookup (where it looked and how to get the
files); with ``--require-data`` the run stops instead, so that a run that is meant to have the data proves it did.
Notebooks get the marker for every data set name that appears as a string literal in their code cells.
"""

from __future__ import annotations

import ast
import json
import os
from functools import cache
from pathlib import Path

import pytest

from gpytorch_decoupled import datasets

CLOSED_PORT_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there on a test machine


def pytest_configure(config: pytest.Config) -> None:
    # Tests never reach the internet: loading an absent set fails instead of downloading it, and a download that a
    # test asks for without a mirror of its own goes to a closed local port. Set before the notebooks' kernels and
    # the xdist workers start, which inherit it.
    os.environ[datasets.DOWNLOAD_ENV_VAR] = "0"
    os.environ.setdefault(datasets.MIRROR_ENV_VAR, CLOSED_PORT_URL)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-data",
        action="store_true",
        help="stop, rather than skip, when a test marked `data` cannot find its data set",
    )


@cache
def _missing(name: str, source: str | None) -> str | None:
    """Why the set cannot be loaded, or None when it can."""
    try:
        datasets.locate(name, source)
    except FileNotFoundError as error:
        return str(error)
    return None


def _notebook_data_sets(path: Path) -> list[str]:
    # Every string literal of a code cell that names a registered set: the notebooks pass names to datasets.load
    # directly or through a tuple they loop over, and both show up here.
    known = set(datasets.available())
    names = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        tree = ast.parse("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
        names |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in known}
    return sorted(names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing_required = []
    for item in items:
        if item.path.suffix == ".ipynb":
            for name in _notebook_data_sets(item.path):
                item.add_marker(pytest.mark.data(name))
        for mark in item.iter_markers("data"):
            reasons = [_missing(name, mark.kwargs.get("source")) for name in mark.args]
            reason = next((reason for reason in reasons if reason), None)
            if reason is None:
                continue
            if config.getoption("--require-data"):
                missing_required.append(f"{item.nodeid}: {reason}")
            item.add_marker(pytest.mark.skip(reason=reason))
    if missing_required:
        raise pytest.UsageError("--require-data, but data sets are missing:\n" + "\n".join(missing_required))
