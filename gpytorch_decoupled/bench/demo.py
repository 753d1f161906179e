"""``python -m gpytorch_decoupled demo``: every method of the package against GPyTorch's SVGP on embedded real data."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common_arguments import add_run_arguments, load_split, run_config
from .report import benchmark_payload, format_table, plot_curves, write_results
from .runner import compare

#: The demo's line-up: GPyTorch's baselines first, then each method family of this package as it lands.
DEMO_METHODS: list[tuple[str, dict]] = [
    ("svgp", {"num_inducing": 200}),
    ("svgp-ngd", {"num_inducing": 200}),
    ("sgpr", {"num_inducing": 200}),
    ("orthnat", {"num_inducing": 200, "num_mean_inducing": 1000}),
    ("decoupled", {"num_inducing": 200, "num_mean_inducing": 1200}),
    ("dual", {"num_inducing": 200}),
    ("recursive", {"num_inducing": 100, "lr": 0.05}),
]


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=1500, eval_every=100)
    # Full-batch baselines (SGPR) and the mean-basis methods cost more per iteration than SVGP; the per-method budget
    # keeps the whole demo (six methods) about two minutes of training.
    parser.set_defaults(time_budget=20.0)
    parser.add_argument("--dataset", default="elevators", help="data set (elevators is embedded in the package)")
    parser.add_argument("--output-dir", default="demo_output", help="where the table (JSON) and the plot go")
    parser.add_argument("--smoke", action="store_true", help="a few iterations only, to check that everything runs")


def run_demo(args: argparse.Namespace) -> dict:
    if args.smoke:
        # every method runs its 20 iterations, however loaded the machine (no time budget)
        args.iterations, args.eval_every, args.warmup, args.time_budget = 20, 10, 2, None
    split = load_split(args, args.dataset)
    config = run_config(args)
    print(
        f"Training {len(DEMO_METHODS)} methods on {split.name} (split {split.split}: {split.train_x.size(0)} training, "
        f"{split.test_x.size(0)} test rows, {split.train_x.size(1)} inputs), {config.iterations} iterations each."
    )
    results = compare(DEMO_METHODS, split, config)
    print()
    print(format_table(results))
    output = Path(args.output_dir)
    payload = benchmark_payload("demo", {**config.to_json(), "dataset": split.name}, results, {}, {}, args.device)
    json_path = write_results(output / "demo.json", payload)
    plot_path = plot_curves(
        results, output / "demo_nll_vs_time.png", title=f"Test NLL over training time, {split.name}"
    )
    print(f"\nresults: {json_path}")
    print(f"plot:    {plot_path}" if plot_path else "plot:    skipped (pip install matplotlib to get it)")
    return payload
