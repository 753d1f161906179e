"""``bench distributed``: throughput of data-parallel training (:mod:`gpytorch_decoupled.distributed`) with 1 and 2
processes on this machine, and the communication of a step against its computation.

Three parts, each a training loop over synthetic regression data (:math:`\\mathbf x` uniform on :math:`[-1, 1]^D`,
:math:`y = \\sin(\\sum_d x_d) + 0.1\\varepsilon`), the same global mini-batches (``--batch-size``, split evenly over the
processes by :class:`~gpytorch_decoupled.distributed.ShardedBatches`) and :math:`M` inducing inputs:

1. **gradient**: GPyTorch's SVGP (whitened ``VariationalStrategy``, ``CholeskyVariationalDistribution``), Adam on the
   ELBO, gradients all-reduced by :class:`~gpytorch_decoupled.distributed.GradientAllReduce` (one message of every
   parameter's gradient, :math:`\\approx M^2 + MD` values).
2. **estep**: the t-SVGP E-step, :class:`~gpytorch_decoupled.distributed.DistributedEStep` (one message of
   :math:`M + M^2 + 1` values).
3. **kalman**: one streaming pass of :class:`~gpytorch_decoupled.distributed.DistributedKalmanUpdate` (an all-gather
   of :math:`1 + M + M^2` float64 values per process, then one scalar all-reduce).

Each layout ``PxT`` (``P`` processes of ``T`` threads; by default ``1x1``, ``1x2`` and ``2x1``) runs every part in
fresh processes (gloo on CPU, NCCL on GPUs, where ``P`` may not exceed the number of GPUs); a part's time is the
slowest rank's wall-clock time for ``--iterations`` steps after ``--warmup`` steps, and its throughput is training
points per second. The communication is the message each process contributes per step, and the time of that collective
alone (repeated on the same message without any computation) against the time of a whole step. On a machine whose
cores other jobs share, two processes may well be slower than one process with two threads; the numbers say what
they measure.

The shared run options apply as follows: ``--batch-size``, ``--iterations``, ``--warmup``, ``--seed``, ``--dtype``
and ``--device``; the others are not used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import gpytorch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

from gpytorch_decoupled.distributed import DistributedEStep, DistributedKalmanUpdate, GradientAllReduce, ShardedBatches
from gpytorch_decoupled.variational import (
    DualVariationalDistribution,
    DualVariationalStrategy,
    KalmanVariationalStrategy,
)

from .benchmark import Benchmark
from .benchmark_parts import PartsOutcome, publish_parts
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, run_config
from .method_result import MethodResult
from .report import format_table

NAME = "distributed"
PARTS = ("gradient", "estep", "kalman")
LAYOUTS = ("1x1", "1x2", "2x1")
TABLE_COLUMNS = (
    ("part @ layout", "label", "{}"),
    ("sizes", "sizes", "{}"),
    ("s / step", "seconds_per_iteration", "{:.4f}"),
    ("steps", "iterations", "{}"),
)

RATIO_NOTES = {
    "<part>_throughput_2x1_vs_1x1_higher_is_better": (
        "training points per second with 2 processes of 1 thread ÷ with 1 process of 1 thread; 2 is perfect scaling"
    ),
    "<part>_throughput_2x1_vs_1x2_higher_is_better": (
        "the same ÷ 1 process of 2 threads (the same cores used by intra-op threads instead of processes; on cores "
        "that other jobs share, the threads' synchronization can make that layout far slower than 1 thread)"
    ),
    "<part>_communication_vs_step": (
        "seconds of the step's collective alone (2 processes, the same message, no computation) ÷ seconds of a whole "
        "step with 2 processes"
    ),
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=40, eval_every=1)
    parser.set_defaults(batch_size=1024, warmup=5)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="PxT: P processes of T threads each")
    parser.add_argument("--num-inducing", type=int, default=256, help="M of every part")
    parser.add_argument("--dims", type=int, default=8, help="input dimension D of the synthetic data")
    parser.add_argument("--collective-repeats", type=int, default=20, help="repeats of the collective-only timing")
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)


# ---------------------------------------------------------------------------------------------------------- workers
class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, z: torch.Tensor):
        q = gpytorch.variational.CholeskyVariationalDistribution(z.size(0))
        super().__init__(gpytorch.variational.VariationalStrategy(self, z, q, learn_inducing_locations=True))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=z.size(-1)))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class _StrategyGP(gpytorch.models.ApproximateGP):
    def __init__(self, strategy):
        super().__init__(strategy(self))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _synthetic(spec: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data on every rank: enough rows for the warm-up and timed steps."""
    generator = torch.Generator().manual_seed(spec["seed"])
    rows = spec["batch_size"] * (spec["warmup"] + spec["iterations"])
    x = 2 * torch.rand(rows, spec["dims"], generator=generator, dtype=torch.float64) - 1
    y = x.sum(-1).sin() + 0.1 * torch.randn(rows, generator=generator, dtype=torch.float64)
    return x.to(device, dtype), y.to(device, dtype)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_loop(spec: dict, device: torch.device, batches: ShardedBatches, step) -> float:
    """Wall-clock seconds of the timed steps (after the warm-up), the slowest rank's."""
    start = None
    for index, (x, y) in enumerate(batches):
        if index == spec["warmup"]:
            _synchronize(device)
            dist.barrier()
            start = time.perf_counter()
        step(x, y)
    _synchronize(device)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _collective_seconds(spec: dict, device: torch.device, sizes: list[tuple[int, torch.dtype, str]]) -> float:
    """Median seconds of the step's collectives alone (``(values, dtype, "all_reduce" | "all_gather")``)."""
    messages = [(torch.randn(size, device=device).to(dtype), kind) for size, dtype, kind in sizes]
    times = []
    for _ in range(spec["collective_repeats"] + 2):
        _synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for message, kind in messages:
            if kind == "all_reduce":
                dist.all_reduce(message)
            else:
                dist.all_gather([torch.empty_like(message) for _ in range(dist.get_world_size())], message)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _gradient_part(spec: dict, device: torch.device, dtype: torch.dtype) -> dict:
    x, y = _synthetic(spec, device, dtype)
    torch.manual_seed(spec["seed"])
    model = _SVGP(x[: spec["num_inducing"]].clone()).to(device, dtype)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device, dtype)
    gradients = GradientAllReduce(model, likelihood)
    objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=x.size(0))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)

    def step(x_batch, y_batch):
        optimizer.zero_grad()
        (-objective(model(x_batch), y_batch)).backward()
        gradients.all_reduce(batch_size=x_batch.size(0))
        optimizer.step()

    seconds = _timed_loop(spec, device, ShardedBatches(TensorDataset(x, y), spec["batch_size"]), step)
    values = dist.get_world_size() + gradients.message_size
    return {"seconds": seconds, "message": [(values, dtype, "all_reduce")]}


def _estep_part(spec: dict, device: torch.device, dtype: torch.dtype) -> dict:
    x, y = _synthetic(spec, device, dtype)
    m = spec["num_inducing"]
    model = _StrategyGP(lambda gp: DualVariationalStrategy(gp, x[:m].clone(), DualVariationalDistribution(m)))
    model = model.to(device, dtype)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device, dtype)
    e_step = DistributedEStep(model, likelihood, num_data=x.size(0), lr=0.5)
    seconds = _timed_loop(spec, device, ShardedBatches(TensorDataset(x, y), spec["batch_size"]), e_step.step)
    values = dist.get_world_size() + m + m * m + 1
    return {"seconds": seconds, "message": [(values, dtype, "all_reduce")]}


def _kalman_part(spec: dict, device: torch.device, dtype: torch.dtype) -> dict:
    x, y = _synthetic(spec, device, dtype)
    m = spec["num_inducing"]
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device, dtype)
    model = _StrategyGP(lambda gp: KalmanVariationalStrategy(gp, x[:m].clone(), likelihood=likelihood)).to(
        device, dtype
    )
    kalman = DistributedKalmanUpdate(model, likelihood)
    seconds = _timed_loop(spec, device, ShardedBatches(TensorDataset(x, y), spec["batch_size"]), kalman.update)
    world_size = dist.get_world_size()
    message = [(2 + m + m * m, torch.float64, "all_gather"), (world_size + 1, torch.float64, "all_reduce")]
    return {"seconds": seconds, "message": message}


_PART_RUNNERS = {"gradient": _gradient_part, "estep": _estep_part, "kalman": _kalman_part}


def _worker(rank: int, world_size: int, threads: int, store: str, output: str, spec: dict) -> None:
    torch.set_num_threads(threads)
    cuda = spec["device"].startswith("cuda")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=600)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timeout)
    dtype = getattr(torch, spec["dtype"])
    results = {}
    for part in spec["parts"]:
        result = _PART_RUNNERS[part](spec, device, dtype)
        message = result.pop("message")
        result["message_bytes"] = sum(size * torch.empty((), dtype=kind).element_size() for size, kind, _ in message)
        result["collective_seconds"] = _collective_seconds(spec, device, message) if world_size > 1 else 0.0
        results[part] = result
    dist.destroy_process_group()
    if rank == 0:
        Path(output).write_text(json.dumps(results))


def _launch(processes: int, threads: int, spec: dict) -> dict:
    """Runs every part on ``processes`` fresh processes of ``threads`` threads; rank 0's measurements."""
    with tempfile.TemporaryDirectory() as directory:
        store, output = Path(directory) / "store", Path(directory) / "result.json"
        mp.start_processes(
            _worker, args=(processes, threads, str(store), str(output), spec), nprocs=processes, start_method="spawn"
        )
        return json.loads(output.read_text())


# ---------------------------------------------------------------------------------------------------------- run
def _layout(text: str) -> tuple[int, int]:
    try:
        processes, threads = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a layout is PxT (processes x threads), e.g. 2x1; got {text!r}.") from None
    if processes < 1 or threads < 1:
        raise ValueError(f"a layout needs at least 1 process and 1 thread, got {text!r}.")
    return processes, threads


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    layouts = {text: _layout(text) for text in args.layouts}
    if config.batch_size % math.lcm(*(processes for processes, _ in layouts.values())):
        raise ValueError(f"--batch-size {config.batch_size} must be a multiple of every layout's process count.")
    spec = {
        "parts": [part for part in PARTS if part in args.parts],
        "batch_size": config.batch_size,
        "iterations": config.iterations,
        "warmup": config.warmup,
        "seed": config.seed,
        "dtype": str(config.dtype).replace("torch.", ""),
        "device": config.device,
        "num_inducing": args.num_inducing,
        "dims": args.dims,
        "collective_repeats": args.collective_repeats,
    }
    available = torch.cuda.device_count() if config.device.startswith("cuda") else None
    measured, results, start = {}, [], time.perf_counter()
    seconds = {}
    for text, (processes, threads) in layouts.items():
        label_sizes = f"M={args.num_inducing}, B={config.batch_size}"
        if available is not None and processes > available:
            for part in spec["parts"]:
                reason = f"{processes} processes need {processes} GPUs, {available} present"
                results.append(MethodResult(f"{part}@{text}", f"{part} @ {text}", label_sizes, skipped=reason))
            continue
        layout_start = time.perf_counter()
        measured[text] = _launch(processes, threads, spec)
        seconds[text] = time.perf_counter() - layout_start
        for part, row in measured[text].items():
            row["seconds_per_step"] = row["seconds"] / config.iterations
            row["samples_per_second"] = config.batch_size * config.iterations / row["seconds"]
            results.append(
                MethodResult(
                    f"{part}@{text}",
                    f"{part} @ {text}",
                    label_sizes,
                    seconds_per_iteration=row["seconds_per_step"],
                    iterations=config.iterations,
                    train_seconds=row["seconds"],
                )
            )

    ratios, notes = {}, {}
    for part in spec["parts"]:
        rows = {text: measured[text][part] for text in measured}
        if "2x1" in rows and "1x1" in rows:
            name = f"{part}_throughput_2x1_vs_1x1_higher_is_better"
            ratios[name] = rows["2x1"]["samples_per_second"] / rows["1x1"]["samples_per_second"]
            notes[name] = RATIO_NOTES["<part>_throughput_2x1_vs_1x1_higher_is_better"]
        if "2x1" in rows and "1x2" in rows:
            name = f"{part}_throughput_2x1_vs_1x2_higher_is_better"
            ratios[name] = rows["2x1"]["samples_per_second"] / rows["1x2"]["samples_per_second"]
            notes[name] = RATIO_NOTES["<part>_throughput_2x1_vs_1x2_higher_is_better"]
        if "2x1" in rows:
            name = f"{part}_communication_vs_step"
            ratios[name] = rows["2x1"]["collective_seconds"] / rows["2x1"]["seconds_per_step"]
            notes[name] = RATIO_NOTES["<part>_communication_vs_step"]

    print(f"\n{NAME}: {', '.join(spec['parts'])} on layouts {', '.join(layouts)} (processes x threads)\n")
    print(format_table(results, columns=TABLE_COLUMNS).rsplit("\n", 1)[0])  # (the last line is about test metrics)
    print()
    for text, parts in measured.items():
        for part, row in parts.items():
            kilobytes, step_ms, collective_ms = (
                row["message_bytes"] / 1e3,
                1e3 * row["seconds_per_step"],
                1e3 * row["collective_seconds"],
            )
            print(
                f"{part:8s} @ {text}: {row['samples_per_second']:9.0f} points/s, message {kilobytes:8.1f} kB/step, "
                f"collective alone {collective_ms:7.2f} ms of {step_ms:7.2f} ms/step"
            )
    summary = {"layouts": measured, "layout_seconds": seconds, "wall_seconds": time.perf_counter() - start}
    config_json = {
        **config.to_json(),
        "parts": spec["parts"],
        "layouts": list(layouts),
        "num_inducing": args.num_inducing,
        "dims": args.dims,
        "collective_repeats": args.collective_repeats,
    }
    # Every layout runs every part (see layout_seconds), so rows and ratios are not attributed to parts.
    outcome = PartsOutcome({"measurements": summary}, results, ratios, {}, [], {})
    return publish_parts(NAME, config_json, outcome, {}, notes, args.device, Path(args.output_dir))


DISTRIBUTED = Benchmark(
    NAME,
    "throughput of data-parallel training (gradients, t-SVGP E-step, Kalman updates) on 1 and 2 processes",
    _add_arguments,
    _run,
)
