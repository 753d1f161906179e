"""Spec §7 identities for :class:`HybridVariationalStrategy`, against dense float64 oracles.

Everything runs in float64 with a jitter of 1e-10 on :math:`\\mathbf K_\\beta` and well-separated inducing points,
so that the implementation and the oracles (which are given the same jittered :math:`\\mathbf K_\\beta`) agree to
roundoff and the tolerances below can fail on a wrong sign, factor or transposed solve.

Conventions: ``beta`` / ``gamma`` are the covariance / extra mean bases, ``m_w, S_w`` the whitened
:math:`q(\\mathbf u_\\beta)` the strategy stores, ``m_beta = L_beta m_w`` and ``S = L_beta S_w L_beta^T`` the
unwhitened block the oracles take (``L_beta`` the jittered Cholesky factor the strategy uses). Unlike ODVGP, the hybrid
mean at :math:`\\beta` is :math:`\\mathbf m_\\beta + \\mathbf K_{\\beta\\gamma}\\mathbf a_\\gamma` (spec §4.7).
GPyTorch's ``VariationalELBO`` returns ELBO / N, so it is multiplied by N before any comparison (spec G2).
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpytorch_decoupled.variational import (
    convert_mean_basis,
)
from tests.float64_problems import (
    F64,
    JITTER,
    NOISE,
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
)
from tests.oracles import (
    decoupled_optimum,
    exact_log_marginal_likelihood,
    hybrid_elbo,
    hybrid_kl,
    hybrid_optimum,
    hybrid_predictive,
    hybrid_to_odvgp,
    odvgp_conditional_optimum,
    odvgp_optimal_elbo,
    odvgp_optimum,
    odvgp_to_hybrid,
    process_kl,
    titsias_optimal_qu,
)
from tests.variational.mean_basis_cases import MeanBasisGP, residual_state, set_residual_state

CONSTANT_MEAN = 0.7


pytestmark = pytest.mark.usefixtures("single_thread")

# --------------------------------------------------------------------------------------------------------- helpers


def _model(beta: torch.Tensor, gamma: torch.Tensor, kind: str = "hybrid", **kwargs) -> MeanBasisGP:
    """A float64 Hybrid (or ODVGP) GP with the SE kernel fixed at (LENGTHSCALE, OUTPUTSCALE), the constant prior mean
    CONSTANT_MEAN and the exact KL."""
    return MeanBasisGP(kind, beta, gamma, constant_mean=CONSTANT_MEAN, **kwargs)


def _decoupled_model(beta: torch.Tensor, alpha: torch.Tensor) -> MeanBasisGP:
    """The Decoupled GP with the same kernel (it adds no jitter), exact KL, zero prior mean."""
    return MeanBasisGP("decoupled", beta, alpha)


def _random_state(gen: torch.Generator, m_gamma: int = 10, m_beta: int = 6):
    return randn(m_gamma, gen=gen), randn(m_beta, gen=gen), random_spd(m_beta, gen)


def _oracle_elbo(beta, gamma, X, y, a_gamma, m_beta, S) -> torch.Tensor:
    """The Hybrid ELBO oracle for these models (constant prior mean, jittered K_beta and predictive diagonal)."""
    b = odvgp_blocks(gamma, beta, X, JITTER)
    prior_mean = torch.full((X.size(0),), CONSTANT_MEAN, dtype=F64)
    return hybrid_elbo(
        b["K_bb"],
        b["K_gb"].mT,
        b["K_gg"],
        b["K_bX"],
        b["K_gX"],
        prior_variances(X.size(0), JITTER),
        y,
        NOISE,
        a_gamma,
        m_beta,
        S,
        prior_mean_f=prior_mean,
    )


# ------------------------------------------------------------------------------------ predictive, KL and ELBO
@pytest.mark.parametrize("seed", [0, 1])
def test_predictive_kl_and_elbo_match_the_oracles(seed: int) -> None:
    beta, gamma, X, y = regression_problem(seed)
    model, likelihood = _model(beta, gamma), gaussian_likelihood()
    set_residual_state(model, *_random_state(generator(20 + seed)))
    a_gamma, m_beta, S = residual_state(model)
    X_test = torch.cat([X[:20], beta])
    K_ss = kernel_matrix(X_test, X_test) + JITTER * torch.eye(26, dtype=F64)
    prior_mean = torch.full((26,), CONSTANT_MEAN, dtype=F64)
    mean, cov = hybrid_predictive(
        jittered_kernel_matrix(beta),
        kernel_matrix(beta, gamma),
        kernel_matrix(beta, X_test),
        kernel_matrix(gamma, X_test),
        K_ss,
        a_gamma,
        m_beta,
        S,
        prior_mean,
    )
    model.eval()
    with torch.no_grad():
        output = model(X_test)
        kl = model.variational_strategy.kl_divergence()
    torch.testing.assert_close(output.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(output.covariance_matrix, cov, rtol=1e-12, atol=1e-12)
    # The hybrid's q(f(beta)) has mean m_beta + K_bg a_gamma (not m_beta, as ODVGP's has) and covariance S.
    torch.testing.assert_close(
        output.mean[20:], m_beta + kernel_matrix(beta, gamma) @ a_gamma + CONSTANT_MEAN, rtol=0, atol=3e-9
    )
    torch.testing.assert_close(
        output.covariance_matrix[20:, 20:], S + JITTER * torch.eye(6, dtype=F64), rtol=0, atol=3e-9
    )
    torch.testing.assert_close(
        kl,
        hybrid_kl(
            jittered_kernel_matrix(beta), kernel_matrix(beta, gamma), kernel_matrix(gamma, gamma), a_gamma, m_beta, S
        ),
    )
    model.train()
    with torch.no_grad():
        train_output = model(X_test)
        torch.testing.assert_close(model.variational_strategy.kl_divergence(), kl, rtol=1e-13, atol=0)
    torch.testing.assert_close(train_output.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(train_output.variance, cov.diagonal(), rtol=1e-12, atol=1e-12)
    # G2 and B1: N x VariationalELBO is the summed ELBO (0.3), below log p(y).
    with torch.no_grad():
        elbo = full_batch_elbo(model, likelihood, X, y)
    torch.testing.assert_close(elbo, _oracle_elbo(beta, gamma, X, y, a_gamma, m_beta, S), rtol=1e-12, atol=0)
    assert elbo < exact_log_marginal_likelihood(kernel_matrix(X, X), y - CONSTANT_MEAN, NOISE)


@pytest.mark.parametrize("seed", [0, 1])
def test_k2_kl_is_the_kl_of_the_predicted_process(seed: int) -> None:
    D = finite_domain(seed)
    beta, gamma = D[:5], D[5:11]  # the other 19 points stand for data and test inputs
    model = _model(beta, gamma)
    set_residual_state(model, *_random_state(generator(10 + seed), m_gamma=6, m_beta=5))
    model.eval()
    with torch.no_grad():
        output = model(D)
        kl = model.variational_strategy.kl_divergence()
    prior_mean = torch.full((30,), CONSTANT_MEAN, dtype=F64)
    expected = process_kl(output.mean, output.covariance_matrix, prior_mean, kernel_matrix(D, D))
    torch.testing.assert_close(kl, expected, rtol=1e-8, atol=0)
    # Without the 1/2 on the log-determinant (the printed [CB] eq. 14) the KL would be far off.
    _, _, S = residual_state(model)
    assert (0.5 * (torch.logdet(S) - torch.logdet(jittered_kernel_matrix(beta)))).abs() > 1e-2 * expected.abs()


# -------------------------------------------------------------------------------------------------- structural
@pytest.mark.parametrize(
    "target_distribution",
    [gpytorch.variational.CholeskyVariationalDistribution, gpytorch.variational.NaturalVariationalDistribution],
)
def test_s2_convert_mean_basis_maps_hybrid_to_odvgp_and_back(target_distribution) -> None:
    beta, gamma, X, y = regression_problem(7)
    hybrid = _model(beta, gamma)
    set_residual_state(hybrid, *_random_state(generator(50)))
    a_gamma, m_hyb, S = residual_state(hybrid)
    odvgp = _model(beta, gamma, "orthogonal", distribution_cls=target_distribution)
    convert_mean_basis(hybrid.variational_strategy, odvgp.variational_strategy)

    # Parameters: the oracle's map (spec §4.7), with the same a_gamma and S.
    a_odvgp, m_odvgp, S_odvgp = residual_state(odvgp)
    expected_a, expected_m = hybrid_to_odvgp(kernel_matrix(beta, gamma), a_gamma, m_hyb)
    torch.testing.assert_close(a_odvgp, expected_a, rtol=0, atol=0)
    torch.testing.assert_close(m_odvgp, expected_m, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(S_odvgp, S, rtol=1e-10, atol=1e-11)
    assert (m_odvgp - m_hyb).abs().max() > 0.1  # the map is not the identity

    # The same process: ELBO, KL, mean and covariance.
    likelihood = gaussian_likelihood()
    with torch.no_grad():
        torch.testing.assert_close(
            full_batch_elbo(odvgp, likelihood, X, y), full_batch_elbo(hybrid, likelihood, X, y), rtol=1e-11, atol=0
        )
    X_test = torch.cat([X[:20], beta, gamma])
    for m in (hybrid, odvgp):
        m.eval()
    with torch.no_grad():
        ours, theirs = hybrid(X_test), odvgp(X_test)
        kl_hyb, kl_odvgp = hybrid.variational_strategy.kl_divergence(), odvgp.variational_strategy.kl_divergence()
    torch.testing.assert_close(ours.mean, theirs.mean, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(ours.covariance_matrix, theirs.covariance_matrix, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(kl_hyb, kl_odvgp, rtol=1e-11, atol=0)
    # S1 for the converted ODVGP: its marginal at beta is N(m_odvgp, S) (plus the predictive jitter).
    eye = torch.eye(6, dtype=F64)
    torch.testing.assert_close(theirs.mean[20:26], m_odvgp + CONSTANT_MEAN, rtol=0, atol=3e-9)
    torch.testing.assert_close(theirs.covariance_matrix[20:26, 20:26], S + JITTER * eye, rtol=0, atol=3e-9)

    # Back again, onto a fresh hybrid: the original parameters (the oracle's inverse map).
    back = _model(beta, gamma)
    convert_mean_basis(odvgp.variational_strategy, back.variational_strategy)
    a_back, m_back, S_back = residual_state(back)
    torch.testing.assert_close(a_back, a_gamma, rtol=0, atol=0)
    torch.testing.assert_close(
        m_back, odvgp_to_hybrid(kernel_matrix(beta, gamma), a_odvgp, m_odvgp)[1], rtol=1e-10, atol=1e-11
    )
    torch.testing.assert_close(m_back, m_hyb, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(S_back, S, rtol=1e-10, atol=1e-11)


# ------------------------------------------------------------------------------------------- natural gradients
@pytest.mark.parametrize("num_mean_points", [10, 0])
def test_n1_one_ngd_step_lands_on_the_conditional_optimum(num_mean_points: int) -> None:
    # With a_gamma fixed, the hybrid's beta block is a conjugate Gaussian problem, so one NGD step of size 1 from any
    # state reaches its optimum: S = S* (Titsias) and, setting the gradient in m_beta to zero,
    #   m_beta = S* K^-1 [K_bX (y - mu_0 - K_Xg a_g) / sigma^2 - K_bg a_g],
    # i.e. Titsias' mean for the targets y - K_Xg a_g *minus* S* K^-1 K_bg a_g, from the KL's cross term
    # m_beta^T K^-1 K_bg a_g (4.2). It is the ODVGP conditional optimum mapped by spec §4.7.
    beta, gamma, X, y = regression_problem(9)
    gamma = gamma[:num_mean_points]
    model = _model(beta, gamma, distribution_cls=gpytorch.variational.NaturalVariationalDistribution)
    likelihood = gaussian_likelihood()
    a_gamma, m_beta, S = _random_state(generator(80), m_gamma=num_mean_points)
    set_residual_state(model, a_gamma, m_beta, S)
    for p in [*model.parameters(), *likelihood.parameters()]:
        p.requires_grad_(False)
    for p in model.variational_parameters():
        p.requires_grad_(True)
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=60, lr=1.0)
    ngd.zero_grad()
    (-full_batch_elbo(model, likelihood, X, y) / 60).backward()
    ngd.step()

    a_after, m_after, S_after = residual_state(model)
    torch.testing.assert_close(a_after, a_gamma, rtol=0, atol=0)
    b = odvgp_blocks(gamma, beta, X, JITTER)
    targets = y - CONSTANT_MEAN - b["K_gX"].mT @ a_gamma
    m_titsias, S_star = titsias_optimal_qu(b["K_bb"], b["K_bX"], targets, NOISE)
    m_expected = m_titsias - S_star @ torch.linalg.solve(b["K_bb"], b["K_gb"].mT @ a_gamma)
    torch.testing.assert_close(S_after, S_star, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m_after, m_expected, rtol=1e-10, atol=1e-12)
    m_odvgp, _ = odvgp_conditional_optimum(
        b["K_bb"], b["K_gb"].mT, b["K_bX"], b["K_gX"], y - CONSTANT_MEAN, NOISE, a_gamma
    )
    torch.testing.assert_close(m_after, odvgp_to_hybrid(b["K_gb"].mT, a_gamma, m_odvgp)[1], rtol=1e-10, atol=1e-12)
    if num_mean_points:
        # The cross term matters: the mean is not Titsias' for the residual targets alone.
        assert (m_after - m_titsias).abs().max() > 1e-2
    # A second step stays there.
    ngd.zero_grad()
    (-full_batch_elbo(model, likelihood, X, y) / 60).backward()
    ngd.step()
    torch.testing.assert_close(residual_state(model)[1], m_after, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------- bound and optimum
def test_b5_hybrid_odvgp_and_decoupled_share_the_optimum() -> None:
    beta, gamma, X, y = regression_problem(8)
    b = odvgp_blocks(gamma, beta, X, JITTER)
    likelihood = gaussian_likelihood()
    y_centred = y - CONSTANT_MEAN
    elbo_star = odvgp_optimal_elbo(**b, k_XX_diag=prior_variances(60, JITTER), y=y_centred, noise=NOISE)

    hybrid = _model(beta, gamma)
    a_star, m_star, S_star = hybrid_optimum(**b, y=y_centred, noise=NOISE)
    set_residual_state(hybrid, a_star, m_star, S_star)
    hybrid_elbo_value = full_batch_elbo(hybrid, likelihood, X, y)
    torch.testing.assert_close(hybrid_elbo_value.detach(), elbo_star, rtol=1e-10, atol=0)
    # Stationary in every block (the lower triangle of the Cholesky parameter is what the strategy uses).
    strategy = hybrid.variational_strategy
    q = strategy._variational_distribution
    blocks = {"a_gamma": strategy.mean_coefficients, "m_w": q.variational_mean, "chol_S_w": q.chol_variational_covar}
    for name, grad in zip(blocks, torch.autograd.grad(hybrid_elbo_value, list(blocks.values()))):
        grad = grad.tril() if name == "chol_S_w" else grad
        assert grad.abs().max() < 1e-6, name

    # ODVGP at its own optimum (5.10)-(5.12): the hybrid optimum mapped by spec §4.7, the same process.
    odvgp = _model(beta, gamma, "orthogonal")
    a_odvgp, m_odvgp, S_odvgp = odvgp_optimum(**b, y=y_centred, noise=NOISE)
    torch.testing.assert_close(a_odvgp, a_star, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(m_odvgp, hybrid_to_odvgp(b["K_gb"].mT, a_star, m_star)[1], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(S_odvgp, S_star, rtol=1e-9, atol=1e-11)
    set_residual_state(odvgp, a_odvgp, m_odvgp, S_odvgp)
    with torch.no_grad():
        torch.testing.assert_close(full_batch_elbo(odvgp, likelihood, X, y), elbo_star, rtol=1e-10, atol=0)

    # Decoupled with alpha = [gamma; beta] at (3.3); it adds no jitter, so its blocks are the plain ones.
    alpha = torch.cat([gamma, beta])
    decoupled = _decoupled_model(beta, alpha)
    a_dec, _, L_dec = decoupled_optimum(
        kernel_matrix(alpha, alpha),
        kernel_matrix(beta, beta),
        kernel_matrix(alpha, X),
        kernel_matrix(beta, X),
        y_centred,
        NOISE,
    )
    q_dec = decoupled.variational_strategy._variational_distribution
    with torch.no_grad():
        q_dec.mean_coefficients.copy_(a_dec)
        q_dec.precision_factor.copy_(L_dec)
        dec_elbo = full_batch_elbo(decoupled, likelihood, X, y_centred)
    # The jitter 1e-10 on K_beta and on the predictive diagonal is the only difference.
    torch.testing.assert_close(dec_elbo, elbo_star, rtol=1e-8, atol=0)

    X_test = torch.cat([4.4 * torch.rand(30, 2, generator=generator(8), dtype=F64) - 2.2, beta])
    for m in (hybrid, odvgp, decoupled):
        m.eval()
    with torch.no_grad():
        outputs = [hybrid(X_test), odvgp(X_test), decoupled(X_test)]
    for other, rtol in ((outputs[1], 1e-10), (outputs[2], 1e-8)):
        shift = CONSTANT_MEAN if other is outputs[2] else 0.0
        torch.testing.assert_close(outputs[0].mean, other.mean + shift, rtol=rtol, atol=rtol)
        torch.testing.assert_close(outputs[0].covariance_matrix, other.covariance_matrix, rtol=rtol, atol=rtol)
    # B4: at beta, the covariance is Titsias'.
    S_titsias = titsias_optimal_qu(b["K_bb"], b["K_bX"], y_centred, NOISE)[1]
    torch.testing.assert_close(outputs[0].covariance_matrix[30:, 30:], S_titsias + JITTER * torch.eye(6, dtype=F64))
