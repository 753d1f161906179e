"""Shared float64 models and helpers for the tests of the three mean-basis strategies (Decoupled, Hybrid and
orthogonally decoupled), so that the identities and contract checks they have in common are written once and
parametrized over the strategies.

``kind`` names a strategy: ``"decoupled"`` (mean basis :math:`\\alpha`, inverse parametrization), ``"hybrid"`` and
``"orthogonal"`` (a whitened :math:`q(\\mathbf u_\\beta)` plus a mean basis :math:`\\gamma`).
"""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from tests.float64_problems import JITTER, fix_hyperparameters, jittered_kernel_matrix

KINDS = ("decoupled", "hybrid", "orthogonal")
RESIDUAL_STRATEGIES = {"hybrid": HybridVariationalStrategy, "orthogonal": OrthogonallyDecoupledVariationalStrategy}


def mean_basis_strategy(
    kind: str,
    model,
    beta: torch.Tensor,
    gamma: torch.Tensor,
    distribution_cls=gpytorch.variational.CholeskyVariationalDistribution,
    batch_shape: torch.Size = torch.Size([]),
    **strategy_kwargs,
):
    """The strategy of ``kind`` on the covariance basis ``beta`` and the mean basis ``gamma`` (``distribution_cls`` is
    the whitened :math:`q(\\mathbf u_\\beta)` of the hybrid and orthogonal kinds; the decoupled kind has its own)."""
    if kind == "decoupled":
        q = DecoupledVariationalDistribution(gamma.size(-2), beta.size(-2), batch_shape=batch_shape)
        return DecoupledVariationalStrategy(model, beta, q, gamma, **strategy_kwargs)
    q = distribution_cls(beta.size(-2), batch_shape=batch_shape)
    return RESIDUAL_STRATEGIES[kind](model, beta, q, gamma, **strategy_kwargs)


class MeanBasisGP(gpytorch.models.ApproximateGP):
    """A float64 GP of ``kind`` with a constant mean (``None``: zero mean), the fixed SE kernel of
    ``tests/float64_problems.py`` and the exact KL unless ``num_kl_columns`` is given. The hybrid and orthogonal kinds
    get the jitter ``JITTER`` on :math:`\\mathbf K_\\beta` (the decoupled kind factors no kernel matrix) and an
    initialized :math:`q(\\mathbf u_\\beta)`, so that what a test sets is not overwritten by the first call."""

    def __init__(
        self,
        kind: str,
        beta: torch.Tensor,
        gamma: torch.Tensor,
        constant_mean: float | None = None,
        distribution_cls=gpytorch.variational.CholeskyVariationalDistribution,
        batch_shape: torch.Size = torch.Size([]),
        num_kl_columns: int | None = None,
        **strategy_kwargs,
    ):
        if kind != "decoupled":
            strategy_kwargs = {"jitter_val": JITTER, **strategy_kwargs}
        strategy = mean_basis_strategy(
            kind, self, beta, gamma, distribution_cls, batch_shape, num_kl_columns=num_kl_columns, **strategy_kwargs
        )
        super().__init__(strategy)
        if constant_mean is None:
            self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch_shape)
        else:
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch_shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(batch_shape=batch_shape))
        fix_hyperparameters(self, constant_mean)
        if kind != "decoupled":
            self.variational_strategy.variational_params_initialized.fill_(1)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


# ------------------------------------------------------------------------------------------ the whitened block
def whiten(beta: torch.Tensor, m_beta: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m_w, S_w)`` of an unwhitened ``(m_beta, S)``, with the jittered Cholesky factor of K_beta."""
    L = torch.linalg.cholesky(jittered_kernel_matrix(beta))
    m_w = torch.linalg.solve_triangular(L, m_beta.unsqueeze(-1), upper=False).squeeze(-1)
    S_w = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, S, upper=False).mT, upper=False)
    return m_w, 0.5 * (S_w + S_w.mT)


def set_whitened_q(model, m_w: torch.Tensor, S_w: torch.Tensor) -> None:
    """Sets a Cholesky or natural whitened :math:`q(\\mathbf u_\\beta) = \\mathcal N(\\mathbf m_w, \\mathbf S_w)`."""
    q = model.variational_strategy._variational_distribution
    with torch.no_grad():
        if isinstance(q, gpytorch.variational.NaturalVariationalDistribution):
            precision = torch.linalg.inv(S_w)
            q.natural_vec.copy_(precision @ m_w)
            q.natural_mat.copy_(-0.5 * precision)
        else:
            q.variational_mean.copy_(m_w)
            q.chol_variational_covar.copy_(torch.linalg.cholesky(S_w))
    model.variational_strategy._clear_cache()


def set_residual_state(model, a_gamma: torch.Tensor, m_beta: torch.Tensor, S: torch.Tensor) -> None:
    """Sets ``a_gamma`` and the **unwhitened** ``(m_beta, S)`` on a hybrid or orthogonal model."""
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.mean_coefficients.copy_(a_gamma)
    set_whitened_q(model, *whiten(strategy.inducing_points.detach(), m_beta, S))


def residual_state(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a_gamma, m_beta, S)`` of a hybrid or orthogonal model, unwhitened with the oracle's jittered Cholesky."""
    strategy = model.variational_strategy
    L = torch.linalg.cholesky(jittered_kernel_matrix(strategy.inducing_points.detach()))
    q = strategy._variational_distribution()  # not the strategy's property: GPyTorch memoizes it until the next call
    m_beta, S = L @ q.mean.detach(), L @ q.covariance_matrix.detach() @ L.mT
    return strategy.mean_coefficients.detach().clone(), m_beta, 0.5 * (S + S.mT)


def set_decoupled_state(model, a: torch.Tensor, L_B: torch.Tensor) -> None:
    """Sets the raw parameters of a decoupled model (``L_B`` as given: only its lower triangle is read)."""
    q = model.variational_strategy._variational_distribution
    with torch.no_grad():
        q.mean_coefficients.copy_(a)
        q.precision_factor.copy_(L_B)
    model.variational_strategy._clear_cache()


# ------------------------------------------------------------------------------------------ process and caches
def eval_process(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, full covariance and (exact, eval-mode) KL of the model's process at ``x``."""
    model.eval()
    with torch.no_grad():
        output = model(x)
        return output.mean, output.covariance_matrix, model.variational_strategy.kl_divergence()


def assert_same_process(first, second, tol: float = 1e-10) -> None:
    for actual, expected in zip(first, second, strict=True):
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def cache_snapshot(model) -> dict:
    """The memoized values of every module of ``model`` and the values a strategy keeps between computations (its
    ``_step_attributes``), by module name."""
    snapshot = {}
    for name, module in model.named_modules():
        kept = {attribute: getattr(module, attribute) for attribute in getattr(module, "_step_attributes", ())}
        if hasattr(module, "_memoize_cache") or kept:
            snapshot[name] = {**getattr(module, "_memoize_cache", {}), **kept}
    return snapshot


def assert_same_caches(model, snapshot: dict) -> None:
    """Every module caches exactly the objects of ``snapshot`` (the same objects, not recomputed ones)."""
    after = cache_snapshot(model)
    assert after.keys() == snapshot.keys()
    for name, cache in snapshot.items():
        assert after[name].keys() == cache.keys(), name
        for key, value in cache.items():
            assert after[name][key] is value, (name, key)


class SVGPModel(gpytorch.models.ApproximateGP):
    """GPyTorch's whitened SVGP on ``beta`` with the kernel and mean of :class:`MeanBasisGP` (``jitter_val`` on
    :math:`\\mathbf K_\\beta`: ``JITTER`` as the hybrid and orthogonal kinds, 0 as the decoupled kind)."""

    def __init__(self, beta: torch.Tensor, constant_mean: float | None = None, jitter_val: float = JITTER):
        q_u = gpytorch.variational.CholeskyVariationalDistribution(beta.size(-2))
        super().__init__(gpytorch.variational.VariationalStrategy(self, beta, q_u, jitter_val=jitter_val))
        self.mean_module = gpytorch.means.ZeroMean() if constant_mean is None else gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        fix_hyperparameters(self, constant_mean)
        self.variational_strategy.variational_params_initialized.fill_(1)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
