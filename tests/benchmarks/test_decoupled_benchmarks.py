import json
import math
import statistics

import pytest
import torch

from benchmarks.cli import main
from benchmarks.decoupled_accuracy_benchmark import GOALS as ACCURACY_GOALS
from benchmarks.decoupled_accuracy_benchmark import value_at_time
from benchmarks.decoupled_speed_benchmark import GOALS as SPEED_GOALS
from benchmarks.decoupled_step_benchmark import GOALS as STEP_GOALS
from benchmarks.methods import build_method
from benchmarks.orthogonal_speed_benchmark import enlarge_mean_basis, mean_basis_with_replacement


def _every_goal_in_ratios_and_goals(payload: dict, goals: dict) -> None:
    assert set(payload["goals"]) == set(goals)
    assert set(goals) <= set(payload["ratios"])
    assert all(math.isfinite(payload["ratios"][name]) for name in goals)
    assert set(goals) <= set(payload["ratio_notes"])
    assert set(goals) == set(payload["goal_met"])


def test_decoupled_speed_tiny_run(tmp_path, capsys):
    main(
        ["decoupled-speed", "--dataset", "elevators", "--max-train-rows", "300", "--iterations", "4",
         "--warmup", "2", "--scale-iterations", "3", "--mean-sizes", "100", "400", "--num-mean-inducing", "50",
         "--num-inducing", "20", "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "decoupled-speed.json").read_text())
    _every_goal_in_ratios_and_goals(payload, SPEED_GOALS)
    rows = {row["name"]: row for row in payload["rows"]}
    assert set(rows) == {
        "svgp", "decoupled", "hybrid", "decoupled@Mα=100", "decoupled@Mα=400", "hybrid@Mγ=100", "hybrid@Mγ=400"
    }  # fmt: skip
    assert all(row["skipped"] is None and row["iterations"] > 0 for row in rows.values())
    assert rows["decoupled@Mα=400"]["sizes"] == "Mα=400, Mβ=20"
    assert rows["hybrid@Mγ=400"]["sizes"] == "Mγ=400, Mβ=20"
    assert [entry["drawn_with_replacement"] for entry in payload["scale"]] == [False, True, False, True]
    ratios = payload["ratios"]
    assert ratios["time_ratio_1e4_to_1e5"] == pytest.approx(ratios["time_ratio_1e2_to_400"])
    assert ratios["hybrid_time_ratio_1e4_to_1e5"] == pytest.approx(ratios["hybrid_time_ratio_1e2_to_400"])
    assert {"decoupled_time_per_iteration", "hybrid_time_per_iteration"} <= set(ratios)
    assert (tmp_path / "decoupled-speed.png").stat().st_size > 5_000
    assert "decoupled_time_per_iteration" in capsys.readouterr().out


def test_decoupled_accuracy_tiny_run(tmp_path, capsys):
    main(
        ["decoupled-accuracy", "--datasets", "kuka", "elevators", "--outputs", "7", "9",
         "--max-train-rows", "300", "--iterations", "6", "--eval-every", "3", "--warmup", "2", "--num-inducing", "10",
         "--num-mean-inducing", "20", "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "decoupled-accuracy.json").read_text())
    _every_goal_in_ratios_and_goals(payload, ACCURACY_GOALS)
    methods = ("decoupled", "hybrid", "orthnat", "svgp")
    tags = ("kuka/y7", "kuka/y9", "elevators")
    assert {row["name"] for row in payload["rows"]} == {f"{method}@{tag}" for method in methods for tag in tags}
    assert {"decoupled_nmse_vs_svgp_kuka", "decoupled_nmse_vs_svgp_elevators"} <= set(payload["ratios"])
    kuka = payload["accuracy"]["kuka"]
    assert [fit["output_name"] for fit in kuka["fits"]] == ["qd1(t+1)", "qd3(t+1)"]
    for fit in kuka["fits"]:
        assert set(fit["methods"]) == set(methods)
        assert all(row["nmse"] > 0 and row["nmse_at_reference_time"] > 0 for row in fit["methods"].values())
        assert fit["methods"]["decoupled"]["sizes"] == "Mα=30, Mβ=10"
    ratio = kuka["summary"]["ratios_to_reference"]["decoupled"]["at_reference_time"]
    assert payload["ratios"]["decoupled_nmse_vs_svgp_kuka"] == pytest.approx(ratio)
    per_dataset = [entry["summary"]["ratios_to_reference"]["decoupled"]["at_reference_time"]
                   for entry in payload["accuracy"].values()]  # fmt: skip
    assert payload["ratios"]["decoupled_nmse_vs_svgp"] == pytest.approx(sum(per_dataset) / len(per_dataset))
    assert (tmp_path / "decoupled-accuracy.png").stat().st_size > 5_000
    assert "mean nMSE over outputs" in capsys.readouterr().out


def test_value_at_time_interpolates_and_holds_the_last_value():
    curve = [{"seconds": 0.0, "nmse": 1.0}, {"seconds": 2.0, "nmse": 0.5}, {"seconds": 4.0, "nmse": 0.3}]
    assert value_at_time(curve, 0.0, "nmse") == 1.0
    assert value_at_time(curve, 3.0, "nmse") == pytest.approx(0.4)
    assert value_at_time(curve, 10.0, "nmse") == 0.3


def test_decoupled_mean_basis_stacks_the_covariance_points_on_the_odvgp_mean_points():
    torch.manual_seed(0)
    x, y = torch.randn(60, 2), torch.randn(60)
    decoupled = build_method("decoupled", x, y, num_inducing=5, num_mean_inducing=15, seed=3)
    orthnat = build_method("orthnat", x, y, num_inducing=5, num_mean_inducing=10, seed=3)
    alpha = decoupled.model.variational_strategy.mean_inducing_points
    gamma = orthnat.model.variational_strategy.mean_inducing_points
    beta = orthnat.model.variational_strategy.inducing_points
    assert torch.equal(alpha, torch.cat([gamma, beta]))
    with pytest.raises(ValueError, match="at least num_inducing"):
        build_method("decoupled", x, y, num_inducing=5, num_mean_inducing=4)


@pytest.mark.parametrize("name", ["decoupled", "hybrid"])
def test_enlarged_mean_basis_is_trained_by_the_methods_optimizers(name):
    torch.manual_seed(0)
    x, y = torch.randn(40, 2), torch.randn(40)
    method = build_method(name, x, y, num_inducing=5, num_mean_inducing=10, num_kl_columns=8)
    enlarge_mean_basis(method, mean_basis_with_replacement(x, 120, jitter=1e-2, seed=1), seed=0)
    strategy = method.model.variational_strategy
    before = strategy.mean_coefficients.detach().clone()
    method.step(x, y)
    assert strategy.mean_coefficients.shape == (120,)
    assert not torch.equal(strategy.mean_coefficients.detach(), before)
    assert math.isfinite(method.objective())


def test_decoupled_step_tiny_run(tmp_path, capsys):
    main(
        ["decoupled-step", "--dataset", "elevators", "--max-train-rows", "300", "--iterations", "4", "--warmup", "2",
         "--repeats", "2", "--num-mean-inducing", "50", "--large-mean-size", "400", "--exact-size", "60",
         "--num-inducing", "20", "--kl-draws", "3", "--block-rounds", "1", "--no-progress",
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "decoupled-step.json").read_text())
    _every_goal_in_ratios_and_goals(payload, STEP_GOALS)
    rows = {row["name"]: row for row in payload["rows"]}
    assert set(rows) == {"svgp", "orthnat", "decoupled", "orthnat@Mγ=400", "orthnat-lean", "decoupled-lean"}
    assert rows["orthnat@Mγ=400"]["sizes"] == "Mγ=400, Mβ=20"
    assert rows["orthnat-lean"]["label"] == "OrthNat (ours), lean step"
    ratios = payload["ratios"]
    assert ratios["orthnat_lean_time_per_iteration"] == statistics.median(payload["per_repeat"]["orthnat-lean"])
    assert ratios["decoupled_lean_time_per_iteration"] == statistics.median(payload["per_repeat"]["decoupled-lean"])
    assert rows["decoupled-lean"]["label"] == "Decoupled (ours), lean step"
    assert ratios["peak_memory_gb_at_1e5"] * 1024 == rows["orthnat@Mγ=400"]["peak_memory_mb"] > 0
    assert all(len(values) == 2 for values in payload["per_repeat"].values())
    assert payload["per_repeat"]["svgp"] == [1.0, 1.0]
    # Bases this small have the exact KL in training: every draw equals the eval-mode value.
    assert all(spread["std"] == 0 and spread["mean"] == pytest.approx(spread["exact"]) for spread in
               payload["kl_spread"].values())  # fmt: skip
    assert [entry["mean_size"] for entry in payload["kernel_block"]] == [50, 400]
    assert "kl_relative_std_at_1e5" in capsys.readouterr().out
