"""Command-line options shared by every benchmark, and how they become a run configuration."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from gpytorch_decoupled import datasets

from .run_config import RunConfig

#: The committed results, beside the harness (whatever the working directory).
DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_run_arguments(parser: argparse.ArgumentParser, iterations: int, eval_every: int) -> None:
    """Options of :class:`RunConfig` plus data selection and output."""
    parser.add_argument("--iterations", type=int, default=iterations, help="training iterations per method")
    parser.add_argument("--batch-size", type=int, default=256, help="mini-batch size")
    parser.add_argument("--eval-every", type=int, default=eval_every, help="evaluate test metrics every N iterations")
    parser.add_argument(
        "--warmup", type=int, default=10, help="iterations excluded from timing (memory is taken there)"
    )
    parser.add_argument("--time-budget", type=float, default=None, help="stop each method after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--split", type=int, default=0, help="which published train/test split")
    parser.add_argument(
        "--data-dir", default=None, help="data directory (default: $GPYTORCH_DECOUPLED_DATA, ../shared/data)"
    )
    parser.add_argument(
        "--max-train-rows", type=int, default=None, help="use a seeded random subset of the training rows (quick runs)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="training time as wall-clock (CUDA synchronized), or as the training thread's CPU time (one torch "
        "thread; for a shared CPU machine)",
    )


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run configuration of the parsed options; a thread-clock run uses one torch thread (the thread's CPU time
    would not count work done by others)."""
    if args.clock == "thread":
        torch.set_num_threads(1)
    return RunConfig(
        iterations=args.iterations,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        warmup=args.warmup,
        time_budget=args.time_budget,
        seed=args.seed,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        progress=not args.no_progress,
        clock=args.clock,
    )


def load_split(args: argparse.Namespace, name: str):
    """The requested data split, optionally with a seeded subset of its training rows."""
    split = datasets.load(name, split=args.split, data_dir=args.data_dir)
    if args.max_train_rows is not None and args.max_train_rows < split.train_x.size(0):
        generator = torch.Generator().manual_seed(args.seed)
        keep = torch.randperm(split.train_x.size(0), generator=generator)[: args.max_train_rows]
        split = replace(split, train_x=split.train_x[keep], train_y=split.train_y[keep])
    return split


def split_config(split) -> dict:
    """What a results file records about the data it was measured on."""
    return {"dataset": split.name, "split": split.split, "train_rows": split.train_x.size(0)}
