"""The diagonal mean natural-gradient rule (paper eq. 17, spec 5.8) of :class:`OrthogonalMeanNaturalGradient`.

Spec identity N3: alternating an exact natural-gradient step on the covariance block (``gpytorch.optim.NGD``, step
1) with the diagonal rule on :math:`\\mathbf a_\\gamma` is preconditioned gradient descent on the profile ELBO in
:math:`\\mathbf a_\\gamma`, so it converges to :math:`\\mathrm{ELBO}^\\star` (5.13) exactly when
:math:`\\tau<2/\\lambda_{\\max}(\\mathbf P\\mathbf H_p)`, with :math:`\\mathbf P=(\\mathbf D+\\epsilon\\mathbf I)^{-1}`
and :math:`\\mathbf H_p` the Hessian of the profile :math:`-\\mathrm{ELBO}`. The bound is computed here from dense
oracle matrices, and the rule is run just below it (converges) and just above it (diverges). A wrong preconditioner
(e.g. :math:`\\mathbf D^{-2}`) or a missing factor :math:`N` moves the threshold and fails one of the two.
"""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch

from gpytorch_decoupled.optim import OrthogonalMeanNaturalGradient
from gpytorch_decoupled.variational import FastNaturalVariationalDistribution
from tests.float64_problems import (
    F64,
    JITTER,
    NOISE,
    full_batch_elbo,
    generator,
    odvgp_blocks,
    randn,
    regression_problem,
)
from tests.oracles import odvgp_residual_features
from tests.variational.test_orthogonally_decoupled_identities import (
    _natural_model_with_fixed_hyperparameters,
    _optimal_elbo,
)

EPSILON = 1e-12  # the rule's jitter on D; the dense bound below uses the same D + EPSILON


def _problem():
    beta, gamma, X, y = regression_problem(14, m_gamma=10)
    model, likelihood, _ = _natural_model_with_fixed_hyperparameters(beta, gamma, FastNaturalVariationalDistribution)
    return model, likelihood, beta, gamma, X, y


def _residual_schur(beta, gamma, X) -> torch.Tensor:
    b = odvgp_blocks(gamma, beta, X, JITTER)
    return b["K_gg"] - b["K_gb"] @ torch.linalg.solve(b["K_bb"], b["K_gb"].mT)


def _stability_limit(beta, gamma, X) -> tuple[float, float]:
    """``(2 / lambda_max, 2 / (lambda_min + lambda_max))`` of the preconditioned profile Hessian (dense oracle)."""
    b = odvgp_blocks(gamma, beta, X, JITTER)
    K_bg = b["K_gb"].mT
    phi = odvgp_residual_features(b["K_bb"], b["K_bX"], b["K_gX"], K_bg).mT  # (N, M_gamma)
    projection = torch.linalg.solve(b["K_bb"], b["K_bX"]).mT  # K_Xb K_b^-1, (N, M_beta)
    # -ELBO is quadratic in (a_gamma, m_beta): (1/2s)|y - phi a - P m|^2 + a' K_perp a / 2 + m' K_b^-1 m / 2 + const.
    h_aa = phi.mT @ phi / NOISE + _residual_schur(beta, gamma, X)
    h_am = phi.mT @ projection / NOISE
    h_mm = projection.mT @ projection / NOISE + torch.linalg.inv(b["K_bb"])
    profile = h_aa - h_am @ torch.linalg.solve(h_mm, h_am.mT)  # the beta block is re-optimised by each NGD step
    scale = (torch.diagonal(_residual_schur(beta, gamma, X)) + EPSILON).rsqrt()
    eigenvalues = torch.linalg.eigvalsh(scale.unsqueeze(-1) * profile * scale)
    low, high = eigenvalues.min().item(), eigenvalues.max().item()
    return 2.0 / high, 2.0 / (low + high)


def _run_orthnat_diagonal(lr: float, iterations: int, stop_gap: float | None = None) -> tuple[list[float], float]:
    model, likelihood, beta, gamma, X, y = _problem()
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=60, lr=1.0)
    mean_step = OrthogonalMeanNaturalGradient(model, num_data=60, lr=lr, jitter=EPSILON)
    elbo_star = _optimal_elbo(beta, gamma, X, y).item()
    history = []
    for _ in range(iterations):
        for optimizer in (ngd, mean_step):
            optimizer.zero_grad()
            elbo = full_batch_elbo(model, likelihood, X, y)
            (-elbo / 60).backward()
            optimizer.step()
            history.append(elbo.item())
        if stop_gap is not None and abs(history[-1] - elbo_star) < stop_gap * abs(elbo_star):
            break
    return history, elbo_star


def test_residual_variances_are_the_schur_diagonal() -> None:
    model, _, beta, gamma, X, _ = _problem()
    expected = torch.diagonal(_residual_schur(beta, gamma, X))
    torch.testing.assert_close(model.variational_strategy.residual_variances().detach(), expected, rtol=1e-12, atol=0)


def test_one_step_is_the_diagonal_rule() -> None:
    # a <- a - lr N grad(-ELBO / N) / (D + eps), with D = diag(K_gamma_perp_beta) from the dense oracle.
    model, likelihood, beta, gamma, X, y = _problem()
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.mean_coefficients.copy_(randn(10, gen=generator(1)))
    lr = 0.01
    mean_step = OrthogonalMeanNaturalGradient(model, num_data=60, lr=lr, jitter=1e-3)
    (-full_batch_elbo(model, likelihood, X, y) / 60).backward()
    before, grad = strategy.mean_coefficients.detach().clone(), strategy.mean_coefficients.grad.clone()
    mean_step.step()
    expected = before - lr * 60 * grad / (torch.diagonal(_residual_schur(beta, gamma, X)) + 1e-3)
    torch.testing.assert_close(strategy.mean_coefficients.detach(), expected, rtol=1e-13, atol=1e-13)


def test_converges_to_the_optimum_below_the_stability_limit() -> None:
    limit, best = _stability_limit(*_problem()[2:5])
    assert best < limit
    for lr, iterations in ((best, 120), (0.9 * limit, 150)):
        history, elbo_star = _run_orthnat_diagonal(lr, iterations, stop_gap=1e-7)
        assert abs(history[-1] - elbo_star) < 1e-7 * abs(elbo_star), (lr, history[-1], elbo_star)
        assert max(history) <= elbo_star + 1e-9 * abs(elbo_star)


def test_diverges_above_the_stability_limit() -> None:
    limit, _ = _stability_limit(*_problem()[2:5])
    history, elbo_star = _run_orthnat_diagonal(1.1 * limit, 60)
    assert all(math.isfinite(value) for value in history)
    # The error along the top eigenvector grows by |1 - 1.1 * 2| = 1.2 per step: the ELBO runs away from ELBO*.
    assert history[-1] < elbo_star - 1e3 * abs(elbo_star)
    assert history[-1] < history[len(history) // 2] < history[2]


def test_refuses_other_strategies_and_bad_settings() -> None:
    model, *_ = _problem()
    beta = torch.zeros(3, 2, dtype=F64)
    q_u = gpytorch.variational.CholeskyVariationalDistribution(3)
    svgp = gpytorch.variational.VariationalStrategy(gpytorch.models.ApproximateGP(None), beta, q_u)
    svgp_model = gpytorch.models.ApproximateGP(svgp)
    for wrong in (svgp, svgp_model, [model.variational_strategy.mean_coefficients]):
        with pytest.raises(TypeError, match="OrthogonallyDecoupledVariationalStrategy"):
            OrthogonalMeanNaturalGradient(wrong, num_data=60)
    for kwargs in ({"lr": 0.0}, {"lr": -1.0}, {"num_data": 0}, {"jitter": 0.0}):
        with pytest.raises(ValueError, match="positive"):
            OrthogonalMeanNaturalGradient(model, **{"num_data": 60, **kwargs})


def test_the_strategy_form_is_deprecated_and_steps_the_same() -> None:
    model, likelihood, _, _, X, y = _problem()
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.mean_coefficients.copy_(randn(10, gen=generator(3)))
    (-full_batch_elbo(model, likelihood, X, y) / 60).backward()
    before = strategy.mean_coefficients.detach().clone()
    with pytest.warns(DeprecationWarning, match="pass the model"):
        old_form = OrthogonalMeanNaturalGradient(strategy, num_data=60, lr=0.01)
    old_form.step()
    after_old_form = strategy.mean_coefficients.detach().clone()
    with torch.no_grad():
        strategy.mean_coefficients.copy_(before)
    OrthogonalMeanNaturalGradient(model, num_data=60, lr=0.01).step()
    assert not torch.equal(after_old_form, before)
    assert torch.equal(strategy.mean_coefficients.detach(), after_old_form)


def test_a_closure_is_evaluated_and_its_loss_returned() -> None:
    model, likelihood, _, _, X, y = _problem()
    mean_step = OrthogonalMeanNaturalGradient(model, num_data=60, lr=0.01)

    def closure():
        mean_step.zero_grad()
        loss = -full_batch_elbo(model, likelihood, X, y) / 60
        loss.backward()
        return loss

    before = model.variational_strategy.mean_coefficients.detach().clone()
    loss = mean_step.step(closure)
    assert torch.is_tensor(loss) and loss.requires_grad
    assert not torch.equal(model.variational_strategy.mean_coefficients.detach(), before)
    assert mean_step.step() is None


def test_non_finite_update_leaves_the_coefficients_unchanged() -> None:
    model, likelihood, _, _, X, y = _problem()
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.mean_coefficients.copy_(randn(10, gen=generator(2)))
    before = strategy.mean_coefficients.detach().clone()
    mean_step = OrthogonalMeanNaturalGradient(model, num_data=60, lr=0.01)
    # No gradient yet: nothing to do.
    mean_step.step()
    assert torch.equal(strategy.mean_coefficients.detach(), before)
    (-full_batch_elbo(model, likelihood, X, y) / 60).backward()
    for bad in (float("nan"), float("inf")):
        strategy.mean_coefficients.grad[3] = bad
        with pytest.raises(RuntimeError, match="not finite"):
            mean_step.step()
        assert torch.equal(strategy.mean_coefficients.detach(), before)
