"""fit_collapsed_bound: the data-driven initialization (median heuristic, noise and signal from Var(y), constant mean),
the noise-only detector (fires on pure noise and on a fit stuck at the noise-only optimum, not on a real fit), the
restarts (the best start is kept, its state restored), the fitted bound against the dense oracle, and bad arguments
(a clear error, nothing changed).
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import pytest
import torch
from linear_operator.utils.errors import NotPSDError

from gpytorch_decoupled.kernels import median_lengthscales
from gpytorch_decoupled.mlls import StreamingCollapsedBound, fit_collapsed_bound
from tests.recursive_problems import F64, RecursiveGP, oracle_bound

pytestmark = pytest.mark.usefixtures("single_thread")


def _data(n=300, dims=2, seed=0, signal=True):
    generator = torch.Generator().manual_seed(seed)
    x = 4.0 * torch.rand(n, dims, generator=generator, dtype=F64) - 2.0
    noise = 0.1 * torch.randn(n, generator=generator, dtype=F64)
    y = (torch.sin(2.0 * x[:, 0]) + 0.5 * torch.cos(3.0 * x[:, -1]) if signal else 0.0) + noise
    return x, 3.0 + 2.0 * y  # an offset and a scale that GPyTorch's defaults do not know


def _model(x, num_inducing=15, seed=1):
    z = x[torch.randperm(x.size(0), generator=torch.Generator().manual_seed(seed))[:num_inducing]].clone()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    return RecursiveGP(z, likelihood, constant_mean=True).double(), likelihood


def _batches(x, y, size=100):
    return list(zip(x.split(size), y.split(size)))


def _noise_only_warnings(caught):
    return [w for w in caught if "noise-only" in str(w.message)]


def test_a_real_fit_is_not_noise_only_and_matches_the_dense_bound():
    x, y = _data()
    model, likelihood = _model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = fit_collapsed_bound(model, likelihood, _batches(x, y), max_iter=50)
    assert not fit.noise_only and not _noise_only_warnings(caught)
    variance = y.var()
    assert likelihood.noise.item() < 0.05 * variance  # the noise is 0.04 of a variance near 5
    assert (fit.bound - fit.noise_only_bound).item() / y.numel() > 1.0
    # The returned bound is the batch bound at the fitted values (dense oracle), and the state is its posterior.
    with torch.no_grad():
        torch.testing.assert_close(fit.bound, oracle_bound(model, likelihood, x, y), rtol=1e-10, atol=0.0)
    assert model.variational_strategy.num_observed == y.numel()
    torch.testing.assert_close(model.variational_strategy.recursive_bound, fit.bound, rtol=1e-9, atol=0.0)
    # The noise-only reference is the Gaussian log likelihood at the targets' mean and maximum-likelihood variance.
    s2 = y.var(unbiased=False)
    torch.testing.assert_close(
        fit.noise_only_bound, -0.5 * y.numel() * (torch.log(2 * math.pi * s2) + 1), rtol=1e-12, atol=0.0
    )


def test_the_detector_fires_on_pure_noise():
    x, y = _data(signal=False)
    model, likelihood = _model(x)
    with pytest.warns(RuntimeWarning, match="noise-only solution.*num_starts=5"):
        fit = fit_collapsed_bound(model, likelihood, _batches(x, y), max_iter=50)
    assert fit.noise_only
    assert likelihood.noise.item() > 0.8 * y.var().item()


def test_the_detector_fires_on_a_fit_stuck_at_the_noise_only_optimum():
    x, y = _data()
    model, likelihood = _model(x)
    # The noise-only optimum: a vanishing signal (where the bound's gradient in it vanishes too) and noise = Var(y).
    model.covar_module.outputscale = 1e-8
    model.mean_module.constant = y.mean()
    likelihood.noise = y.var(unbiased=False)
    with pytest.warns(RuntimeWarning, match="noise-only solution"):
        fit = fit_collapsed_bound(model, likelihood, _batches(x, y), max_iter=20, initialize=False)
    assert fit.noise_only
    # From the data-driven initialization the same model does not stall.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = fit_collapsed_bound(model, likelihood, _batches(x, y), max_iter=50)
    assert not fit.noise_only and not _noise_only_warnings(caught)


def test_initialization_from_the_data():
    x, y = _data(n=200, dims=3)
    x[:, 1] = 0.5  # a constant column
    model, likelihood = _model(x)
    with pytest.warns(RuntimeWarning, match="column 1 is constant"):
        fit_collapsed_bound(model, likelihood, _batches(x, y), max_iter=1, absorb=False)
    values = [*model.parameters(), *likelihood.parameters()]
    assert all(torch.isfinite(value).all() for value in values)
    # Without iterations beyond the first, the initial values are those of the heuristics (max_iter=1 moves them
    # a little, so compare the initialization itself through a fit whose optimizer cannot move: no parameters).
    model, likelihood = _model(x)
    for parameter in [*model.parameters(), *likelihood.parameters()]:
        parameter.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_collapsed_bound(model, likelihood, _batches(x, y), noise_fraction=0.2, absorb=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = median_lengthscales(x)  # 200 rows: the sample is all of them
    torch.testing.assert_close(model.covar_module.base_kernel.lengthscale[0], expected, rtol=1e-12, atol=0.0)
    variance = y.var()
    torch.testing.assert_close(likelihood.noise[0], 0.2 * variance, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(model.covar_module.outputscale, 0.8 * variance, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(model.mean_module.constant, y.mean(), rtol=1e-12, atol=0.0)


def test_constant_targets_warn_and_stay_finite():
    x, _ = _data(n=100)
    y = torch.full((100,), 2.0, dtype=F64)
    model, likelihood = _model(x)
    with pytest.warns(RuntimeWarning, match="targets are constant"):
        fit_collapsed_bound(model, likelihood, _batches(x, y), max_iter=1, absorb=False)
    assert all(torch.isfinite(value).all() for value in [*model.parameters(), *likelihood.parameters()])


def test_restarts_keep_the_best_start():
    x, y = _data(n=200)
    model, likelihood = _model(x, num_inducing=8)
    # Few iterations, so that the starts end in different places.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = fit_collapsed_bound(model, likelihood, _batches(x, y), num_starts=4, max_iter=3, absorb=False)
    assert len(fit.start_bounds) == 4
    assert len(set(fit.start_bounds)) == 4  # four different results
    assert fit.best_start == max(range(4), key=fit.start_bounds.__getitem__)
    assert fit.best_start != 3  # so the kept state is not merely the last one
    assert fit.bound.sum().item() == max(fit.start_bounds)
    # The model holds the kept start's values: its bound now is that start's.
    value = StreamingCollapsedBound(model, likelihood).value(_batches(x, y))
    torch.testing.assert_close(value, fit.bound, rtol=1e-12, atol=0.0)
    assert model.variational_strategy.num_observed == 0  # absorb=False leaves the state alone


def test_a_line_search_into_failure_ends_at_the_best_point_before(monkeypatch):
    x, y = _data(n=200)
    model, likelihood = _model(x)
    calls, losses = [0], []
    original = StreamingCollapsedBound.value_and_backward

    def failing_on_the_fourth_call(self, batches):
        calls[0] += 1
        if calls[0] == 4:
            raise NotPSDError("K_uu is not positive definite (simulated)")
        loss = original(self, batches)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(StreamingCollapsedBound, "value_and_backward", failing_on_the_fourth_call)
    with pytest.warns(RuntimeWarning, match="stepped to parameters where the bound fails.*simulated"):
        fit = fit_collapsed_bound(model, likelihood, _batches(x, y), max_iter=20, absorb=False)
    assert calls[0] == 4 and len(losses) == 3
    torch.testing.assert_close(fit.bound.sum(), torch.tensor(-min(losses), dtype=F64), rtol=1e-12, atol=0.0)
    monkeypatch.undo()
    value = StreamingCollapsedBound(model, likelihood).value(_batches(x, y))
    torch.testing.assert_close(value, fit.bound, rtol=1e-12, atol=0.0)


def test_bad_arguments_change_nothing():
    x, y = _data(n=50)
    model, likelihood = _model(x)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    for kwargs, error, match in [
        ({"num_starts": 0}, ValueError, "num_starts"),
        ({"max_iter": 1.5}, TypeError, "max_iter"),
        ({"noise_fraction": 1.5}, ValueError, "noise_fraction"),
        ({"noise_only_tolerance": -1.0}, ValueError, "noise_only_tolerance"),
    ]:
        with pytest.raises(error, match=match):
            fit_collapsed_bound(model, likelihood, _batches(x, y), **kwargs)
    with pytest.raises(ValueError, match="no mini-batches"):
        fit_collapsed_bound(model, likelihood, [])
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in state.items())


def test_value_is_the_bound_of_value_and_backward():
    x, y = _data(n=120)
    model, likelihood = _model(x)
    objective = StreamingCollapsedBound(model, likelihood)
    value = objective.value(_batches(x, y, 50))
    loss = objective.value_and_backward(_batches(x, y, 50))
    torch.testing.assert_close(value.sum(), -loss, rtol=1e-13, atol=0.0)
    assert not value.requires_grad
