import json
import math

import pytest
import torch

from benchmarks.method_result import MethodResult
from benchmarks.metrics import gaussian_test_metrics
from benchmarks.peak_memory_meter import PeakMemoryMeter
from benchmarks.report import benchmark_payload, format_table, write_results


def test_gaussian_metrics_match_the_formula_and_units():
    mean = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    variance = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    y = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    metrics = gaussian_test_metrics(mean, variance, y)
    expected_nll = torch.distributions.Normal(mean, variance.sqrt()).log_prob(y).neg().mean().item()
    assert metrics["nll"] == pytest.approx(expected_nll, rel=1e-12)
    assert metrics["rmse"] == pytest.approx(math.sqrt((0.25 + 0 + 1) / 3), rel=1e-12)

    # In original units (y = 3 * standardized) the RMSE scales by 3 and the density by 1/3.
    scaled = gaussian_test_metrics(mean, variance, y, y_std=3.0)
    assert scaled["rmse"] == pytest.approx(3 * metrics["rmse"], rel=1e-12)
    assert scaled["nll"] == pytest.approx(metrics["nll"] + math.log(3.0), rel=1e-12)
    direct = torch.distributions.Normal(3 * mean, 3 * variance.sqrt()).log_prob(3 * y).neg().mean().item()
    assert scaled["nll"] == pytest.approx(direct, rel=1e-12)


def test_gaussian_metrics_average_over_output_columns():
    mean = torch.zeros(4, 2, dtype=torch.float64)
    y = torch.ones(4, 2, dtype=torch.float64)
    metrics = gaussian_test_metrics(mean, torch.ones_like(mean), y, y_std=torch.tensor([1.0, 2.0]))
    assert metrics["rmse"] == pytest.approx(1.5)


def test_payload_verdicts_follow_the_goal_direction(tmp_path):
    results = [MethodResult(name="svgp", label="SVGP", seconds_per_iteration=0.01)]
    ratios = {"speed": 1.2, "accuracy_higher_is_better": 0.9}
    payload = benchmark_payload("x", {}, results, ratios, {"speed": 1.5, "accuracy_higher_is_better": 1.0})
    assert payload["goal_met"] == {"speed": True, "accuracy_higher_is_better": False}
    assert payload["passed"] is False
    assert benchmark_payload("x", {}, results, {}, {"missing": 1.0})["passed"] is False
    assert benchmark_payload("x", {}, results, ratios, {"speed": 1.5})["passed"] is True

    path = write_results(tmp_path / "x.json", payload)
    loaded = json.loads(path.read_text())  # strict JSON: NaN became null
    assert loaded["rows"][0]["nll"] is None
    assert {"benchmark", "machine", "config", "ratios", "goals", "passed"} <= loaded.keys()


def test_table_lists_every_method_and_skips_with_reason():
    table = format_table(
        [
            MethodResult(name="svgp", label="SVGP", sizes="M=10", seconds_per_iteration=0.5, rmse=0.1, nll=-1.0),
            MethodResult(name="exact", label="Exact GP", skipped="too many rows"),
        ]
    )
    assert "SVGP" in table and "M=10" in table and "0.5000" in table
    assert table.splitlines()[-2] == "skipped Exact GP: too many rows"


def test_peak_memory_meter_sees_a_large_temporary():
    with PeakMemoryMeter("cpu", interval=1e-4) as meter:
        block = torch.ones(48, 1024, 1024, dtype=torch.float32)  # 192 MiB
        block.add_(1.0)
        del block
    if math.isnan(meter.peak_mb):
        pytest.skip("no /proc on this platform")
    assert 150 < meter.peak_mb < 1000
