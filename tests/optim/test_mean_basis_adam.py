"""MeanBasisAdam: its first step moves the mean function by the same amount whatever the basis size (plain Adam's
step grows with it), and with the default rate it converges, without oscillating, to the optimal mean coefficients
for a Gaussian and a Bernoulli likelihood at a small and a 16 times larger mean basis (float64; the optimum from
L-BFGS on the same objective)."""

from __future__ import annotations

import pytest
import torch

from gpytorch_decoupled.optim import MeanBasisAdam
from tests.float64_problems import F64, bernoulli_likelihood, full_batch_elbo, gaussian_likelihood
from tests.variational.mean_basis_cases import MeanBasisGP

SIZES = (40, 640)


def _problem(kind: str, size: int, likelihood: str):
    """A 1-D problem on [-3, 3] with 5 covariance points and ``size`` mean points, coefficients 0."""
    X = torch.linspace(-3, 3, 120, dtype=F64).unsqueeze(-1)
    f = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 0]
    y = f if likelihood == "gaussian" else (f > 0).to(F64)
    beta = torch.linspace(-3, 3, 5, dtype=F64).unsqueeze(-1)
    gamma = torch.linspace(-3.1, 3.1, size, dtype=F64).unsqueeze(-1)
    model = MeanBasisGP(kind, beta, gamma, learn_inducing_locations=False)
    with torch.no_grad():
        model.variational_strategy.mean_coefficients.zero_()
    return model, gaussian_likelihood() if likelihood == "gaussian" else bernoulli_likelihood(), X, y


def _mean(model, X: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(X).mean


def _train(model, likelihood, X, y, optimizer, steps: int) -> list[float]:
    """Full-batch steps of ``optimizer`` on the ELBO; the ELBO before each step."""
    values = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = -full_batch_elbo(model, likelihood, X, y)
        loss.backward()
        optimizer.step()
        values.append(-loss.item())
    return values


@pytest.mark.parametrize("kind", ["orthogonal", "hybrid"])
def test_the_first_step_moves_the_mean_alike_for_any_basis_size(kind: str) -> None:
    moves = {}
    for rule in ("function scale", "plain"):
        for size in SIZES:
            model, likelihood, X, y = _problem(kind, size, "gaussian")
            before = _mean(model, X)
            a = model.variational_strategy.mean_coefficients
            optimizer = MeanBasisAdam(model, lr=0.05) if rule == "function scale" else torch.optim.Adam([a], lr=0.05)
            _train(model, likelihood, X, y, optimizer, 1)
            moves[rule, size] = (_mean(model, X) - before).abs().max().item()
    small, large = SIZES
    assert 0.5 < moves["function scale", large] / moves["function scale", small] < 2.0, moves
    assert moves["plain", large] / moves["plain", small] > 8.0, moves  # what the function scale takes out


@pytest.mark.parametrize("likelihood", ["gaussian", "bernoulli"])
@pytest.mark.parametrize("size", SIZES)
def test_the_default_rate_converges_at_any_basis_size(likelihood: str, size: int) -> None:
    model, lik, X, y = _problem("orthogonal", size, likelihood)
    reference, _, _, _ = _problem("orthogonal", size, likelihood)
    coefficients = reference.variational_strategy.mean_coefficients
    lbfgs = torch.optim.LBFGS(
        [coefficients], max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-13, line_search_fn="strong_wolfe"
    )

    def closure():
        lbfgs.zero_grad()
        loss = -full_batch_elbo(reference, lik, X, y)
        loss.backward()
        return loss

    lbfgs.step(closure)
    best = -closure().item()
    values = _train(model, lik, X, y, MeanBasisAdam(model), 400)
    gap = best - values[0]
    assert best - values[-1] < 0.02 * gap, (best, values[0], values[-1])
    assert max(values[-50:]) - min(values[-50:]) < 0.005 * gap  # no oscillation


def test_bad_arguments_are_refused_before_anything_changes() -> None:
    with pytest.raises(TypeError, match="decoupled strategy"):
        MeanBasisAdam(torch.nn.Linear(2, 1))
    model, _, _, _ = _problem("orthogonal", 40, "gaussian")
    for name, value in (("lr", 0.0), ("num_samples", 0), ("smoothing", 1.0), ("refresh_every", 0)):
        with pytest.raises(ValueError, match=name):
            MeanBasisAdam(model, **{name: value})


def test_the_scale_is_estimated_every_refresh_every_steps_and_resumes() -> None:
    model, likelihood, X, y = _problem("orthogonal", 200, "gaussian")
    optimizer = MeanBasisAdam(model, refresh_every=4, generator=torch.Generator().manual_seed(0))
    estimated = []
    original = optimizer.function_scale
    optimizer.function_scale = lambda strategy: estimated.append(len(estimated)) or original(strategy)
    scales = []
    for step in range(9):
        _train(model, likelihood, X, y, optimizer, 1)
        scales.append(optimizer.state[model.variational_strategy.mean_coefficients]["function_scale"])
        if step == 4:  # a checkpoint mid-way between two estimates resumes the schedule
            resumed = MeanBasisAdam(model, refresh_every=4)
            resumed.load_state_dict(optimizer.state_dict())
    assert len(estimated) == 3  # steps 1, 5 and 9
    assert scales[0] is scales[3] and scales[4] is not scales[3] and scales[4] is scales[7]
    state = resumed.state[model.variational_strategy.mean_coefficients]
    assert state["function_scale_age"] == 0 and torch.equal(state["function_scale"], scales[4])
    # Every step, as before: one estimate per step.
    every, _, _, _ = _problem("orthogonal", 200, "gaussian")
    optimizer = MeanBasisAdam(every, refresh_every=1)
    calls = []
    original = optimizer.function_scale
    optimizer.function_scale = lambda strategy: calls.append(1) or original(strategy)
    _train(every, likelihood, X, y, optimizer, 3)
    assert len(calls) == 3
