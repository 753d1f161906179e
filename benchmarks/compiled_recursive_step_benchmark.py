"""``bench compiled-recursive-step``: the Kalman-recursive family's compiled steps against their eager forms (issue 21,
item 1): SRGP's whole step (:class:`~benchmarks.methods.RecursiveMethod`: VFE, ``propagate="full"``, the prior frozen
at the epoch's start; :func:`~gpytorch_decoupled.training.compile_training_step` of its SRGP object) and the Kalman
update alone (``strategy.update`` and its compiled form, at fixed hyperparameters), on kin40k (split 0, :math:`d = 8`)
with the same inducing inputs, learning rate and mini-batches.

Each compiled step's first call compiles; its wall-clock and thread CPU seconds are recorded (the one-time cost), and
the crossover is the number of steps after which compiling has paid for itself (compile seconds ÷ seconds saved per
step). Then the four steps run in lockstep (one step of each in turn, the order alternating) for ``--iterations``
steps after ``--warmup``, timed in CPU seconds of this thread (one torch thread), ``--repeats`` times on the same
methods; the ratios are the medians over the repeats, and the machine's load average is recorded with each repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from gpytorch_decoupled.training import compile_training_step

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .methods import build_method
from .report import benchmark_payload, format_ratios, write_results
from .runner import lockstep_step_seconds, random_minibatches, split_tensors

NAME = "compiled-recursive-step"
RATIO_NOTES = {
    "compiled_srgp_step_vs_eager": "median over the repeats of the compiled SRGP step's median time ÷ the eager one's",
    "compiled_update_vs_eager": "the same for the Kalman update (strategy.update)",
    "srgp_compile_seconds": "wall-clock seconds of the compiled SRGP step's first call (compiling); not a ratio",
    "update_compile_seconds": "wall-clock seconds of the compiled update's first call (compiling); not a ratio",
    "srgp_crossover_steps": "SRGP steps after which compiling pays: compile seconds ÷ seconds saved per step",
    "update_crossover_steps": "the same for the update",
}


class _Update:
    """The Kalman update of a method's model at fixed hyperparameters, as a method with ``step(x, y)``."""

    def __init__(self, method, compile_options: dict | None):
        strategy = method.model.variational_strategy
        self.step = strategy.update if compile_options is None else compile_training_step(strategy, **compile_options)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=40, eval_every=1)
    parser.set_defaults(batch_size=1000, dtype="float64", warmup=5, clock="thread")
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--num-inducing", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate of SRGP")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--output-dir", default=str(DEFAULT_RESULTS_DIR))


def _first_call(step, x, y) -> dict[str, float]:
    """The wall-clock and thread CPU seconds of a step's first call (for a compiled step: compiling it)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    step(x, y)
    return {"wall": time.perf_counter() - wall, "thread": time.thread_time() - cpu}


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    split = load_split(args, args.dataset)
    x, y = split_tensors(split, config)[0]
    options = {"backend": args.backend}
    build = {"num_inducing": args.num_inducing, "lr": args.lr, "seed": config.seed}
    methods = {
        "srgp_eager": build_method("recursive", x, y, **build),
        "srgp_compiled": build_method("recursive", x, y, compile_options=options, **build),
    }
    methods["update_eager"] = _Update(build_method("recursive", x, y, **build), None)
    methods["update_compiled"] = _Update(build_method("recursive", x, y, **build), options)
    batches = random_minibatches(x, y, config.batch_size, config.seed)
    first = {name: _first_call(method.step, *next(batches)) for name, method in methods.items()}
    print(", ".join(f"{name} first call {times['wall']:.1f} s" for name, times in first.items()))
    repeats = []
    for repeat in range(args.repeats):
        load = os.getloadavg()
        medians = lockstep_step_seconds(list(methods.items()), batches, config.iterations, config.warmup, "thread")
        repeats.append({"seconds": medians, "load_average": load})
        print(
            f"repeat {repeat} (load {load[0]:.1f}): "
            + ", ".join(f"{name} {1000 * seconds:.2f} ms" for name, seconds in medians.items())
        )
    ratios = {}
    for kind in ("srgp", "update"):
        compiled = statistics.median(row["seconds"][f"{kind}_compiled"] for row in repeats)
        eager = statistics.median(row["seconds"][f"{kind}_eager"] for row in repeats)
        name = "compiled_srgp_step_vs_eager" if kind == "srgp" else "compiled_update_vs_eager"
        ratios[name] = compiled / eager
        ratios[f"{kind}_compile_seconds"] = first[f"{kind}_compiled"]["wall"]
        saved = eager - compiled
        ratios[f"{kind}_crossover_steps"] = first[f"{kind}_compiled"]["wall"] / saved if saved > 0 else float("inf")
    run = {
        **config.to_json(),
        **split_config(split),
        "num_inducing": args.num_inducing,
        "repeats": args.repeats,
        "lr": args.lr,
        "backend": args.backend,
        "clock": "thread CPU time",
    }
    payload = benchmark_payload(
        NAME, run, [], ratios, {}, device=args.device, ratio_notes=RATIO_NOTES, first_call=first, repeats=repeats
    )
    write_results(Path(args.output_dir) / f"{NAME}.json", payload)
    print("\n" + format_ratios(payload))
    return payload


COMPILED_RECURSIVE_STEP = Benchmark(
    NAME,
    "compiled SRGP step and Kalman update vs their eager forms (M = 100, batch 1,000, kin40k), compile time, crossover",
    _add_arguments,
    _run,
)
