"""The dense float64 oracles checked against closed forms and independent implementations.

Every later identity test trusts ``tests/oracles``; these tests are what that trust rests on. Tolerances are tight
enough to fail on a wrong sign, a missing factor of two, or a transposed solve.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from tests.oracles import (
    collapsed_bound,
    exact_log_marginal_likelihood,
    exact_posterior,
    expected_gaussian_loglik,
    gaussian_kl,
    gaussian_logpdf,
    process_kl,
    rbf,
    svgp_elbo,
    svgp_kl,
    svgp_marginals,
    svgp_predictive,
    titsias_optimal_qu,
    unwhiten_qu,
    whiten_qu,
)

F64 = torch.float64
LENGTHSCALE, OUTPUTSCALE, NOISE = 0.8, 1.3, 0.1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def _random_spd(n: int, gen: torch.Generator, batch: tuple[int, ...] = (), floor: float = 0.05) -> torch.Tensor:
    A = _randn(*batch, n, n, gen=gen) * 0.4
    return A @ A.mT + floor * torch.eye(n, dtype=F64)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor | float, rtol: float, atol: float = 0.0) -> None:
    expected = torch.as_tensor(expected, dtype=F64)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def _regression_data(n: int, seed: int, spread: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D inputs near a regular grid on [-3, 3] (keeps ``K_XX`` well conditioned for Z = X) and noisy targets."""
    gen = _gen(seed)
    X = (torch.linspace(-3.0, 3.0, n, dtype=F64) + spread * _randn(n, gen=gen)).unsqueeze(-1)
    y = torch.sin(2.0 * X[:, 0]) + 0.3 * _randn(n, gen=gen)
    return X, y


def _k(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return rbf(A, B, LENGTHSCALE, OUTPUTSCALE)


# ----------------------------------------------------------------------------------------------------------- dtype


def test_float32_inputs_are_refused() -> None:
    m, S = torch.zeros(3), torch.eye(3)
    with pytest.raises(TypeError, match="float64"):
        gaussian_kl(m, S, m, S)
    with pytest.raises(TypeError, match="float64"):
        rbf(torch.zeros(2, 1), torch.zeros(2, 1), 1.0, 1.0)
    with pytest.raises(TypeError, match="float64"):
        process_kl(m.double(), S.double(), m, S.double())
    with pytest.raises(TypeError, match="float64"):
        svgp_elbo(S.double(), S.double(), torch.ones(3, dtype=F64), m, 0.1, m.double(), S.double())


def test_non_positive_definite_and_bad_noise_raise() -> None:
    bad = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=F64)
    zero = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="positive definite"):
        gaussian_kl(zero, bad, zero, torch.eye(2, dtype=F64))
    with pytest.raises(ValueError, match="noise"):
        exact_log_marginal_likelihood(torch.eye(2, dtype=F64), zero, 0.0)


# ---------------------------------------------------------------------------------------------------------- kernel


def test_rbf_closed_form() -> None:
    lengthscale = torch.tensor([0.5, 2.0], dtype=F64)
    x = torch.tensor([[0.3, -1.0]], dtype=F64)
    shifted = x + torch.tensor([[0.5, 0.0], [0.0, 2.0], [0.5, 2.0]], dtype=F64)
    K = rbf(x, torch.cat([x, shifted]), lengthscale, 1.7)
    expected = 1.7 * torch.tensor([1.0, math.exp(-0.5), math.exp(-0.5), math.exp(-1.0)], dtype=F64)
    _assert_close(K[0], expected, rtol=1e-15)


def test_rbf_matches_gpytorch_kernel() -> None:
    import gpytorch

    gen = _gen(0)
    X1, X2 = _randn(7, 3, gen=gen), _randn(5, 3, gen=gen)
    lengthscale = torch.tensor([0.4, 1.1, 2.5], dtype=F64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)).double()
    kernel.base_kernel.lengthscale = lengthscale
    # A Python-float setter goes through float32 in GPyTorch, so set a float64 tensor and read the values back.
    kernel.outputscale = torch.tensor(0.9, dtype=F64)
    with torch.no_grad():
        expected = kernel(X1, X2).to_dense()
        actual = rbf(X1, X2, kernel.base_kernel.lengthscale.squeeze(0), kernel.outputscale)
    _assert_close(actual, expected, rtol=1e-12, atol=1e-14)


# -------------------------------------------------------------------------------------------------------- gaussian


def test_gaussian_kl_zero_for_identical() -> None:
    gen = _gen(1)
    m, S = _randn(4, 6, gen=gen), _random_spd(6, gen, batch=(4,))
    _assert_close(gaussian_kl(m, S, m, S), torch.zeros(4, dtype=F64), rtol=0.0, atol=1e-13)


def test_gaussian_kl_one_dimensional_closed_form() -> None:
    mq, vq, mp, vp = 0.7, 0.3, -0.4, 1.9
    expected = 0.5 * (vq / vp + (mp - mq) ** 2 / vp - 1.0 + math.log(vp / vq))
    kl = gaussian_kl(
        torch.tensor([mq], dtype=F64),
        torch.tensor([[vq]], dtype=F64),
        torch.tensor([mp], dtype=F64),
        torch.tensor([[vp]], dtype=F64),
    )
    _assert_close(kl, expected, rtol=1e-14)


def test_gaussian_kl_diagonal_is_sum_of_one_dimensional() -> None:
    gen = _gen(2)
    mq, mp = _randn(5, gen=gen), _randn(5, gen=gen)
    vq, vp = 0.1 + _randn(5, gen=gen).square(), 0.1 + _randn(5, gen=gen).square()
    per_dim = 0.5 * (vq / vp + (mp - mq).square() / vp - 1.0 + torch.log(vp / vq))
    _assert_close(gaussian_kl(mq, torch.diag(vq), mp, torch.diag(vp)), per_dim.sum(), rtol=1e-13)


def test_gaussian_kl_matches_torch_distributions_batched() -> None:
    gen = _gen(3)
    mq, mp = _randn(3, 6, gen=gen), _randn(3, 6, gen=gen)
    Sq, Sp = _random_spd(6, gen, batch=(3,)), _random_spd(6, gen, batch=(3,))
    MVN = torch.distributions.MultivariateNormal
    expected = torch.distributions.kl_divergence(MVN(mq, covariance_matrix=Sq), MVN(mp, covariance_matrix=Sp))
    kl = gaussian_kl(mq, Sq, mp, Sp)
    assert kl.shape == (3,)
    _assert_close(kl, expected, rtol=1e-11)
    # One shared p broadcasts against a batch of q.
    _assert_close(gaussian_kl(mq, Sq, mp[0], Sp[0])[1], gaussian_kl(mq[1], Sq[1], mp[0], Sp[0]), rtol=1e-14)


def test_gaussian_logpdf_matches_scipy_and_one_dimensional_form() -> None:
    gen = _gen(4)
    y, m, S = _randn(2, 5, gen=gen), _randn(5, gen=gen), _random_spd(5, gen)
    expected = scipy.stats.multivariate_normal(m.numpy(), S.numpy()).logpdf(y.numpy())
    _assert_close(gaussian_logpdf(y, m, S), torch.from_numpy(expected), rtol=1e-12)
    one_d = gaussian_logpdf(
        torch.tensor([1.2], dtype=F64), torch.tensor([0.2], dtype=F64), 4.0 * torch.eye(1, dtype=F64)
    )
    _assert_close(one_d, -0.5 * math.log(2 * math.pi * 4.0) - 1.0 / 8.0, rtol=1e-15)


def test_expected_gaussian_loglik_matches_gauss_hermite() -> None:
    # The integrand is quadratic in f, so 10-point Gauss-Hermite quadrature is exact up to rounding.
    nodes, weights = np.polynomial.hermite.hermgauss(10)
    y, mean, var, noise = 0.4, -0.3, 0.7, 0.05
    f = mean + math.sqrt(2.0 * var) * nodes
    quad = (weights * scipy.stats.norm(f, math.sqrt(noise)).logpdf(y)).sum() / math.sqrt(math.pi)
    value = expected_gaussian_loglik(
        torch.tensor(y, dtype=F64), torch.tensor(mean, dtype=F64), torch.tensor(var, dtype=F64), noise
    )
    _assert_close(value, quad, rtol=1e-13)


# -------------------------------------------------------------------------------------------------------- exact GP


def test_exact_posterior_single_training_point() -> None:
    k, k_star, k_ss, y, noise = 1.3, 0.6, 1.1, 0.9, 0.2
    mean, cov = exact_posterior(
        torch.tensor([[k]], dtype=F64),
        torch.tensor([[k_star]], dtype=F64),
        torch.tensor([[k_ss]], dtype=F64),
        torch.tensor([y], dtype=F64),
        noise,
    )
    _assert_close(mean, torch.tensor([k_star / (k + noise) * y], dtype=F64), rtol=1e-15)
    _assert_close(cov, torch.tensor([[k_ss - k_star**2 / (k + noise)]], dtype=F64), rtol=1e-15)


def test_exact_log_marginal_likelihood_one_dimensional_and_diagonal() -> None:
    one = exact_log_marginal_likelihood(torch.tensor([[1.3]], dtype=F64), torch.tensor([0.8], dtype=F64), 0.2)
    _assert_close(one, -0.5 * math.log(2 * math.pi * 1.5) - 0.8**2 / (2 * 1.5), rtol=1e-15)

    gen = _gen(5)
    variances, y = 0.5 + _randn(6, gen=gen).square(), _randn(6, gen=gen)
    expected = scipy.stats.norm(0.0, np.sqrt(variances.numpy() + 0.1)).logpdf(y.numpy()).sum()
    _assert_close(exact_log_marginal_likelihood(torch.diag(variances), y, 0.1), expected, rtol=1e-13)


def test_exact_log_marginal_likelihood_matches_scipy_with_prior_mean() -> None:
    X, y = _regression_data(15, seed=6)
    K, prior_mean = _k(X, X), 0.3 * X[:, 0]
    expected = scipy.stats.multivariate_normal(prior_mean.numpy(), (K + NOISE * torch.eye(15, dtype=F64)).numpy())
    _assert_close(exact_log_marginal_likelihood(K, y, NOISE, prior_mean), expected.logpdf(y.numpy()), rtol=1e-12)


def test_exact_posterior_matches_joint_precision_conditioning() -> None:
    """Independent route: condition the joint Gaussian of (y, f_*) through the blocks of its precision matrix."""
    X, y = _regression_data(10, seed=7)
    Xs = torch.linspace(-3.5, 3.5, 6, dtype=F64).unsqueeze(-1)
    K_xx, K_xs, K_ss = _k(X, X), _k(X, Xs), _k(Xs, Xs)
    joint = torch.cat([torch.cat([K_xx + NOISE * torch.eye(10, dtype=F64), K_xs], 1), torch.cat([K_xs.mT, K_ss], 1)], 0)
    precision = torch.linalg.inv(joint)
    cov_expected = torch.linalg.inv(precision[10:, 10:])
    mean_expected = -cov_expected @ precision[10:, :10] @ y

    mean, cov = exact_posterior(K_xx, K_xs, K_ss, y, NOISE)
    _assert_close(mean, mean_expected, rtol=1e-9, atol=1e-11)
    _assert_close(cov, cov_expected, rtol=1e-9, atol=1e-11)
    _, cov_y = exact_posterior(K_xx, K_xs, K_ss, y, NOISE, include_noise=True)
    _assert_close(cov_y - cov, NOISE * torch.eye(6, dtype=F64), rtol=0.0, atol=1e-15)

    shift_x, shift_s = 0.5 * X[:, 0], 0.5 * Xs[:, 0]
    mean_shifted, cov_shifted = exact_posterior(K_xx, K_xs, K_ss, y + shift_x, NOISE, shift_x, shift_s)
    _assert_close(mean_shifted, mean + shift_s, rtol=1e-13, atol=1e-14)
    _assert_close(cov_shifted, cov, rtol=0.0, atol=0.0)


def test_exact_posterior_with_tiny_noise_interpolates() -> None:
    X, y = _regression_data(12, seed=8)
    K = _k(X, X)
    tiny = 1e-10
    mean, cov = exact_posterior(K, K, K, y, tiny)
    # The residual is sigma^2 K^{-1} y: ~1e-8 for this well-conditioned K.
    _assert_close(mean, y, rtol=0.0, atol=1e-6)
    assert float(torch.diagonal(cov).abs().max()) < 2 * tiny


# ------------------------------------------------------------------------------------------------------- sparse GP


def _sparse_problem(seed: int, n: int = 40, M: int = 7) -> dict[str, torch.Tensor]:
    gen = _gen(seed)
    X, y = _regression_data(n, seed=seed, spread=0.2)
    Z = (torch.linspace(-2.8, 2.8, M, dtype=F64) + 0.2 * _randn(M, gen=gen)).unsqueeze(-1)
    return {"K_uu": _k(Z, Z), "K_uf": _k(Z, X), "k_ff": torch.diagonal(_k(X, X)), "y": y, "X": X, "Z": Z}


def test_titsias_with_inducing_points_at_data_is_exact_gp() -> None:
    X, y = _regression_data(12, seed=9)
    Xs = torch.linspace(-3.5, 3.5, 5, dtype=F64).unsqueeze(-1)
    K, K_xs, K_ss = _k(X, X), _k(X, Xs), _k(Xs, Xs)
    k_diag = torch.diagonal(K)

    m, S = titsias_optimal_qu(K, K, y, NOISE)
    post_mean, post_cov = exact_posterior(K, K, K, y, NOISE)
    _assert_close(m, post_mean, rtol=1e-10, atol=1e-12)
    _assert_close(S, post_cov, rtol=1e-10, atol=1e-12)

    lml = exact_log_marginal_likelihood(K, y, NOISE)
    _assert_close(collapsed_bound(K, K, k_diag, y, NOISE), lml, rtol=1e-10)
    _assert_close(svgp_elbo(K, K, k_diag, y, NOISE, m, S), lml, rtol=1e-10)

    mean_s, cov_s = svgp_predictive(K, K_xs, K_ss, m, S)
    exact_mean_s, exact_cov_s = exact_posterior(K, K_xs, K_ss, y, NOISE)
    _assert_close(mean_s, exact_mean_s, rtol=1e-9, atol=1e-11)
    _assert_close(cov_s, exact_cov_s, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_svgp_elbo_at_titsias_optimum_equals_collapsed_bound(seed: int) -> None:
    p = _sparse_problem(seed)
    m, S = titsias_optimal_qu(p["K_uu"], p["K_uf"], p["y"], NOISE)
    bound = collapsed_bound(p["K_uu"], p["K_uf"], p["k_ff"], p["y"], NOISE)
    _assert_close(svgp_elbo(p["K_uu"], p["K_uf"], p["k_ff"], p["y"], NOISE, m, S), bound, rtol=1e-10)
    # Collapsed bound <= exact log marginal likelihood, strictly for M << N.
    K_ff = _k(p["X"], p["X"])
    assert float(bound) < float(exact_log_marginal_likelihood(K_ff, p["y"], NOISE)) - 1e-3


def test_collapsed_bound_below_exact_lml_for_random_inducing_inputs() -> None:
    X, y = _regression_data(30, seed=13, spread=0.2)
    gen, K_ff = _gen(13), _k(X, X)
    lml = float(exact_log_marginal_likelihood(K_ff, y, NOISE))
    for M in (1, 3, 8, 15):
        Z = 6.0 * torch.rand(M, 1, generator=gen, dtype=F64) - 3.0
        bound = collapsed_bound(_k(Z, Z) + 1e-10 * torch.eye(M, dtype=F64), _k(Z, X), torch.diagonal(K_ff), y, NOISE)
        assert float(bound) <= lml


def test_svgp_elbo_is_maximised_at_titsias_optimum() -> None:
    p = _sparse_problem(14)
    args = (p["K_uu"], p["K_uf"], p["k_ff"], p["y"], NOISE)
    m, S = titsias_optimal_qu(*args[:2], p["y"], NOISE)
    best = float(svgp_elbo(*args, m, S))
    L = torch.linalg.cholesky(S)
    gen = _gen(14)
    for scale in (1e-4, 1e-2, 0.3):
        for _ in range(10):
            L_new = L + scale * torch.tril(_randn(*L.shape, gen=gen))
            perturbed = float(svgp_elbo(*args, m + scale * _randn(*m.shape, gen=gen), L_new @ L_new.mT))
            assert perturbed < best
    # Any q is also below the exact log marginal likelihood.
    lml = float(exact_log_marginal_likelihood(_k(p["X"], p["X"]), p["y"], NOISE))
    assert best < lml


def test_svgp_elbo_gradient_vanishes_at_optimum() -> None:
    p = _sparse_problem(15)
    m_opt, S_opt = titsias_optimal_qu(p["K_uu"], p["K_uf"], p["y"], NOISE)

    def grads(m0: torch.Tensor, S0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, S = m0.clone().requires_grad_(True), S0.clone().requires_grad_(True)
        elbo = svgp_elbo(p["K_uu"], p["K_uf"], p["k_ff"], p["y"], NOISE, m, S)
        return torch.autograd.grad(elbo, (m, S))

    g_m, g_S = grads(m_opt, S_opt)
    # Observed ~1e-13 at the optimum; 1e-3 away the gradient is O(0.1-1), so the check is not vacuous.
    assert float(g_m.abs().max()) < 1e-10 and float(g_S.abs().max()) < 1e-10
    g_m_off, g_S_off = grads(m_opt + 1e-3 * _randn(7, gen=_gen(15)), S_opt + 1e-3 * torch.eye(7, dtype=F64))
    assert float(g_m_off.abs().max()) > 1e-2 and float(g_S_off.abs().max()) > 1e-2


def test_svgp_prior_q_gives_prior_marginals_and_zero_kl() -> None:
    p = _sparse_problem(16)
    mean, var = svgp_marginals(p["K_uu"], p["K_uf"], p["k_ff"], torch.zeros(7, dtype=F64), p["K_uu"])
    _assert_close(mean, torch.zeros_like(mean), rtol=0.0, atol=1e-14)
    _assert_close(var, p["k_ff"], rtol=1e-12)
    _assert_close(svgp_kl(p["K_uu"], torch.zeros(7, dtype=F64), p["K_uu"]), 0.0, rtol=0.0, atol=1e-12)


def test_svgp_marginals_are_diagonal_of_predictive_and_prior_mean_shifts() -> None:
    p = _sparse_problem(17)
    gen = _gen(17)
    m, S = _randn(7, gen=gen), _random_spd(7, gen)
    K_ff = _k(p["X"], p["X"])
    mean, var = svgp_marginals(p["K_uu"], p["K_uf"], p["k_ff"], m, S)
    full_mean, full_cov = svgp_predictive(p["K_uu"], p["K_uf"], K_ff, m, S)
    _assert_close(mean, full_mean, rtol=1e-13, atol=1e-14)
    _assert_close(var, torch.diagonal(full_cov), rtol=1e-12, atol=1e-14)

    shift = 0.7 * p["X"][:, 0]
    args = (p["K_uu"], p["K_uf"], p["k_ff"])
    elbo = svgp_elbo(*args, p["y"], NOISE, m, S)
    _assert_close(svgp_elbo(*args, p["y"] + shift, NOISE, m, S, prior_mean_f=shift), elbo, rtol=1e-13)
    bound = collapsed_bound(*args, p["y"], NOISE)
    _assert_close(collapsed_bound(*args, p["y"] + shift, NOISE, prior_mean_f=shift), bound, rtol=1e-13)


def test_whitening_round_trip_preserves_process_and_kl() -> None:
    p = _sparse_problem(18)
    gen = _gen(18)
    m, S = _randn(7, gen=gen), _random_spd(7, gen)
    m_w, S_w = whiten_qu(p["K_uu"], m, S)
    m_back, S_back = unwhiten_qu(p["K_uu"], m_w, S_w)
    _assert_close(m_back, m, rtol=1e-12, atol=1e-13)
    _assert_close(S_back, S, rtol=1e-12, atol=1e-13)
    m_w2, S_w2 = whiten_qu(p["K_uu"], *unwhiten_qu(p["K_uu"], m_w, S_w))
    _assert_close(m_w2, m_w, rtol=1e-11, atol=1e-12)
    _assert_close(S_w2, S_w, rtol=1e-11, atol=1e-12)
    # Whitened KL is against N(0, I) (spec identity R4).
    eye = torch.eye(7, dtype=F64)
    _assert_close(gaussian_kl(m_w, S_w, torch.zeros(7, dtype=F64), eye), svgp_kl(p["K_uu"], m, S), rtol=1e-11)
    # Whitening by the Cholesky factor: K_uu itself whitens to the identity.
    _assert_close(whiten_qu(p["K_uu"], m, p["K_uu"])[1], eye, rtol=0.0, atol=1e-12)


# ------------------------------------------------------------------------------------------------------ process KL


def test_process_kl_equals_gaussian_kl_full_rank() -> None:
    gen = _gen(19)
    mq, mp = _randn(3, 8, gen=gen), _randn(3, 8, gen=gen)
    Sq, Sp = _random_spd(8, gen, batch=(3,)), _random_spd(8, gen, batch=(3,))
    _assert_close(process_kl(mq, Sq, mp, Sp), gaussian_kl(mq, Sq, mp, Sp), rtol=1e-11)
    _assert_close(process_kl(mq, Sq, mq, Sq), torch.zeros(3, dtype=F64), rtol=0.0, atol=1e-13)


def _grid_sparse_kl(
    grid: torch.Tensor, z_index: torch.Tensor, seed: int, jitter: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid process KL, KL(q(u) || p(u))) for a random q(u) on Z = grid[z_index], with a non-zero prior mean."""
    gen = _gen(seed)
    K = _k(grid, grid)
    Z = grid[z_index]
    K_uu, K_ug = _k(Z, Z), _k(Z, grid)
    M = Z.shape[0]
    m, S = _randn(M, gen=gen), _random_spd(M, gen)
    prior_mean = torch.sin(grid.sum(-1))
    m_D, S_D = svgp_predictive(K_uu, K_ug, K, m, S, prior_mean_s=prior_mean)
    return process_kl(m_D, S_D, prior_mean, K, jitter=jitter), svgp_kl(K_uu, m, S)


@pytest.mark.parametrize("seed", [20, 21, 22])
def test_process_kl_of_sparse_q_equals_inducing_kl(seed: int) -> None:
    """Spec §7's dense KL: on a grid containing Z, KL[q(f_D) || p(f_D)] = KL[q(u) || p(u)] exactly."""
    grid = 3.0 * torch.rand(30, 2, generator=_gen(seed), dtype=F64)  # cond(K_DD) ~ 1e6
    z_index = torch.randperm(30, generator=_gen(seed))[:6]
    grid_kl, u_kl = _grid_sparse_kl(grid, z_index, seed, jitter=0.0)
    _assert_close(grid_kl, u_kl, rtol=1e-10)
    # The value does not depend on which non-inducing points the grid holds.
    keep = torch.cat([z_index, torch.arange(30)[~torch.isin(torch.arange(30), z_index)][:10]])
    smaller_kl, _ = _grid_sparse_kl(grid[keep], torch.arange(6), seed, jitter=0.0)
    _assert_close(smaller_kl, u_kl, rtol=1e-10)


def test_process_kl_of_sparse_q_on_nearly_singular_grid_with_jitter() -> None:
    grid = torch.linspace(0.0, 5.0, 40, dtype=F64).unsqueeze(-1)  # cond(K_DD) ~ 1e17: needs the jitter
    z_index = torch.tensor([2, 7, 13, 19, 24, 30, 37])
    grid_kl, u_kl = _grid_sparse_kl(grid, z_index, seed=23, jitter=1e-10)
    _assert_close(grid_kl, u_kl, rtol=1e-7)


def test_process_kl_on_grid_missing_inducing_points_is_smaller() -> None:
    """Data processing: dropping an inducing point from the grid can only lose KL."""
    grid = 3.0 * torch.rand(25, 2, generator=_gen(24), dtype=F64)
    Z = 3.0 * torch.rand(5, 2, generator=_gen(25), dtype=F64)
    gen = _gen(24)
    m, S = _randn(5, gen=gen), _random_spd(5, gen)
    K_uu = _k(Z, Z)
    u_kl = float(svgp_kl(K_uu, m, S))
    K = _k(grid, grid)
    m_D, S_D = svgp_predictive(K_uu, _k(Z, grid), K, m, S)
    grid_kl = float(process_kl(m_D, S_D, torch.zeros(25, dtype=F64), K))
    assert 0.0 < grid_kl < u_kl - 1e-3
