"""The mean-basis KL of the three decoupled strategies in training: exact by default for a small basis (zero
variance, equal to the dense oracle), and for a larger one the unbiased landmark-controlled estimate of the hybrid and
orthogonal strategies (value and gradients, drawn in the forward pass or in the KL, from the basis's own generator),
with far less variance than the uniformly column-sampled estimate."""

from __future__ import annotations

import pytest
import torch

from gpytorch_decoupled.linalg.landmark_quadratic_form import row_probabilities
from gpytorch_decoupled.variational.mean_basis import EXACT_KL_SIZE
from tests.float64_problems import (
    F64,
    finite_domain,
    generator,
    jittered_kernel_matrix,
    kernel_matrix,
    randn,
    random_factor,
    random_spd,
)
from tests.variational.mean_basis_cases import KINDS, MeanBasisGP, set_decoupled_state, set_residual_state

RESIDUAL_KINDS = ("hybrid", "orthogonal")


def _model(kind: str, domain: torch.Tensor, seed: int, smooth: float = 0.0, **kwargs):
    """A model of ``kind`` with 5 covariance and 9 mean-basis points of ``domain`` and random state; ``smooth`` adds to
    the mean coefficients a large component in the span of the covariance basis (as training leaves it)."""
    gen = generator(seed)
    beta, gamma = domain[:5], domain[5:14]
    model = MeanBasisGP(kind, beta, gamma, **kwargs)
    if kind == "decoupled":
        set_decoupled_state(model, randn(9, gen=gen), random_factor(5, gen, scale=0.7))
        return model
    a = randn(9, gen=gen)
    if smooth:
        a = a + smooth * torch.linalg.solve(kernel_matrix(gamma, gamma), kernel_matrix(gamma, beta) @ randn(5, gen=gen))
    set_residual_state(model, a, randn(5, gen=gen), random_spd(5, gen))
    return model


def _residual_oracle(model) -> torch.Tensor:
    r""":math:`\mathbf a^\top(\mathbf K_\gamma - \mathbf K_{\gamma\beta}\mathbf K_\beta^{-1}\mathbf K_{\beta\gamma})
    \mathbf a` with the strategy's jittered :math:`\mathbf K_\beta`, from dense matrices."""
    strategy = model.variational_strategy
    gamma, beta, a = strategy.mean_inducing_points, strategy.inducing_points, strategy.mean_coefficients
    schur = kernel_matrix(gamma, gamma) - kernel_matrix(gamma, beta) @ torch.linalg.solve(
        jittered_kernel_matrix(beta), kernel_matrix(beta, gamma)
    )
    return a @ schur @ a


@pytest.mark.parametrize("kind", KINDS)
def test_a_small_basis_has_the_exact_kl_in_training_by_default(kind: str) -> None:
    D = finite_domain(40)
    model = _model(kind, D, seed=41, num_kl_columns=2)  # sampling would draw 2 of 9 rows
    strategy = model.variational_strategy
    assert strategy.exact_kl_size == EXACT_KL_SIZE
    model.eval()
    with torch.no_grad():
        exact = strategy.kl_divergence()
    model.train()
    with torch.no_grad():
        draws = torch.stack([strategy.kl_divergence() for _ in range(5)])
        model(D[14:20])  # a training forward pass draws nothing either
        step = strategy.kl_divergence()
    torch.testing.assert_close(draws, exact.expand(5), rtol=1e-13, atol=0)
    torch.testing.assert_close(step, exact, rtol=1e-13, atol=0)
    if kind == "orthogonal":
        torch.testing.assert_close(strategy.mean_quadratic_form(), _residual_oracle(model), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("kind", RESIDUAL_KINDS)
def test_landmark_estimate_averages_to_the_exact_value_and_gradient(kind: str) -> None:
    # One draw per step: the expectation over i ~ p is a finite sum, so unbiasedness is checked exactly.
    D = finite_domain(42)
    model = _model(kind, D, seed=43, smooth=3.0, num_kl_columns=1, exact_kl_size=0)
    strategy = model.variational_strategy
    model.train()
    form = strategy.mean_quadratic_form if kind == "orthogonal" else strategy.mean_basis_quadratic_form
    params = [strategy.mean_coefficients, strategy.mean_inducing_points, model.covar_module.raw_outputscale]
    with torch.no_grad():
        model.eval()
        exact_value = form()
        model.train()
    exact_grads = torch.autograd.grad(_exact(model, form), params)
    probabilities = row_probabilities(strategy.mean_coefficients)
    total, total_grads = 0.0, [torch.zeros_like(p) for p in params]
    for index in range(9):
        strategy._clear_cache()
        value = form(indices=torch.tensor([index]))
        total = total + probabilities[index] * value.detach()
        for accumulated, grad in zip(total_grads, torch.autograd.grad(value, params), strict=True):
            accumulated += probabilities[index] * grad
    torch.testing.assert_close(total, exact_value, rtol=1e-10, atol=1e-10)
    for accumulated, expected in zip(total_grads, exact_grads, strict=True):
        torch.testing.assert_close(accumulated, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", RESIDUAL_KINDS)
def test_with_the_data_as_landmarks_the_estimate_averages_to_the_exact_value_and_gradient(kind: str) -> None:
    # A training step's estimate has the step's data as landmarks besides beta; for every data set the expectation
    # over one draw i ~ p is a finite sum, so unbiasedness (value and gradients) is checked exactly, for data that
    # repeat a point of beta too (a singular landmark matrix but for the jitter).
    D = finite_domain(46)
    model = _model(kind, D, seed=47, smooth=3.0, num_kl_columns=1, exact_kl_size=0)
    strategy = model.variational_strategy
    model.train()
    params = [strategy.mean_coefficients, strategy.mean_inducing_points, model.covar_module.raw_outputscale]
    exact_value = _residual_oracle(model).detach()
    exact_grads = torch.autograd.grad(_exact(model, strategy.residual_quadratic_form), params)
    probabilities = row_probabilities(strategy.mean_coefficients)
    for data in (D[14:20], torch.cat([D[14:18], D[:2]])):
        total, total_grads = 0.0, [torch.zeros_like(p) for p in params]
        values = []
        for index in range(9):
            strategy._clear_cache()
            value = strategy.residual_quadratic_form(indices=torch.tensor([index]), data=data)
            values.append(value.detach())
            total = total + probabilities[index] * value.detach()
            for accumulated, grad in zip(total_grads, torch.autograd.grad(value, params), strict=True):
                accumulated += probabilities[index] * grad
        torch.testing.assert_close(total, exact_value, rtol=1e-9, atol=1e-9)
        for accumulated, expected in zip(total_grads, exact_grads, strict=True):
            torch.testing.assert_close(accumulated, expected, rtol=1e-8, atol=1e-9)
        assert torch.stack(values).std() > 1e-3 * exact_value.abs()  # the draws differ: a test that could fail


@pytest.mark.parametrize("kind", RESIDUAL_KINDS)
def test_training_steps_kl_averages_to_the_exact_float64_kl(kind: str) -> None:
    # The whole training-mode estimate (stratified draws from the basis's generator, beta and the step's data as
    # landmarks, fused with the forward pass) over many steps against the exact KL: within 4 standard errors, and the
    # standard error is small enough (under 1% of the KL's mean-basis term) for a bias of that size to fail.
    D = finite_domain(48)
    model = _model(kind, D, seed=49, smooth=3.0, num_kl_columns=3, exact_kl_size=0)
    strategy = model.variational_strategy
    strategy.mean_basis.generator = torch.Generator().manual_seed(50)
    model.eval()
    with torch.no_grad():
        exact = strategy.kl_divergence()
        quadratic = strategy.mean_quadratic_form() if kind == "orthogonal" else strategy.mean_basis_quadratic_form()
    model.train()
    gen = generator(51)
    draws = []
    with torch.no_grad():
        for _ in range(300):
            strategy._clear_cache()
            model(D[14:][torch.randperm(16, generator=gen)[:6]])
            draws.append(strategy.kl_divergence())
    draws = torch.stack(draws)
    standard_error = draws.std() / len(draws) ** 0.5
    assert draws.std() > 1e-4 * exact.abs()
    assert standard_error < 0.01 * quadratic.abs()
    assert (draws.mean() - exact).abs() < 4 * standard_error, (draws.mean(), exact, standard_error)


def _exact(model, form) -> torch.Tensor:
    """The exact form with a graph (eval mode computes it exactly)."""
    model.eval()
    try:
        model.variational_strategy._clear_cache()
        return form()
    finally:
        model.train()
        model.variational_strategy._clear_cache()


@pytest.mark.parametrize("data_landmarks", [True, False])
@pytest.mark.parametrize("kind", RESIDUAL_KINDS)
def test_the_training_step_draws_from_the_basis_generator_and_its_kl_is_that_draws_estimate(
    kind: str, data_landmarks: bool
) -> None:
    D = finite_domain(44)
    model = _model(kind, D, seed=45, smooth=3.0, num_kl_columns=3, exact_kl_size=0, kl_data_landmarks=data_landmarks)
    strategy = model.variational_strategy
    basis = strategy.mean_basis
    model.train()
    kls = []
    for _ in range(2):
        basis.generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            model(D[14:20])
            kls.append(strategy.kl_divergence())
            indices = basis.sampled_rows.indices
            assert strategy.kl_divergence() == kls[-1]  # one estimate per step
            # The fused rows (drawn with the data's kernel row, the data also landmarks) give the estimate of the same
            # draws made afresh.
            fresh = strategy.residual_quadratic_form(indices=indices, data=D[14:20] if data_landmarks else None)
            torch.testing.assert_close(strategy.residual_quadratic_form(), fresh, rtol=1e-11, atol=1e-11)
    assert kls[0] == kls[1]  # the caller's generator makes the step reproducible
    with torch.no_grad():
        basis.generator = torch.Generator().manual_seed(8)
        model(D[14:20])
        assert strategy.kl_divergence() != kls[0]


def test_the_landmark_estimate_has_far_less_variance_than_the_column_sampled_one() -> None:
    # 80 mean points, 8 covariance points; coefficients with a large part along directions that the orthogonal KL
    # barely sees (where Adam lets a trained orthogonal model's coefficients drift). With one draw per step the
    # distribution of each estimate is a finite sum over the 80 rows, so its mean and variance are computed exactly
    # (the column-sampled estimate is heavy-tailed: a few hundred random draws underestimate its spread).
    gen = generator(50)
    gamma = 3.0 * torch.rand(80, 2, generator=gen, dtype=F64) - 1.5
    beta = 3.0 * torch.rand(8, 2, generator=gen, dtype=F64) - 1.5
    schur = kernel_matrix(gamma, gamma) - kernel_matrix(gamma, beta) @ torch.linalg.solve(
        jittered_kernel_matrix(beta), kernel_matrix(beta, gamma)
    )
    flat = torch.linalg.eigh(schur).eigenvectors[:, :8]
    a = randn(80, gen=gen) + 10.0 * flat @ randn(8, gen=gen)
    exact = a @ schur @ a
    spreads = {}
    for control in (True, False):
        model = MeanBasisGP("orthogonal", beta, gamma, num_kl_columns=1, exact_kl_size=0, kl_control_variate=control)
        strategy = model.variational_strategy
        with torch.no_grad():
            strategy.mean_coefficients.copy_(a)
        model.train()
        probabilities = row_probabilities(a) if control else torch.full_like(a, 1 / 80)
        with torch.no_grad():
            values = torch.stack([strategy.mean_quadratic_form(indices=torch.tensor([i])) for i in range(80)])
        torch.testing.assert_close(probabilities @ values, exact, rtol=1e-10, atol=0)  # unbiased either way
        spreads[control] = (probabilities @ (values - exact).pow(2)).sqrt() / exact
    # One draw's standard deviation: 9.3 and 40 times the exact value (19 times less variance).
    assert spreads[True] < spreads[False] / 3, spreads
