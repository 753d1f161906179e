"""``bench baselines``: GPyTorch's baselines side by side, the reference every later benchmark's ratios build on."""

from __future__ import annotations

import argparse
from pathlib import Path

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .report import benchmark_payload, format_ratios, format_table, plot_curves, write_results
from .runner import compare

NAME = "baselines"
REFERENCE = "svgp"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=2000, eval_every=100)
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--num-inducing", type=int, default=200, help="M (SVGP, SGPR) and Mβ (ODVGP)")
    parser.add_argument("--num-mean-inducing", type=int, default=1000, help="Mγ of GPyTorch's ODVGP")
    parser.add_argument("--exact-max-rows", type=int, default=5000, help="run the exact GP only up to this many rows")
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)
    parser.set_defaults(time_budget=60.0)


def _run(args: argparse.Namespace) -> dict:
    split = load_split(args, args.dataset)
    config = run_config(args)
    m = args.num_inducing
    methods = [
        ("svgp", {"num_inducing": m}),
        ("svgp-ngd", {"num_inducing": m}),
        ("gpytorch-odvgp", {"num_inducing": m, "num_mean_inducing": args.num_mean_inducing}),
        ("sgpr", {"num_inducing": m}),
        ("exact", {"max_exact_rows": args.exact_max_rows}),
    ]
    results = compare(methods, split, config)
    print(f"\n{NAME} on {split.name} (split {split.split}, {split.train_x.size(0)} training rows)\n")
    print(format_table(results))

    reference = next(result for result in results if result.name == REFERENCE)
    ratios = {}
    for result in results:
        if result.name != REFERENCE and not result.skipped:
            ratios[f"{result.name}_seconds_per_iteration"] = (
                result.seconds_per_iteration / reference.seconds_per_iteration
            )
            ratios[f"{result.name}_peak_memory"] = result.peak_memory_mb / max(reference.peak_memory_mb, 1.0)
    payload = benchmark_payload(
        NAME,
        {
            **config.to_json(),
            **split_config(split),
            "methods": methods,
            "reference": REFERENCE,
        },
        results,
        ratios,
        goals={},
        device=args.device,
    )
    output = Path(args.output_dir)
    write_results(output / f"{NAME}.json", payload)
    plot_curves(results, output / f"{NAME}.png", title=f"GPyTorch baselines on {split.name}: test NLL over time")
    print("\n" + format_ratios(payload))
    return payload


BASELINES = Benchmark(
    NAME, "GPyTorch's SVGP (Adam, NGD), ODVGP, SGPR and exact GP on one data set", _add_arguments, _run
)
