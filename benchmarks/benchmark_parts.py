"""Benchmarks made of named parts, each run on its own and timed (``--parts`` selects them)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from .method_result import MethodResult
from .report import benchmark_payload, format_ratios, machine_info, write_results
from .run_config import RunConfig

#: A part: ``(args, config, output directory) -> (summary for the JSON, result rows, ratios)``.
PartRunner = Callable[[argparse.Namespace, RunConfig, Path], tuple[dict, list[MethodResult], dict[str, float]]]


class PartsOutcome(NamedTuple):
    """What :func:`run_parts` measured: the summaries by part, all result rows, all ratios, the wall-clock seconds of
    each part, and which part produced each row and each ratio (empty where a benchmark does not attribute them)."""

    summaries: dict
    results: list[MethodResult]
    ratios: dict[str, float]
    seconds: dict[str, float]
    row_parts: list[str]
    ratio_parts: dict[str, str]


def run_parts(
    runners: dict[str, PartRunner], selected: Sequence[str], args: argparse.Namespace, config: RunConfig, output: Path
) -> PartsOutcome:
    """Run the ``selected`` parts in the order of ``runners``."""
    outcome = PartsOutcome({}, [], {}, {}, [], {})
    for part in (part for part in runners if part in selected):
        start = time.perf_counter()
        outcome.summaries[part], part_results, part_ratios = runners[part](args, config, output)
        outcome.seconds[part] = time.perf_counter() - start
        outcome.results.extend(part_results)
        outcome.row_parts.extend([part] * len(part_results))
        outcome.ratios.update(part_ratios)
        outcome.ratio_parts.update(dict.fromkeys(part_ratios, part))
    return outcome


def _kept_from_earlier_run(path: Path, name: str, rerun: set[str]) -> dict:
    """The parts of the results file at ``path`` that this run did not re-run: summaries, rows, ratios, seconds and
    machines of those parts (empty when there is no earlier file of this benchmark). Rows and ratios of files written
    before parts were recorded are kept when this run produced none of the same name."""
    if not rerun or not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier.get("benchmark") != name:
        return {}
    kept_parts = [part for part in earlier.get("part_seconds", {}) if part not in rerun]
    if not kept_parts:
        return {}
    ratio_parts = earlier.get("ratio_parts", {})
    return {
        "summaries": {part: earlier[part] for part in kept_parts if part in earlier},
        "rows": [row for row in earlier.get("rows", []) if row.get("part", "") not in rerun],
        "ratios": {key: value for key, value in earlier.get("ratios", {}).items() if ratio_parts.get(key) not in rerun},
        "ratio_parts": {key: part for key, part in ratio_parts.items() if part not in rerun},
        "seconds": {part: earlier["part_seconds"][part] for part in kept_parts},
        "machines": {part: earlier.get("part_machines", {}).get(part, earlier.get("machine")) for part in kept_parts},
    }


def publish_parts(
    name: str,
    config: dict,
    outcome: PartsOutcome,
    goals: dict[str, float],
    ratio_notes: dict[str, str],
    device: str,
    output: Path,
) -> dict:
    """Write ``<output>/<name>.json`` from the ``outcome`` of :func:`run_parts` (each part's summary under its name,
    ``part_seconds``, the machine each part ran on, the ratio notes), print the ratios against the goals, and return
    the payload.

    A run of some of the parts keeps the other parts of an earlier file of the same benchmark (summaries, rows, ratios,
    seconds, machines), so that re-measuring one part does not erase the others; the goals are judged on the union.
    """
    path = output / f"{name}.json"
    kept = _kept_from_earlier_run(path, name, set(outcome.seconds))
    machine = machine_info(device)
    rows = [result.to_json() for result in outcome.results]
    for row, part in zip(rows, outcome.row_parts):
        row["part"] = part
    payload = benchmark_payload(
        name,
        config,
        [],
        {**kept.get("ratios", {}), **outcome.ratios},
        goals,
        device=device,
        ratio_notes=ratio_notes,
        ratio_parts={**kept.get("ratio_parts", {}), **outcome.ratio_parts},
        part_seconds={**kept.get("seconds", {}), **outcome.seconds},
        part_machines={**kept.get("machines", {}), **dict.fromkeys(outcome.seconds, machine)},
        **kept.get("summaries", {}),
        **outcome.summaries,
    )
    new_names = {row["name"] for row in rows}
    payload["rows"] = [
        *(row for row in kept.get("rows", []) if "part" in row or row["name"] not in new_names),
        *rows,
    ]
    write_results(path, payload)
    print("\n" + format_ratios(payload))
    return payload
