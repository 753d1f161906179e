"""``bench decoupled-speed``: cost of one Decoupled (SVDGP) iteration against GPyTorch's SVGP, and how it grows with Mα.

Two parts, one process, one data set (kin40k split 0 by default), mini-batches of 256:

1. **Speed.** GPyTorch's SVGP (Adam, :math:`M=200`), this package's Decoupled (Adam, :math:`M_\\alpha=1000` including
   the :math:`M_\\beta=200` covariance points, 64 sampled KL rows) and Hybrid (Adam, :math:`M_\\gamma=1000`,
   :math:`M_\\beta=200`, 64 sampled KL rows) are trained in lockstep on the same mini-batches (one iteration of each
   in turn); the median seconds per iteration after warm-up are compared with SVGP's. Peak memory is measured over the
   warm-up iterations of a fresh copy of each method.
2. **Scale.** Decoupled at :math:`M_\\alpha = 10^3, 10^4, 10^5` (:math:`M_\\beta=200`, 64 sampled KL rows), and
   Hybrid at :math:`M_\\gamma` of the same sizes: the time of an iteration must grow at most linearly in the mean
   basis and the peak memory at :math:`10^5` stay small. A basis larger than kin40k's 36,000 training rows is drawn
   as in ``bench orthogonal-speed`` (with replacement plus a small jitter, swapped into the built method's parameters
   by :func:`~benchmarks.orthogonal_speed_benchmark.enlarge_mean_basis`); Decoupled's enlarged basis
   still ends with its covariance points (:math:`\\alpha = \\gamma \\cup \\beta`).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .method_result import MethodResult
from .orthogonal_speed_benchmark import _size_label, scale_run
from .report import benchmark_payload, format_ratios, format_table, pyplot, save_figure, write_results
from .runner import compare, split_tensors

NAME = "decoupled-speed"
REFERENCE = "svgp"
SCALE_METHODS = ("decoupled", "hybrid")

GOALS = {
    "time_ratio_1e4_to_1e5": 12.0,
    "peak_memory_gb_at_1e5": 1.5,
}

RATIO_NOTES = {
    "decoupled_time_per_iteration": (
        "Decoupled (Mα=1000 including Mβ=200) ÷ GPyTorch SVGP (M=200), median s / iteration, same run; no goal "
        "(OrthNat's analogous goal in orthogonal-speed is 1.5)"
    ),
    "hybrid_time_per_iteration": "Hybrid (Mγ=1000, Mβ=200) ÷ GPyTorch SVGP (M=200); no goal",
    "decoupled_peak_memory": "Decoupled (Mα=1000) ÷ GPyTorch SVGP peak memory over warm-up; no goal",
    "time_ratio_1e4_to_1e5": (
        "Decoupled s / iteration at the largest ÷ the second largest Mα of the scale series (10^5 ÷ 10^4 by default); "
        "linear growth gives their size ratio (10)"
    ),
    "peak_memory_gb_at_1e5": (
        "absolute value, not a ratio: peak memory (GB, above the level before training) of Decoupled over the "
        "warm-up iterations at the largest Mα of the scale series (10^5 by default)"
    ),
    "hybrid_time_ratio_1e4_to_1e5": "the same for Hybrid (Mγ); no goal",
    "hybrid_peak_memory_gb_at_1e5": "the same for Hybrid (Mγ); absolute value, no goal",
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=500, eval_every=10**9)
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--num-inducing", type=int, default=200, help="M of SVGP and Mβ of Decoupled and Hybrid")
    parser.add_argument(
        "--num-mean-inducing", type=int, default=1000, help="Mα of Decoupled (Mβ included) and Mγ of Hybrid (speed)"
    )
    parser.add_argument("--num-kl-columns", type=int, default=64, help="sampled KL rows of Decoupled and Hybrid")
    parser.add_argument(
        "--mean-sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000], help="Mα / Mγ of the scale series"
    )
    parser.add_argument(
        "--scale-methods",
        nargs="+",
        choices=SCALE_METHODS,
        default=list(SCALE_METHODS),
        help="methods of the scale series (the goals are Decoupled's)",
    )
    parser.add_argument("--scale-iterations", type=int, default=200, help="training iterations per scale run")
    parser.add_argument(
        "--mean-jitter",
        type=float,
        default=1e-2,
        help="standard deviation (standardized input units) of the jitter on mean-basis points drawn with replacement",
    )
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)


def _scale_ratios(results: list[MethodResult], prefix: str) -> dict[str, float]:
    ratios = {}
    sizes = [int(result.name.split("=")[1]) for result in results]
    for (small, smaller), (large, larger) in zip(zip(sizes, results), zip(sizes[1:], results[1:])):
        key = f"{prefix}time_ratio_{_size_label(small)}_to_{_size_label(large)}"
        ratios[key] = larger.seconds_per_iteration / smaller.seconds_per_iteration
    if len(results) >= 2:
        ratios[f"{prefix}time_ratio_1e4_to_1e5"] = results[-1].seconds_per_iteration / results[-2].seconds_per_iteration
    ratios[f"{prefix}peak_memory_gb_at_1e5"] = results[-1].peak_memory_mb / 1024
    return ratios


def _plot_scale(scale: dict[str, list[MethodResult]], sizes: list[int], path: Path) -> Path | None:
    """Seconds per iteration and peak memory against the mean-basis size, log-log, with a linear-growth guide."""
    plt = pyplot()
    if plt is None:
        return None
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for results in scale.values():
        label = results[0].label
        time_axis.plot(sizes, [r.seconds_per_iteration for r in results], marker="o", label=label)
        memory_axis.plot(sizes, [max(r.peak_memory_mb, 1e-3) / 1024 for r in results], marker="o", label=label)
    first = next(iter(scale.values()))[0].seconds_per_iteration
    time_axis.plot(sizes, [first * size / sizes[0] for size in sizes], "k:", linewidth=1, label="linear growth")
    memory_axis.axhline(
        GOALS["peak_memory_gb_at_1e5"], color="grey", linestyle="--", linewidth=1, label="goal at the largest size"
    )
    for axis, ylabel in ((time_axis, "median s / iteration"), (memory_axis, "peak memory over warm-up (GB)")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("mean basis size (Mα for Decoupled, Mγ for Hybrid)")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    figure.suptitle("Decoupled and Hybrid, Mβ=200, batch 256: time and memory against the mean basis size")
    return save_figure(figure, path)


def _run(args: argparse.Namespace) -> dict:
    split = load_split(args, args.dataset)
    config = run_config(args)
    m, m_mean, kl = args.num_inducing, args.num_mean_inducing, args.num_kl_columns
    methods = [
        ("svgp", {"num_inducing": m}),
        ("decoupled", {"num_inducing": m, "num_mean_inducing": m_mean, "num_kl_columns": kl}),
        ("hybrid", {"num_inducing": m, "num_mean_inducing": m_mean, "num_kl_columns": kl}),
    ]
    results = compare(methods, split, config, lockstep=True)
    by_name = {result.name: result for result in results}
    reference = by_name[REFERENCE]

    train, test = split_tensors(split, config)
    scale_config = replace(config, iterations=args.scale_iterations, eval_every=10**9)
    sizes = sorted(args.mean_sizes)
    # Decoupled first: its goals are the benchmark's.
    scale_methods = sorted(args.scale_methods, key=SCALE_METHODS.index)
    scale = {
        name: [scale_run(name, train, test, split.y_std, args, scale_config, size) for size in sizes]
        for name in scale_methods
    }

    print(f"\n{NAME} on {split.name} (split {split.split}, {split.train_x.size(0)} training rows)\n")
    print("speed: same mini-batches, median seconds per iteration after warm-up\n")
    print(format_table(results))
    for name, scale_results in scale.items():
        print(f"\nscale: {name}, Mβ={m}, {kl} sampled KL rows, {args.scale_iterations} iterations each\n")
        print(format_table(scale_results))

    ratios = {
        "decoupled_time_per_iteration": by_name["decoupled"].seconds_per_iteration / reference.seconds_per_iteration,
        "hybrid_time_per_iteration": by_name["hybrid"].seconds_per_iteration / reference.seconds_per_iteration,
        "decoupled_peak_memory": by_name["decoupled"].peak_memory_mb / max(reference.peak_memory_mb, 1.0),
    }
    for name, scale_results in scale.items():
        ratios.update(_scale_ratios(scale_results, "" if name == "decoupled" else f"{name}_"))

    scale_table = [
        {
            "method": name,
            "mean_size": size,
            "seconds_per_iteration": result.seconds_per_iteration,
            "peak_memory_mb": result.peak_memory_mb,
            "drawn_with_replacement": size > split.train_x.size(0),
        }
        for name, scale_results in scale.items()
        for size, result in zip(sizes, scale_results)
    ]
    notes = dict(RATIO_NOTES)
    if len(sizes) >= 2 and sizes[-2:] != [10_000, 100_000]:
        for key in ("time_ratio_1e4_to_1e5", "hybrid_time_ratio_1e4_to_1e5"):
            notes[key] += f" (this run: {sizes[-1]} ÷ {sizes[-2]})"
    if sizes[-1] != 100_000:
        for key in ("peak_memory_gb_at_1e5", "hybrid_peak_memory_gb_at_1e5"):
            notes[key] += f" (this run: {sizes[-1]})"
    payload = benchmark_payload(
        NAME,
        {
            **config.to_json(),
            **split_config(split),
            "methods": methods,
            "reference": REFERENCE,
            "scale_methods": scale_methods,
            "scale_num_inducing": m,
            "scale_mean_sizes": sizes,
            "scale_iterations": args.scale_iterations,
            "num_kl_columns": kl,
            "mean_jitter": args.mean_jitter,
        },
        [*results, *(result for scale_results in scale.values() for result in scale_results)],
        ratios,
        GOALS,
        device=args.device,
        ratio_notes=notes,
        scale=scale_table,
    )
    output = Path(args.output_dir)
    write_results(output / f"{NAME}.json", payload)
    if scale:
        _plot_scale(scale, sizes, output / f"{NAME}.png")
    print("\n" + format_ratios(payload) + "\n(peak_memory_gb_at_1e5 is an absolute value; see ratio_notes in the JSON)")
    return payload


DECOUPLED_SPEED = Benchmark(
    NAME,
    "Decoupled's time per iteration vs GPyTorch's SVGP, and Decoupled's and Hybrid's time and memory at "
    "Mα = 10^3 ... 10^5",
    _add_arguments,
    _run,
)
