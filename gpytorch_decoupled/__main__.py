"""Command line: ``python -m gpytorch_decoupled {demo,datasets} --help`` (also installed as ``gpytorch-decoupled``).

The benchmarks live in the source repository, outside the package: ``python -m benchmarks <name>`` from its root.
"""

from __future__ import annotations

import argparse

from . import datasets
from .demo import add_demo_arguments, run_demo


def _list_datasets(args: argparse.Namespace) -> None:
    print(f"{'name':14s} {'task':15s} {'rows':>7s} {'dims':>5s} {'splits':>6s}  source    present")
    for name in datasets.available():
        for source in datasets.sources(name):
            entry = datasets.info(name, source=source)
            try:
                datasets.locate(name, source=source, data_dir=args.data_dir)
                present = "yes"
            except FileNotFoundError:
                present = "no"
            print(
                f"{name:14s} {entry.task:15s} {entry.n:7d} {entry.d:5d} {entry.num_splits:6d}  {source:8s}  {present}"
            )
    print(f"\nsearched: {', '.join(str(path) for path in datasets.data_dirs(args.data_dir))}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpytorch_decoupled",
        description="Scalable sparse variational GPs for GPyTorch: a demo on embedded data, and the data sets.",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)

    demo = commands.add_parser("demo", help="train every method against GPyTorch's SVGP on embedded real data")
    add_demo_arguments(demo)
    demo.set_defaults(run=run_demo)

    listing = commands.add_parser("datasets", help="list the data sets the loaders know and whether they are present")
    listing.add_argument("--data-dir", default=None)
    listing.set_defaults(run=_list_datasets)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
