"""``bench cuda-step``: the training steps of issue 21 on a CUDA GPU, compiled with CUDA graphs
(``mode="reduce-overhead"``), against GPyTorch's own eager steps with its ``VariationalStrategy`` and its
``LargeBatchVariationalStrategy``, at mini-batches of 256 and 4,096.

One process, float32, kin40k split 0 (M = 200, Mγ = 1000; the inducing inputs of ``bench compiled-step``). For each
batch size every configuration is built on the GPU and its first step timed (the compilation and the graph's
capture, for ``-graphs`` configurations), then ``--warmup`` steps; then all configurations step in lockstep on the
same mini-batches for ``--steps`` steps (one step of each in turn, the order alternating), each step timed in
wall-clock with the GPU synchronized before and after. Reported: the median step time, the ratio of each step to the
two GPyTorch references and to its own eager form, the crossover (steps after which compiling has paid for itself:
``(first graphs step − first eager step) ÷ (eager − graphs step time)``), the peak GPU memory of each configuration's
first steps, and how many times Inductor declined to capture a CUDA graph (``cudagraph_skips``: zero means every
``-graphs`` step replays a graph). No goals: the issue asks for the measurements.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from torch._dynamo.utils import counters

from gpytorch_decoupled import datasets

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR
from .compiled_step_benchmark import crossover_steps, step_ratio
from .compiled_step_worker import make_step
from .methods.inducing_points import initial_inducing_points
from .report import benchmark_payload, format_ratios, write_results
from .runner import timed_call

REFERENCES = ("gpytorch-svgp-adam", "gpytorch-largebatch-adam")
FAMILIES = ("ours-svgp-natural", "ours-orthnat", "ours-tsvgp", "ours-decoupled", "ours-vbks")
CONFIGS = (*REFERENCES, *(f"{family}-{mode}" for family in FAMILIES for mode in ("eager", "graphs")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--num-inducing", type=int, default=200)
    parser.add_argument("--num-mean-inducing", type=int, default=1000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--steps", type=int, default=200, help="timed lockstep steps per batch size")
    parser.add_argument("--warmup", type=int, default=20, help="steps after the first, before timing")
    parser.add_argument("--configs", nargs="*", default=None, help=f"subset of {', '.join(CONFIGS)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output", default=str(DEFAULT_RESULTS_DIR / "cuda-step.json"))


def _prepare(config: str, data: dict, batches, warmup: int, device: torch.device) -> tuple:
    """The step of a configuration after its first step (timed) and ``warmup`` more, with its peak memory (MB) and
    the CUDA-graph captures Inductor skipped meanwhile."""
    skips = counters["inductor"]["cudagraph_skips"]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    step = make_step(config, data["x"], data["y"], data["inducing"], data["mean_inducing"])
    first = timed_call(step, *batches[0], device=device)
    for index in range(1, warmup + 1):
        step(*batches[index % len(batches)])
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return step, first, peak, counters["inductor"]["cudagraph_skips"] - skips


def _measure_batch_size(configs, data: dict, batch_size: int, args, device: torch.device) -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(batch_size)
    n = data["x"].size(0)
    batches = []
    for _ in range(16):
        index = torch.randperm(n, generator=generator)[:batch_size].to(device)
        batches.append((data["x"][index], data["y"][index]))
    steps, summary, skipped = {}, {}, {}
    for config in configs:
        try:
            step, first, peak, skips = _prepare(config, data, batches, args.warmup, device)
        except Exception as error:  # a configuration that fails is reported, the others still run
            skipped[config] = f"{type(error).__name__}: {error}"[:1000]
            print(f"batch {batch_size} {config} failed: {skipped[config]}", flush=True)
            continue
        steps[config] = step
        summary[config] = {"first_step_s": first, "peak_memory_mb": peak, "cudagraph_skips": skips}
        print(f"batch {batch_size} {config:28s} first step {first:7.2f} s, skips {skips}", flush=True)
    times = {config: [] for config in steps}
    names = list(steps)
    for iteration in range(args.steps):
        x, y = batches[(args.warmup + 1 + iteration) % len(batches)]
        for config in names[:: 1 if iteration % 2 else -1]:
            times[config].append(timed_call(steps[config], x, y, device=device))
    for config, values in times.items():
        milliseconds = sorted(1e3 * value for value in values)
        summary[config].update(
            step_ms=statistics.median(milliseconds),
            step_ms_p10=milliseconds[len(milliseconds) // 10],
            step_ms_p90=milliseconds[(9 * len(milliseconds)) // 10],
        )
        print(f"batch {batch_size} {config:28s} median step {summary[config]['step_ms']:7.3f} ms", flush=True)
    for family in FAMILIES:
        graphs, eager = summary.get(f"{family}-graphs"), summary.get(f"{family}-eager")
        if graphs and eager:
            graphs["crossover_steps"] = crossover_steps(graphs, eager)
    return summary, skipped


def _ratios(by_batch: dict) -> dict:
    ratios = {}
    for batch_size, summary in by_batch.items():
        ratio = functools.partial(step_ratio, summary)
        for family in FAMILIES:
            name = family.removeprefix("ours-").replace("-", "_")
            graphs = f"{family}-graphs"
            ratios[f"{name}_graphs_vs_gpytorch_svgp_adam_b{batch_size}"] = ratio(graphs, "gpytorch-svgp-adam")
            ratios[f"{name}_graphs_vs_largebatch_adam_b{batch_size}"] = ratio(graphs, "gpytorch-largebatch-adam")
            ratios[f"{name}_graphs_vs_eager_b{batch_size}"] = ratio(graphs, f"{family}-eager")
        ratios[f"largebatch_adam_vs_gpytorch_svgp_adam_b{batch_size}"] = ratio(
            "gpytorch-largebatch-adam", "gpytorch-svgp-adam"
        )
        # what the mean basis costs once both steps are graphs
        ratios[f"orthnat_graphs_vs_svgp_natural_graphs_b{batch_size}"] = ratio(
            "ours-orthnat-graphs", "ours-svgp-natural-graphs"
        )
    return ratios


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda-step needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu runs it here.")
    configs = args.configs or list(CONFIGS)
    split = datasets.load(args.dataset, split=0)
    x = split.train_x.float()
    data = {
        "x": x.to(device),
        "y": split.train_y.float().to(device),
        "inducing": initial_inducing_points(x, args.num_inducing, 0).to(device),
        "mean_inducing": initial_inducing_points(x, args.num_mean_inducing, 1).to(device),
    }
    by_batch, skipped = {}, {}
    for batch_size in args.batch_sizes:
        by_batch[batch_size], failures = _measure_batch_size(configs, data, batch_size, args, device)
        skipped.update({f"{config}@{batch_size}": reason for config, reason in failures.items()})
        payload = _payload(args, device, by_batch, skipped)
        write_results(args.output, payload)  # after each batch size: a run cut short keeps what it measured
    print(format_ratios(payload))
    return payload


def _payload(args: argparse.Namespace, device: torch.device, by_batch: dict, skipped: dict) -> dict:
    config = {key: value for key, value in vars(args).items() if key not in ("run", "output")}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return benchmark_payload(
        "cuda-step",
        {**config, "dtype": "float32", "torch": torch.__version__, "gpu": name},
        [],
        _ratios(by_batch),
        {},
        device=str(device),
        configurations={str(batch_size): summary for batch_size, summary in by_batch.items()},
        skipped=skipped,
        notes=(
            "One process; per batch size, every configuration's first step (compilation and capture for -graphs), "
            "warm-up, then lockstep steps on the same mini-batches, wall-clock with the GPU synchronized around each "
            "step; medians. -graphs: compile_training_step(..., mode='reduce-overhead'); -eager: the same model's "
            "eager step (GPyTorch's general path); gpytorch-*: GPyTorch's own eager step (zero_grad, loss, "
            "backward, optimizer.step) with VariationalStrategy / LargeBatchVariationalStrategy and Adam."
        ),
    )


CUDA_STEP = Benchmark(
    "cuda-step",
    "Training steps with CUDA graphs vs GPyTorch's SVGP and LargeBatchVariationalStrategy on a GPU (batch 256, 4096)",
    add_arguments,
    run,
)
