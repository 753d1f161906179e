import json
import warnings

import pytest
import torch

from gpytorch_decoupled import datasets
from gpytorch_decoupled.__main__ import main
from gpytorch_decoupled.demo import DEMO_METHODS, gaussian_metrics
from gpytorch_decoupled.variational import (
    DecoupledVariationalStrategy,
    DualVariationalStrategy,
    KalmanVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_demo_smoke_run_prints_the_table_writes_the_results_and_every_method_learns(tmp_path, capsys):
    # No RuntimeWarning: SRGP's check of its closed-form kernel derivatives passes in float32 (rounding reached 5e-4).
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        main(["demo", "--smoke", "--no-progress", "--max-train-rows", "2000", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    for column in ("method", "inducing sizes", "iterations", "s / iteration", "test RMSE", "test NLL"):
        assert column in out
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    assert [row["method"] for row in rows] == [
        "GPyTorch SVGP (Adam)",
        "GPyTorch SVGP (NGD)",
        "OrthNat (ours)",
        "Decoupled (ours)",
        "t-SVGP (dual, ours)",
        "SRGP (Kalman, VFE, ours)",
    ]
    for row in rows:
        assert row["method"] in out
        assert row["iterations"] == 20
        assert [point["iteration"] for point in row["curve"]] == [0, 10, 20]
        # Twenty steps already lower the test NLL of every method (by 0.011 to 0.11 nats on this subset).
        assert row["nll"] < row["curve"][0]["nll"] - 0.005
    assert (tmp_path / "demo_nll_vs_time.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "name, strategy_cls",
    [
        ("orthnat", OrthogonallyDecoupledVariationalStrategy),
        ("decoupled", DecoupledVariationalStrategy),
        ("t-svgp", DualVariationalStrategy),
        ("srgp", KalmanVariationalStrategy),
    ],
)
def test_each_family_of_the_package_is_in_the_demo(name, strategy_cls):
    train_x, train_y = torch.randn(1300, 2), torch.randn(1300)
    method = DEMO_METHODS[name](train_x, train_y)
    assert type(method.model.variational_strategy) is strategy_cls


def test_srgp_predicts_from_all_rows_and_goes_on_with_its_epoch():
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(400, 2, generator=generator, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(400, generator=generator, dtype=torch.float64)
    method = DEMO_METHODS["srgp"](x, y)
    strategy = method.model.variational_strategy
    method.start_epoch()
    method.step(x[:100], y[:100])
    epoch_state = {name: value.clone() for name, value in strategy.state_dict().items()}
    mean, variance = method.predict(x[:50])
    # The prediction is the posterior of all 400 rows: one pass of `update` at the current hyperparameters.
    strategy.reset()
    strategy.update(x, y)
    with torch.no_grad():
        method.model.eval()
        expected = method.likelihood(method.model(x[:50]))
        method.model.train()
    torch.testing.assert_close(mean, expected.mean)
    torch.testing.assert_close(variance, expected.variance)
    strategy.load_state_dict(epoch_state)
    # Predicting left SRGP's epoch state (100 rows absorbed) as it was, so its recursion goes on.
    method.predict(x[:50])
    for name, value in strategy.state_dict().items():
        torch.testing.assert_close(value, epoch_state[name])
    method.step(x[100:200], y[100:200])
    assert strategy.num_observed == 200


def test_too_few_training_rows_for_the_inducing_inputs_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 1200 training rows"):
        DEMO_METHODS["orthnat"](torch.randn(500, 2), torch.randn(500))


def test_gaussian_metrics_are_in_original_units():
    split = datasets.load("elevators", split=0)
    y_std = split.y_std
    mean, variance = torch.zeros_like(split.test_y), torch.full_like(split.test_y, 0.5)
    metrics = gaussian_metrics(mean, variance, split.test_y, y_std)
    original = split.unstandardize_y(split.test_y)
    _, original_variance = split.unstandardize_y(mean, variance)
    expected_nll = -torch.distributions.Normal(split.y_mean, original_variance.sqrt()).log_prob(original).mean()
    assert metrics["rmse"] == pytest.approx((original - split.y_mean).square().mean().sqrt().item(), rel=1e-5)
    assert metrics["nll"] == pytest.approx(expected_nll.item(), rel=1e-5, abs=1e-5)
