"""``bench srgp-step``: the cost of one SRGP step against one step of GPyTorch's SVGP with Adam (issue 19, item 2).

SRGP is :class:`~benchmarks.methods.RecursiveMethod` (VFE, ``propagate="full"``: the Jacobians of every
hyperparameter and, in their structure, of the inducing inputs; the state's prior frozen at the epoch's start, the
default); SVGP is GPyTorch's whitened ``VariationalStrategy`` with a ``CholeskyVariationalDistribution`` and Adam on
everything. Both have :math:`M = 100` inducing inputs drawn from the training rows, mini-batches of 1,000 rows of
kin40k (split 0, :math:`d = 8`), the same learning rate and the same mini-batches, and are stepped in lockstep (one
step of each in turn, the order alternating), so that the load of other jobs on shared cores slows both alike.

A step is timed in CPU seconds of this thread (``time.thread_time``), which other jobs on the cores do not inflate
(wall-clock on a GPU). The run is repeated ``--repeats`` times with fresh methods; each repeat's ratio is the median
SRGP step over the median SVGP step after ``--warmup`` steps, and the goal is the median ratio over the repeats (their
range and the machine's load average are recorded).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .methods import build_method
from .report import benchmark_payload, format_ratios, write_results
from .runner import lockstep_step_seconds, random_minibatches, split_tensors

NAME = "srgp-step"
GOAL = "srgp_step_vs_svgp_adam_step"
GOALS = {GOAL: 4.0}
RATIO_NOTES = {
    GOAL: (
        "median over the repeats of SRGP's median step time (VFE, full Jacobians) ÷ GPyTorch SVGP-Adam's median step "
        "time, stepped in lockstep, CPU time of this thread"
    ),
    "srgp_step_vs_svgp_adam_step_min": "the smallest ratio of a repeat; no goal",
    "srgp_step_vs_svgp_adam_step_max": "the largest ratio of a repeat; no goal",
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=40, eval_every=1)
    parser.set_defaults(batch_size=1000, dtype="float64", warmup=5)
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--num-inducing", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate of both methods")
    parser.add_argument("--output-dir", default=str(DEFAULT_RESULTS_DIR))


def _repeat(train, args, config, repeat: int) -> dict:
    """One lockstep run of fresh methods: the median step times after the warm-up."""
    x, y = train
    seed = config.seed + repeat
    methods = {
        "srgp": build_method("recursive", x, y, num_inducing=args.num_inducing, lr=args.lr, seed=seed),
        "svgp": build_method("svgp", x, y, num_inducing=args.num_inducing, lr=args.lr, seed=seed),
    }
    clock = "wall" if x.device.type == "cuda" else "thread"
    batches = random_minibatches(x, y, config.batch_size, seed)
    medians = lockstep_step_seconds(list(methods.items()), batches, config.iterations, config.warmup, clock)
    return {"seconds": medians, "ratio": medians["srgp"] / medians["svgp"], "load_average": os.getloadavg()}


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    split = load_split(args, args.dataset)
    train, _ = split_tensors(split, config)
    repeats = []
    for repeat in range(args.repeats):
        repeats.append(_repeat(train, args, config, repeat))
        row = repeats[-1]
        print(
            f"repeat {repeat}: SRGP {1000 * row['seconds']['srgp']:.1f} ms, SVGP-Adam "
            f"{1000 * row['seconds']['svgp']:.1f} ms, ratio {row['ratio']:.2f} (load {row['load_average'][0]:.1f})"
        )
    ratios_of_repeats = [row["ratio"] for row in repeats]
    ratios = {
        GOAL: statistics.median(ratios_of_repeats),
        f"{GOAL}_min": min(ratios_of_repeats),
        f"{GOAL}_max": max(ratios_of_repeats),
    }
    run = {
        **config.to_json(),
        **split_config(split),
        "num_inducing": args.num_inducing,
        "repeats": args.repeats,
        "lr": args.lr,
        "clock": "wall-clock" if train[0].device.type == "cuda" else "thread CPU time",
    }
    payload = benchmark_payload(
        NAME, run, [], ratios, GOALS, device=args.device, ratio_notes=RATIO_NOTES, repeats=repeats
    )
    write_results(Path(args.output_dir) / f"{NAME}.json", payload)
    print("\n" + format_ratios(payload))
    return payload


SRGP_STEP = Benchmark(
    NAME,
    "SRGP step (VFE, full Jacobians) vs GPyTorch SVGP-Adam step at M = 100, batch 1,000 on kin40k, in lockstep",
    _add_arguments,
    _run,
)
