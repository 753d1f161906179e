"""Spec §7 identities for the Decoupled (SVDGP) and Hybrid oracles, checked at oracle level in float64.

The implementations of both families will be tested against ``tests/oracles/decoupled.py`` and
``tests/oracles/hybrid.py``; these tests are what that trust rests on. Each identity compares two independent
routes: the closed forms against the dense KL on a finite input domain (:func:`process_kl`), against the SVGP and
ODVGP oracles they must reduce to, or against autograd. Kernel matrices come from well-separated points
(condition numbers ~1e1-1e3), so the tolerances are tight enough to fail on a missing factor or a transposed solve.
"""

from __future__ import annotations

import pytest
import torch

from tests.float64_problems import (
    F64,
    NOISE,
    covariance_below,
    decoupled_blocks,
    eye,
    finite_domain,
    generator,
    kernel_matrix,
    odvgp_blocks,
    prior_variances,
    randn,
    random_factor,
    random_spd,
    regression_problem,
)
from tests.oracles import (
    exact_log_marginal_likelihood,
    expected_gaussian_loglik,
    gaussian_kl,
    odvgp_elbo,
    odvgp_kl,
    odvgp_optimal_elbo,
    odvgp_optimum,
    odvgp_predictive,
    process_kl,
    svgp_elbo,
    svgp_kl,
    svgp_predictive,
)
from tests.oracles.decoupled import (
    decoupled_covariance_to_s,
    decoupled_elbo,
    decoupled_kl,
    decoupled_kl_gradients,
    decoupled_optimum,
    decoupled_predictive,
    s_to_decoupled_precision,
)
from tests.oracles.hybrid import (
    hybrid_elbo,
    hybrid_kl,
    hybrid_optimum,
    hybrid_predictive,
    hybrid_to_odvgp,
    odvgp_to_hybrid,
)

# --------------------------------------------------------------------------------------------------------- helpers


def _assert_close(actual: torch.Tensor, expected: torch.Tensor | float, rtol: float, atol: float = 0.0) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------------- input checks
def test_new_oracles_refuse_float32_and_bad_shapes() -> None:
    K, a = torch.eye(3), torch.zeros(3)
    with pytest.raises(TypeError, match="float64"):
        decoupled_kl(K, K, a, K)
    with pytest.raises(TypeError, match="float64"):
        hybrid_kl(K.double(), K.double(), K.double(), a.double(), a.double(), K)
    with pytest.raises(TypeError, match="float64"):
        decoupled_optimum(K.double(), K.double(), K.double(), K.double(), a, NOISE)
    with pytest.raises(ValueError, match="L_B"):
        decoupled_kl(eye(3), eye(3), torch.zeros(3, dtype=F64), eye(2))
    with pytest.raises(ValueError, match="noise"):
        decoupled_elbo(eye(3), eye(3), eye(3), eye(3), torch.ones(3, dtype=F64), a.double(), 0.0, a.double(), eye(3))


# ------------------------------------------------------------------------------------------------- KL identities
@pytest.mark.parametrize("rank", [None, 2, 0])
def test_k3_decoupled_kl_is_the_process_kl(rank: int | None) -> None:
    # K3: (3.2) via L_B and H equals the n-dimensional KL of (3.1) on a domain holding alpha and beta; the two bases
    # overlap in three points and alpha does not contain beta. rank=2 / 0: singular B (0 is the prior covariance).
    D = finite_domain(0)
    alpha, beta = D[:8], D[5:11]
    gen = generator(1)
    a, L_B = randn(8, gen=gen), random_factor(6, gen, rank=rank)
    prior_mean = torch.sin(D.sum(-1))
    K_bb = kernel_matrix(beta, beta)
    mean, cov = decoupled_predictive(
        K_bb, kernel_matrix(alpha, D), kernel_matrix(beta, D), kernel_matrix(D, D), a, L_B, prior_mean_s=prior_mean
    )
    expected = process_kl(mean, cov, prior_mean, kernel_matrix(D, D))
    kl = decoupled_kl(kernel_matrix(alpha, alpha), K_bb, a, L_B)
    _assert_close(kl, expected, rtol=1e-9)
    # log|I + K_beta B| (non-symmetric, by LU) = log|H| (Sylvester).
    B = L_B @ L_B.mT
    sign, logdet = torch.linalg.slogdet(eye(6) + K_bb @ B)
    assert float(sign) == 1.0
    _assert_close(logdet, torch.logdet(eye(6) + L_B.mT @ K_bb @ L_B), rtol=1e-10, atol=1e-13)
    # Substituting S = (K^-1 + B)^-1 gives 1/2 a^T K_alpha a + KL_cov(S) (spec §3.3).
    S = decoupled_covariance_to_s(K_bb, L_B)
    zeros = torch.zeros(6, dtype=F64)
    _assert_close(kl, 0.5 * a @ kernel_matrix(alpha, alpha) @ a + gaussian_kl(zeros, S, zeros, K_bb), rtol=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
def test_k2_hybrid_kl_is_the_process_kl(seed: int) -> None:
    # K2: (4.2) with the 1/2 on the log-det (erratum E6) equals the dense KL; S is not restricted to S <= K_beta.
    D = finite_domain(seed)
    beta, gamma = D[:5], D[5:11]
    gen = generator(10 + seed)
    a_gamma, m_beta, S = randn(6, gen=gen), randn(5, gen=gen), random_spd(5, gen)
    prior_mean = torch.full((30,), 0.7, dtype=F64)
    K_bb, K_bg = kernel_matrix(beta, beta), kernel_matrix(beta, gamma)
    mean, cov = hybrid_predictive(
        K_bb, K_bg, kernel_matrix(beta, D), kernel_matrix(gamma, D), kernel_matrix(D, D), a_gamma, m_beta, S, prior_mean
    )
    expected = process_kl(mean, cov, prior_mean, kernel_matrix(D, D))
    kl = hybrid_kl(K_bb, K_bg, kernel_matrix(gamma, gamma), a_gamma, m_beta, S)
    _assert_close(kl, expected, rtol=1e-9)
    # Without the 1/2 (the OCR of [CB] eq. 14) the value would be off by 1/2 log|K^-1 S|, far outside the tolerance.
    half_logdet = 0.5 * (torch.logdet(S) - torch.logdet(K_bb))
    assert abs(float(half_logdet)) > 1e-2 * abs(float(expected))


# ---------------------------------------------------------------------------------------------- reductions to SVGP
def test_r2_hybrid_without_mean_coefficients_is_svgp() -> None:
    beta, gamma, X, y = regression_problem(2)
    gen = generator(3)
    m_beta, S, zero = randn(6, gen=gen), random_spd(6, gen), torch.zeros(10, dtype=F64)
    K_bb, K_bg, K_bX = kernel_matrix(beta, beta), kernel_matrix(beta, gamma), kernel_matrix(beta, X)
    mean, cov = hybrid_predictive(K_bb, K_bg, K_bX, kernel_matrix(gamma, X), kernel_matrix(X, X), zero, m_beta, S)
    svgp_mean, svgp_cov = svgp_predictive(K_bb, K_bX, kernel_matrix(X, X), m_beta, S)
    _assert_close(mean, svgp_mean, rtol=1e-12, atol=1e-12)
    _assert_close(cov, svgp_cov, rtol=1e-12, atol=1e-12)
    _assert_close(
        hybrid_kl(K_bb, K_bg, kernel_matrix(gamma, gamma), zero, m_beta, S), svgp_kl(K_bb, m_beta, S), rtol=1e-12
    )
    elbo = hybrid_elbo(
        K_bb,
        K_bg,
        kernel_matrix(gamma, gamma),
        K_bX,
        kernel_matrix(gamma, X),
        prior_variances(60),
        y,
        NOISE,
        zero,
        m_beta,
        S,
    )
    _assert_close(elbo, svgp_elbo(K_bb, K_bX, prior_variances(60), y, NOISE, m_beta, S), rtol=1e-12)


def test_r3_decoupled_with_alpha_equal_to_beta_is_svgp() -> None:
    # R3: alpha = beta, a = K^-1 m, B = S^-1 - K^-1 (S < K_beta) is the SVGP process q(u) = N(m, S).
    beta, _, X, y = regression_problem(4)
    gen = generator(5)
    K_bb, K_bX = kernel_matrix(beta, beta), kernel_matrix(beta, X)
    m, S = randn(6, gen=gen), covariance_below(K_bb, gen)
    a = torch.linalg.solve(K_bb, m)
    L_B = torch.linalg.cholesky(s_to_decoupled_precision(K_bb, S))
    mean, cov = decoupled_predictive(K_bb, K_bX, K_bX, kernel_matrix(X, X), a, L_B)
    svgp_mean, svgp_cov = svgp_predictive(K_bb, K_bX, kernel_matrix(X, X), m, S)
    _assert_close(mean, svgp_mean, rtol=1e-10, atol=1e-12)
    _assert_close(cov, svgp_cov, rtol=1e-9, atol=1e-11)
    _assert_close(decoupled_kl(K_bb, K_bb, a, L_B), svgp_kl(K_bb, m, S), rtol=1e-9)
    elbo = decoupled_elbo(K_bb, K_bb, K_bX, K_bX, prior_variances(60), y, NOISE, a, L_B)
    _assert_close(elbo, svgp_elbo(K_bb, K_bX, prior_variances(60), y, NOISE, m, S), rtol=1e-10)

    # B = 0: the covariance is the prior one, and the KL is the mean term alone.
    zero = torch.zeros(6, 6, dtype=F64)
    _, prior_cov = decoupled_predictive(K_bb, K_bX, K_bX, kernel_matrix(X, X), a, zero)
    _assert_close(prior_cov, kernel_matrix(X, X), rtol=0.0, atol=1e-15)
    _assert_close(decoupled_kl(K_bb, K_bb, a, zero), 0.5 * a @ K_bb @ a, rtol=1e-14)
    _assert_close(decoupled_covariance_to_s(K_bb, zero), K_bb, rtol=0.0, atol=1e-15)


# ------------------------------------------------------------------------------------------ structural identities
@pytest.mark.parametrize("seed", [6, 7])
def test_s2_hybrid_and_odvgp_map_preserves_the_process(seed: int) -> None:
    beta, gamma, X, y = regression_problem(seed)
    gen = generator(seed)
    a_gamma, m_hyb, S = randn(10, gen=gen), randn(6, gen=gen), random_spd(6, gen)
    K_bb, K_bg, K_gg, K_bX, K_gX = (
        kernel_matrix(beta, beta),
        kernel_matrix(beta, gamma),
        kernel_matrix(gamma, gamma),
        kernel_matrix(beta, X),
        kernel_matrix(gamma, X),
    )
    a_odvgp, m_odvgp = hybrid_to_odvgp(K_bg, a_gamma, m_hyb)
    _assert_close(a_odvgp, a_gamma, rtol=0.0, atol=0.0)
    # The map is not the identity: the two parametrisations differ by K_bg a_gamma.
    assert float((m_odvgp - m_hyb).abs().max()) > 0.1

    Xs = torch.cat([X[:8], beta])  # test points include beta: there both give q(f(beta)) = N(m_odvgp, S)
    K_bs, K_gs, K_ss = kernel_matrix(beta, Xs), kernel_matrix(gamma, Xs), kernel_matrix(Xs, Xs)
    prior_mean = 0.3 * Xs[:, 0]
    hyb = hybrid_predictive(K_bb, K_bg, K_bs, K_gs, K_ss, a_gamma, m_hyb, S, prior_mean)
    odv = odvgp_predictive(K_bb, K_bg, K_bs, K_gs, K_ss, a_odvgp, m_odvgp, S, prior_mean)
    _assert_close(hyb[0], odv[0], rtol=1e-10, atol=1e-12)
    _assert_close(hyb[1], odv[1], rtol=1e-10, atol=1e-12)
    _assert_close(hyb[0][8:], m_odvgp + prior_mean[8:], rtol=1e-10, atol=1e-12)
    _assert_close(hyb[1][8:, 8:], S, rtol=1e-10, atol=1e-12)

    kl_hyb = hybrid_kl(K_bb, K_bg, K_gg, a_gamma, m_hyb, S)
    _assert_close(kl_hyb, odvgp_kl(K_bb, K_bg, K_gg, a_odvgp, m_odvgp, S), rtol=1e-10)
    args = (K_bb, K_bg, K_gg, K_bX, K_gX, prior_variances(60), y, NOISE)
    _assert_close(hybrid_elbo(*args, a_gamma, m_hyb, S), odvgp_elbo(*args, a_odvgp, m_odvgp, S), rtol=1e-11)

    a_back, m_back = odvgp_to_hybrid(K_bg, a_odvgp, m_odvgp)
    _assert_close(a_back, a_gamma, rtol=0.0, atol=0.0)
    _assert_close(m_back, m_hyb, rtol=1e-14, atol=1e-14)
    _, m_again = hybrid_to_odvgp(K_bg, *odvgp_to_hybrid(K_bg, a_odvgp, m_odvgp))
    _assert_close(m_again, m_odvgp, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("rank", [None, 3])
def test_s3_decoupled_is_the_s_form_with_s_below_the_prior(rank: int | None) -> None:
    D = finite_domain(8)
    alpha, beta = D[:9], D[9:15]
    gen = generator(8)
    a, L_B = randn(9, gen=gen), random_factor(6, gen, rank=rank)
    K_bb, B = kernel_matrix(beta, beta), L_B @ L_B.mT
    S = decoupled_covariance_to_s(K_bb, L_B)
    # The stable form equals the definition (K^-1 + B)^-1, formed here with explicit inverses.
    _assert_close(S, torch.linalg.inv(torch.linalg.inv(K_bb) + B), rtol=1e-10, atol=1e-12)
    # K_beta - S = K P K is PSD (of rank rank(B)), S is PD.
    gap = torch.linalg.eigvalsh(K_bb - S)
    assert float(gap.min()) > -1e-12
    assert int((gap > 1e-8).sum()) == (6 if rank is None else rank)
    assert float(torch.linalg.eigvalsh(S).min()) > 0.0
    # (3.1) equals (0.1) with this S, for the SVGP and the ODVGP S-form oracles alike; and q(f(beta)) has covariance S.
    K_as, K_bs, K_ss = kernel_matrix(alpha, D), kernel_matrix(beta, D), kernel_matrix(D, D)
    mean, cov = decoupled_predictive(K_bb, K_as, K_bs, K_ss, a, L_B)
    _assert_close(cov, svgp_predictive(K_bb, K_bs, K_ss, torch.zeros(6, dtype=F64), S)[1], rtol=1e-10, atol=1e-12)
    _assert_close(mean, K_as.mT @ a, rtol=1e-14, atol=1e-14)
    _, cov_beta = decoupled_predictive(K_bb, kernel_matrix(alpha, beta), K_bb, K_bb, a, L_B)
    _assert_close(cov_beta, S, rtol=1e-10, atol=1e-12)
    # Round trip S -> B (singular B included).
    _assert_close(s_to_decoupled_precision(K_bb, S), B, rtol=1e-8, atol=1e-9)
    if rank is None:
        # The relation quoted in [CB] A.3: B^-1 = -(K + K (S - K)^-1 K).
        rhs = -(K_bb + K_bb @ torch.linalg.solve(S - K_bb, K_bb))
        _assert_close(torch.linalg.inv(B), rhs, rtol=1e-8, atol=1e-9)


def test_s3_s_form_to_decoupled_needs_s_below_the_prior() -> None:
    K_bb = kernel_matrix(finite_domain(9)[:6], finite_domain(9)[:6])
    gen = generator(9)
    S = covariance_below(K_bb, gen)
    B = s_to_decoupled_precision(K_bb, S)
    assert float(torch.linalg.eigvalsh(B).min()) > 0.0
    _assert_close(decoupled_covariance_to_s(K_bb, torch.linalg.cholesky(B)), S, rtol=1e-10, atol=1e-12)
    # S > K_beta in some direction: B = S^-1 - K^-1 is indefinite, so the Decoupled family cannot represent it.
    assert float(torch.linalg.eigvalsh(s_to_decoupled_precision(K_bb, 1.5 * K_bb)).min()) < 0.0


def test_s4_decoupled_variance_never_exceeds_the_prior() -> None:
    D = finite_domain(10)
    beta = D[:6]
    K_bb, K_bD, k_DD = kernel_matrix(beta, beta), kernel_matrix(beta, D), kernel_matrix(D, D)
    K_as_empty = torch.zeros(0, 30, dtype=F64)
    a_empty = torch.zeros(0, dtype=F64)
    gen = generator(10)
    for rank in (None, 5, 3, 1, 0):
        for scale in (0.01, 0.5, 10.0):
            L_B = random_factor(6, gen, rank=rank, scale=scale)
            _, cov = decoupled_predictive(K_bb, K_as_empty, K_bD, k_DD, a_empty, L_B)
            reduction = torch.diagonal(k_DD) - torch.diagonal(cov)
            assert float(reduction.min()) >= -1e-13
            if rank != 0:  # a non-zero B strictly reduces the variance at beta
                assert float(reduction[:6].max()) > 1e-6
    # The S-form families (Hybrid, ODVGP) can exceed the prior: S = 2 K_beta doubles the variance at beta.
    _, cov = hybrid_predictive(K_bb, K_bb[:, :0], K_bD, K_bD[:0], k_DD, a_empty, torch.zeros(6, dtype=F64), 2.0 * K_bb)
    _assert_close(torch.diagonal(cov)[:6], 2.0 * torch.diagonal(K_bb), rtol=1e-12)


# --------------------------------------------------------------------------------------- bounds and the optimum
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_b1_elbos_are_below_the_exact_log_marginal_likelihood(seed: int) -> None:
    beta, gamma, X, y = regression_problem(seed)
    alpha = torch.cat([gamma, beta])
    lml = float(exact_log_marginal_likelihood(kernel_matrix(X, X), y, NOISE))
    gen = generator(seed)
    dec = decoupled_blocks(alpha, beta, X)
    hyb_args = (
        kernel_matrix(beta, beta),
        kernel_matrix(beta, gamma),
        kernel_matrix(gamma, gamma),
        kernel_matrix(beta, X),
        kernel_matrix(gamma, X),
        prior_variances(60),
        y,
        NOISE,
    )
    for scale in (0.0, 0.1, 1.0):
        a, L_B = scale * randn(16, gen=gen), random_factor(6, gen, scale=max(scale, 1e-3))
        elbo = decoupled_elbo(dec["K_aa"], dec["K_bb"], dec["K_aX"], dec["K_bX"], prior_variances(60), y, NOISE, a, L_B)
        assert float(elbo) < lml
        a_gamma, m_beta, S = scale * randn(10, gen=gen), scale * randn(6, gen=gen), random_spd(6, gen)
        assert float(hybrid_elbo(*hyb_args, a_gamma, m_beta, S)) < lml
    # The common optimum too (strictly: 16 basis functions cannot reproduce the exact posterior of 60 points).
    value = odvgp_optimal_elbo(**odvgp_blocks(gamma, beta, X), k_XX_diag=prior_variances(60), y=y, noise=NOISE)
    assert float(value) < lml - 1.0


@pytest.mark.parametrize("seed", [14, 15])
def test_b5_decoupled_hybrid_and_odvgp_optima_coincide(seed: int) -> None:
    beta, gamma, X, y = regression_problem(seed)
    alpha = torch.cat([gamma, beta])
    blocks, dec = odvgp_blocks(gamma, beta, X), decoupled_blocks(alpha, beta, X)
    K_bb, K_bg = blocks["K_bb"], blocks["K_gb"].mT
    a_star, B_star, L_B_star = decoupled_optimum(**dec, y=y, noise=NOISE)
    ag_hyb, m_hyb, S_hyb = hybrid_optimum(**blocks, y=y, noise=NOISE)
    ag_odv, m_odv, S_odv = odvgp_optimum(**blocks, y=y, noise=NOISE)

    # Parameters: the same S* (three routes), B* = S*^-1 - K^-1, the Hybrid optimum maps onto the ODVGP one.
    _assert_close(L_B_star @ L_B_star.mT, B_star, rtol=1e-10, atol=1e-12)
    assert torch.equal(L_B_star, torch.tril(L_B_star))
    _assert_close(decoupled_covariance_to_s(K_bb, L_B_star), S_odv, rtol=1e-9, atol=1e-11)
    _assert_close(S_hyb, S_odv, rtol=1e-9, atol=1e-11)
    _assert_close(s_to_decoupled_precision(K_bb, S_odv), B_star, rtol=1e-8, atol=1e-8)
    mapped = hybrid_to_odvgp(K_bg, ag_hyb, m_hyb)
    _assert_close(mapped[0], ag_odv, rtol=1e-9, atol=1e-11)
    _assert_close(mapped[1], m_odv, rtol=1e-9, atol=1e-11)
    _assert_close(a_star[:10], ag_odv, rtol=1e-9, atol=1e-11)

    # The same predictive process at test points.
    Xs = torch.cartesian_prod(*(2 * [torch.linspace(-2.5, 2.5, 5, dtype=F64)]))
    K_bs, K_gs, K_ss = kernel_matrix(beta, Xs), kernel_matrix(gamma, Xs), kernel_matrix(Xs, Xs)
    dec_pred = decoupled_predictive(K_bb, kernel_matrix(alpha, Xs), K_bs, K_ss, a_star, L_B_star)
    hyb_pred = hybrid_predictive(K_bb, K_bg, K_bs, K_gs, K_ss, ag_hyb, m_hyb, S_hyb)
    odv_pred = odvgp_predictive(K_bb, K_bg, K_bs, K_gs, K_ss, ag_odv, m_odv, S_odv)
    for other in (hyb_pred, odv_pred):
        _assert_close(dec_pred[0], other[0], rtol=1e-9, atol=1e-10)
        _assert_close(dec_pred[1], other[1], rtol=1e-9, atol=1e-10)

    # The same ELBO, equal to the closed-form value (5.13).
    k_diag = prior_variances(60)
    value = odvgp_optimal_elbo(**blocks, k_XX_diag=k_diag, y=y, noise=NOISE)
    dec_args = (dec["K_aa"], K_bb, dec["K_aX"], dec["K_bX"], k_diag, y, NOISE)
    hyb_args = (K_bb, K_bg, blocks["K_gg"], blocks["K_bX"], blocks["K_gX"], k_diag, y, NOISE)
    dec_elbo = decoupled_elbo(*dec_args, a_star, L_B_star)
    _assert_close(dec_elbo, value, rtol=1e-11)
    _assert_close(hybrid_elbo(*hyb_args, ag_hyb, m_hyb, S_hyb), value, rtol=1e-11)
    _assert_close(odvgp_elbo(*hyb_args, ag_odv, m_odv, S_odv), value, rtol=1e-11)

    # Stationarity: the ELBO gradient vanishes at the optimum in (a, L_B) and in (a_gamma, m_beta, S).
    a, L = a_star.clone().requires_grad_(True), L_B_star.clone().requires_grad_(True)
    g_a, g_L = torch.autograd.grad(decoupled_elbo(*dec_args, a, L), (a, L))
    assert float(g_a.abs().max()) < 1e-8 and float(g_L.abs().max()) < 1e-8
    params = [p.clone().requires_grad_(True) for p in (ag_hyb, m_hyb, S_hyb)]
    grads = torch.autograd.grad(hybrid_elbo(*hyb_args, *params), params)
    assert max(float(g.abs().max()) for g in grads) < 1e-8

    # Random perturbations of the decoupled optimum only decrease its ELBO (it is a global maximum).
    gen = generator(seed)
    for scale in (1e-4, 1e-2, 0.3):
        for _ in range(10):
            a_new = a_star + scale * randn(16, gen=gen)
            L_new = L_B_star + scale * torch.tril(randn(6, 6, gen=gen))
            assert float(decoupled_elbo(*dec_args, a_new, L_new)) < float(dec_elbo)
    # Erratum E1: the printed a* without 1/sigma^2 on K_aX y is not the optimum.
    precision = dec["K_aX"] @ dec["K_aX"].mT / NOISE + dec["K_aa"]
    a_printed = torch.linalg.solve(precision, dec["K_aX"] @ y)
    assert float(decoupled_elbo(*dec_args, a_printed, L_B_star)) < float(dec_elbo) - 1.0


def test_b5_decoupled_optimum_with_singular_precision() -> None:
    # Fewer data than covariance points: B* = A A^T / sigma^2 has rank N < M_beta, L_B* has zero columns, and the
    # singular-B route through H still attains (5.13) and reproduces the Titsias S*.
    beta, gamma, X, y = regression_problem(16, n=4)
    alpha = torch.cat([gamma, beta])
    dec = decoupled_blocks(alpha, beta, X)
    a_star, B_star, L_B_star = decoupled_optimum(**dec, y=y, noise=NOISE)
    assert int(torch.linalg.matrix_rank(B_star)) == 4
    _assert_close(L_B_star[:, 4:], torch.zeros(6, 2, dtype=F64), rtol=0.0, atol=0.0)
    _assert_close(L_B_star @ L_B_star.mT, B_star, rtol=1e-10, atol=1e-10)
    blocks = odvgp_blocks(gamma, beta, X)
    S_odv = odvgp_optimum(**blocks, y=y, noise=NOISE)[2]
    _assert_close(decoupled_covariance_to_s(dec["K_bb"], L_B_star), S_odv, rtol=1e-9, atol=1e-11)
    value = odvgp_optimal_elbo(**blocks, k_XX_diag=prior_variances(4), y=y, noise=NOISE)
    elbo = decoupled_elbo(
        dec["K_aa"], dec["K_bb"], dec["K_aX"], dec["K_bX"], prior_variances(4), y, NOISE, a_star, L_B_star
    )
    _assert_close(elbo, value, rtol=1e-10)


def test_elbos_use_the_predictive_marginals_and_the_prior_mean() -> None:
    beta, gamma, X, y = regression_problem(17, n=20)
    alpha = torch.cat([gamma, beta])
    gen = generator(17)
    shift = 0.5 * X[:, 0] - 0.2
    K_XX, k_diag = kernel_matrix(X, X), prior_variances(20)

    dec = decoupled_blocks(alpha, beta, X)
    a, L_B = randn(16, gen=gen), random_factor(6, gen)
    mean, cov = decoupled_predictive(dec["K_bb"], dec["K_aX"], dec["K_bX"], K_XX, a, L_B, prior_mean_s=shift)
    expected = expected_gaussian_loglik(y, mean, torch.diagonal(cov), NOISE).sum()
    expected = expected - decoupled_kl(dec["K_aa"], dec["K_bb"], a, L_B)
    dec_args = (dec["K_aa"], dec["K_bb"], dec["K_aX"], dec["K_bX"], k_diag)
    _assert_close(decoupled_elbo(*dec_args, y, NOISE, a, L_B, prior_mean_f=shift), expected, rtol=1e-12)
    _assert_close(
        decoupled_elbo(*dec_args, y + shift, NOISE, a, L_B, prior_mean_f=shift),
        decoupled_elbo(*dec_args, y, NOISE, a, L_B),
        rtol=1e-12,
    )
    a_shifted = decoupled_optimum(**dec, y=y + shift, noise=NOISE, prior_mean_f=shift)[0]
    _assert_close(a_shifted, decoupled_optimum(**dec, y=y, noise=NOISE)[0], rtol=1e-10, atol=1e-12)

    K_bb, K_bg, K_gg, K_bX, K_gX = (
        kernel_matrix(beta, beta),
        kernel_matrix(beta, gamma),
        kernel_matrix(gamma, gamma),
        kernel_matrix(beta, X),
        kernel_matrix(gamma, X),
    )
    a_gamma, m_beta, S = randn(10, gen=gen), randn(6, gen=gen), random_spd(6, gen)
    mean, cov = hybrid_predictive(K_bb, K_bg, K_bX, K_gX, K_XX, a_gamma, m_beta, S, prior_mean_s=shift)
    expected = expected_gaussian_loglik(y, mean, torch.diagonal(cov), NOISE).sum()
    expected = expected - hybrid_kl(K_bb, K_bg, K_gg, a_gamma, m_beta, S)
    hyb_args = (K_bb, K_bg, K_gg, K_bX, K_gX, k_diag)
    _assert_close(hybrid_elbo(*hyb_args, y, NOISE, a_gamma, m_beta, S, prior_mean_f=shift), expected, rtol=1e-12)
    optimum = hybrid_optimum(**odvgp_blocks(gamma, beta, X), y=y + shift, noise=NOISE, prior_mean_f=shift)
    unshifted = hybrid_optimum(**odvgp_blocks(gamma, beta, X), y=y, noise=NOISE)
    for got, want in zip(optimum, unshifted):
        _assert_close(got, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("rank", [None, 3])
def test_g1_autograd_of_decoupled_kl_matches_cheng_boots_gradients(rank: int | None) -> None:
    D = finite_domain(18)
    alpha, beta = D[:9], D[6:12]
    K_aa, K_bb = kernel_matrix(alpha, alpha), kernel_matrix(beta, beta)
    gen = generator(18)
    a0, L0 = randn(9, gen=gen), random_factor(6, gen, rank=rank)
    B = L0 @ L0.mT
    grad_a, grad_B = decoupled_kl_gradients(K_aa, K_bb, a0, B)

    # Through the factor: grad_L = 2 grad_B L_B (on every entry of L_B, as the KL depends on L_B only via L_B L_B^T).
    a, L = a0.clone().requires_grad_(True), L0.clone().requires_grad_(True)
    auto_a, auto_L = torch.autograd.grad(decoupled_kl(K_aa, K_bb, a, L), (a, L))
    _assert_close(auto_a, grad_a, rtol=1e-12, atol=1e-13)
    _assert_close(auto_L, 2.0 * grad_B @ L0, rtol=1e-10, atol=1e-12)
    assert float(auto_L.abs().max()) > 1e-2  # not vacuous
    # grad_B is symmetric and equals 1/2 S B S with S = (K^-1 + B)^-1.
    _assert_close(grad_B, grad_B.mT, rtol=0.0, atol=1e-14)
    S = decoupled_covariance_to_s(K_bb, L0)
    _assert_close(grad_B, 0.5 * S @ B @ S, rtol=1e-10, atol=1e-12)

    if rank is None:
        # Directly in B: central differences of the KL along random symmetric directions E,
        # d/dt KL(B + t E) = <grad_B, E>, with L_B = chol(B + t E).
        def kl_at(B_t: torch.Tensor) -> float:
            return float(decoupled_kl(K_aa, K_bb, a0, torch.linalg.cholesky(B_t)))

        h = 1e-5
        for _ in range(3):
            E = randn(6, 6, gen=gen)
            E = 0.5 * (E + E.mT)
            numeric = (kl_at(B + h * E) - kl_at(B - h * E)) / (2 * h)
            _assert_close(torch.tensor(numeric, dtype=F64), (grad_B * E).sum(), rtol=1e-7, atol=1e-9)
