"""``bench kernel-selection``: a tiny run of all three parts (``--quick``), and the helpers it is built from: the
log-log slope, the profile of size options, the scoring of one candidate as a one-component mixture against the
Gaussian test metrics."""

import argparse
import json
import math

import pytest
import torch

from benchmarks.cli import main
from benchmarks.kernel_selection_benchmark import (
    GOALS,
    PROFILES,
    candidate_marginals,
    loglog_slope,
    mixture_metrics,
    resolve_profile,
    single_predictive,
)
from benchmarks.metrics import gaussian_test_metrics
from gpytorch_decoupled.models import KernelSelectionGP

pytestmark = pytest.mark.usefixtures("single_thread")


def test_kernel_selection_tiny_run(tmp_path, capsys):
    main(["kernel-selection", "--quick", "--no-progress", "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "kernel-selection.json").read_text())
    assert set(payload["goals"]) == set(GOALS) == set(payload["goal_met"])
    assert set(payload["ratios"]) <= set(payload["ratio_notes"])
    assert all(math.isfinite(value) for value in payload["ratios"].values())
    assert set(payload["part_seconds"]) == {"co2", "scaling", "elevators"}
    assert payload["config"]["quick"] and payload["config"]["dtype"] == "float64"

    co2 = payload["co2"]
    (repeat,) = co2["repeats"]
    assert [stage["fraction"] for stage in repeat["stages"]] == PROFILES["co2_fractions"][1]
    assert [stage["rows"] for stage in repeat["stages"]] == [315, 629]
    for stage in repeat["stages"]:
        assert stage["elbo_scale"] == 2 / math.ceil(stage["rows"] / stage["batch_size"])
        for key in ("posterior_prior_0.1", "posterior_prior_0.5"):
            assert len(stage[key]) == co2["num_candidates"] == 35 and sum(stage[key]) == pytest.approx(1, abs=1e-9)
    assert len(repeat["random"]["kernels"]) == 3 and len(repeat["bma"]["kernels"]) == 10
    # The single best kernel is the most probable one, scored like every candidate.
    assert repeat["single_best"]["rmse"] == repeat["candidates"][repeat["single_best"]["kernel"]]["rmse"]
    assert repeat["random"]["rmse"] == pytest.approx(
        sum(repeat["candidates"][name]["rmse"] for name in repeat["random"]["kernels"]) / 3
    )
    assert co2["period_init_standardized"] == pytest.approx(1 / 15.1323, rel=1e-4)
    assert len(repeat["forecast"]["mean"]) == co2["test_months"] == 158
    assert all(
        low < mean < high for low, mean, high in zip(*(repeat["forecast"][k] for k in ("lower", "mean", "upper")))
    )

    scaling = payload["scaling"]
    assert [row["num_kernels"] for row in scaling["kernels"]] == [2, 4]
    assert [row["batch_size"] for row in scaling["batch_sizes"]] == [32, 64]
    assert all(row["cpu_seconds"] > 0 for row in scaling["kernels"] + scaling["batch_sizes"])

    elevators = payload["elevators"]
    assert elevators["data"]["train_rows"] == 400 and len(elevators["candidates"]) == 15
    assert not any("PER" in name for name in elevators["candidates"])
    ratios = payload["ratios"]
    assert ratios["elevators_bma_nll_minus_svgp"] == pytest.approx(elevators["bma"]["nll"] - elevators["svgp"]["nll"])
    assert {row["name"] for row in payload["rows"]} >= {"vbks@elevators", "svgp@elevators", "svgp-fixed-z@elevators"}
    for name in ("kernel-selection-co2.png", "kernel-selection-scaling.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    out = capsys.readouterr().out
    assert "co2_bma_rmse_vs_single_best" in out and "elevators: test NLL" in out


def test_loglog_slope_and_profiles():
    assert loglog_slope([5, 10, 20, 40], [3.0 * c for c in (5, 10, 20, 40)]) == pytest.approx(1.0)
    assert loglog_slope([1, 2, 4], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    args = argparse.Namespace(quick=True, **{**dict.fromkeys(PROFILES), "co2_iterations": 7})
    resolved = resolve_profile(args)
    assert resolved.co2_iterations == 7 and resolved.co2_inducing == PROFILES["co2_inducing"][1]
    assert args.co2_inducing is None  # the namespace given is left alone
    args.quick = False
    assert resolve_profile(args).scaling_kernels == [5, 10, 20, 40]


def test_one_candidate_is_scored_like_a_gaussian_predictive():
    generator = torch.Generator().manual_seed(0)
    x = torch.linspace(-1, 1, 80, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(3 * x.squeeze(-1)) + 0.1 * torch.randn(80, generator=generator, dtype=torch.float64)
    model = KernelSelectionGP(["SE", "LIN", "SE + LIN"], x[::8].clone()).double()
    model.fit(x, y, num_iterations=5, batch_size=40, progress=False)
    means, variances = candidate_marginals(model, x)
    assert means.shape == variances.shape == (3, 80)
    # The candidates' marginals are those the model's own top-1 predictive mixes.
    top = int(model.kernel_posterior().indices[0])
    single = single_predictive(means, variances, top)
    torch.testing.assert_close(single.mean, model.predict(x, top=1).mean)
    ours = mixture_metrics(single, y, y_std=2.0)
    reference = gaussian_test_metrics(means[top], variances[top], y, 2.0)
    assert ours["rmse"] == pytest.approx(reference["rmse"], rel=1e-12)
    assert ours["nll"] == pytest.approx(reference["nll"], rel=1e-12)
    assert 0 <= ours["coverage"] <= 1
