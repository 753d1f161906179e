from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """A named benchmark of ``python -m benchmarks <name>``.

    :param name: The command-line name.
    :param description: One line for ``--help``.
    :param add_arguments: Adds the benchmark's own options to its argument parser.
    :param run: Runs it from the parsed arguments, prints its table, writes its results and returns the JSON payload.
    """

    name: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict]
