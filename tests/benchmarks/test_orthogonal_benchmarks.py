import json
import math

import gpytorch
import pytest
import torch

from benchmarks.cli import main
from benchmarks.methods import build_method
from benchmarks.orthogonal_accuracy_benchmark import GOALS as ACCURACY_GOALS
from benchmarks.orthogonal_accuracy_benchmark import (
    _converge,
    _fix_all_but_variational,
    average_ranks,
    optimal_elbo,
)
from benchmarks.orthogonal_speed_benchmark import GOALS as SPEED_GOALS
from benchmarks.orthogonal_speed_benchmark import enlarge_mean_basis, mean_basis_with_replacement


def _every_goal_in_ratios_and_goals(payload: dict, goals: dict) -> None:
    assert set(payload["goals"]) == set(goals)
    assert set(goals) <= set(payload["ratios"])
    assert all(math.isfinite(payload["ratios"][name]) for name in goals)
    assert set(goals) <= set(payload["ratio_notes"])


def test_orthogonal_speed_tiny_run(tmp_path, capsys):
    main(
        ["orthogonal-speed", "--dataset", "elevators", "--max-train-rows", "300", "--iterations", "5",
         "--warmup", "2", "--scale-iterations", "3", "--mean-sizes", "100", "400", "--num-mean-inducing", "50",
         "--num-inducing", "20", "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "orthogonal-speed.json").read_text())
    _every_goal_in_ratios_and_goals(payload, SPEED_GOALS)
    rows = {row["name"]: row for row in payload["rows"]}
    assert set(rows) == {"svgp", "gpytorch-odvgp", "orthnat", "orthnat@Mγ=100", "orthnat@Mγ=400"}
    assert all(row["skipped"] is None and row["iterations"] > 0 for row in rows.values())
    # 400 mean-basis points from 300 training rows: drawn with replacement and trained at that size.
    assert rows["orthnat@Mγ=400"]["sizes"] == "Mγ=400, Mβ=20"
    assert [entry["drawn_with_replacement"] for entry in payload["scale"]] == [False, True]
    assert payload["ratios"]["time_ratio_1e4_to_1e5"] == pytest.approx(payload["ratios"]["time_ratio_1e2_to_400"])
    assert "orthnat_time_per_iteration" in capsys.readouterr().out


def test_enlarged_mean_basis_is_trained_by_the_methods_optimizers():
    torch.manual_seed(0)
    x, y = torch.randn(40, 2), torch.randn(40)
    method = build_method("orthnat", x, y, num_inducing=5, num_mean_inducing=10, num_kl_columns=8)
    points = mean_basis_with_replacement(x, 120, jitter=1e-2, seed=1)
    assert points.shape == (120, 2) and torch.unique(points, dim=0).size(0) == 120
    enlarge_mean_basis(method, points, seed=0)
    strategy = method.model.variational_strategy
    before = strategy.mean_coefficients.detach().clone()
    method.step(x, y)
    assert strategy.mean_coefficients.shape == (120,)
    assert not torch.equal(strategy.mean_coefficients.detach(), before)


def test_orthogonal_accuracy_tiny_run(tmp_path, capsys):
    main(
        ["orthogonal-accuracy", "--datasets", "elevators", "pol", "--max-train-rows", "300",
         "--iterations", "5", "--eval-every", "3", "--warmup", "2", "--num-inducing", "10", "--num-mean-inducing",
         "20", "--svgp-inducing", "15", "--convergence-rows", "200", "--convergence-inducing", "15",
         "--max-iterations", "30", "--tolerance", "0.05", "--hyper-iterations", "3", "--no-progress",
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "orthogonal-accuracy.json").read_text())
    _every_goal_in_ratios_and_goals(payload, ACCURACY_GOALS)
    names = {row["name"] for row in payload["rows"]}
    expected = {f"{method}@{data}" for method in ("orthnat", "svgp-ngd", "svgp") for data in ("elevators", "pol")}
    assert names == expected | {"orthnat@convergence", "orth@convergence"}
    for rows in payload["accuracy"]["datasets"].values():
        assert sum(row["mae_rank"] for row in rows.values()) == sum(row["nll_rank"] for row in rows.values()) == 6
        assert all(row["mae"] > 0 for row in rows.values())
    convergence = payload["convergence"]
    assert set(convergence["methods"]) == {"orthnat", "orth"}
    assert convergence["optimal_elbo"] < 0
    assert (tmp_path / "orthogonal-accuracy.png").stat().st_size > 5_000
    assert "mean ranks" in capsys.readouterr().out


def test_average_ranks_share_ties_and_put_nan_last():
    assert average_ranks({"a": 1.0, "b": float("nan"), "c": 1.0, "d": 0.5}) == {"a": 2.5, "b": 4.0, "c": 2.5, "d": 1.0}


def _dense_optimal_elbo(kernel, noise, x, y, beta, gamma) -> float:
    # Eq. 5.13 term by term with explicit inverses.
    def nystrom(points):
        return kernel(x, points).to_dense() @ torch.linalg.solve(
            kernel(points).to_dense(), kernel(points, x).to_dense()
        )

    n, eye = x.size(0), torch.eye(x.size(0), dtype=x.dtype)
    q_beta, q_alpha = nystrom(beta), nystrom(torch.cat([gamma, beta]))
    return (
        -0.5 * n * math.log(2 * math.pi)
        - 0.5 * torch.logdet(q_beta + noise * eye)
        - 0.5 * y @ torch.linalg.solve(q_alpha + noise * eye, y)
        - 0.5 * (kernel(x, diag=True).sum() - q_beta.diagonal().sum()) / noise
    ).item()


@pytest.fixture
def small_problem():
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(120, 2, generator=generator, dtype=torch.float64) * 4
    y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1]) + 0.1 * torch.randn(120, generator=generator, dtype=torch.float64)
    return x, y - y.mean(), x[:6].clone(), x[6:14].clone()


def test_optimal_elbo_matches_the_dense_formula(small_problem):
    x, y, beta, gamma = small_problem
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
    kernel.base_kernel.lengthscale = torch.tensor([0.8, 1.3])
    noise = torch.tensor(0.05, dtype=torch.float64)
    with torch.no_grad():
        expected = _dense_optimal_elbo(kernel, noise, x, y, beta, gamma)
    assert optimal_elbo(kernel, noise, x, y, beta, gamma) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["orthnat", "orth"])
def test_fixed_hyperparameter_training_approaches_the_optimum_from_below(small_problem, name):
    x, y, beta, gamma = small_problem
    method = build_method(name, x, y, num_inducing=6, num_mean_inducing=8, num_kl_columns=None, lr=0.1, ngd_lr=1.0)
    hypers = {
        "lengthscale": torch.tensor([0.8, 1.3], dtype=torch.float64),
        "outputscale": torch.tensor(1.0, dtype=torch.float64),
        "noise": torch.tensor(0.05, dtype=torch.float64),
    }
    _fix_all_but_variational(method, beta, gamma, hypers)
    trainable = [p for p in [*method.model.parameters(), *method.likelihood.parameters()] if p.requires_grad]
    assert len(trainable) == 3  # the two tensors of q(u_beta) and a_gamma
    optimum = optimal_elbo(method.model.covar_module, method.likelihood.noise, x, y, beta, gamma) / x.size(0)
    trace = _converge(method, x, y, optimum, tolerance=1e-3, max_iterations=1500)
    assert trace["reached"]
    assert all(point["relative_gap"] > -1e-6 for point in trace["curve"])
