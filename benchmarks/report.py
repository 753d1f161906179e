"""Tables, result files and plots shared by every benchmark."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import gpytorch
import linear_operator
import torch

from gpytorch_decoupled.version import __version__

from .method_result import MethodResult

TABLE_COLUMNS = (
    ("method", "label", "{}"),
    ("inducing sizes", "sizes", "{}"),
    ("s / iteration", "seconds_per_iteration", "{:.4f}"),
    ("peak MB", "peak_memory_mb", "{:.0f}"),
    ("iterations", "iterations", "{}"),
    ("test RMSE", "rmse", "{:.4f}"),
    ("test NLL", "nll", "{:.4f}"),
    ("final ELBO / N", "objective", "{:.4f}"),
)


TABLE_UNITS_NOTE = "(test RMSE and NLL in the target's original units; ELBO / N of the standardized targets)"


def format_table(results: Sequence[MethodResult], columns=TABLE_COLUMNS) -> str:
    """A plain-text table, one row per method that ran; skipped methods are listed below it with their reason."""
    header = [title for title, _, _ in columns]
    ran = [result for result in results if not result.skipped]
    rows = [[fmt.format(getattr(result, attribute)) for _, attribute, fmt in columns] for result in ran]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines += [f"skipped {result.label}: {result.skipped}" for result in results if result.skipped]
    lines.append(TABLE_UNITS_NOTE)
    return "\n".join(lines)


def machine_info(device: str = "cpu") -> dict:
    """Where a result was measured: enough to know that ratios, not absolute times, compare across machines."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpytorch": gpytorch.__version__,
        "linear_operator": linear_operator.__version__,
        "gpytorch_decoupled": __version__,
        "device": device,
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _finite_or_none(value):
    # JSON has no NaN/inf; keep the files strictly valid.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(item) for item in value]
    return value


def write_results(path: str | os.PathLike, payload: dict) -> Path:
    """Write a benchmark's results as strict JSON (NaN and inf become ``null``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite_or_none(payload), indent=2, ensure_ascii=False) + "\n")
    return path


def pyplot():
    """matplotlib's ``pyplot`` on the non-interactive Agg backend, or ``None`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(figure, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Lay out ``figure``, write it to ``path`` (creating its folder) and close it."""
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
    return path


def plot_curves(
    results: Sequence[MethodResult],
    path: str | os.PathLike,
    metric: str = "nll",
    title: str = "",
    x: str = "seconds",
    xlabel: str = "training wall-clock time (s)",
    ylabel: str | None = None,
    log: bool = False,
    reference: tuple[float, str] | None = None,
) -> Path | None:
    """Plot one curve per method (``metric`` against ``x`` from each result's curve); ``None`` without matplotlib.

    :param log: Logarithmic y axis (values are floored at 1e-12).
    :param reference: A horizontal line ``(value, label)``, e.g. a tolerance.
    """
    plt = pyplot()
    if plt is None:
        return None
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for result in results:
        if result.curve:
            values = [point[metric] for point in result.curve]
            if log:
                values = [max(value, 1e-12) for value in values]
            axis.plot([point[x] for point in result.curve], values, label=f"{result.label} ({result.sizes})")
    if reference is not None:
        axis.axhline(reference[0], color="grey", linestyle="--", linewidth=1, label=reference[1])
    if log:
        axis.set_yscale("log")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel or f"test {metric.upper()}")
    axis.set_title(title)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    return save_figure(figure, path)


def lower_is_better(goal_name: str) -> bool:
    """Ratios are ours ÷ baseline, lower is better, unless the goal's name ends in ``_higher_is_better``."""
    return not goal_name.endswith("_higher_is_better")


def benchmark_payload(
    name: str,
    config: dict,
    results: Sequence[MethodResult],
    ratios: dict[str, float],
    goals: dict[str, float],
    device: str = "cpu",
    **extra,
) -> dict:
    """The results file of a benchmark: machine, config, ratios against the same-run baseline, goals, verdict, rows.

    ``passed`` is true when every goal is met (a missing or non-finite ratio fails its goal).
    """
    verdicts = {}
    for goal_name, bound in goals.items():
        value = ratios.get(goal_name, float("nan"))
        met = math.isfinite(value) and (value <= bound if lower_is_better(goal_name) else value >= bound)
        verdicts[goal_name] = met
    return {
        "benchmark": name,
        "machine": machine_info(device),
        "config": config,
        "ratios": ratios,
        "goals": goals,
        "goal_met": verdicts,
        "passed": all(verdicts.values()),
        "rows": [result.to_json() for result in results],
        **extra,
    }


def format_ratios(payload: dict) -> str:
    """The ratios of a results payload, one per line, with the goal and the verdict where the ratio has a goal."""
    lines = ["ratios (ours ÷ same-run baseline unless its note says otherwise):"]
    for goal_name, value in payload["ratios"].items():
        bound = payload["goals"].get(goal_name)
        verdict = ""
        if bound is not None:
            relation = "≤" if lower_is_better(goal_name) else "≥"
            verdict = f"  goal {relation} {bound:g}: {'met' if payload['goal_met'][goal_name] else 'MISSED'}"
        lines.append(f"  {goal_name:40s} {value:8.3f}{verdict}")
    return "\n".join(lines)
