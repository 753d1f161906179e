"""Spec §7 identities for :class:`OrthogonallyDecoupledVariationalStrategy`, against dense float64 oracles.

Everything runs in float64 with a jitter of 1e-10 on :math:`\\mathbf K_\\beta` and well-separated inducing points,
so that the implementation and the oracles (which factor the same jittered :math:`\\mathbf K_\\beta`) agree to
roundoff and the tolerances below can fail on a wrong sign, factor or transposed solve. The first block checks the
ODVGP oracle itself against the independent oracles it must reduce to; the rest checks the strategy.

Conventions: ``beta`` / ``gamma`` are the covariance / mean bases, ``m_w, S_w`` the whitened
:math:`q(\\mathbf u_\\beta)` the strategy stores, ``m_beta = L_beta m_w`` and ``S = L_beta S_w L_beta^T`` the
unwhitened block the oracles take.
GPyTorch's ``VariationalELBO`` returns ELBO / N, so it is multiplied by N before any comparison (spec G2).
"""

from __future__ import annotations

import math
import unittest.mock

import gpytorch
import pytest
import torch

from gpytorch_decoupled.variational import FastNaturalVariationalDistribution, IndependentMultitaskVariationalStrategy
from tests.float64_problems import (
    F64,
    JITTER,
    NOISE,
    OUTPUTSCALE,
    finite_domain,
    full_batch_elbo,
    gaussian_likelihood,
    generator,
    jittered_kernel_matrix,
    kernel_matrix,
    odvgp_blocks,
    prior_variances,
    randn,
    random_spd,
    regression_problem,
    relative_error,
)
from tests.oracles import (
    collapsed_bound,
    exact_log_marginal_likelihood,
    odvgp_conditional_optimum,
    odvgp_elbo,
    odvgp_kl,
    odvgp_optimal_elbo,
    odvgp_optimum,
    odvgp_predictive,
    odvgp_residual_features,
    process_kl,
    svgp_elbo,
    svgp_kl,
    svgp_predictive,
    titsias_optimal_qu,
)
from tests.variational.mean_basis_cases import MeanBasisGP, residual_state, set_whitened_q, whiten

# --------------------------------------------------------------------------------------------------------- helpers


def _odvgp_model(beta: torch.Tensor, gamma: torch.Tensor, **kwargs) -> MeanBasisGP:
    """A float64 ODVGP with the SE kernel fixed at (LENGTHSCALE, OUTPUTSCALE); ``batch_shape`` gives several latents."""
    return MeanBasisGP("orthogonal", beta, gamma, **kwargs)


def _set_random_state(model: MeanBasisGP, gen: torch.Generator, scale: float = 1.0) -> None:
    """Random a_gamma, m_w and SPD S_w on a Cholesky q(u)."""
    strategy = model.variational_strategy
    m_beta = strategy.inducing_points.size(-2)
    with torch.no_grad():
        strategy.mean_coefficients.copy_(scale * randn(strategy.mean_inducing_points.size(-2), gen=gen))
    set_whitened_q(model, randn(m_beta, gen=gen), random_spd(m_beta, gen))


def _unwhitened_block(model: MeanBasisGP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m_beta, S)`` of the strategy's current q(u_beta), unwhitened with the oracle's jittered Cholesky."""
    return residual_state(model)[1:]


def _optimal_elbo(beta, gamma, X, y) -> torch.Tensor:
    b = odvgp_blocks(gamma, beta, X, JITTER)
    return odvgp_optimal_elbo(**b, k_XX_diag=prior_variances(X.size(0), JITTER), y=y, noise=NOISE)


# --------------------------------------------------------------------------------------------- the oracle itself
def test_oracle_kl_is_the_process_kl_on_a_domain() -> None:
    # K1 for the oracle: (5.3) equals the n-dimensional KL of (5.1)/(0.1) restricted to a domain holding beta, gamma.
    D = finite_domain(0)
    beta, gamma = D[:5], D[5:11]
    gen = generator(1)
    a_gamma, m_beta, S = randn(6, gen=gen), randn(5, gen=gen), random_spd(5, gen)
    K_bb = kernel_matrix(beta, beta)
    mean, cov = odvgp_predictive(
        K_bb,
        kernel_matrix(beta, gamma),
        kernel_matrix(beta, D),
        kernel_matrix(gamma, D),
        kernel_matrix(D, D),
        a_gamma,
        m_beta,
        S,
    )
    expected = process_kl(mean, cov, torch.zeros(30, dtype=F64), kernel_matrix(D, D))
    torch.testing.assert_close(
        odvgp_kl(K_bb, kernel_matrix(beta, gamma), kernel_matrix(gamma, gamma), a_gamma, m_beta, S),
        expected,
        rtol=1e-9,
        atol=0,
    )


def test_oracle_without_mean_basis_is_svgp() -> None:
    # R1 for the oracle: gamma = {} gives the SVGP predictive, KL and ELBO of the sparse_gp oracles.
    beta, _, X, y = regression_problem(2)
    gen = generator(3)
    m_beta, S = randn(6, gen=gen), random_spd(6, gen)
    K_bb, K_bX, empty = kernel_matrix(beta, beta), kernel_matrix(beta, X), torch.zeros(0, 2, dtype=F64)
    none = torch.zeros(0, dtype=F64)
    K_bg, K_gX = kernel_matrix(beta, empty), kernel_matrix(empty, X)
    mean, cov = odvgp_predictive(K_bb, K_bg, K_bX, K_gX, kernel_matrix(X, X), none, m_beta, S)
    svgp_mean, svgp_cov = svgp_predictive(K_bb, K_bX, kernel_matrix(X, X), m_beta, S)
    torch.testing.assert_close(mean, svgp_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cov, svgp_cov, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        odvgp_kl(K_bb, K_bg, kernel_matrix(empty, empty), none, m_beta, S), svgp_kl(K_bb, m_beta, S)
    )
    k_diag = torch.full((60,), OUTPUTSCALE, dtype=F64)
    elbo = odvgp_elbo(K_bb, K_bg, kernel_matrix(empty, empty), K_bX, K_gX, k_diag, y, NOISE, none, m_beta, S)
    torch.testing.assert_close(elbo, svgp_elbo(K_bb, K_bX, k_diag, y, NOISE, m_beta, S), rtol=1e-12, atol=0)


def test_oracle_optimum_attains_its_value_and_reduces_to_titsias() -> None:
    beta, gamma, X, y = regression_problem(4)
    b = odvgp_blocks(gamma, beta, X, JITTER)
    k_diag = torch.full((60,), OUTPUTSCALE, dtype=F64)
    a_star, m_star, S_star = odvgp_optimum(**b, y=y, noise=NOISE)
    elbo_star = odvgp_optimal_elbo(**b, k_XX_diag=k_diag, y=y, noise=NOISE)
    # B3: (5.10)-(5.12) attain (5.13).
    at_optimum = odvgp_elbo(
        b["K_bb"], b["K_gb"].mT, b["K_gg"], b["K_bX"], b["K_gX"], k_diag, y, NOISE, a_star, m_star, S_star
    )
    torch.testing.assert_close(at_optimum, elbo_star, rtol=1e-12, atol=0)
    # Given a_gamma*, the conditional optimum of the beta block is the joint optimum (the two forms of 5.12 agree).
    m_cond, S_cond = odvgp_conditional_optimum(b["K_bb"], b["K_gb"].mT, b["K_bX"], b["K_gX"], y, NOISE, a_star)
    torch.testing.assert_close(S_cond, S_star, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m_cond, m_star, rtol=1e-10, atol=1e-12)
    # B4: S* is Titsias' covariance for any gamma (all ten points, two of them, none).
    m_titsias, S_titsias = titsias_optimal_qu(b["K_bb"], b["K_bX"], y, NOISE)
    for keep in (10, 2, 0):
        S_sub = odvgp_optimum(**odvgp_blocks(gamma[:keep], beta, X, JITTER), y=y, noise=NOISE)[2]
        torch.testing.assert_close(S_sub, S_titsias, rtol=1e-10, atol=1e-12)
    # gamma = {}: the optimum is Titsias' q(u) and (5.13) is the collapsed bound.
    no_gamma = odvgp_blocks(gamma[:0], beta, X, JITTER)
    torch.testing.assert_close(odvgp_optimum(**no_gamma, y=y, noise=NOISE)[1], m_titsias, rtol=1e-10, atol=1e-12)
    bound = collapsed_bound(b["K_bb"], b["K_bX"], k_diag, y, NOISE)
    value = odvgp_optimal_elbo(**no_gamma, k_XX_diag=k_diag, y=y, noise=NOISE)
    torch.testing.assert_close(value, bound, rtol=1e-12, atol=0)
    # B5: the mean basis can only help (here by a lot); B1 at the optimum.
    assert elbo_star > bound + 1.0
    assert elbo_star < exact_log_marginal_likelihood(kernel_matrix(X, X), y, NOISE)


@pytest.mark.parametrize("num_mean_points", [0, 4])
def test_oracle_optimum_is_tight_when_the_covariance_basis_is_the_data(num_mean_points: int) -> None:
    # B2: beta = X (and alpha = gamma + beta contains X) gives ELBO* = log p(y).
    gen = generator(7)
    X = torch.cartesian_prod(*(2 * [torch.linspace(-2.0, 2.0, 5, dtype=F64)])) + 0.05 * randn(25, 2, gen=gen)
    y = torch.sin(1.5 * X[:, 0]) + 0.3 * randn(25, gen=gen)
    gamma = 0.5 * torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, 1.0], [1.0, -1.0]], dtype=F64)[:num_mean_points]
    blocks = {**odvgp_blocks(gamma, X, X, JITTER), "K_bb": kernel_matrix(X, X)}
    value = odvgp_optimal_elbo(**blocks, k_XX_diag=torch.full((25,), OUTPUTSCALE, dtype=F64), y=y, noise=NOISE)
    torch.testing.assert_close(value, exact_log_marginal_likelihood(kernel_matrix(X, X), y, NOISE), rtol=1e-10, atol=0)


def test_oracle_conditional_optimum_is_titsias_on_the_residual_targets() -> None:
    # N1's target: with a_gamma fixed, the beta block sees the targets y - Phi a_gamma.
    beta, gamma, X, y = regression_problem(5)
    b = odvgp_blocks(gamma, beta, X, JITTER)
    a_gamma = randn(10, gen=generator(6))
    phi = odvgp_residual_features(b["K_bb"], b["K_bX"], b["K_gX"], b["K_gb"].mT).mT
    expected = titsias_optimal_qu(b["K_bb"], b["K_bX"], y - phi @ a_gamma, NOISE)
    actual = odvgp_conditional_optimum(b["K_bb"], b["K_gb"].mT, b["K_bX"], b["K_gX"], y, NOISE, a_gamma)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------- KL identities
@pytest.mark.parametrize("seed", [0, 1])
def test_k1_kl_is_the_kl_of_the_predicted_process(seed: int) -> None:
    D = finite_domain(seed)
    beta, gamma = D[:5], D[5:11]  # the other 19 points stand for data and test inputs
    model = _odvgp_model(beta, gamma, constant_mean=0.7)
    _set_random_state(model, generator(10 + seed))
    strategy = model.variational_strategy
    model.eval()
    with torch.no_grad():
        output = model(D)
        kl = strategy.kl_divergence()
    prior_mean = torch.full((30,), 0.7, dtype=F64)
    expected = process_kl(output.mean, output.covariance_matrix, prior_mean, kernel_matrix(D, D))
    torch.testing.assert_close(kl, expected, rtol=1e-8, atol=0)

    # The closed forms (5.1), (0.1), (5.3) agree to roundoff (eval mode adds the jitter to the predictive diagonal).
    m_beta, S = _unwhitened_block(model)
    a_gamma = strategy.mean_coefficients.detach()
    K_ss = kernel_matrix(D, D) + JITTER * torch.eye(30, dtype=F64)
    mean, cov = odvgp_predictive(
        jittered_kernel_matrix(beta),
        kernel_matrix(beta, gamma),
        kernel_matrix(beta, D),
        kernel_matrix(gamma, D),
        K_ss,
        a_gamma,
        m_beta,
        S,
    )
    torch.testing.assert_close(output.mean, mean + 0.7, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(output.covariance_matrix, cov, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        kl,
        odvgp_kl(
            jittered_kernel_matrix(beta), kernel_matrix(beta, gamma), kernel_matrix(gamma, gamma), a_gamma, m_beta, S
        ),
    )
    # Train mode with num_kl_columns=None gives the same exact KL.
    model.train()
    with torch.no_grad():
        model(D[:3])
        torch.testing.assert_close(strategy.kl_divergence(), kl, rtol=1e-13, atol=0)


# -------------------------------------------------------------------------------------------------- structural
def test_s1_marginal_at_the_covariance_basis_ignores_the_mean_coefficients() -> None:
    beta, gamma, _, _ = regression_problem(7)
    model = _odvgp_model(beta, gamma, constant_mean=0.7)
    _set_random_state(model, generator(50), scale=3.0)
    m_beta, S = _unwhitened_block(model)
    model.eval()
    with torch.no_grad():
        output = model(beta)
        # a_gamma moves the mean elsewhere (this is not a vacuous check) ...
        off_basis = model(gamma).mean
        model.variational_strategy.mean_coefficients.mul_(-1.0)
        model.variational_strategy._clear_cache()
        assert (model(gamma).mean - off_basis).abs().max() > 0.1
        # ... but not at beta.
        flipped = model(beta)
    # The strategy adds JITTER to the predictive diagonal and factors K_beta + JITTER I: O(1e-10) differences.
    eye = torch.eye(6, dtype=F64)
    for out in (output, flipped):
        torch.testing.assert_close(out.mean, m_beta + 0.7, rtol=0, atol=3e-9)
        torch.testing.assert_close(out.covariance_matrix, S + JITTER * eye, rtol=0, atol=3e-9)


# ------------------------------------------------------------------------------------------- bound and optimum
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_b1_elbo_is_below_the_exact_log_marginal_likelihood(seed: int) -> None:
    beta, gamma, X, y = regression_problem(10 + seed)
    model, likelihood = _odvgp_model(beta, gamma), gaussian_likelihood()
    gen = generator(60 + seed)
    _set_random_state(model, gen)
    with torch.no_grad():
        elbo = full_batch_elbo(model, likelihood, X, y)
    # G2: N x VariationalELBO is the summed ELBO (0.3) of the oracle.
    m_beta, S = _unwhitened_block(model)
    b = odvgp_blocks(gamma, beta, X, JITTER)
    k_diag = prior_variances(60, JITTER)
    a_gamma = model.variational_strategy.mean_coefficients.detach()
    expected = odvgp_elbo(
        b["K_bb"], b["K_gb"].mT, b["K_gg"], b["K_bX"], b["K_gX"], k_diag, y, NOISE, a_gamma, m_beta, S
    )
    torch.testing.assert_close(elbo, expected, rtol=1e-12, atol=0)
    assert elbo <= _optimal_elbo(beta, gamma, X, y) <= exact_log_marginal_likelihood(kernel_matrix(X, X), y, NOISE)


def _set_optimum(model: MeanBasisGP, beta, gamma, X, y) -> None:
    a_star, m_star, S_star = odvgp_optimum(**odvgp_blocks(gamma, beta, X, JITTER), y=y, noise=NOISE)
    with torch.no_grad():
        model.variational_strategy.mean_coefficients.copy_(a_star)
    set_whitened_q(model, *whiten(beta, m_star, S_star))


def test_b3_b4_closed_form_optimum_is_attained_and_stationary() -> None:
    beta, gamma, X, y = regression_problem(8)
    model, likelihood = _odvgp_model(beta, gamma), gaussian_likelihood()
    _set_optimum(model, beta, gamma, X, y)
    elbo_star = _optimal_elbo(beta, gamma, X, y)
    strategy = model.variational_strategy
    q = strategy._variational_distribution
    blocks = {"a_gamma": strategy.mean_coefficients, "m_w": q.variational_mean, "chol_S_w": q.chol_variational_covar}

    elbo = full_batch_elbo(model, likelihood, X, y)
    torch.testing.assert_close(elbo.detach(), elbo_star, rtol=1e-10, atol=0)
    # Stationary in every block (the lower triangle of the Cholesky parameter is what the strategy uses).
    grads = torch.autograd.grad(elbo, list(blocks.values()))
    for name, grad in zip(blocks, grads):
        grad = grad.tril() if name == "chol_S_w" else grad
        assert grad.abs().max() < 1e-6, name

    # B4: the optimal S equals Titsias' (the strategy's q(u) after setting it, unwhitened).
    _, S = _unwhitened_block(model)
    torch.testing.assert_close(
        S, titsias_optimal_qu(jittered_kernel_matrix(beta), kernel_matrix(beta, X), y, NOISE)[1], rtol=1e-9, atol=1e-12
    )

    # Random perturbations of each block only decrease the ELBO.
    gen = generator(70)
    for name, param in blocks.items():
        original = param.detach().clone()
        for _ in range(3):
            with torch.no_grad():
                step = 0.02 * randn(*param.shape, gen=gen)
                param.add_(step.tril() if name == "chol_S_w" else step)
                perturbed = full_batch_elbo(model, likelihood, X, y)
                param.copy_(original)
            assert perturbed < elbo_star - 1e-9 * elbo_star.abs(), name


# ------------------------------------------------------------------------------------------- natural gradients
def _freeze_all_but(model, likelihood, *keep: torch.nn.Parameter) -> None:
    """Fix hyperparameters and inducing inputs (spec N1/N3: only the stepped blocks move)."""
    kept = {id(p) for p in keep}
    for p in [*model.parameters(), *likelihood.parameters()]:
        p.requires_grad_(id(p) in kept)


NATURAL_DISTRIBUTIONS = [gpytorch.variational.NaturalVariationalDistribution, FastNaturalVariationalDistribution]


def _natural_model_with_fixed_hyperparameters(beta: torch.Tensor, gamma: torch.Tensor, distribution_cls):
    """A natural-gradient beta block and a_gamma = 0 as the only free parameters (the OrthNat test problems)."""
    model = _odvgp_model(beta, gamma, distribution_cls=distribution_cls)
    likelihood = gaussian_likelihood()
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.mean_coefficients.zero_()
    _freeze_all_but(model, likelihood, strategy.mean_coefficients, *model.variational_parameters())
    return model, likelihood, strategy


@pytest.mark.parametrize("distribution_cls", NATURAL_DISTRIBUTIONS)
@pytest.mark.parametrize("num_mean_points", [10, 0])
def test_n1_one_ngd_step_lands_on_the_conditional_optimum(num_mean_points: int, distribution_cls) -> None:
    beta, gamma, X, y = regression_problem(9)
    gamma = gamma[:num_mean_points]
    model = _odvgp_model(beta, gamma, distribution_cls=distribution_cls)
    likelihood = gaussian_likelihood()
    gen = generator(80)
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.mean_coefficients.copy_(randn(num_mean_points, gen=gen))
    set_whitened_q(model, randn(6, gen=gen), random_spd(6, gen))
    _freeze_all_but(model, likelihood, *model.variational_parameters())
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=60, lr=1.0)

    ngd.zero_grad()
    (-full_batch_elbo(model, likelihood, X, y) / 60).backward()
    ngd.step()

    m_beta, S = _unwhitened_block(model)
    b = odvgp_blocks(gamma, beta, X, JITTER)
    a_gamma = strategy.mean_coefficients.detach()
    m_expected, S_expected = odvgp_conditional_optimum(b["K_bb"], b["K_gb"].mT, b["K_bX"], b["K_gX"], y, NOISE, a_gamma)
    torch.testing.assert_close(S, S_expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m_beta, m_expected, rtol=1e-10, atol=1e-12)
    if num_mean_points == 0:
        # Without a mean basis the one step reaches the global optimum: the collapsed bound.
        with torch.no_grad():
            elbo = full_batch_elbo(model, likelihood, X, y)
        k_diag = prior_variances(60, JITTER)
        torch.testing.assert_close(elbo, collapsed_bound(b["K_bb"], b["K_bX"], k_diag, y, NOISE), rtol=1e-12, atol=0)


@pytest.mark.parametrize("distribution_cls", NATURAL_DISTRIBUTIONS)
def test_orthnat_reaches_the_closed_form_optimum(distribution_cls) -> None:
    # The paper's OrthNat scheme with fixed hyperparameters: an NGD step (size 1) on the beta block, then an Adam
    # step on a_gamma, each on a fresh full-batch ELBO. It must approach ELBO* (5.13) from below.
    beta, gamma, X, y = regression_problem(11)
    model, likelihood, strategy = _natural_model_with_fixed_hyperparameters(beta, gamma, distribution_cls)
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=60, lr=1.0)
    adam = torch.optim.Adam([strategy.mean_coefficients], lr=0.1)
    elbo_star = _optimal_elbo(beta, gamma, X, y).item()

    history = []
    for _ in range(300):  # about 110 iterations are needed
        for optimizer in (ngd, adam):
            optimizer.zero_grad()
            elbo = full_batch_elbo(model, likelihood, X, y)
            (-elbo / 60).backward()
            optimizer.step()
            history.append(elbo.item())
        if abs(history[-1] - elbo_star) < 1e-6 * abs(elbo_star):
            break
    assert abs(history[-1] - elbo_star) < 1e-6 * abs(elbo_star), f"ELBO {history[-1]} vs ELBO* {elbo_star}"
    assert max(history) <= elbo_star + 1e-9 * abs(elbo_star)
    # The mean coefficients approach the closed-form a_gamma*.
    a_star = odvgp_optimum(**odvgp_blocks(gamma, beta, X, JITTER), y=y, noise=NOISE)[0]
    assert relative_error(strategy.mean_coefficients.detach(), a_star) < 0.05


# ---------------------------------------------------------------------------------------- non-Gaussian likelihoods
def _train(model, likelihood, objective, X, y, num_data: int, steps: int = 100, lr: float = 0.05) -> list[float]:
    model.train()
    likelihood.train()
    mll = objective(likelihood, model, num_data=num_data)
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)
    values = []
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the sampled KL columns and Monte-Carlo likelihoods
        for _ in range(steps):
            optimizer.zero_grad()
            loss = -mll(model(X), y)
            loss.backward()
            optimizer.step()
            values.append(loss.item())
    return values


@pytest.mark.parametrize("objective", [gpytorch.mlls.VariationalELBO, gpytorch.mlls.PredictiveLogLikelihood])
def test_bernoulli_classification_trains(objective) -> None:
    gen = generator(90)
    X = 4.0 * torch.rand(80, 2, generator=gen, dtype=F64) - 2.0
    labels = (torch.sin(1.5 * X[:, 0]) + X[:, 1] > 0).to(F64)
    beta = torch.cartesian_prod(*(2 * [torch.linspace(-1.6, 1.6, 3, dtype=F64)]))
    model = _odvgp_model(beta, X[::4].clone(), num_kl_columns=8)  # 20 mean points, 8 KL rows sampled per step
    with torch.no_grad():
        model.variational_strategy.mean_coefficients.zero_()
    likelihood = gpytorch.likelihoods.BernoulliLikelihood().double()
    losses = _train(model, likelihood, objective, X, labels, num_data=80)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    model.eval()
    likelihood.eval()
    with torch.no_grad():
        probabilities = likelihood(model(X)).mean
    accuracy = ((probabilities > 0.5).to(F64) == labels).to(F64).mean().item()
    assert accuracy > 0.9, accuracy


def test_softmax_classification_with_three_latents_trains() -> None:
    gen = generator(91)
    centres = torch.tensor([[-1.5, -0.8], [1.5, -0.8], [0.0, 1.6]], dtype=F64)
    labels = torch.arange(3).repeat_interleave(30)
    X = centres[labels] + 0.6 * randn(90, 2, gen=gen)
    beta = torch.cartesian_prod(*(2 * [torch.linspace(-2.0, 2.0, 3, dtype=F64)]))
    model = _odvgp_model(beta, X[::5].clone(), num_kl_columns=6, batch_shape=torch.Size([3]))
    base = model.variational_strategy
    with torch.no_grad():
        base.mean_coefficients.zero_()
    assert base.mean_coefficients.shape == torch.Size([3, 18])
    model.variational_strategy = IndependentMultitaskVariationalStrategy(base, num_tasks=3)
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_features=3, num_classes=3, mixing_weights=False).double()
    losses = _train(model, likelihood, gpytorch.mlls.VariationalELBO, X, labels, num_data=90)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        output = model(X)
        # The wrapper's KL is the base strategy's ODVGP KL summed over the three latents.
        torch.testing.assert_close(model.variational_strategy.kl_divergence(), base.kl_divergence().sum())
    assert output.mean.shape == torch.Size([90, 3])
    accuracy = (output.mean.argmax(-1) == labels).to(F64).mean().item()
    assert accuracy > 0.9, accuracy


# ------------------------------------------------------------------------------------- one prior per training step
@pytest.mark.parametrize("num_kl_columns", [None, 4])
def test_training_forward_from_one_prior_equals_the_generic_path(num_kl_columns: int | None) -> None:
    # The training forward takes K_beta, K_beta,x and K_xx from the mean basis's joint prior (one model.forward per
    # step); the generic path (three model.forward calls: the mean basis, K_beta and the SVGP block's [beta; x], as
    # GPyTorch's VariationalStrategy.forward) must give the same marginals, KL and gradients.
    beta, gamma, X, y = regression_problem(21)
    outputs = []
    for generic in (False, True):
        model = _odvgp_model(beta, gamma, num_kl_columns=num_kl_columns, constant_mean=0.3)
        _set_random_state(model, generator(22))
        likelihood = gaussian_likelihood()
        strategy = model.variational_strategy
        torch.manual_seed(23)  # the same sampled KL rows in both runs
        if generic:  # no joint prior handed back: the strategy takes the generic route
            fused = strategy.mean_basis.fused_values
            strategy.mean_basis.fused_values = lambda *args, f=fused, **kwargs: f(*args, **kwargs)._replace(prior=None)
        model.train()
        with unittest.mock.patch.object(model, "forward", wraps=model.forward) as spy:
            output = model(X)
        assert spy.call_count == (3 if generic else 1)
        elbo = likelihood.expected_log_prob(y, output).sum() - strategy.kl_divergence()
        parameters = [p for p in model.parameters() if p.requires_grad]
        outputs.append((output.mean, output.variance, elbo, torch.autograd.grad(elbo, parameters)))
    (mean, variance, elbo, grads), (mean_ref, variance_ref, elbo_ref, grads_ref) = outputs
    torch.testing.assert_close(mean, mean_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(variance, variance_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(elbo, elbo_ref, rtol=1e-12, atol=0)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)
