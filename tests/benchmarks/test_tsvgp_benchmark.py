"""``bench tsvgp``: a tiny run of each part; a later run of one part keeps the other in the results file."""

import json

import pytest

from benchmarks.cli import main
from benchmarks.tsvgp_benchmark import EQUAL_TIME_GOAL, GOALS, ITERATION_GOAL

COMMON = ["--max-train-rows", "300", "--batch-size", "32", "--warmup", "1", "--clock", "thread", "--no-progress"]


def test_tsvgp_equal_time_then_iteration(tmp_path):
    main(
        ["tsvgp", "--parts", "equal-time", "--datasets", "elevators", "pima", "--equal-iterations", "6",
         "--equal-eval-every", "2", "--equal-checkpoints", "2", "4", "--equal-inducing", "8", *COMMON,
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "tsvgp.json").read_text())
    rows = payload["equal-time"]["datasets"]
    assert [row["dataset"] for row in rows] == ["elevators", "pima"]
    assert [row["task"] for row in rows] == ["regression", "classification"]
    curves = {result["name"]: result["curve"] for result in payload["rows"]}
    for row in rows:
        assert row["win"] == (row["tsvgp_nll_at_ngd_seconds"] <= row["ngd_final_nll"])
        assert set(row["checkpoints"]) == {"2", "4"}
        for iterations, checkpoint in row["checkpoints"].items():
            (ngd_point,) = (p for p in curves[f"svgp-ngd@{row['dataset']}"] if p["iteration"] == int(iterations))
            assert (checkpoint["ngd_seconds"], checkpoint["ngd_nll"]) == (ngd_point["seconds"], ngd_point["nll"])
            ours = [p for p in curves[f"dual@{row['dataset']}"] if p["seconds"] <= ngd_point["seconds"]][-1]
            assert checkpoint["tsvgp_nll_at_ngd_seconds"] == ours["nll"]
            assert checkpoint["win"] == (ours["nll"] <= ngd_point["nll"])
    assert payload["ratios"][EQUAL_TIME_GOAL] == sum(row["win"] for row in rows)
    assert payload["ratios"]["tsvgp_wins_at_ngd_time_after_4_iterations"] == sum(
        row["checkpoints"]["4"]["win"] for row in rows
    )
    assert all(row["part"] == "equal-time" for row in payload["rows"])

    main(
        ["tsvgp", "--parts", "iteration", "--sizes", "8", "--repeats", "1", "--iterations", "4", *COMMON,
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    merged = json.loads((tmp_path / "tsvgp.json").read_text())
    assert merged["equal-time"] == json.loads(json.dumps(payload["equal-time"]))  # kept as it was
    assert set(merged["part_seconds"]) == {"equal-time", "iteration"}
    assert merged["ratios"][ITERATION_GOAL] == pytest.approx(merged["iteration"]["sizes"][0]["ratio"])
    assert merged["ratios"][EQUAL_TIME_GOAL] == payload["ratios"][EQUAL_TIME_GOAL]
    assert set(merged["goal_met"]) == set(GOALS)
