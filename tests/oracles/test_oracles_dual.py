"""The t-SVGP oracles (``tests/oracles/dual.py``) checked against independent routes, in float64.

The t-SVGP identity tests trust these oracles; each check here compares two routes that share no formula: the natural
parameters against eqs. 47-48, the sites against the log densities they define, eq. 49 / eq. 51 against the generic
SVGP predictive / Gaussian KL, the two normalizations of log Z against -KL and against 1-D quadrature, the Bernoulli
quadrature against scipy, the autograd site targets against closed forms (Bonnet / Price), and the dense E-step
against a natural-gradient step computed by autograd through the ELBO in expectation parameters.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.stats
import torch

from tests.float64_problems import (
    F64,
    NOISE,
    assert_close,
    eye,
    generator,
    jittered_kernel_matrix,
    kernel_matrix,
    prior_variances,
    randn,
    random_spd,
    regression_problem,
)
from tests.oracles import (
    collapsed_bound,
    expected_gaussian_loglik,
    gaussian_kl,
    gaussian_logpdf,
    svgp_elbo,
    svgp_predictive,
    titsias_optimal_qu,
)
from tests.oracles.dual import (
    bernoulli_expected_loglik,
    datum_sites_to_summaries,
    dual_e_step,
    dual_kl,
    dual_log_normalizer,
    dual_predictive,
    dual_qu_from_sites,
    dual_qu_from_summaries,
    dual_site_targets,
    expected_log_site,
    normalized_expected_log_site,
    normalized_log_normalizer,
    sites_to_summaries,
    summaries_to_sites,
    variational_elbo,
)


def _problem(seed: int = 0, n: int = 40, M: int = 8):
    """``(K_uu, K_uf, k_ff, X, y, Z)`` with the fixed SE kernel and K_uu jittered by 1e-10."""
    Z, _, X, y = regression_problem(seed, n=n, m_beta=M, m_gamma=0)
    return jittered_kernel_matrix(Z), kernel_matrix(Z, X), prior_variances(n), X, y, Z


def _random_sites(M: int, seed: int, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = generator(seed)
    return randn(M, gen=gen), scale * random_spd(M, gen)


def _gaussian(y: torch.Tensor, noise: float = NOISE):
    return lambda mean, var: expected_gaussian_loglik(y, mean, var, noise)


def _plain_marginals(K_uu, K_uf, k_ff, m, S):
    """Marginal means and variances by the plain formula, not through the oracle."""
    A = torch.linalg.solve(K_uu, K_uf)
    return A.mT @ m, k_ff - (A * K_uf).sum(0) + (A * (S @ A)).sum(0)


def _bernoulli(labels: torch.Tensor, num_points: int = 40):
    return lambda mean, var: bernoulli_expected_loglik(labels, mean, var, num_points)


# -------------------------------------------------------------------------------------------------------- inputs
def test_dual_oracles_refuse_float32() -> None:
    K, v = torch.eye(3), torch.zeros(3)
    with pytest.raises(TypeError, match="float64"):
        dual_qu_from_sites(K, v, K)
    with pytest.raises(TypeError, match="float64"):
        dual_kl(eye(3), v, eye(3))
    with pytest.raises(TypeError, match="float64"):
        bernoulli_expected_loglik(v, v.double(), v.double() + 1)


# ------------------------------------------------------------------------------------------------- q(u) routes
@pytest.mark.parametrize("seed", [0, 1])
def test_natural_parameters_and_eqs_47_48_give_the_same_q(seed: int) -> None:
    K_uu = _problem(seed)[0]
    ell1, L2 = _random_sites(8, seed + 10)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    lam1bar, Lam2bar = sites_to_summaries(K_uu, ell1, L2)
    m47, S47 = dual_qu_from_summaries(K_uu, lam1bar, Lam2bar)
    assert_close(m47, m, rtol=1e-10, atol=1e-12)
    assert_close(S47, S, rtol=1e-10, atol=1e-12)
    back = summaries_to_sites(K_uu, lam1bar, Lam2bar)
    assert_close(back[0], ell1, rtol=1e-10, atol=1e-12)
    assert_close(back[1], L2, rtol=1e-10, atol=1e-12)
    # Batched sites broadcast against one K_uu.
    batch_m, batch_S = dual_qu_from_sites(K_uu, torch.stack([ell1, 2 * ell1]), torch.stack([L2, 3 * L2]))
    assert_close(batch_m[0], m, rtol=1e-12)
    assert_close(batch_S[1], dual_qu_from_sites(K_uu, ell1, 3 * L2)[1], rtol=1e-12)


def test_q_is_the_prior_times_the_sites() -> None:
    # log q(u) - log p(u) - (ell1^T u - u^T L2 u / 2) is the same constant (-log Z) at every u.
    K_uu = _problem()[0]
    ell1, L2 = _random_sites(8, 2)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    u = randn(6, 8, gen=generator(3))
    log_sites = u @ ell1 - 0.5 * ((u @ L2) * u).sum(-1)
    zero = torch.zeros(8, dtype=F64)
    constants = gaussian_logpdf(u, m, S) - gaussian_logpdf(u, zero, K_uu) - log_sites
    log_z = dual_log_normalizer(K_uu, *sites_to_summaries(K_uu, ell1, L2))
    assert_close(constants, (-log_z).expand(6), rtol=1e-10)


def test_gaussian_datum_sites_give_titsias_q() -> None:
    K_uu, K_uf, _, _, y, _ = _problem()
    lam1bar, Lam2bar = datum_sites_to_summaries(K_uf, y / NOISE, torch.full_like(y, 1.0 / NOISE))
    m, S = dual_qu_from_summaries(K_uu, lam1bar, Lam2bar)
    m_star, S_star = titsias_optimal_qu(K_uu, K_uf, y, NOISE)
    assert_close(m, m_star, rtol=1e-10, atol=1e-12)
    assert_close(S, S_star, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------ predictive and KL
def test_eq49_predictive_is_the_generic_predictive() -> None:
    K_uu, _, _, X, _, Z = _problem()
    X_test = X[:12]
    ell1, L2 = _random_sites(8, 4)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    prior_mean = torch.full((12,), 0.4, dtype=F64)
    K_us, K_ss = kernel_matrix(Z, X_test), kernel_matrix(X_test, X_test)
    mean, cov = dual_predictive(K_uu, K_us, K_ss, *sites_to_summaries(K_uu, ell1, L2), prior_mean_s=prior_mean)
    expected_mean, expected_cov = svgp_predictive(K_uu, K_us, K_ss, m, S, prior_mean_s=prior_mean)
    assert_close(mean, expected_mean, rtol=1e-10, atol=1e-12)
    assert_close(cov, expected_cov, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_eq51_kl_is_the_generic_kl(seed: int) -> None:
    K_uu = _problem(seed)[0]
    ell1, L2 = _random_sites(8, seed + 20)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    kl = dual_kl(K_uu, *sites_to_summaries(K_uu, ell1, L2))
    assert_close(kl, gaussian_kl(m, S, torch.zeros_like(m), K_uu), rtol=1e-10)
    assert kl > 0.1
    assert_close(dual_kl(K_uu, torch.zeros(8, dtype=F64), torch.zeros(8, 8, dtype=F64)), 0.0, rtol=0, atol=1e-13)


# --------------------------------------------------------------------------------------------------------- log Z
def test_log_normalizer_of_one_inducing_variable_by_quadrature() -> None:
    # M = 1: Z = int N(u | 0, k) exp(l u - L u^2 / 2) du, integrated numerically.
    k, ell, L = 1.7, 0.8, 0.6
    integral, _ = scipy.integrate.quad(
        lambda u: scipy.stats.norm.pdf(u, 0.0, math.sqrt(k)) * math.exp(ell * u - 0.5 * L * u * u), -40, 40
    )
    K = torch.tensor([[k]], dtype=F64)
    log_z = dual_log_normalizer(
        K, *sites_to_summaries(K, torch.tensor([ell], dtype=F64), torch.tensor([[L]], dtype=F64))
    )
    assert_close(log_z, math.log(integral), rtol=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
def test_both_normalizations_give_log_z_minus_expected_log_site_equal_minus_kl(seed: int) -> None:
    # q = p t / Z for any normalization of t, so log Z - E_q[log t] = -KL(q || p) and log Z + c = ELBO (eq. 40).
    K_uu, K_uf, k_ff, _, y, _ = _problem(seed)
    ell1, L2 = _random_sites(8, seed + 30)  # L2 full rank: eq. 41 applies
    lam1bar, Lam2bar = sites_to_summaries(K_uu, ell1, L2)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    minus_kl = -gaussian_kl(m, S, torch.zeros_like(m), K_uu)
    unnormalized = dual_log_normalizer(K_uu, lam1bar, Lam2bar) - expected_log_site(ell1, L2, m, S)
    normalized = normalized_log_normalizer(K_uu, lam1bar, Lam2bar)
    normalized = normalized - normalized_expected_log_site(K_uu, lam1bar, Lam2bar, m, S)
    assert_close(unnormalized, minus_kl, rtol=1e-9)
    assert_close(normalized, minus_kl, rtol=1e-9)
    # The two normalizers differ by the constant of N(y~ | u, Sigma~) as a function of u: not equal themselves.
    assert (dual_log_normalizer(K_uu, lam1bar, Lam2bar) - normalized_log_normalizer(K_uu, lam1bar, Lam2bar)).abs() > 1
    elbo = svgp_elbo(K_uu, K_uf, k_ff, y, NOISE, m, S)
    data_term = elbo - minus_kl
    c = data_term - expected_log_site(ell1, L2, m, S)
    assert_close(dual_log_normalizer(K_uu, lam1bar, Lam2bar) + c, elbo, rtol=1e-10)


# ---------------------------------------------------------------------------------------------- likelihoods
def test_bernoulli_quadrature_matches_scipy() -> None:
    y = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)
    mean = torch.tensor([0.3, -1.0, 2.5, 1.5], dtype=F64)
    var = torch.tensor([0.5, 1.0, 0.01, 2.0], dtype=F64)
    expected = [
        scipy.integrate.quad(
            lambda f, s=2 * yi - 1, mi=mi, vi=vi: (
                scipy.stats.norm.pdf(f, mi, math.sqrt(vi)) * scipy.stats.norm.logcdf(s * f)
            ),
            mi - 15 * math.sqrt(vi),
            mi + 15 * math.sqrt(vi),
            epsabs=1e-14,
            epsrel=1e-13,
        )[0]
        for yi, mi, vi in zip(y.tolist(), mean.tolist(), var.tolist(), strict=True)
    ]
    assert_close(bernoulli_expected_loglik(y, mean, var, 100), torch.tensor(expected, dtype=F64), rtol=1e-10)


def test_site_targets_match_closed_forms() -> None:
    K_uu, K_uf, k_ff, _, y, _ = _problem()
    m, S = dual_qu_from_sites(K_uu, *_random_sites(8, 5))
    mean, var = _plain_marginals(K_uu, K_uf, k_ff, m, S)
    # Gaussian: alpha = (y - mu) / s2, beta = 1 / s2, so g1 = y / s2 (with a prior mean: y - m0) and g2 = 1 / s2.
    prior_mean = torch.full_like(y, 0.4)
    g1, g2 = dual_site_targets(K_uu, K_uf, k_ff, m, S, _gaussian(y), prior_mean_b=prior_mean)
    assert_close(g1, (y - prior_mean) / NOISE, rtol=1e-11)
    assert_close(g2, torch.full_like(y, 1.0 / NOISE), rtol=1e-12)
    # Bernoulli-probit by Bonnet / Price: alpha = E[s r(z)], beta = E[r(z) (z + r(z))], z = s f, r = phi / Phi.
    labels = (y > 0).to(F64)
    g1, g2 = dual_site_targets(K_uu, K_uf, k_ff, m, S, _bernoulli(labels, 60))
    nodes, weights = np.polynomial.hermite_e.hermegauss(120)
    f = mean.unsqueeze(-1) + var.sqrt().unsqueeze(-1) * torch.from_numpy(nodes)
    s = (2 * labels - 1).unsqueeze(-1)
    ratio = torch.exp(-0.5 * (s * f) ** 2 - 0.5 * math.log(2 * math.pi) - torch.special.log_ndtr(s * f))
    w = torch.from_numpy(weights / math.sqrt(2 * math.pi))
    alpha, beta = (s * ratio * w).sum(-1), (ratio * (s * f + ratio) * w).sum(-1)
    assert_close(g2, beta, rtol=1e-9)
    assert_close(g1, beta * mean + alpha, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------------ E-step
def test_full_batch_gaussian_e_step_gives_titsias_q_and_the_vfe_bound() -> None:
    K_uu, K_uf, k_ff, _, y, _ = _problem()
    ell1, L2 = dual_e_step(K_uu, K_uf, k_ff, *_random_sites(8, 6, scale=1.0), _gaussian(y), lr=1.0)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    m_star, S_star = titsias_optimal_qu(K_uu, K_uf, y, NOISE)
    assert_close(m, m_star, rtol=1e-10, atol=1e-12)
    assert_close(S, S_star, rtol=1e-10, atol=1e-12)
    elbo = variational_elbo(K_uu, K_uf, k_ff, m, S, _gaussian(y))
    assert_close(elbo, collapsed_bound(K_uu, K_uf, k_ff, y, NOISE), rtol=1e-11)
    assert_close(elbo, svgp_elbo(K_uu, K_uf, k_ff, y, NOISE, m, S), rtol=1e-13)


def test_e_step_is_a_natural_gradient_step_bernoulli_mini_batch() -> None:
    # eta <- eta + r * grad of the (mini-batch, s = n / B) ELBO in the expectation parameters (m, S + m m^T).
    K_uu, K_uf, k_ff, _, y, _ = _problem()
    labels = (y > 0).to(F64)
    batch, scale, lr = torch.arange(0, 40, 4), 4.0, 0.3
    ell1, L2 = _random_sites(8, 7)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)

    def loglik(mean, var):
        return scale * bernoulli_expected_loglik(labels[batch], mean, var, 40)

    def elbo_of_expectations(e1: torch.Tensor, e2: torch.Tensor) -> torch.Tensor:
        return variational_elbo(K_uu, K_uf[:, batch], k_ff[batch], e1, e2 - torch.outer(e1, e1), loglik)

    e1, e2 = m.clone().requires_grad_(True), (S + torch.outer(m, m)).requires_grad_(True)
    g1, g2 = torch.autograd.grad(elbo_of_expectations(e1, e2), [e1, e2])
    precision = torch.linalg.inv(S)
    new_precision = precision - 2 * lr * 0.5 * (g2 + g2.mT)  # eta2 = -precision / 2
    new_S = torch.linalg.inv(new_precision)
    new_m = new_S @ (precision @ m + lr * g1)

    step = dual_e_step(K_uu, K_uf[:, batch], k_ff[batch], ell1, L2, _bernoulli(labels[batch]), lr, scale=scale)
    m_step, S_step = dual_qu_from_sites(K_uu, *step)
    assert (m_step - m).abs().max() > 0.05
    assert_close(m_step, new_m, rtol=1e-9, atol=1e-11)
    assert_close(S_step, 0.5 * (new_S + new_S.mT), rtol=1e-9, atol=1e-11)
