"""The command line of ``python -m benchmarks <name>`` (``make bench NAME=<name> ARGS=...``)."""

from __future__ import annotations

import argparse

from . import BENCHMARKS


def bench_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    """One sub-command per registered benchmark, each with its own ``--help``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a named benchmark: ours vs GPyTorch baselines in one process; results in benchmarks/results.",
    )
    subcommands = parser.add_subparsers(dest="benchmark", metavar="<name>", required=True)
    for benchmark in BENCHMARKS.values():
        sub = subcommands.add_parser(benchmark.name, help=benchmark.description, description=benchmark.description)
        benchmark.add_arguments(sub)
        sub.set_defaults(run=benchmark.run)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = bench_parser().parse_args(argv)
    return args.run(args)
