"""Execute notebooks top to bottom in full (not the CI smoke mode) and store their outputs for the documentation.

    python notebooks/execute.py notebooks/00_quickstart.ipynb [more.ipynb ...] [--threads 1]
    make notebooks NB=00_quickstart          # the same through the Makefile; no NB: every notebook

The outputs are stored without execution timestamps, so that a re-run changes only what the run changed. Each
notebook runs in the notebooks folder (the working directory a reader's Jupyter would use), with the ``CI``
environment variable removed. ``--threads`` sets ``OMP_NUM_THREADS`` for the kernel: on a machine shared with other
jobs one thread per process gives steadier timings than oversubscribed cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

FOLDER = Path(__file__).resolve().parent


def strip_execution_metadata(notebook: nbformat.NotebookNode) -> None:
    """Remove what changes on every run without changing a result: the cells' execution timestamps."""
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)


def execute(path: Path, timeout: int | None) -> float:
    """Run ``path`` in place; returns the wall-clock seconds it took."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    strip_execution_metadata(notebook)
    nbformat.write(notebook, path)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to run (default: all in notebooks/)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the kernel")
    parser.add_argument("--timeout", type=int, default=None, help="seconds a cell may take (default: no limit)")
    args = parser.parse_args(argv)
    os.environ.pop("CI", None)  # the smoke switch of every notebook
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    for path in args.notebooks or sorted(FOLDER.glob("*.ipynb")):
        print(f"{path.name}: running ...", flush=True)
        print(f"{path.name}: {execute(path.resolve(), args.timeout):.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
