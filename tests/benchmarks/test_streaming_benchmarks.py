"""The collapsed-fit and streaming benchmarks (issue 19, items 3 and 4) on tiny runs: their JSON holds the goals under
the same names as the ratios, one fit per data set and method, and one prequential row per arriving batch."""

import json

import pytest

from benchmarks.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def test_collapsed_fit_records_every_set_and_method(tmp_path):
    main(
        ["collapsed-fit", "--datasets", "kin40k", "kuka", "--max-train-rows", "300", "--num-inducing", "10",
         "--max-iter", "5", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "collapsed-fit.json").read_text())
    assert set(payload["goals"]) <= set(payload["ratios"])
    fits = payload["fits"]
    assert [(row["dataset"], row["method"]) for row in fits] == [
        (name, method) for name in ("kin40k", "kuka") for method in ("gpytorch_default", "fit_collapsed_bound")
    ]
    for row in fits:
        assert row["noise_variance"] > 0 and row["test_rmse_vs_std"] > 0
        assert row["noise_only"] == bool(row["warnings"])
    ours = [row for row in fits if row["method"] == "fit_collapsed_bound"]
    assert payload["ratios"]["noise_only_fits_from_defaults"] == sum(row["noise_only"] for row in ours)


def test_streaming_predicts_every_batch_before_learning_it(tmp_path):
    main(
        ["streaming", "--max-rows", "700", "--warmup-rows", "200", "--batch-size", "50", "--refit-every", "4",
         "--window", "300", "--refit-iter", "3", "--warmup-iter", "5", "--num-inducing", "10",
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "streaming.json").read_text())
    assert set(payload["goals"]) <= set(payload["ratios"])
    for name in ("kalman_refit", "kalman_fixed", "srgp", "svgp", "svgp_3x"):
        curve = payload["curves"][name]
        assert [row["rows"] for row in curve] == list(range(250, 701, 50))
        assert sum(row["count"] for row in curve) == 500
    summary = payload["summary"]
    assert summary["kalman_refit"]["refits"] == 2  # after batches 4 and 8 of 10
    # Equal compute: SVGP trains until its CPU time reaches the recipe's (at most one step beyond it).
    assert summary["svgp"]["cpu_seconds"] >= summary["kalman_refit"]["cpu_seconds"]
    assert summary["svgp_3x"]["cpu_seconds"] >= 3 * summary["kalman_refit"]["cpu_seconds"]
    assert summary["svgp_3x"]["adam_steps"] > summary["svgp"]["adam_steps"]
    assert (tmp_path / "streaming.png").exists()
