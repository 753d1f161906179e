"""``bench compiled-step``: compiled training steps (issue 21) against their eager forms, GPyTorch's SVGP and the
compiled SVGP steps of GPflow (``tf.function``) and GPJax (``jax.jit``).

Every configuration runs in its own process (``benchmarks/compiled_step_worker.py``; GPflow's and GPJax's in the
interpreters of their own environments, ``benchmarks/peers/``), on the same float32 data, inducing inputs and batch
order (kin40k split 0, M = 200, Mγ = 1000, batch 256, one thread), in alternating order for ``--rounds`` rounds: the
first step is timed (the compilation, for compiled steps), then ``--warmup`` steps, then steps for ``--seconds``; the
median step time of each round is kept. Inductor's on-disk cache is emptied before the run, so the first round's
compile time is a cold compilation and later rounds' are cache hits. The crossover is the number of steps after
which a compiled step has paid for its compilation: ``(first compiled step − first eager step) ÷ (eager − compiled
step time)``. GPflow or GPJax is skipped, with a message, when its interpreter is missing or fails.

Goals (issue 21), as ratios (lower is better): ``orthnat_compiled_vs_gpflow_natgrad_adam`` ≤ 1, ``tsvgp_compiled_vs_
gpflow_natgrad_adam`` ≤ 1, ``svgp_natural_compiled_vs_gpflow_adam`` ≤ 1 (each our median ÷ the GPflow median of the
same run, rounds pooled). Without a goal, ``gpytorch_svgp_adam_compiled_vs_gpflow_adam`` compares the same model as
GPflow's SVGP-Adam (GPyTorch's SVGP with a Cholesky q(u), Adam on every parameter) compiled by
:func:`~gpytorch_decoupled.training.compile_training_step`, and the ``*_lean_vs_eager`` ratios the lean step run
without compiling (``TrainingStep(mll, optimizers, compile=False)``: no compile time) against the general eager step.
The Decoupled strategy (:math:`M_\\alpha` = 1000 on OrthNat's γ, :math:`M_\\beta` = 200, MeanBasisAdam's curvature
step on its parameters and Adam on the rest) is measured the same way, without a goal: ``decoupled_*_vs_eager`` and
``decoupled_compiled_vs_gpytorch_svgp_adam``. So is VBKS's step (:class:`~gpytorch_decoupled.training.
KernelSelectionStep`: the 15 kernels of at most one operator over SE, RQ and LIN with ARD, each its own whitened SVGP
at the shared M = 200 inducing inputs, Adam): ``vbks_*_vs_eager`` and ``vbks_compiled_vs_gpytorch_svgp_adam``.
``--likelihood bernoulli`` times the same steps for binary classification (targets above the median are class 1,
GPyTorch's probit ``BernoulliLikelihood``) for the configurations that take one (GPyTorch's SVGP, ours SVGP, OrthNat
and t-SVGP).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from gpytorch_decoupled import datasets

from .benchmark import Benchmark
from .compiled_step_worker import TORCH_CONFIGS
from .methods.inducing_points import initial_inducing_points
from .report import benchmark_payload, format_ratios, write_results

ROOT = Path(__file__).resolve().parent
PEERS = {
    "gpflow-svgp-adam": ("gpflow", ROOT / "peers" / "gpflow_svgp.py"),
    "gpflow-svgp-natgrad-adam": ("gpflow", ROOT / "peers" / "gpflow_svgp.py"),
    "gpjax-svgp-adam": ("gpjax", ROOT / "peers" / "gpjax_svgp.py"),
}
GOALS = {
    "orthnat_compiled_vs_gpflow_natgrad_adam": 1.0,
    "tsvgp_compiled_vs_gpflow_natgrad_adam": 1.0,
    "svgp_natural_compiled_vs_gpflow_adam": 1.0,
}
#: each compiled configuration and its eager counterpart (for the crossover)
PAIRS = {
    "gpytorch-svgp-adam-compiled": "gpytorch-svgp-adam",
    "ours-svgp-natural-compiled": "ours-svgp-natural-eager",
    "ours-orthnat-compiled": "ours-orthnat-eager",
    "ours-tsvgp-compiled": "ours-tsvgp-eager",
    "ours-decoupled-compiled": "ours-decoupled-eager",
    "ours-vbks-compiled": "ours-vbks-eager",
}


def crossover_steps(compiled: dict, eager: dict, first_step: str = "first_step_s") -> float:
    """Steps after which the compiled step has paid for its compilation: ``(first compiled step − first eager step) ÷
    (eager − compiled step time)`` from two configurations' summaries (``step_ms`` and the first step's seconds
    under ``first_step``); inf where compiling saves nothing."""
    saved_s = (eager["step_ms"] - compiled["step_ms"]) / 1e3
    extra_s = compiled[first_step] - eager[first_step]
    return extra_s / saved_s if saved_s > 0 else float("inf")


def step_ratio(summary: dict, ours: str, theirs: str) -> float:
    """Median step time of configuration ``ours`` over that of ``theirs`` in ``summary``; NaN where either is
    missing."""
    if ours in summary and theirs in summary:
        return summary[ours]["step_ms"] / summary[theirs]["step_ms"]
    return float("nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--num-inducing", type=int, default=200)
    parser.add_argument("--num-mean-inducing", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-batches", type=int, default=64, help="distinct batches, cycled in order")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed stepping per configuration and round")
    parser.add_argument("--warmup", type=int, default=20, help="steps after the first, before timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="*", default=None, help="subset of configurations (default: all)")
    parser.add_argument("--gpflow-python", default=str(ROOT.parent / ".venv-gpflow" / "bin" / "python"))
    parser.add_argument("--gpjax-python", default=str(ROOT.parent / ".venv-gpjax" / "bin" / "python"))
    parser.add_argument(
        "--likelihood",
        choices=("gaussian", "bernoulli"),
        default="gaussian",
        help="bernoulli: targets above the median are class 1, probit likelihood (GPyTorch's SVGP, ours SVGP, "
        "OrthNat and t-SVGP; the other configurations and the peers are skipped)",
    )
    parser.add_argument("--output", default=str(ROOT / "results" / "compiled-step.json"))


def _data_file(args, directory: str) -> str:
    split = datasets.load(args.dataset, split=0)
    x, y = split.train_x.float(), split.train_y.float()
    if args.likelihood == "bernoulli":
        y = (y > y.median()).float()
    generator = torch.Generator().manual_seed(0)
    batches = torch.stack(
        [torch.randperm(x.size(0), generator=generator)[: args.batch_size] for _ in range(args.num_batches)]
    )
    path = os.path.join(directory, "data.npz")
    np.savez(
        path,
        train_x=x.numpy(),
        train_y=y.numpy(),
        inducing=initial_inducing_points(x, args.num_inducing, 0).numpy(),
        mean_inducing=initial_inducing_points(x, args.num_mean_inducing, 1).numpy(),
        batches=batches.numpy(),
        likelihood=np.array(args.likelihood),
    )
    return path


def _command(config: str, data: str, args) -> list[str] | str:
    """The command of one configuration, or a message saying why it is skipped."""
    steps = [data, str(args.seconds), str(args.warmup)]
    if config in TORCH_CONFIGS:
        return [sys.executable, "-m", "benchmarks.compiled_step_worker", config, *steps]
    framework, script = PEERS[config]
    if args.likelihood != "gaussian":
        return f"{config} skipped: the peers' scripts train a Gaussian likelihood"
    python = getattr(args, f"{framework}_python")
    if not Path(python).exists():
        return f"{framework} skipped: no interpreter at {python} (install it in its own environment, see README)"
    return [python, str(script), config, *steps]


def run(args: argparse.Namespace) -> dict:
    configs = args.configs or [*TORCH_CONFIGS, *PEERS]
    load_start = os.getloadavg()
    rounds: dict[str, list[dict]] = {config: [] for config in configs}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as directory:
        data = _data_file(args, directory)
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        environment["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(directory, "inductor-cache")
        environment["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), environment.get("PYTHONPATH", "")])
        for index in range(args.rounds):
            order = configs if index % 2 == 0 else configs[::-1]
            for config in order:
                if config in skipped:
                    continue
                command = _command(config, data, args)
                if isinstance(command, str):
                    skipped[config] = command
                    print(command)
                    continue
                done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT.parent)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                if done.returncode != 0 or not lines:
                    skipped[config] = f"{config} failed: {done.stderr.strip().splitlines()[-1:]}"
                    print(skipped[config])
                    continue
                result = json.loads(lines[-1])
                result["load_1min_after"] = os.getloadavg()[0]
                rounds[config].append(result)
                print(
                    f"round {index + 1} {config:28s} first step {result['first_step_s']:8.2f} s, "
                    f"median step {result['step_ms']:7.2f} ms ({result['steps']} steps)",
                    flush=True,
                )
    summary = {}
    for config, results in rounds.items():
        if not results:
            continue
        summary[config] = {
            "step_ms": statistics.median(result["step_ms"] for result in results),
            "step_ms_per_round": [result["step_ms"] for result in results],
            "first_step_s_cold": results[0]["first_step_s"],
            "first_step_s_per_round": [result["first_step_s"] for result in results],
            "load_1min_after_per_round": [result["load_1min_after"] for result in results],
        }
    for compiled, eager in PAIRS.items():
        if compiled in summary and eager in summary:
            summary[compiled]["crossover_steps"] = crossover_steps(
                summary[compiled], summary[eager], "first_step_s_cold"
            )
    ratio = functools.partial(step_ratio, summary)
    ratios = {
        "orthnat_compiled_vs_gpflow_natgrad_adam": ratio("ours-orthnat-compiled", "gpflow-svgp-natgrad-adam"),
        "tsvgp_compiled_vs_gpflow_natgrad_adam": ratio("ours-tsvgp-compiled", "gpflow-svgp-natgrad-adam"),
        "svgp_natural_compiled_vs_gpflow_adam": ratio("ours-svgp-natural-compiled", "gpflow-svgp-adam"),
        "svgp_natural_compiled_vs_gpjax_adam": ratio("ours-svgp-natural-compiled", "gpjax-svgp-adam"),
        "svgp_natural_compiled_vs_gpytorch_svgp_adam": ratio("ours-svgp-natural-compiled", "gpytorch-svgp-adam"),
        "gpytorch_svgp_adam_compiled_vs_gpflow_adam": ratio("gpytorch-svgp-adam-compiled", "gpflow-svgp-adam"),
        "gpytorch_svgp_adam_compiled_vs_eager": ratio("gpytorch-svgp-adam-compiled", "gpytorch-svgp-adam"),
        "svgp_natural_compiled_vs_eager": ratio("ours-svgp-natural-compiled", "ours-svgp-natural-eager"),
        "orthnat_compiled_vs_eager": ratio("ours-orthnat-compiled", "ours-orthnat-eager"),
        "tsvgp_compiled_vs_eager": ratio("ours-tsvgp-compiled", "ours-tsvgp-eager"),
        "decoupled_compiled_vs_eager": ratio("ours-decoupled-compiled", "ours-decoupled-eager"),
        "decoupled_compiled_vs_gpytorch_svgp_adam": ratio("ours-decoupled-compiled", "gpytorch-svgp-adam"),
        "vbks_compiled_vs_eager": ratio("ours-vbks-compiled", "ours-vbks-eager"),
        "vbks_compiled_vs_gpytorch_svgp_adam": ratio("ours-vbks-compiled", "gpytorch-svgp-adam"),
        "gpytorch_svgp_adam_lean_vs_eager": ratio("gpytorch-svgp-adam-lean", "gpytorch-svgp-adam"),
        "svgp_natural_lean_vs_eager": ratio("ours-svgp-natural-lean", "ours-svgp-natural-eager"),
        "orthnat_lean_vs_eager": ratio("ours-orthnat-lean", "ours-orthnat-eager"),
        "tsvgp_lean_vs_eager": ratio("ours-tsvgp-lean", "ours-tsvgp-eager"),
        "decoupled_lean_vs_eager": ratio("ours-decoupled-lean", "ours-decoupled-eager"),
        "vbks_lean_vs_eager": ratio("ours-vbks-lean", "ours-vbks-eager"),
        "gpflow_adam_vs_gpytorch_svgp_adam": ratio("gpflow-svgp-adam", "gpytorch-svgp-adam"),
    }
    config = {key: value for key, value in vars(args).items() if key not in ("run",)}
    payload = benchmark_payload(
        "compiled-step",
        {**config, "dtype": "float32", "threads": 1, "torch": torch.__version__},
        [],
        ratios,
        GOALS,
        configurations=summary,
        skipped=skipped,
        notes=(
            "Each configuration in its own process, rounds in alternating order, median step time per round, "
            "median over rounds; step times in process CPU time. The t-SVGP iteration is the default schedule (the "
            "M-step's forward and backward pass, the E-step at its marginals with r_t = max(1/t, 0.1), the Adam "
            "step). The machine was shared with other jobs (load in machine.load_average): ratios within a run are "
            "meaningful, absolute times less so."
        ),
    )
    # The machine is shared: the load (1, 5, 15-minute averages) when the run started and ended.
    payload["machine"]["load_average"] = {"start": list(load_start), "end": list(os.getloadavg())}
    print(json.dumps(summary, indent=1))
    print(format_ratios(payload))
    write_results(args.output, payload)
    return payload


COMPILED_STEP = Benchmark(
    "compiled-step",
    "Compiled training steps vs their eager forms, GPyTorch's SVGP, GPflow's and GPJax's compiled SVGP (own processes)",
    add_arguments,
    run,
)
