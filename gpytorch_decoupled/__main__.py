"""Command line: ``python -m gpytorch_decoupled {demo,datasets} --help`` (also installed as ``gpytorch-decoupled``).

The benchmarks live in the source repository, outside the package: ``python -m benchmarks <name>`` from its root.
"""

from __future__ import annotations

import argparse
import sys

from . import datasets
from .demo import add_demo_arguments, run_demo


def _list_datasets(args: argparse.Namespace) -> None:
    print(f"{'name':14s} {'task':15s} {'rows':>7s} {'dims':>5s} {'splits':>6s}  source    present")
    for name in datasets.available():
        for source in datasets.sources(name):
            entry = datasets.info(name, source)
            try:
                datasets.locate(name, source=source, data_dir=args.data_dir)
                present = "yes"
            except FileNotFoundError:
                present = "no"
            print(
                f"{name:14s} {entry.task:15s} {entry.n:7d} {entry.d:5d} {entry.num_splits:6d}  {source:8s}  {present}"
            )
    cache = datasets.cache_dir()
    print(f"\nsearched: {', '.join(str(path) for path in datasets.data_dirs(args.data_dir))}")
    print(f"download cache: {cache if cache else 'none (pip install ' + repr('gpytorch_decoupled[data]') + ')'}")
    print("missing sets: python -m gpytorch_decoupled datasets download NAME [NAME ...] (or all)")


def _download_datasets(args: argparse.Namespace) -> None:
    wanted = (
        [(name, source) for name in datasets.available() for source in datasets.sources(name)]
        if args.names == ["all"]
        else [(name, args.source) for name in args.names]
    )
    for name, source in wanted:
        try:
            path = datasets.download(
                name, source, cache_dir=args.cache_dir, mirror=args.mirror, progress=not args.no_progress
            )
        except (datasets.DownloadError, ModuleNotFoundError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(1) from error
        print(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpytorch_decoupled",
        description="Scalable sparse variational GPs for GPyTorch: a demo on embedded data, and the data sets.",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)

    demo = commands.add_parser("demo", help="train every method against GPyTorch's SVGP on embedded real data")
    add_demo_arguments(demo)
    demo.set_defaults(run=run_demo)

    listing = commands.add_parser(
        "datasets", help="list the data sets the loaders know and whether they are present; `datasets download`"
    )
    listing.add_argument("--data-dir", default=None)
    listing.set_defaults(run=_list_datasets)
    actions = listing.add_subparsers(dest="action", metavar="<action>")
    fetch = actions.add_parser(
        "download", help="download data sets from their original source into the cache, verified by SHA-256"
    )
    fetch.add_argument("names", nargs="+", metavar="NAME", help="data set names, or `all` for every set and source")
    fetch.add_argument("--source", default=None, help="which copy, e.g. gal or evans (default: each set's default)")
    fetch.add_argument("--cache-dir", default=None, help="where to put the files (default: datasets.cache_dir())")
    fetch.add_argument("--mirror", default=None, help="base URL of a server laid out like a data directory")
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars")
    fetch.set_defaults(run=_download_datasets)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
