"""Spec §7 identities for :class:`DecoupledVariationalStrategy` (SVDGP), against dense float64 oracles.

Everything runs in float64 with well-separated inducing points, so that the implementation and the oracles agree to
roundoff and the tolerances below can fail on a wrong sign, factor or transposed solve. The strategy factors only
:math:`\\mathbf H = \\mathbf I + \\mathbf L_B^\\top\\mathbf K_\\beta\\mathbf L_B` and adds no jitter anywhere
(neither to :math:`\\mathbf K_\\beta` nor to the predictive diagonal), so the oracles get the plain kernel blocks.

Conventions: ``alpha`` / ``beta`` are the mean / covariance bases, ``a`` the mean coefficients and ``L_B`` the
(lower-triangular) factor of :math:`\\mathbf B = \\mathbf L_B\\mathbf L_B^\\top`; where the spec compares with ODVGP,
``alpha = [gamma; beta]``. GPyTorch's ``VariationalELBO`` returns ELBO / N, so it is multiplied by N before any
comparison (spec G2).
"""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch

from tests.float64_problems import (
    F64,
    NOISE,
    covariance_below,
    decoupled_blocks,
    eye,
    finite_domain,
    full_batch_elbo,
    gaussian_likelihood,
    generator,
    kernel_matrix,
    odvgp_blocks,
    prior_variances,
    randn,
    random_factor,
    regression_problem,
)
from tests.oracles import (
    decoupled_covariance_to_s,
    decoupled_elbo,
    decoupled_kl,
    decoupled_kl_gradients,
    decoupled_optimum,
    decoupled_predictive,
    exact_log_marginal_likelihood,
    odvgp_optimal_elbo,
    odvgp_optimum,
    process_kl,
    s_to_decoupled_precision,
    titsias_optimal_qu,
)
from tests.variational.mean_basis_cases import MeanBasisGP, SVGPModel, set_decoupled_state

CONSTANT_MEAN = 0.7


pytestmark = pytest.mark.usefixtures("single_thread")

# --------------------------------------------------------------------------------------------------------- helpers


class DecoupledModel(MeanBasisGP):
    """A float64 Decoupled GP with an SE kernel fixed at (LENGTHSCALE, OUTPUTSCALE) and the exact KL by default."""

    def __init__(self, beta: torch.Tensor, alpha: torch.Tensor, **kwargs):
        super().__init__("decoupled", beta, alpha, **kwargs)


def _odvgp_model(beta: torch.Tensor, gamma: torch.Tensor) -> MeanBasisGP:
    """The package's ODVGP with the same kernel and no jitter on ``K_beta`` (as the Decoupled strategy)."""
    return MeanBasisGP("orthogonal", beta, gamma, jitter_val=0.0)


def _q(model: DecoupledModel) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, L_B)`` as the strategy uses them (after the tril and any preconditioning)."""
    strategy = model.variational_strategy
    return strategy.mean_coefficients.detach(), strategy.precision_factor.detach()


def _optimal_elbo(gamma, beta, X, y) -> torch.Tensor:
    """ELBO* (spec eq. 5.13) with ``alpha = [gamma; beta]``."""
    return odvgp_optimal_elbo(**odvgp_blocks(gamma, beta, X), k_XX_diag=prior_variances(X.size(0)), y=y, noise=NOISE)


def _set_optimum(model: DecoupledModel, alpha, beta, X, y) -> tuple[torch.Tensor, torch.Tensor]:
    a_star, _, L_star = decoupled_optimum(**decoupled_blocks(alpha, beta, X), y=y, noise=NOISE)
    set_decoupled_state(model, a_star, L_star)
    return a_star, L_star


# ------------------------------------------------------------------------------------------- predictive and KL
@pytest.mark.parametrize("rank", [None, 2])
def test_predictive_matches_the_oracle(rank: int | None) -> None:
    # (3.1): eval mean and full covariance, and train-mode variances, at test points; alpha does not contain beta and
    # the bases overlap in two points. rank=2: a singular B.
    beta, gamma, X, _ = regression_problem(0)
    alpha = torch.cat([gamma, beta[:2]])
    model = DecoupledModel(beta, alpha, constant_mean=CONSTANT_MEAN)
    gen = generator(1)
    a, L_B = randn(12, gen=gen), random_factor(6, gen, rank=rank, scale=0.7)
    # The upper triangle of the raw parameter is never read.
    set_decoupled_state(model, a, L_B + torch.triu(randn(6, 6, gen=gen), diagonal=1))
    torch.testing.assert_close(_q(model)[1], L_B, rtol=0, atol=0)
    X_test = X[:25]
    prior_mean = torch.full((25,), CONSTANT_MEAN, dtype=F64)
    mean, cov = decoupled_predictive(
        kernel_matrix(beta, beta),
        kernel_matrix(alpha, X_test),
        kernel_matrix(beta, X_test),
        kernel_matrix(X_test, X_test),
        a,
        L_B,
        prior_mean_s=prior_mean,
    )
    model.eval()
    with torch.no_grad():
        output = model(X_test)
    torch.testing.assert_close(output.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(output.covariance_matrix, cov, rtol=1e-12, atol=1e-12)
    model.train()
    with torch.no_grad():
        output = model(X_test)
    torch.testing.assert_close(output.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(output.variance, cov.diagonal(), rtol=1e-12, atol=1e-12)
    # The strategy's q(f(beta)) is the S-form (S3): its covariance at beta is S = (K^-1 + B)^-1.
    model.eval()
    with torch.no_grad():
        at_beta = model(beta).covariance_matrix
    torch.testing.assert_close(
        at_beta, decoupled_covariance_to_s(kernel_matrix(beta, beta), L_B), rtol=1e-11, atol=1e-12
    )


@pytest.mark.parametrize("seed, rank", [(0, None), (1, 3)])
def test_k3_exact_kl_is_the_kl_of_the_predicted_process(seed: int, rank: int | None) -> None:
    D = finite_domain(seed)
    alpha, beta = D[:8], D[5:11]  # overlapping bases; the other 19 points stand for data and test inputs
    model = DecoupledModel(beta, alpha, constant_mean=CONSTANT_MEAN)
    gen = generator(10 + seed)
    a, L_B = randn(8, gen=gen), random_factor(6, gen, rank=rank, scale=0.7)
    set_decoupled_state(model, a, L_B)
    strategy = model.variational_strategy
    model.eval()
    with torch.no_grad():
        output = model(D)
        kl = strategy.kl_divergence()
    prior_mean = torch.full((30,), CONSTANT_MEAN, dtype=F64)
    expected = process_kl(output.mean, output.covariance_matrix, prior_mean, kernel_matrix(D, D))
    torch.testing.assert_close(kl, expected, rtol=1e-8, atol=0)
    torch.testing.assert_close(
        kl, decoupled_kl(kernel_matrix(alpha, alpha), kernel_matrix(beta, beta), a, L_B), rtol=1e-12, atol=0
    )
    # Train mode with num_kl_columns=None gives the same exact KL, with or without a forward pass first.
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(strategy.kl_divergence(), kl, rtol=1e-13, atol=0)
        model(D[:3])
        torch.testing.assert_close(strategy.kl_divergence(), kl, rtol=1e-13, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_b1_elbo_matches_the_oracle_and_is_below_the_log_marginal_likelihood(seed: int) -> None:
    beta, gamma, X, y = regression_problem(10 + seed)
    alpha = torch.cat([gamma, beta])
    model, likelihood = DecoupledModel(beta, alpha, constant_mean=CONSTANT_MEAN), gaussian_likelihood()
    gen = generator(60 + seed)
    a, L_B = 0.3 * randn(16, gen=gen), random_factor(6, gen, scale=0.7)
    set_decoupled_state(model, a, L_B)
    with torch.no_grad():
        elbo = full_batch_elbo(model, likelihood, X, y)
    prior_mean = torch.full((60,), CONSTANT_MEAN, dtype=F64)
    expected = decoupled_elbo(
        **decoupled_blocks(alpha, beta, X),
        k_XX_diag=prior_variances(60),
        y=y,
        noise=NOISE,
        a=a,
        L_B=L_B,
        prior_mean_f=prior_mean,
    )
    torch.testing.assert_close(elbo, expected, rtol=1e-12, atol=0)
    log_evidence = exact_log_marginal_likelihood(kernel_matrix(X, X), y - CONSTANT_MEAN, NOISE)
    assert elbo <= _optimal_elbo(gamma, beta, X, y - CONSTANT_MEAN) <= log_evidence


# ---------------------------------------------------------------------------------------------- reduction to SVGP
def test_r3_with_alpha_equal_to_beta_is_gpytorch_svgp() -> None:
    # alpha = beta, a = K^-1 m, B = S^-1 - K^-1 (S < K_beta) is GPyTorch's SVGP with unwhitened q(u) = N(m, S),
    # stored whitened as N(L^-1 m, L^-1 S L^-T).
    beta, _, X, y = regression_problem(4)
    gen = generator(5)
    K_bb = kernel_matrix(beta, beta)
    m, S = randn(6, gen=gen), covariance_below(K_bb, gen)
    model = DecoupledModel(beta, beta.clone(), constant_mean=CONSTANT_MEAN)
    set_decoupled_state(model, torch.linalg.solve(K_bb, m), torch.linalg.cholesky(s_to_decoupled_precision(K_bb, S)))
    svgp = SVGPModel(beta, constant_mean=CONSTANT_MEAN, jitter_val=0.0)
    L = torch.linalg.cholesky(K_bb)
    q_u = svgp.variational_strategy._variational_distribution
    with torch.no_grad():
        q_u.variational_mean.copy_(torch.linalg.solve_triangular(L, m.unsqueeze(-1), upper=False).squeeze(-1))
        S_w = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, S, upper=False).mT, upper=False)
        q_u.chol_variational_covar.copy_(torch.linalg.cholesky(0.5 * (S_w + S_w.mT)))
    likelihood = gaussian_likelihood()
    with torch.no_grad():
        ours, theirs = full_batch_elbo(model, likelihood, X, y), full_batch_elbo(svgp, likelihood, X, y)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=0)
    for gp in (model, svgp):
        gp.eval()
    X_test = torch.cat([X[:20], beta])
    with torch.no_grad():
        ours, theirs = model(X_test), svgp(X_test)
        kl, svgp_kl_value = model.variational_strategy.kl_divergence(), svgp.variational_strategy.kl_divergence()
    torch.testing.assert_close(ours.mean, theirs.mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.covariance_matrix, theirs.covariance_matrix, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kl, svgp_kl_value, rtol=1e-10, atol=0)
    # Both are N(m, S) at beta.
    torch.testing.assert_close(ours.mean[20:], m + CONSTANT_MEAN, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.covariance_matrix[20:, 20:], S, rtol=1e-10, atol=1e-12)


def test_r3_zero_precision_is_the_prior_covariance() -> None:
    # B = 0: s = k exactly (eval and train), and the KL is the mean term 1/2 a^T K_alpha a alone.
    beta, gamma, X, _ = regression_problem(3)
    model = DecoupledModel(beta, gamma, constant_mean=CONSTANT_MEAN)
    a = randn(10, gen=generator(6))
    set_decoupled_state(model, a, torch.zeros(6, 6, dtype=F64))
    model.eval()
    with torch.no_grad():
        output, prior = model(X), model(X, prior=True)
        kl = model.variational_strategy.kl_divergence()
    torch.testing.assert_close(output.covariance_matrix, prior.covariance_matrix, rtol=0, atol=1e-15)
    torch.testing.assert_close(output.mean, prior.mean + kernel_matrix(X, gamma) @ a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, 0.5 * a @ kernel_matrix(gamma, gamma) @ a, rtol=1e-12, atol=0)
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(X).variance, prior_variances(60), rtol=0, atol=1e-15)


# -------------------------------------------------------------------------------------------------- structural
def test_s4_variance_never_exceeds_the_prior() -> None:
    beta, gamma, _, _ = regression_problem(7)
    model = DecoupledModel(beta, gamma)
    gen = generator(7)
    X_test = torch.cat([4.4 * torch.rand(200, 2, generator=gen, dtype=F64) - 2.2, beta])
    model.eval()
    for scale in (0.1, 1.0, 30.0):  # from near the prior to a near-singular posterior at beta
        set_decoupled_state(model, randn(10, gen=gen), random_factor(6, gen, scale=scale))
        with torch.no_grad():
            cov, prior = model(X_test).covariance_matrix, model(X_test, prior=True).covariance_matrix
        reduction = prior - cov
        assert (reduction.diagonal() >= -1e-14).all()
        assert reduction.diagonal().max() > 1e-3
        # The whole reduction k_xb (B^-1 + K)^-1 k_bx is PSD, not just its diagonal.
        assert torch.linalg.eigvalsh(0.5 * (reduction + reduction.mT)).min() > -1e-12
        assert (cov.diagonal() > 0).all()


# ------------------------------------------------------------------------------------------------ KL gradients
@pytest.mark.parametrize("rank", [None, 3])
def test_g1_kl_gradients_match_cheng_and_boots(rank: int | None) -> None:
    # [CB] Prop. 2: grad_a KL = K_alpha a, grad_B KL as in spec §3.3, and grad_{L_B} = 2 grad_B L_B (lower triangle:
    # the raw parameter's upper triangle is not used). rank=3: singular B.
    D = finite_domain(4)
    alpha, beta = D[:9], D[6:12]
    model = DecoupledModel(beta, alpha)
    gen = generator(40)
    a, L_B = randn(9, gen=gen), random_factor(6, gen, rank=rank, scale=0.7)
    set_decoupled_state(model, a, L_B)
    q = model.variational_strategy._variational_distribution
    model.train()
    grad_a, grad_L = torch.autograd.grad(
        model.variational_strategy.kl_divergence(), [q.mean_coefficients, q.precision_factor]
    )
    expected_a, expected_B = decoupled_kl_gradients(
        kernel_matrix(alpha, alpha), kernel_matrix(beta, beta), a, L_B @ L_B.mT
    )
    torch.testing.assert_close(grad_a, expected_a, rtol=1e-11, atol=1e-12)
    expected_L = (2.0 * expected_B @ L_B).tril()
    assert expected_L.abs().max() > 1e-2
    torch.testing.assert_close(grad_L, expected_L, rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------------------------------------- bound and optimum
def test_b3_b4_closed_form_optimum_is_attained_and_stationary() -> None:
    beta, gamma, X, y = regression_problem(8)
    alpha = torch.cat([gamma, beta])
    model, likelihood = DecoupledModel(beta, alpha), gaussian_likelihood()
    _set_optimum(model, alpha, beta, X, y)
    elbo_star = _optimal_elbo(gamma, beta, X, y)
    q = model.variational_strategy._variational_distribution
    blocks = {"a": q.mean_coefficients, "L_B": q.precision_factor}

    elbo = full_batch_elbo(model, likelihood, X, y)
    torch.testing.assert_close(elbo.detach(), elbo_star, rtol=1e-10, atol=0)
    grads = torch.autograd.grad(elbo, list(blocks.values()))
    for name, grad in zip(blocks, grads):
        assert grad.abs().max() < 1e-6, name

    # B4: q(f(beta)) is the optimal mean m*(beta) with Titsias' covariance.
    a_odvgp, m_star, S_star = odvgp_optimum(**odvgp_blocks(gamma, beta, X), y=y, noise=NOISE)
    model.eval()
    with torch.no_grad():
        at_beta = model(beta)
    torch.testing.assert_close(at_beta.mean, m_star, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(at_beta.covariance_matrix, S_star, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(
        S_star, titsias_optimal_qu(kernel_matrix(beta, beta), kernel_matrix(beta, X), y, NOISE)[1]
    )

    # Random perturbations of each block only decrease the ELBO.
    gen = generator(70)
    for name, param in blocks.items():
        original = param.detach().clone()
        for _ in range(3):
            with torch.no_grad():
                step = 0.02 * randn(*param.shape, gen=gen)
                param.add_(step.tril() if name == "L_B" else step)
                perturbed = full_batch_elbo(model, likelihood, X, y)
                param.copy_(original)
            assert perturbed < elbo_star - 1e-9 * elbo_star.abs(), name


def test_b3_adam_approaches_the_optimum_loosely() -> None:
    # Spec B3: Decoupled is non-convex and converges only loosely; full-batch Adam from the near-prior start, with
    # hyperparameters and bases fixed, gets within 1e-2 of ELBO* and never above it.
    beta, gamma, X, y = regression_problem(8)
    alpha = torch.cat([gamma, beta])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = DecoupledModel(beta, alpha)
    likelihood = gaussian_likelihood()
    elbo_star = _optimal_elbo(gamma, beta, X, y).item()
    optimizer = torch.optim.Adam(model.variational_parameters(), lr=0.1)
    history = []
    for _ in range(150):
        optimizer.zero_grad()
        elbo = full_batch_elbo(model, likelihood, X, y)
        (-elbo / 60).backward()
        optimizer.step()
        history.append(elbo.item())
    assert all(math.isfinite(v) for v in history)
    assert abs(history[0] - elbo_star) > 0.3 * abs(elbo_star)  # it did start far away
    assert max(history) <= elbo_star + 1e-9 * abs(elbo_star)
    assert abs(history[-1] - elbo_star) < 1e-2 * abs(elbo_star), f"ELBO {history[-1]} vs ELBO* {elbo_star}"


def test_b5_optimum_is_the_odvgp_optimum() -> None:
    # alpha = [gamma; beta] at (3.3) and ODVGP at (5.10)-(5.12) are the same process: same predictive, same ELBO.
    beta, gamma, X, y = regression_problem(9)
    alpha = torch.cat([gamma, beta])
    model, likelihood = DecoupledModel(beta, alpha), gaussian_likelihood()
    _set_optimum(model, alpha, beta, X, y)
    odvgp = _odvgp_model(beta, gamma)
    a_gamma, m_beta, S = odvgp_optimum(**odvgp_blocks(gamma, beta, X), y=y, noise=NOISE)
    L = torch.linalg.cholesky(kernel_matrix(beta, beta))
    with torch.no_grad():
        odvgp.variational_strategy.mean_coefficients.copy_(a_gamma)
        q = odvgp.variational_strategy._variational_distribution
        q.variational_mean.copy_(torch.linalg.solve_triangular(L, m_beta.unsqueeze(-1), upper=False).squeeze(-1))
        S_w = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, S, upper=False).mT, upper=False)
        q.chol_variational_covar.copy_(torch.linalg.cholesky(0.5 * (S_w + S_w.mT)))
    with torch.no_grad():
        ours, theirs = full_batch_elbo(model, likelihood, X, y), full_batch_elbo(odvgp, likelihood, X, y)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=0)
    torch.testing.assert_close(ours, _optimal_elbo(gamma, beta, X, y), rtol=1e-10, atol=0)
    X_test = torch.cat([4.4 * torch.rand(30, 2, generator=generator(9), dtype=F64) - 2.2, beta])
    for gp in (model, odvgp):
        gp.eval()
    with torch.no_grad():
        ours, theirs = model(X_test), odvgp(X_test)
    torch.testing.assert_close(ours.mean, theirs.mean, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ours.covariance_matrix, theirs.covariance_matrix, rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------------------------------------- robustness
def test_duplicate_covariance_basis_points_are_harmless() -> None:
    # Two coinciding beta rows make K_beta singular, but only H = I + L_B^T K_beta L_B is factored. The process equals
    # the one on the deduplicated basis with B' = P B P^T (P adds the duplicate's row to its twin's).
    beta, gamma, X, y = regression_problem(13, m_beta=5)
    beta_dup = torch.cat([beta, beta[1:2]])
    P = torch.cat([eye(5), eye(5)[:, 1:2]], dim=1)  # (5, 6)
    gen = generator(80)
    a, L_B = randn(10, gen=gen), random_factor(6, gen, scale=0.7)
    duplicated, deduplicated = DecoupledModel(beta_dup, gamma), DecoupledModel(beta, gamma)
    B_dedup = P @ L_B @ L_B.mT @ P.mT
    set_decoupled_state(duplicated, a, L_B)
    set_decoupled_state(deduplicated, a, torch.linalg.cholesky(0.5 * (B_dedup + B_dedup.mT)))
    likelihood = gaussian_likelihood()
    elbo = full_batch_elbo(duplicated, likelihood, X, y)
    q = duplicated.variational_strategy._variational_distribution
    grads = torch.autograd.grad(elbo, [q.mean_coefficients, q.precision_factor])
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        torch.testing.assert_close(elbo, full_batch_elbo(deduplicated, likelihood, X, y), rtol=1e-11, atol=0)
        expected = decoupled_elbo(
            **decoupled_blocks(gamma, beta_dup, X), k_XX_diag=prior_variances(60), y=y, noise=NOISE, a=a, L_B=L_B
        )
        torch.testing.assert_close(elbo, expected, rtol=1e-12, atol=0)
    for gp in (duplicated, deduplicated):
        gp.eval()
    with torch.no_grad():
        ours, theirs = duplicated(X[:20]), deduplicated(X[:20])
        kl = duplicated.variational_strategy.kl_divergence()
        torch.testing.assert_close(kl, deduplicated.variational_strategy.kl_divergence(), rtol=1e-11, atol=0)
    torch.testing.assert_close(
        kl, decoupled_kl(kernel_matrix(gamma, gamma), kernel_matrix(beta_dup, beta_dup), a, L_B), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(ours.mean, theirs.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.covariance_matrix, theirs.covariance_matrix, rtol=1e-11, atol=1e-12)


class _LinearPlusSEModel(DecoupledModel):
    """SE plus a linear kernel: prior variances :math:`1.3 + 0.4\\lVert x\\rVert^2` differ between basis points."""

    def __init__(self, beta: torch.Tensor, alpha: torch.Tensor, jacobi_preconditioning: bool):
        super().__init__(beta, alpha, jacobi_preconditioning=jacobi_preconditioning)
        linear = gpytorch.kernels.LinearKernel().double()
        linear.variance = torch.tensor(0.4, dtype=F64)
        self.covar_module = self.covar_module + linear

    def dense(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """A dense kernel block from the model's own kernel."""
        with torch.no_grad():
            return self.covar_module(A, B).to_dense()


def test_jacobi_preconditioning_does_not_change_the_optimum() -> None:
    # a = diag(K_alpha)^-1 a_0, L_B = diag(K_beta)^-1 L_0 (spec §3.5, row scaling): the same processes in other
    # coordinates, so the optimum maps to a stationary point with the same ELBO*. The kernel has a non-constant
    # diagonal, so that scaling rows and columns of L_0, or by the wrong basis, would differ.
    beta, gamma, X, y = regression_problem(8)
    alpha = torch.cat([gamma, beta])
    plain = _LinearPlusSEModel(beta, alpha, jacobi_preconditioning=False)
    preconditioned = _LinearPlusSEModel(beta, alpha, jacobi_preconditioning=True)
    likelihood = gaussian_likelihood()
    d_alpha, d_beta = plain.dense(alpha, alpha).diagonal(), plain.dense(beta, beta).diagonal()
    assert d_alpha.max() - d_alpha.min() > 1.0

    # Away from the optimum: the same process for the mapped raw parameters; the raw gradients scale by 1 / diag(K).
    gen = generator(90)
    a, L_B = randn(16, gen=gen), random_factor(6, gen, scale=0.7)
    set_decoupled_state(plain, a, L_B)
    set_decoupled_state(preconditioned, d_alpha * a, d_beta.unsqueeze(-1) * L_B)
    torch.testing.assert_close(_q(preconditioned)[0], a, rtol=1e-14, atol=0)
    torch.testing.assert_close(_q(preconditioned)[1], L_B, rtol=1e-14, atol=1e-16)
    q_plain = plain.variational_strategy._variational_distribution
    q_pre = preconditioned.variational_strategy._variational_distribution
    elbo_plain = full_batch_elbo(plain, likelihood, X, y)
    elbo_pre = full_batch_elbo(preconditioned, likelihood, X, y)
    torch.testing.assert_close(elbo_pre, elbo_plain, rtol=1e-13, atol=0)
    g_plain = torch.autograd.grad(elbo_plain, [q_plain.mean_coefficients, q_plain.precision_factor])
    g_pre = torch.autograd.grad(elbo_pre, [q_pre.mean_coefficients, q_pre.precision_factor])
    torch.testing.assert_close(g_pre[0], g_plain[0] / d_alpha, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(g_pre[1], g_plain[1] / d_beta.unsqueeze(-1), rtol=1e-11, atol=1e-13)

    # At the optimum (3.3), computed from the model's own kernel blocks.
    blocks = {"K_aa": plain.dense(alpha, alpha), "K_bb": plain.dense(beta, beta)}
    blocks.update(K_aX=plain.dense(alpha, X), K_bX=plain.dense(beta, X))
    a_star, _, L_star = decoupled_optimum(**blocks, y=y, noise=NOISE)
    k_diag = plain.dense(X, X).diagonal()
    elbo_star = decoupled_elbo(**blocks, k_XX_diag=k_diag, y=y, noise=NOISE, a=a_star, L_B=L_star)
    value = odvgp_optimal_elbo(  # alpha = [gamma; beta]: ELBO* (5.13)
        K_gg=blocks["K_aa"][:10, :10],
        K_gb=blocks["K_aa"][:10, 10:],
        K_bb=blocks["K_bb"],
        K_gX=blocks["K_aX"][:10],
        K_bX=blocks["K_bX"],
        k_XX_diag=k_diag,
        y=y,
        noise=NOISE,
    )
    torch.testing.assert_close(elbo_star, value, rtol=1e-10, atol=0)
    set_decoupled_state(preconditioned, d_alpha * a_star, d_beta.unsqueeze(-1) * L_star)
    elbo = full_batch_elbo(preconditioned, likelihood, X, y)
    torch.testing.assert_close(elbo.detach(), elbo_star, rtol=1e-10, atol=0)
    for grad in torch.autograd.grad(elbo, [q_pre.mean_coefficients, q_pre.precision_factor]):
        assert grad.abs().max() < 1e-6
