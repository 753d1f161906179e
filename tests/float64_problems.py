"""Small float64 problems shared by the oracle and strategy identity tests of the decoupled families.

One fixed squared-exponential kernel (length-scale 0.7, amplitude 1.3, noise 0.1), random parameters from seeded
generators, a finite input domain for dense process KLs, and a 2-D regression problem whose bases sit on a jittered
grid (so every kernel matrix stays well conditioned).
"""

from __future__ import annotations

import gpytorch
import numpy as np
import torch

from tests.oracles import rbf

F64 = torch.float64
LENGTHSCALE, OUTPUTSCALE, NOISE, JITTER = 0.7, 1.3, 0.1, 1e-10


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def eye(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=F64)


def random_spd(n: int, gen: torch.Generator, floor: float = 0.05) -> torch.Tensor:
    A = 0.5 * randn(n, n, gen=gen)
    return A @ A.mT + floor * eye(n)


def random_factor(n: int, gen: torch.Generator, rank: int | None = None, scale: float = 0.5) -> torch.Tensor:
    """A lower-triangular ``L_B``; with ``rank < n`` its last columns are zero, so ``B = L_B L_B^T`` is singular."""
    L = scale * torch.tril(randn(n, n, gen=gen))
    if rank is not None:
        L[:, rank:] = 0.0
    return L


def covariance_below(K: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random ``S`` with ``0 < S < K``: ``L_K U diag(lam) U^T L_K^T`` with eigenvalues ``lam`` in (0.1, 0.9)."""
    n = K.shape[-1]
    U = torch.linalg.qr(randn(n, n, gen=gen))[0]
    lam = 0.1 + 0.8 * torch.rand(n, generator=gen, dtype=F64)
    L_K = torch.linalg.cholesky(K)
    S = L_K @ U @ torch.diag(lam) @ U.mT @ L_K.mT
    return 0.5 * (S + S.mT)


def kernel_matrix(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The fixed kernel's dense matrix between two input sets."""
    return rbf(A, B, LENGTHSCALE, OUTPUTSCALE)


def jittered_kernel_matrix(beta: torch.Tensor) -> torch.Tensor:
    """The jittered :math:`\\mathbf K_\\beta` a whitened strategy factors (the oracles are given the same matrix)."""
    return kernel_matrix(beta, beta) + JITTER * eye(beta.size(-2))


def prior_variances(n: int, jitter: float = 0.0) -> torch.Tensor:
    """:math:`k(x_n, x_n)`, plus the jitter GPyTorch's whitened strategies add to the predictive diagonal."""
    return torch.full((n,), OUTPUTSCALE + jitter, dtype=F64)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor | float, rtol: float, atol: float = 0.0) -> None:
    """``torch.testing.assert_close`` against a float64 ``expected`` (a number is promoted)."""
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=rtol, atol=atol)


def finite_domain(seed: int) -> torch.Tensor:
    """30 distinct 2-D points: a perturbed 6 x 5 grid (spacing ~1, lengthscale 0.7: cond(K_DD) ~ 20)."""
    gen = generator(seed)
    grid = torch.cartesian_prod(torch.linspace(-2.5, 2.5, 6, dtype=F64), torch.linspace(-2.0, 2.0, 5, dtype=F64))
    return (grid + 0.1 * randn(30, 2, gen=gen))[torch.randperm(30, generator=gen)]


def regression_problem(seed: int, n: int = 60, m_beta: int = 6, m_gamma: int = 10):
    """``(beta, gamma, X, y)``: bases on a perturbed 4 x 4 grid (well-conditioned K_alpha), noisy 2-D data."""
    gen = generator(seed)
    grid = torch.cartesian_prod(*(2 * [torch.linspace(-2.0, 2.0, 4, dtype=F64)])) + 0.05 * randn(16, 2, gen=gen)
    grid = grid[torch.randperm(16, generator=gen)]
    X = 4.4 * torch.rand(n, 2, generator=gen, dtype=F64) - 2.2
    y = torch.sin(1.5 * X[:, 0]) + 0.5 * torch.cos(2.0 * X[:, 1]) + 0.3 * randn(n, gen=gen)
    return grid[:m_beta], grid[m_beta : m_beta + m_gamma], X, y


def three_class_blobs(seed: int, per_class: int = 30, spread: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, classes)``: three Gaussian blobs in 2-D (centres on a triangle, standard deviation ``spread``), classes
    ``0, 1, 2`` in blocks of ``per_class``."""
    centres = torch.tensor([[-1.5, -1.0], [1.5, -1.0], [0.0, 1.6]], dtype=F64)
    classes = torch.arange(3).repeat_interleave(per_class)
    return centres[classes] + spread * randn(3 * per_class, 2, gen=generator(seed)), classes


def odvgp_blocks(gamma: torch.Tensor, beta: torch.Tensor, X: torch.Tensor, jitter: float = 0.0) -> dict:
    """Keyword blocks of ``odvgp_optimum`` / ``hybrid_optimum`` / ``odvgp_optimal_elbo``, with ``jitter`` on K_beta."""
    return {
        "K_gg": kernel_matrix(gamma, gamma),
        "K_gb": kernel_matrix(gamma, beta),
        "K_bb": kernel_matrix(beta, beta) + jitter * eye(beta.size(-2)),
        "K_gX": kernel_matrix(gamma, X),
        "K_bX": kernel_matrix(beta, X),
    }


def decoupled_blocks(alpha: torch.Tensor, beta: torch.Tensor, X: torch.Tensor) -> dict:
    """Keyword blocks of ``decoupled_optimum`` / ``decoupled_elbo``."""
    return {
        "K_aa": kernel_matrix(alpha, alpha),
        "K_bb": kernel_matrix(beta, beta),
        "K_aX": kernel_matrix(alpha, X),
        "K_bX": kernel_matrix(beta, X),
    }


def full_batch_elbo(model, likelihood, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:math:`N\\times` GPyTorch's ``VariationalELBO`` in train mode (spec G2)."""
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(-2))
    return X.size(-2) * mll(model(X), y)


def fix_hyperparameters(
    model: gpytorch.Module,
    constant_mean: float | None = None,
    lengthscale: float = LENGTHSCALE,
    outputscale: float = OUTPUTSCALE,
) -> None:
    """Makes ``model`` float64 and gives its first ``ScaleKernel(RBFKernel())`` (also one inside an
    ``InducingPointKernel``) the fixed kernel (and its ``ConstantMean`` the value ``constant_mean``), set from float64
    tensors: a Python float would round through float32."""
    model.double()
    kernel = next(module for module in model.modules() if isinstance(module, gpytorch.kernels.ScaleKernel))
    kernel.base_kernel.lengthscale = torch.tensor(lengthscale, dtype=F64)
    kernel.outputscale = torch.tensor(outputscale, dtype=F64)
    if constant_mean is not None:
        model.mean_module.constant = torch.tensor(constant_mean, dtype=F64)


def gaussian_likelihood(noise: float = NOISE) -> gpytorch.likelihoods.GaussianLikelihood:
    """A float64 Gaussian likelihood with the fixed noise."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = torch.tensor(noise, dtype=F64)
    return likelihood


class ProbitBernoulliLikelihood(gpytorch.likelihoods.BernoulliLikelihood):
    """GPyTorch's Bernoulli-probit likelihood with a float64-accurate expected log-likelihood, for identity tests.

    Two things in GPyTorch cap the accuracy of ``BernoulliLikelihood.expected_log_prob`` far above float64 roundoff:
    its ``log_normal_cdf`` is an approximation (absolute error ~5e-5 at -2, ~1e-7 at -4; ``torch.special.log_ndtr``
    agrees with scipy), and its Gauss-Hermite rule is built through float32 tensors (the weights sum to sqrt(pi) only
    to ~1e-8). This subclass integrates ``log_ndtr`` with a float64 ``num_locs``-point rule, so that it agrees with the
    oracle's :func:`~tests.oracles.dual.bernoulli_expected_loglik` with the same number of points to roundoff.
    """

    def __init__(self, num_locs: int = 40):
        super().__init__()
        nodes, weights = np.polynomial.hermite.hermgauss(num_locs)
        self.quadrature.num_locs = num_locs
        self.quadrature.locations = torch.from_numpy(nodes)
        self.quadrature.weights = torch.from_numpy(weights)

    def expected_log_prob(self, observations, function_dist, *args, **kwargs):
        signs = observations.mul(2).sub(1)
        return self.quadrature(lambda f: torch.special.log_ndtr(f * signs), function_dist)


def bernoulli_likelihood(num_locs: int = 40) -> ProbitBernoulliLikelihood:
    """A float64 :class:`ProbitBernoulliLikelihood`."""
    return ProbitBernoulliLikelihood(num_locs).double()
