"""The demo's command line, training loop, table and plot."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .. import datasets
from .demo_method import DemoMethod
from .demo_methods import DEMO_METHODS

#: Iterations left out of the per-iteration time (first calls allocate and warm caches).
WARMUP = 5


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m gpytorch_decoupled demo``."""
    parser.add_argument("--dataset", default="elevators", help="data set (elevators is embedded in the package)")
    parser.add_argument("--split", type=int, default=0, help="which published train/test split")
    parser.add_argument("--data-dir", default=None, help="where to look for a data set that is not embedded")
    parser.add_argument("--methods", nargs="+", choices=list(DEMO_METHODS), default=list(DEMO_METHODS))
    parser.add_argument("--iterations", type=int, default=1500, help="training iterations per method at most")
    # SRGP and the mean-basis methods cost more per iteration than SVGP; the budget keeps the demo about two minutes.
    parser.add_argument("--time-budget", type=float, default=20.0, help="training seconds per method at most")
    parser.add_argument("--batch-size", type=int, default=256, help="mini-batch size")
    parser.add_argument("--eval-every", type=int, default=100, help="evaluate the test metrics every N iterations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--max-train-rows", type=int, default=None, help="train on a seeded subset of the rows")
    parser.add_argument("--output-dir", default="demo_output", help="where the results (JSON) and the plot go")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--smoke", action="store_true", help="20 iterations per method, to check that all runs")


def gaussian_metrics(mean: Tensor, variance: Tensor, y: Tensor, y_std: Tensor) -> dict[str, float]:
    r"""Test RMSE and mean negative log predictive density in the targets' original units: with :math:`s` the
    training standard deviation of the targets, :math:`\mathrm{RMSE} = s\,(\frac1n\sum_i (y_i-\mu_i)^2)^{1/2}` and
    :math:`\mathrm{NLL} = \frac1n \sum_i [\frac12\log(2\pi\sigma_i^2) + (y_i-\mu_i)^2/(2\sigma_i^2)] + \log s`.

    Example:
        >>> metrics = gaussian_metrics(torch.zeros(2), torch.ones(2), torch.tensor([1.0, -1.0]), torch.tensor(2.0))
        >>> round(metrics["rmse"], 4), round(metrics["nll"], 4)
        (2.0, 2.1121)
    """
    residual = y - mean
    nll = 0.5 * (math.log(2 * math.pi) + variance.log() + residual.square() / variance).mean() + y_std.log()
    return {"rmse": (residual.square().mean().sqrt() * y_std).item(), "nll": nll.item()}


def _minibatches(num_rows: int, batch_size: int, seed: int) -> Iterator[tuple[bool, Tensor]]:
    """Endless ``(starts an epoch, row indices)``, reshuffled every epoch; one seed gives every method one order."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for number, index in enumerate(torch.randperm(num_rows, generator=generator).split(batch_size)):
            yield number == 0, index


def _seconds(method: DemoMethod, x: Tensor, y: Tensor) -> float:
    """Wall-clock seconds of one training step (CUDA synchronized on both sides)."""
    synchronize = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    method.step(x, y)
    synchronize()
    return time.perf_counter() - start


def train_and_score(method: DemoMethod, split: datasets.Split, args: argparse.Namespace) -> dict:
    """Train ``method`` for ``args.iterations`` mini-batches or ``args.time_budget`` seconds, whichever ends first,
    scoring the test predictions every ``args.eval_every`` iterations (outside the timed steps)."""
    train_x, train_y, test_x, test_y = split

    def score(iteration: int, seconds: float) -> dict:
        return {"iteration": iteration, "seconds": seconds, **gaussian_metrics(*method.predict(test_x), test_y, y_std)}

    y_std = split.y_std.to(test_y)
    times, curve = [], [score(0, 0.0)]
    batches = _minibatches(train_x.size(0), args.batch_size, args.seed)
    with tqdm(total=args.iterations, desc=method.label, disable=args.no_progress, leave=False) as progress:
        while len(times) < args.iterations and (args.time_budget is None or sum(times) < args.time_budget):
            epoch_starts, index = next(batches)
            if epoch_starts:
                method.start_epoch()
            times.append(_seconds(method, train_x[index], train_y[index]))
            progress.update()
            if len(times) % args.eval_every == 0:
                curve.append(score(len(times), sum(times)))
                progress.set_postfix(nll=f"{curve[-1]['nll']:.3f}")
    if curve[-1]["iteration"] != len(times):
        curve.append(score(len(times), sum(times)))
    return {
        "method": method.label,
        "sizes": method.sizes,
        "iterations": len(times),
        "seconds_per_iteration": statistics.median(times[WARMUP:] or times),
        "rmse": curve[-1]["rmse"],
        "nll": curve[-1]["nll"],
        "curve": curve,
    }


def format_table(rows: list[dict]) -> str:
    """The results as a plain-text table, one row per method."""
    columns = [
        ("method", "method", "{}"),
        ("inducing sizes", "sizes", "{}"),
        ("iterations", "iterations", "{}"),
        ("s / iteration", "seconds_per_iteration", "{:.4f}"),
        ("test RMSE", "rmse", "{:.4f}"),
        ("test NLL", "nll", "{:.4f}"),
    ]
    cells = [[title for title, _, _ in columns]]
    cells += [[fmt.format(row[key]) for _, key, fmt in columns] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(*cells)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join([*lines, "(test RMSE and NLL in the target's original units)"])


def plot_curves(rows: list[dict], path: Path, title: str) -> Path | None:
    """Test NLL against training time, one curve per method; ``None`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        curve = row["curve"]
        axes.plot(
            [point["seconds"] for point in curve], [point["nll"] for point in curve], marker=".", label=row["method"]
        )
    axes.set(xlabel="training time (s)", ylabel="test NLL", title=title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def load_split(args: argparse.Namespace) -> datasets.Split:
    """The requested split on the requested device and dtype, with a seeded subset of its training rows if asked."""
    split = datasets.load(args.dataset, split=args.split, data_dir=args.data_dir)
    if args.max_train_rows is not None and args.max_train_rows < split.train_x.size(0):
        generator = torch.Generator().manual_seed(args.seed)
        keep = torch.randperm(split.train_x.size(0), generator=generator)[: args.max_train_rows]
        split = replace(split, train_x=split.train_x[keep], train_y=split.train_y[keep])
    options = {"device": torch.device(args.device), "dtype": getattr(torch, args.dtype)}
    tensors = {name: getattr(split, name).to(**options) for name in ("train_x", "train_y", "test_x", "test_y")}
    return replace(split, **tensors)


def run_demo(args: argparse.Namespace) -> list[dict]:
    """Train every method of ``args.methods`` on the same data, seed and mini-batch order; print the table and write
    ``demo.json`` and ``demo_nll_vs_time.png`` (with matplotlib) to ``args.output_dir``."""
    if args.smoke:
        # every method runs its 20 iterations, however loaded the machine (no time budget)
        args.iterations, args.eval_every, args.time_budget = 20, 10, None
    split = load_split(args)
    budget = "" if args.time_budget is None else f" or {args.time_budget:g} s"
    print(
        f"Training {len(args.methods)} methods on {split.name} (split {split.split}: {split.train_x.size(0)} training, "
        f"{split.test_x.size(0)} test rows, {split.train_x.size(1)} inputs), {args.iterations} iterations{budget} each."
    )
    rows = []
    for name in args.methods:
        torch.manual_seed(args.seed)
        method = DEMO_METHODS[name](split.train_x, split.train_y, seed=args.seed)
        rows.append(train_and_score(method, split, args))
    print()
    print(format_table(rows))
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "demo.json").write_text(json.dumps({"dataset": split.name, "split": split.split, "rows": rows}, indent=1))
    plot = plot_curves(rows, output / "demo_nll_vs_time.png", f"Test NLL over training time, {split.name}")
    print(f"\nresults: {output / 'demo.json'}")
    print(f"plot:    {plot}" if plot else "plot:    skipped (pip install matplotlib to get it)")
    return rows
