r"""
The training-mode terms of each supported strategy as plain tensor operations: for a mini-batch :math:`\mathbf x`, the
marginals :math:`q(f_n) = \mathcal N(\mu_n, \sigma_n^2)` and the KL term, with the values and gradients of the
strategy's own training forward pass and ``kl_divergence()`` (tested to :math:`10^{-12}` in float64). One function per
strategy type, found by exact type in :data:`STRATEGY_TERMS`; a subclass (which may change the forward pass) is not
matched and keeps the general path.

Every function takes the strategy, the :class:`~gpytorch_decoupled.linalg.LeanKernel` and prior mean of its model,
the inputs and this step's random draws (made eagerly, before the compiled region, by the second function of its
entry in :data:`STRATEGY_TERMS`, from the same generator calls as the strategy's own training pass; none for the
strategies here), and returns ``(mean, variance, kl, statistics)``: ``statistics`` is what an update of the step
needs of the forward pass besides the loss (t-SVGP's E-step: :class:`~gpytorch_decoupled.variational.
DualSiteStatistics`), or None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy
from torch import Tensor

from ..linalg import LeanKernel, jittered_cholesky, kernel_keep_size, solve_lower, whitened_kl
from ..variational import (
    DualSiteStatistics,
    DualVariationalStrategy,
    FastNaturalVariationalDistribution,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from ..variational.dual_variational_strategy import whitened_posterior_factors, whitened_u_space_sites

MeanFunction = Callable[[Tensor], Tensor]


def whitened_moments(distribution) -> tuple[Tensor, Tensor, Tensor] | None:
    r"""
    :math:`\mathbf m`, dense :math:`\mathbf S` and :math:`\log\lvert\mathbf S\rvert` of a whitened
    :math:`q(\mathbf u)` of a supported type, or None: a
    :class:`~gpytorch_decoupled.variational.FastNaturalVariationalDistribution` or
    :class:`~gpytorch.variational.CholeskyVariationalDistribution` without batch shape.
    """
    if type(distribution) is FastNaturalVariationalDistribution and distribution.natural_vec.dim() == 1:
        return distribution.moments()
    if type(distribution) is CholeskyVariationalDistribution and distribution.variational_mean.dim() == 1:
        factor = distribution.chol_variational_covar.tril()
        logdet = 2.0 * factor.diagonal().abs().log().sum()
        return distribution.variational_mean, factor @ factor.mT, logdet
    return None


def _standard_normal_kl(mean: Tensor, covariance: Tensor, logdet: Tensor) -> Tensor:
    r""":math:`\mathrm{KL}[\mathcal N(\mathbf m, \mathbf S) \Vert \mathcal N(\mathbf 0, \mathbf I)]`."""
    trace = covariance.diagonal(dim1=-2, dim2=-1).sum(-1)
    return 0.5 * (trace + mean.pow(2).sum(-1) - mean.size(-1) - logdet)


def _whitened_block(
    strategy, kernel: LeanKernel, x: Tensor, data_cross: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    r"""
    GPyTorch's whitened SVGP block: the factor :math:`\mathbf L` of :math:`\mathbf K_{\mathbf{uu}} + \epsilon\mathbf I`
    (float64, escalating jitter), :math:`\mathbf W = \mathbf L^{-1}\mathbf K_{\mathbf u\mathbf x}`, the marginal
    variances :math:`k(\mathbf x_n, \mathbf x_n) + \epsilon + \mathbf w_n^\top(\mathbf S - \mathbf I)\mathbf w_n` and
    :math:`q(\mathbf u)`'s moments.
    """
    z = strategy.inducing_points
    moments = whitened_moments(strategy._variational_distribution)
    jitter = strategy.jitter_val
    prior = kernel(z, z)
    prior = prior + jitter * torch.eye(z.size(-2), dtype=z.dtype, device=z.device)
    factor = jittered_cholesky(prior, name="K_uu")
    cross = kernel(z, x) if data_cross is None else data_cross
    interp = solve_lower(factor, cross)
    mean, covariance, _ = moments
    middle = covariance - torch.eye(z.size(-2), dtype=z.dtype, device=z.device)
    variance = kernel.diagonal(x) + jitter + (interp * (middle @ interp)).sum(-2)
    return factor, interp, variance, moments


def _svgp_terms(strategy, kernel: LeanKernel, prior_mean: MeanFunction, x: Tensor, draws: Tensor | None):
    _, interp, variance, moments = _whitened_block(strategy, kernel, x)
    mean = prior_mean(x) + interp.mT @ moments[0]
    return mean, variance, _standard_normal_kl(*moments), None


def _residual_mean_terms(strategy, kernel: LeanKernel, prior_mean: MeanFunction, x: Tensor, draws: Tensor | None):
    r"""
    The hybrid and orthogonally decoupled strategies: the whitened SVGP block on :math:`\beta` plus the mean basis
    :math:`\mathbf K_{\cdot\gamma}\mathbf a_\gamma` at :math:`[\beta; \mathbf x]` from one kernel block, the residual
    coordinates :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma` and the exact
    :math:`\mathbf a_\gamma^\top\mathbf K_\gamma\mathbf a_\gamma` (Salimbeni et al. 2018, eqs. 11-12, App. A), swept in
    tiles as the general path does (:meth:`~gpytorch_decoupled.linalg.LeanKernel.quadratic_form`): the training KL
    of a mean basis of at most ``exact_kl_size`` points (larger bases, whose KL is a control-variate estimate, keep
    the general path).
    """
    basis = strategy.mean_basis
    gamma, coefficients = basis.inducing_points, basis.coefficients
    beta = strategy.inducing_points
    values = kernel(torch.cat([beta, x], dim=-2), gamma) @ coefficients
    beta_values, data_values = values.split([beta.size(-2), x.size(-2)], dim=-1)
    quadratic_form = kernel.quadratic_form(gamma, coefficients)
    factor, interp, variance, moments = _whitened_block(strategy, kernel, x)
    coordinates = torch.linalg.solve_triangular(factor, beta_values.unsqueeze(-1), upper=False).squeeze(-1)
    kl = _standard_normal_kl(*moments)
    if type(strategy) is OrthogonallyDecoupledVariationalStrategy:
        block_mean = moments[0] - coordinates
        kl = kl + 0.5 * (quadratic_form - coordinates.pow(2).sum(-1))
    else:
        block_mean = moments[0]
        kl = kl + (moments[0] * coordinates).sum(-1) + 0.5 * quadratic_form
    mean = prior_mean(x) + interp.mT @ block_mean + data_values
    return mean, variance, kl, None


def _dual_terms(strategy, kernel: LeanKernel, prior_mean: MeanFunction, x: Tensor, draws: Tensor | None):
    r"""
    t-SVGP's training pass (:class:`~gpytorch_decoupled.variational.DualVariationalStrategy`, u-space sites): from
    one kernel block :math:`k(\mathbf Z, [\mathbf Z; \mathbf x])`, the factors of :math:`q` at the current
    hyperparameters (:math:`\mathbf L_K`, :math:`\mathbf H = \mathbf I + \mathbf L_K^\top\mathbf L_2\mathbf L_K`,
    :math:`\mathbf H^{-1}\mathbf h`), the marginals :math:`\mu_0 + \mathbf W^\top\mathbf H^{-1}\mathbf h` and
    :math:`k(\mathbf x_n, \mathbf x_n) - \lVert\mathbf w_n\rVert^2 + \lVert\mathbf L_H^{-1}\mathbf w_n\rVert^2`
    with :math:`\mathbf W = \mathbf L_K^{-1}\mathbf K_{\mathbf u\mathbf x}`, and the KL (Adam et al. 2021, App. C,
    eqs. 49, 51), by the strategy's own functions; the statistics are the E-step's (the strategy keeps the same ones
    from its training pass for :class:`~gpytorch_decoupled.optim.DualEStep`).
    """
    z = strategy.inducing_points
    size = z.size(-2)
    rows = kernel(z, torch.cat([z, x], dim=-2))
    prior = rows[..., :size] + strategy.jitter_val * torch.eye(size, dtype=z.dtype, device=z.device)
    prior_chol = jittered_cholesky(prior, name="DualVariationalStrategy K_uu")
    sites = strategy._variational_distribution()
    factors = whitened_posterior_factors(prior_chol, *whitened_u_space_sites(prior_chol, *sites))
    whitened_cross = solve_lower(prior_chol, rows[..., size:])
    reduced_cross = solve_lower(factors.inner_cholesky, whitened_cross)
    centred_mean = (whitened_cross * factors.whitened_mean.unsqueeze(-1)).sum(-2)
    variance = kernel.diagonal(x) - whitened_cross.pow(2).sum(-2) + reduced_cross.pow(2).sum(-2)
    mean_at_x = prior_mean(x)
    statistics = DualSiteStatistics(mean_at_x, centred_mean, variance, whitened_cross, factors)
    return mean_at_x + centred_mean, variance, whitened_kl(factors.inner_cholesky, factors.whitened_mean), statistics


def _supports_svgp(strategy) -> str | None:
    if strategy.inducing_points.dim() != 2:
        return "the inducing points have a batch shape"
    if not strategy.updated_strategy.item():
        return "the strategy was loaded from a checkpoint of GPyTorch < 1.4 and is not whitened yet"
    if whitened_moments(strategy._variational_distribution) is None:
        name = type(strategy._variational_distribution).__name__
        return f"{name} (supported: FastNaturalVariationalDistribution, CholeskyVariationalDistribution)"
    return None


def _supports_residual_mean(strategy) -> str | None:
    if strategy.inducing_points.dim() != 2:
        return "the inducing points have a batch shape"
    if whitened_moments(strategy._variational_distribution) is None:
        name = type(strategy._variational_distribution).__name__
        return f"{name} (supported: FastNaturalVariationalDistribution, CholeskyVariationalDistribution)"
    basis = strategy.mean_basis
    size = basis.inducing_points.size(-2)
    training = basis.training
    basis.train()  # the question is about training steps
    exact = basis.exact_quadratic_form()
    basis.train(training)
    if not exact:
        return (
            f"the mean basis (M={size}) is larger than exact_kl_size, so its training KL is a control-variate estimate "
            "from rows drawn by |a| (not on the lean path yet)"
        )
    # The lean path forms the block of the rows beta (and the batch) by the basis densely; the KL is swept in tiles.
    if (size + strategy.inducing_points.size(-2)) * size > kernel_keep_size.value():
        return (
            f"the mean basis (M={size}) is larger than the lean path forms as one kernel block (its rows beta and the "
            "batch by the basis, within kernel_keep_size); the general path's tiled products keep memory bounded"
        )
    return None


def _supports_dual(strategy) -> str | None:
    if strategy.inducing_points.dim() != 2 or strategy._variational_distribution.batch_shape != torch.Size([]):
        return "the inducing points or the sites have a batch shape"
    if strategy._variational_distribution.per_datum:
        return "per-datum sites (datum_inputs): their E-step updates only the batch's sites"
    return None


# strategy type -> (why it is unsupported or None, the step's random draws, the terms)
STRATEGY_TERMS: dict[type, tuple[Callable, Callable, Callable]] = {
    VariationalStrategy: (_supports_svgp, lambda strategy: None, _svgp_terms),
    OrthogonallyDecoupledVariationalStrategy: (_supports_residual_mean, lambda strategy: None, _residual_mean_terms),
    HybridVariationalStrategy: (_supports_residual_mean, lambda strategy: None, _residual_mean_terms),
    DualVariationalStrategy: (_supports_dual, lambda strategy: None, _dual_terms),
}
