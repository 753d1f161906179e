"""Spec §7 identities the mean-basis strategies share, parametrized over the strategies, against dense float64
oracles: without mean coefficients the hybrid and orthogonal strategies are GPyTorch's SVGP (R1, R2), and the
column-sampled mean-basis quadratic form of the KL and its gradient are unbiased (K5) for the decoupled basis
(:math:`\\mathbf a^\\top\\mathbf K_\\alpha\\mathbf a`) and the orthogonal one
(:math:`\\mathbf a_\\gamma^\\top\\mathbf K_{\\gamma\\perp\\beta}\\mathbf a_\\gamma`).

Everything runs in float64 with a jitter of 1e-10 on :math:`\\mathbf K_\\beta` (the hybrid and orthogonal kinds) and
well-separated inducing points, so that the tolerances below can fail on a wrong sign, factor or transposed solve.
GPyTorch's ``VariationalELBO`` returns ELBO / N, so it is multiplied by N before any comparison (spec G2).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.float64_problems import (
    F64,
    finite_domain,
    full_batch_elbo,
    gaussian_likelihood,
    generator,
    jittered_kernel_matrix,
    kernel_matrix,
    randn,
    random_factor,
    random_spd,
    regression_problem,
)
from tests.oracles import svgp_kl
from tests.variational.mean_basis_cases import (
    MeanBasisGP,
    SVGPModel,
    set_decoupled_state,
    set_residual_state,
    set_whitened_q,
)

CONSTANT_MEAN = 0.7

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------- reduction to SVGP
@pytest.mark.parametrize("kind", ["hybrid", "orthogonal"])
@pytest.mark.parametrize("mean_basis", ["empty", "zero_coefficients"])
def test_r1_r2_without_mean_coefficients_is_gpytorch_svgp(kind: str, mean_basis: str) -> None:
    beta, gamma, X, y = regression_problem(6)
    if mean_basis == "empty":
        gamma = gamma[:0]
    model = MeanBasisGP(kind, beta, gamma, constant_mean=CONSTANT_MEAN)
    gen = generator(40)
    _, m_beta, S = randn(10, gen=gen), randn(6, gen=gen), random_spd(6, gen)
    set_residual_state(model, torch.zeros(gamma.size(0), dtype=F64), m_beta, S)
    svgp = SVGPModel(beta, constant_mean=CONSTANT_MEAN)
    svgp.variational_strategy._variational_distribution.load_state_dict(
        model.variational_strategy._variational_distribution.state_dict()
    )
    likelihood = gaussian_likelihood()
    # Train mode: the same ELBO (marginals and KL).
    torch.testing.assert_close(
        full_batch_elbo(model, likelihood, X, y), full_batch_elbo(svgp, likelihood, X, y), rtol=1e-13, atol=0
    )
    for m in (model, svgp):
        m.eval()
    X_test = X[:20]
    with torch.no_grad():
        ours, theirs = model(X_test), svgp(X_test)
        kl, svgp_kl_value = model.variational_strategy.kl_divergence(), svgp.variational_strategy.kl_divergence()
    torch.testing.assert_close(ours.mean, theirs.mean, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ours.covariance_matrix, theirs.covariance_matrix, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(kl, svgp_kl_value, rtol=1e-13, atol=0)
    torch.testing.assert_close(kl, svgp_kl(jittered_kernel_matrix(beta), m_beta, S), rtol=1e-10, atol=0)


# ------------------------------------------------------------------------------------------ column-sampled KL
def _sampled_kl_case(kind: str, domain: torch.Tensor, num_kl_columns: int, seed: int):
    """A model of ``kind`` on a finite domain with random parameters, the function of its sampled quadratic form and
    the dense value that form estimates: :math:`\\mathbf a^\\top\\mathbf K_\\alpha\\mathbf a` on 7 (decoupled) or
    :math:`\\mathbf a_\\gamma^\\top\\mathbf K_{\\gamma\\perp\\beta}\\mathbf a_\\gamma` on 6 (orthogonal) mean-basis
    points, next to 5 covariance-basis points."""
    gen = generator(seed)
    if kind == "decoupled":
        alpha, beta = domain[:7], domain[7:12]
        model = MeanBasisGP(kind, beta, alpha, num_kl_columns=num_kl_columns, exact_kl_size=0)
        a = randn(7, gen=gen)
        set_decoupled_state(model, a, random_factor(5, gen, scale=0.7))
        return model, model.variational_strategy.mean_basis_quadratic_form, a @ kernel_matrix(alpha, alpha) @ a
    beta, gamma = domain[:5], domain[5:11]
    model = MeanBasisGP(kind, beta, gamma, num_kl_columns=num_kl_columns, exact_kl_size=0, kl_control_variate=False)
    strategy = model.variational_strategy
    a_gamma = randn(6, gen=gen)
    with torch.no_grad():
        strategy.mean_coefficients.copy_(a_gamma)
    set_whitened_q(model, randn(5, gen=gen), random_spd(5, gen))
    schur = kernel_matrix(gamma, gamma) - kernel_matrix(gamma, beta) @ torch.linalg.solve(
        jittered_kernel_matrix(beta), kernel_matrix(beta, gamma)
    )
    return model, strategy.mean_quadratic_form, a_gamma @ schur @ a_gamma


@pytest.mark.parametrize("kind, num_draws", [("decoupled", 800), ("orthogonal", 3000)])
def test_k5_column_sampled_kl_is_unbiased(kind: str, num_draws: int) -> None:
    D, b = finite_domain(2), 2
    model, quadratic_form, exact = _sampled_kl_case(kind, D, b, seed=20)
    strategy = model.variational_strategy
    num_mean_points = strategy.mean_inducing_points.size(-2)
    model.eval()
    with torch.no_grad():
        exact_kl = strategy.kl_divergence()
        torch.testing.assert_close(quadratic_form(), exact, rtol=1e-12, atol=0)
        model.train()
        estimates = torch.stack(
            [quadratic_form(indices=torch.tensor(C)) for C in itertools.combinations(range(num_mean_points), b)]
        )
    # The exhaustive average over all samples of size 2 is the exact value.
    assert estimates.unique().numel() > 1
    torch.testing.assert_close(estimates.mean(), exact, rtol=1e-12, atol=1e-12)

    # Random draws of the training KL: every draw is one of the estimates (b distinct rows, scaled by M / b) plus the
    # exact rest of the KL, and the Monte-Carlo mean is within 4 standard errors.
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        draws = torch.stack([strategy.kl_divergence() for _ in range(num_draws)])
    sampled_quadratic = 2.0 * (draws - exact_kl) + exact
    distance = (sampled_quadratic.unsqueeze(-1) - estimates).abs().min(-1).values
    assert distance.max() < 1e-10 * exact.abs()
    standard_error = (estimates.var(unbiased=False) / num_draws).sqrt()
    assert (draws.mean() - exact_kl).abs() < 4.0 * standard_error / 2.0

    # In a training step the forward pass draws the sample (fused with the data's kernel row) and the KL reuses it:
    # again one of the estimates.
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for _ in range(20):
            model(D[12:20])
            step_kl = strategy.kl_divergence()
            assert strategy.kl_divergence() == step_kl
            distance = (2.0 * (step_kl - exact_kl) + exact - estimates).abs().min()
            assert distance < 1e-10 * exact.abs()


def _coefficients(model) -> torch.nn.Parameter:
    """The mean coefficients parameter: the decoupled distribution's, the strategy's otherwise."""
    strategy = model.variational_strategy
    owner = strategy._variational_distribution if hasattr(strategy, "precision_factor") else strategy
    return owner.mean_coefficients


@pytest.mark.parametrize("kind", ["decoupled", "orthogonal"])
def test_k5_column_sampled_gradient_is_unbiased(kind: str) -> None:
    D = finite_domain(3)
    if kind == "decoupled":
        alpha, beta = D[:6], D[6:11]
        model = MeanBasisGP(kind, beta, alpha, num_kl_columns=2, exact_kl_size=0)
        gen = generator(30)
        set_decoupled_state(model, randn(6, gen=gen), random_factor(5, gen, scale=0.7))
        quadratic_form = model.variational_strategy.mean_basis_quadratic_form
    else:
        model, quadratic_form, _ = _sampled_kl_case(kind, D, 2, seed=30)
    strategy = model.variational_strategy
    model.train()
    params = [_coefficients(model), model.covar_module.raw_outputscale, strategy.mean_inducing_points]

    def gradient(indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The residual coordinates are cached within a training step, so their graph is shared between the calls.
        return torch.autograd.grad(quadratic_form(indices=indices), params, retain_graph=True)

    exact = gradient(torch.arange(6))
    grads = [gradient(torch.tensor(C)) for C in itertools.combinations(range(6), 2)]
    for i, expected in enumerate(exact):
        torch.testing.assert_close(torch.stack([g[i] for g in grads]).mean(0), expected, rtol=1e-11, atol=1e-12)
