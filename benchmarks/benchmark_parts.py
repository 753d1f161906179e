"""Benchmarks made of named parts, each run on its own and timed (``--parts`` selects them)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .method_result import MethodResult
from .report import benchmark_payload, format_ratios, write_results
from .run_config import RunConfig

#: A part: ``(args, config, output directory) -> (summary for the JSON, result rows, ratios)``.
PartRunner = Callable[[argparse.Namespace, RunConfig, Path], tuple[dict, list[MethodResult], dict[str, float]]]


def run_parts(
    runners: dict[str, PartRunner], selected: Sequence[str], args: argparse.Namespace, config: RunConfig, output: Path
) -> tuple[dict, list[MethodResult], dict[str, float], dict[str, float]]:
    """Run the ``selected`` parts in the order of ``runners``.

    :return: The summaries by part, all result rows, all ratios, and the wall-clock seconds of each part.
    """
    summaries, results, ratios, seconds = {}, [], {}, {}
    for part in (part for part in runners if part in selected):
        start = time.perf_counter()
        summaries[part], part_results, part_ratios = runners[part](args, config, output)
        seconds[part] = time.perf_counter() - start
        results += part_results
        ratios.update(part_ratios)
    return summaries, results, ratios, seconds


def publish_parts(
    name: str,
    config: dict,
    outcome: tuple[dict, list[MethodResult], dict[str, float], dict[str, float]],
    goals: dict[str, float],
    ratio_notes: dict[str, str],
    device: str,
    output: Path,
) -> dict:
    """Write ``<output>/<name>.json`` from the ``outcome`` of :func:`run_parts` (each part's summary under its name,
    ``part_seconds``, the ratio notes), print the ratios against the goals, and return the payload."""
    summaries, results, ratios, seconds = outcome
    payload = benchmark_payload(
        name, config, results, ratios, goals, device=device, ratio_notes=ratio_notes, part_seconds=seconds, **summaries
    )
    write_results(output / f"{name}.json", payload)
    print("\n" + format_ratios(payload))
    return payload
