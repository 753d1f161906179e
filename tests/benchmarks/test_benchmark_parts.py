"""``run_parts`` / ``publish_parts``: re-running some parts of a benchmark keeps the other parts of its results file."""

from __future__ import annotations

import json

from benchmarks.benchmark_parts import publish_parts, run_parts
from benchmarks.method_result import MethodResult


def _runner(part: str, value: float):
    def run(args, config, output):
        summary = {"value": value}
        return summary, [MethodResult(name=f"{part}-method", label=part, rmse=value)], {f"{part}_ratio": value}

    return run


def _publish(tmp_path, values: dict[str, float], selected, goals=None):
    runners = {part: _runner(part, value) for part, value in values.items()}
    outcome = run_parts(runners, selected, None, None, tmp_path)
    publish_parts("fake", {"selected": list(selected)}, outcome, goals or {}, {}, "cpu", tmp_path)
    return json.loads((tmp_path / "fake.json").read_text())


def test_rerunning_one_part_keeps_the_others(tmp_path):
    _publish(tmp_path, {"first": 1.0, "second": 2.0}, ["first", "second"])
    payload = _publish(tmp_path, {"first": 10.0, "second": 20.0}, ["second"], goals={"first_ratio": 5.0})
    assert payload["first"] == {"value": 1.0} and payload["second"] == {"value": 20.0}
    assert payload["ratios"] == {"first_ratio": 1.0, "second_ratio": 20.0}
    assert payload["ratio_parts"] == {"first_ratio": "first", "second_ratio": "second"}
    assert {row["name"]: (row["part"], row["rmse"]) for row in payload["rows"]} == {
        "first-method": ("first", 1.0),
        "second-method": ("second", 20.0),
    }
    assert set(payload["part_seconds"]) == set(payload["part_machines"]) == {"first", "second"}
    assert payload["goal_met"] == {"first_ratio": True}  # judged on the kept part's ratio


def test_a_full_run_replaces_everything(tmp_path):
    _publish(tmp_path, {"first": 1.0, "second": 2.0}, ["first", "second"])
    payload = _publish(tmp_path, {"first": 3.0}, ["first"])  # a benchmark whose second part no longer exists
    assert payload["ratios"] == {"first_ratio": 3.0, "second_ratio": 2.0}
    payload = _publish(tmp_path, {"first": 4.0, "second": 5.0}, ["first", "second"])
    assert payload["ratios"] == {"first_ratio": 4.0, "second_ratio": 5.0}
    assert [row["rmse"] for row in payload["rows"]] == [4.0, 5.0]


def test_a_file_written_before_parts_were_recorded_keeps_what_was_not_reproduced(tmp_path):
    legacy = {
        "benchmark": "fake",
        "ratios": {"first_ratio": 1.0, "second_ratio": 2.0},
        "rows": [{"name": "first-method", "rmse": 1.0}, {"name": "second-method", "rmse": 2.0}],
        "part_seconds": {"first": 1.0, "second": 1.0},
        "first": {"value": 1.0},
        "second": {"value": 2.0},
    }
    (tmp_path / "fake.json").write_text(json.dumps(legacy))
    payload = _publish(tmp_path, {"second": 20.0}, ["second"])
    assert payload["ratios"] == {"first_ratio": 1.0, "second_ratio": 20.0}
    assert sorted(row["rmse"] for row in payload["rows"]) == [1.0, 20.0]
    assert payload["first"] == {"value": 1.0}


def test_another_benchmarks_file_is_not_merged(tmp_path):
    (tmp_path / "fake.json").write_text(
        json.dumps({"benchmark": "other", "ratios": {"x": 1.0}, "part_seconds": {"a": 1}})
    )
    assert _publish(tmp_path, {"first": 1.0}, ["first"])["ratios"] == {"first_ratio": 1.0}
