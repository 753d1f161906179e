"""``bench recursive`` and the ``recursive`` method: a tiny run of all three parts; the CSTR simulator against the
plant's steady states (Schürch et al. 2020, Sec. 5.3), scipy's LSODA and its own sequential integration; one
streaming pass at fixed hyperparameters against the dense collapsed bound; SRGP's epochs and its clean-pass
predictions against the dense batch posterior."""

import json
import math
from unittest import mock

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from benchmarks import METHODS
from benchmarks.cli import main
from benchmarks.cstr_plant import (
    cstr_dataset,
    cstr_derivatives,
    narx_regressors,
    piecewise_constant_input,
    rk4_intervals,
    simulate_cstr,
    steady_state,
)
from benchmarks.methods import build_method
from benchmarks.random_fourier_gp import RandomFourierGP, synthetic_batches
from benchmarks.recursive_benchmark import (
    GOALS,
    _fixed_kalman_model,
    cstr_epochs,
    epochs_to_reach,
    regression_metrics,
)
from gpytorch_decoupled.mlls import StreamingCollapsedBound
from tests.oracles import recursive_sparse_predictive
from tests.recursive_problems import dense_blocks, oracle_bound

pytestmark = pytest.mark.usefixtures("single_thread")
F64 = torch.float64


def test_recursive_tiny_run(tmp_path, capsys):
    main(
        ["recursive", "--stream-sizes", "1000", "3000", "--cstr-sizes", "400", "1200", "--cstr-test-rows",
         "1000", "--cstr-min-steps", "3", "--full-batch-iterations", "3", "--exact-max-rows", "500", "--epochs", "2",
         "--synthetic-dims", "1", "2", "--synthetic-rows", "800", "--synthetic-test-rows", "300", "--datasets",
         "elevators", "--max-train-rows", "800", "--num-inducing", "10", "--batch-size", "400", "--no-progress",
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "recursive.json").read_text())
    assert set(payload["goals"]) == set(GOALS) == set(payload["goal_met"])
    assert set(GOALS) <= set(payload["ratios"]) and set(GOALS) <= set(payload["ratio_notes"])
    assert all(math.isfinite(payload["ratios"][name]) for name in GOALS)
    assert set(payload["part_seconds"]) == {"streaming", "cstr", "epochs"}
    names = {row["name"] for row in payload["rows"]}
    assert names == {
        "update@N=1000", "update@N=3000",
        "recursive@N=400", "svgp@N=400", "sgpr@N=400", "exact@N=400", "recursive@N=1200", "svgp@N=1200",
        "sgpr@N=1200", "recursive@synthetic-1d", "svgp@synthetic-1d", "recursive@synthetic-2d", "svgp@synthetic-2d",
        "recursive@elevators", "svgp@elevators",
    }  # fmt: skip

    streaming = payload["streaming"]
    assert [row["num_observed"] for row in streaming["sizes"]] == [1000, 3000]
    # One pass of updates gives the collapsed bound of the summed mini-batches.
    assert streaming["bound_check"]["relative_difference"] < 1e-10
    ratios = payload["ratios"]
    assert ratios["streaming_time_growth_1e5_to_1e6"] == ratios["streaming_time_growth_1e3_to_3000"]

    cstr = payload["cstr"]
    assert [(row["num_train"], row["epochs"], row["steps"]) for row in cstr["sizes"]] == [(400, 3, 3), (1200, 2, 6)]
    assert set(cstr["sizes"][0]["methods"]) == {"recursive", "svgp", "sgpr", "exact"}
    assert ratios["cstr_srgp_rmse_vs_svgp_max"] == max(row["srgp_rmse_vs_svgp"] for row in cstr["sizes"])
    # The simulated plant stays in the paper's operating range (a 20,000 s check there: Cb in [17.1, 23.0]).
    simulation = cstr["simulation"]
    assert 16 < simulation["cb_range"][0] < simulation["cb_mean"] < simulation["cb_range"][1] < 24
    assert all(0.08 < row["methods"][name]["rmse"] < 2.0 for row in cstr["sizes"] for name in row["methods"])
    for row in cstr["sizes"]:
        assert 0.5 < row["test_inside_training_box"] <= 1
        for entry in row["methods"].values():
            # The RMSE of all test rows lies between those of the rows inside and outside the training inputs' box.
            low, high = sorted((entry["rmse_inside"], entry["rmse_outside"]))
            assert low <= entry["rmse"] <= high
            assert entry["hyperparameters"]["noise"] > 0 and len(entry["hyperparameters"]["lengthscales"]) == 5

    epochs = payload["epochs"]["datasets"]
    assert set(epochs) == {"synthetic-1d", "synthetic-2d", "elevators"}
    for entry in epochs.values():
        for curves in entry["curves"].values():
            assert len(curves["rmse"]) == 3  # before training and after each of the 2 epochs
            assert all(0 <= value <= 1 for value in curves["coverage"])
        # SVGP reaches its own final RMSE at the latest in the last epoch.
        assert entry["epochs_to_target"]["svgp"] <= 2
    assert ratios["epochs_to_converge_srgp_vs_svgp"] == max(entry["ratio"] for entry in epochs.values())
    for name in ("recursive.png", "recursive-cstr.png", "recursive-streaming.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    out = capsys.readouterr().out
    assert "cstr_srgp_rmse_vs_svgp_max" in out and "epochs to within 1% of SVGP's final RMSE" in out


# ---------------------------------------------------------------------------------------------- the CSTR plant
def test_steady_states_of_spec_b6():
    assert steady_state(1.0) == pytest.approx((30.25, 21.476), abs=1e-3)
    assert steady_state(2.0) == pytest.approx((110.25, 21.49), abs=5e-3)
    assert steady_state(0.0) == pytest.approx((0.25, 0.030), abs=1e-3)
    assert steady_state(4.0) == pytest.approx((420.25, 19.55), abs=5e-3)
    for feed in (0.0, 0.5, 1.0, 2.0, 4.0):
        rates = cstr_derivatives(*map(np.asarray, (*steady_state(feed), feed)))
        assert np.abs(rates).max() < 1e-12


def test_a_constant_input_drives_the_plant_to_its_steady_state():
    # From the steady state for w1 = 1, hold w1 = 2 (and, in a second trajectory, w1 = 1) for 4,000 s.
    feeds = np.stack([np.full(20_000, 2.0), np.full(20_000, 1.0)], axis=-1)
    start = np.array(steady_state(1.0))
    levels, concentrations = rk4_intervals(np.full(2, start[0]), np.full(2, start[1]), feeds, 0.2, 4)
    assert (levels[-1, 0], concentrations[-1, 0]) == pytest.approx(steady_state(2.0), rel=1e-8)
    assert np.abs(levels[:, 1] - start[0]).max() < 1e-9 and np.abs(concentrations[:, 1] - start[1]).max() < 1e-9


def test_rk4_matches_lsoda_and_the_chunked_integration_matches_the_sequential_one():
    feeds = piecewise_constant_input(3000, 0.2, np.random.default_rng(3))
    start = steady_state(1.0)
    levels, concentrations, sweeps = simulate_cstr(feeds, start, chunk=250)
    sequential = rk4_intervals(np.array(start[:1]), np.array(start[1:]), feeds[:, None], 0.2, 4)
    assert sweeps > 1
    np.testing.assert_allclose(levels, sequential[0][:, 0], rtol=1e-9)
    np.testing.assert_allclose(concentrations, sequential[1][:, 0], rtol=1e-9)

    state, reference = np.array(start), []
    for feed in feeds[:1000]:  # 200 s with scipy, holding each feed over its interval
        solution = solve_ivp(
            lambda t, s, w=feed: np.stack(cstr_derivatives(s[0], s[1], w)), (0.0, 0.2), state, method="LSODA",
            rtol=1e-10, atol=1e-12,
        )  # fmt: skip
        state = solution.y[:, -1]
        reference.append(state)
    reference = np.array(reference)
    np.testing.assert_allclose(levels[:1000], reference[:, 0], rtol=1e-6)
    np.testing.assert_allclose(concentrations[:1000], reference[:, 1], rtol=1e-6)


def test_the_input_is_held_for_5_to_20_seconds_at_levels_in_0_4():
    feeds = piecewise_constant_input(20_000, 0.2, np.random.default_rng(1))
    assert feeds.min() >= 0 and feeds.max() <= 4
    switches = np.flatnonzero(np.diff(feeds)) + 1
    runs = np.diff(switches) * 0.2
    assert len(runs) > 150 and runs.min() >= 5 - 0.2 - 1e-9 and runs.max() <= 20 + 0.2 + 1e-9


def test_narx_regressors_and_the_dataset():
    outputs, inputs = np.arange(10.0), 100 + np.arange(10.0)
    x, y = narx_regressors(outputs, inputs)
    np.testing.assert_array_equal(x[0], [1.0, 0.0, 102.0, 101.0, 100.0])
    np.testing.assert_array_equal(y, outputs[2:])
    data = cstr_dataset(2000, seed=4, noise_std=0.1, burn_in=100.0)
    assert data.x.shape == (2000, 5) and data.y.shape == data.f.shape == (2000,)
    # The first two regressors are the previous noisy targets; the noise has the requested scale.
    np.testing.assert_array_equal(data.x[1:, 0], data.y[:-1])
    np.testing.assert_array_equal(data.x[2:, 1], data.y[:-2])
    assert 0.09 < np.std(data.y - data.f) < 0.11


# ---------------------------------------------------------------------------------------------- streaming
def test_random_fourier_features_approximate_the_se_kernel():
    function = RandomFourierGP(2, lengthscale=0.5, num_features=200_000, seed=0)
    x = torch.tensor([[0.0, 0.0], [0.3, -0.2], [1.0, 0.5]], dtype=F64)
    features = torch.cos(x @ function.frequencies + function.phases)
    covariance = 2 * features @ features.mT / function.phases.numel()
    expected = torch.exp(-torch.cdist(x, x).square() / (2 * 0.5**2))
    torch.testing.assert_close(covariance, expected, atol=1e-2, rtol=0)


def test_one_streaming_pass_at_fixed_hyperparameters_is_the_collapsed_bound():
    function = RandomFourierGP(3, lengthscale=0.7, num_features=512, seed=1)
    inducing_points = 2 * torch.rand(12, 3, generator=torch.Generator().manual_seed(2), dtype=F64) - 1
    model = _fixed_kalman_model(inducing_points, 0.7, 0.1)
    strategy = model.variational_strategy
    for x, y in synthetic_batches(function, 500, 64, 0.1, seed=3):  # 8 mini-batches, the last of 52
        strategy.update(x, y)
    x, y = (torch.cat(parts) for parts in zip(*synthetic_batches(function, 500, 64, 0.1, seed=3)))
    assert strategy.num_observed == 500
    bound = oracle_bound(model, strategy.likelihood, x, y).detach()
    torch.testing.assert_close(strategy.recursive_bound, bound, rtol=1e-10, atol=0)
    streamed = StreamingCollapsedBound(model, strategy.likelihood).value_and_backward([(x, y)])
    torch.testing.assert_close(-streamed, bound, rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------------------------- the method
def _regression(n=300, dims=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, dims, generator=generator, dtype=F64) * 4 - 2
    y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1]) + 0.1 * torch.randn(n, generator=generator, dtype=F64)
    return x, (y - y.mean()) / y.std()


def test_srgp_starts_an_epoch_every_ceil_n_over_b_steps():
    x, y = _regression(n=250)
    method = build_method("recursive", x, y, num_inducing=8)
    with mock.patch.object(method.srgp, "start_epoch", wraps=method.srgp.start_epoch) as start_epoch:
        for epoch in range(3):
            for index in torch.randperm(250).split(100):  # 100, 100, 50
                method.step(x[index], y[index])
            assert start_epoch.call_count == epoch + 1
            assert method.model.variational_strategy.num_observed == 250


def test_predictions_are_the_exact_batch_posterior_and_leave_the_epoch_alone():
    x, y = _regression()
    test_x, _ = _regression(n=40, seed=1)
    method = build_method("recursive", x, y, num_inducing=10, lr=0.05, batch_size=64)
    for index in torch.arange(300).split(100)[:2]:  # two thirds of an epoch
        method.step(x[index], y[index])
    strategy = method.model.variational_strategy
    epoch_state = {name: value.clone() for name, value in strategy.state_dict().items()}

    mean, variance = method.predict(test_x)
    # The dense VFE predictive of all 300 rows at the hyperparameters after the steps.
    blocks = dense_blocks(method.model, x, test_x)
    noise = method.likelihood.noise.detach()
    dense = {name: value.detach() for name, value in blocks.items()}
    expected_mean, covariance = recursive_sparse_predictive(
        dense["K_uu"], dense["K_uf"], dense["K_ff"], dense["K_us"], dense["K_ss"], y, noise[0], "vfe"
    )
    torch.testing.assert_close(mean, expected_mean, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(variance, covariance.diagonal() + noise, rtol=1e-8, atol=1e-10)
    bound = oracle_bound(method.model, method.likelihood, x, y).item()
    assert method.objective() == pytest.approx(bound / 300, rel=1e-10)

    # SRGP's own (mixed-hyperparameter) state is back, and its epoch goes on.
    assert all(torch.equal(value, strategy.state_dict()[name]) for name, value in epoch_state.items())
    method.step(x[200:], y[200:])
    assert strategy.num_observed == 300


def test_srgp_learns_and_is_registered():
    assert "recursive" in METHODS
    x, y = _regression(n=400)
    test_x, test_y = _regression(n=200, seed=1)
    method = build_method("recursive", x, y, num_inducing=15, lr=0.05)
    assert method.label == "SRGP (Kalman, VFE)" and method.sizes == "M=15"
    before = regression_metrics(method, test_x, test_y, 1.0)
    for _ in range(5):
        for index in torch.randperm(400).split(100):
            method.step(x[index], y[index])
    after = regression_metrics(method, test_x, test_y, 1.0)
    assert after["rmse"] < 0.7 * before["rmse"] and after["nll"] < before["nll"] - 0.3
    assert 0.85 < after["coverage"] <= 1.0


def test_cstr_epochs_and_epochs_to_reach():
    assert [cstr_epochs(n, 1000, 200, 200) for n in (10**3, 10**4, 10**5, 10**6)] == [200, 20, 2, 1]
    assert cstr_epochs(500, 1000, 200, 50) == 50
    assert [cstr_epochs(n, 1000, 600, 600, min_epochs=2) for n in (10**3, 10**4, 10**5, 10**6)] == [600, 60, 6, 2]
    assert epochs_to_reach([0.1, 0.5, 0.3, 0.2], 0.3) == 2  # epoch 0 (before training) does not count
    assert epochs_to_reach([0.9, 0.5], 0.3) is None
