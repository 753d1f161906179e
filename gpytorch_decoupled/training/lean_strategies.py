r"""
The training-mode terms of each supported strategy as plain tensor operations: for a mini-batch :math:`\mathbf x`, the
marginals :math:`q(f_n) = \mathcal N(\mu_n, \sigma_n^2)` and the KL term, with the values and gradients of the
strategy's own training forward pass and ``kl_divergence()`` (tested to :math:`10^{-12}` in float64). One function per
strategy type, found by exact type in :data:`STRATEGY_TERMS`; a subclass (which may change the forward pass) is not
matched and keeps the general path.

Every function takes the strategy, the :class:`~gpytorch_decoupled.linalg.LeanKernel` and prior mean of its model,
the inputs and this step's random draws (made eagerly, before the compiled region, by the second function of its
entry in :data:`STRATEGY_TERMS`, from the same generator calls as the strategy's own training pass: the rows of an
estimated KL of a mean basis, or None), and returns ``(mean, variance, kl, statistics)``: ``statistics`` is what an
update of the step needs of the forward pass besides the loss (t-SVGP's E-step:
:class:`~gpytorch_decoupled.variational.DualSiteStatistics`; the decoupled strategy's curvature step:
:class:`DecoupledTerms`), or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy
from torch import Tensor

from ..linalg import (
    LeanKernel,
    add_to_diagonal,
    data_landmark_residual,
    jittered_cholesky,
    landmark_blocks,
    landmark_controlled_estimate,
    solve_lower,
    whitened_kl,
)
from ..variational import (
    DecoupledVariationalStrategy,
    DualSiteStatistics,
    DualVariationalStrategy,
    FastNaturalVariationalDistribution,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from ..variational.dual_variational_strategy import whitened_posterior_factors, whitened_u_space_sites

MeanFunction = Callable[[Tensor], Tensor]


class DecoupledTerms(NamedTuple):
    r"""The training terms of a :class:`~gpytorch_decoupled.variational.DecoupledVariationalStrategy` whose
    derivatives :class:`~gpytorch_decoupled.optim.MeanBasisAdam`'s curvature step reads (what the strategy's hooks
    record in an eager backward pass, :class:`~gpytorch_decoupled.variational.DecoupledCurvature`): the lean step
    differentiates the loss by them beside the parameters."""

    inputs: Tensor  # x, (N, D)
    mean: Tensor  # the marginal means at x, (N,)
    variance: Tensor  # the marginal variances at x, (N,)
    kl: Tensor  # the KL divergence, ()
    kl_rows: Tensor | None  # the rows of K_alpha of the KL's column-sampled quadratic form, or None (exact)


class WhitenedQ(NamedTuple):
    r"""
    A whitened :math:`q(\mathbf u) = \mathcal N(\mathbf m, \mathbf S)` as the lean path uses it: :math:`\mathbf S`
    either dense (natural distributions, whose map to the moments inverts the precision anyway) or by its lower
    triangular root :math:`\mathbf R` with :math:`\mathbf S = \mathbf R\mathbf R^\top` (Cholesky distributions:
    :math:`\mathbf S` is never formed, which saves an :math:`M^3` product forward and two backward per step).
    """

    mean: Tensor
    covariance: Tensor | None
    root: Tensor | None
    logdet: Tensor

    def trace(self) -> Tensor:
        r""":math:`\operatorname{tr}\mathbf S`."""
        if self.root is not None:
            return self.root.pow(2).sum((-2, -1))
        return self.covariance.diagonal(dim1=-2, dim2=-1).sum(-1)

    def excess_variances(self, interp: Tensor) -> Tensor:
        r""":math:`\mathbf w_n^\top(\mathbf S - \mathbf I)\mathbf w_n` for the columns :math:`\mathbf w_n` of
        ``interp``: :math:`\lVert\mathbf R^\top\mathbf w_n\rVert^2 - \lVert\mathbf w_n\rVert^2` from the root."""
        if self.root is not None:
            return (self.root.mT @ interp).pow(2).sum(-2) - interp.pow(2).sum(-2)
        return (interp * (add_to_diagonal(self.covariance, -1.0) @ interp)).sum(-2)

    def kl(self) -> Tensor:
        r""":math:`\mathrm{KL}[\mathcal N(\mathbf m, \mathbf S) \Vert \mathcal N(\mathbf 0, \mathbf I)]`."""
        return 0.5 * (self.trace() + self.mean.pow(2).sum(-1) - self.mean.size(-1) - self.logdet)


def supports_whitened_q(distribution) -> bool:
    r"""Whether the lean path computes :math:`q(\mathbf u)` of ``distribution`` (:func:`whitened_q`): a
    :class:`~gpytorch_decoupled.variational.FastNaturalVariationalDistribution` or a
    :class:`~gpytorch.variational.CholeskyVariationalDistribution`, without batch shape."""
    if type(distribution) is FastNaturalVariationalDistribution:
        return distribution.natural_vec.dim() == 1
    return type(distribution) is CholeskyVariationalDistribution and distribution.variational_mean.dim() == 1


def whitened_q(distribution) -> WhitenedQ:
    r"""The whitened :math:`q(\mathbf u)` of a supported distribution (:func:`supports_whitened_q`): dense
    :math:`\mathbf S` from a natural distribution, the lower triangle of a Cholesky distribution's factor as the
    root."""
    if type(distribution) is FastNaturalVariationalDistribution:
        mean, covariance, logdet = distribution.moments()
        return WhitenedQ(mean, covariance, None, logdet)
    root = distribution.chol_variational_covar.tril()
    logdet = 2.0 * root.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
    return WhitenedQ(distribution.variational_mean, None, root, logdet)


def _inducing_block(strategy, kernel: LeanKernel, x: Tensor) -> tuple[Tensor, Tensor]:
    r"""The factor :math:`\mathbf L` of :math:`\mathbf K_{\mathbf{uu}} + \epsilon\mathbf I` (float64, escalating
    jitter) and :math:`\mathbf W = \mathbf L^{-1}\mathbf K_{\mathbf u\mathbf x}`, as GPyTorch's strategies factor
    them."""
    z = strategy.inducing_points
    factor = jittered_cholesky(add_to_diagonal(kernel(z, z), strategy.jitter_val), name="K_uu")
    return factor, solve_lower(factor, kernel(z, x))


def _whitened_block(strategy, kernel: LeanKernel, x: Tensor) -> tuple[Tensor, Tensor, Tensor, WhitenedQ]:
    r"""
    GPyTorch's whitened SVGP block: :func:`_inducing_block`'s :math:`\mathbf L` and :math:`\mathbf W`, the marginal
    variances :math:`k(\mathbf x_n, \mathbf x_n) + \epsilon + \mathbf w_n^\top(\mathbf S - \mathbf I)\mathbf w_n` and
    :math:`q(\mathbf u)`.
    """
    q = whitened_q(strategy._variational_distribution)
    factor, interp = _inducing_block(strategy, kernel, x)
    variance = kernel.diagonal(x) + strategy.jitter_val + q.excess_variances(interp)
    return factor, interp, variance, q


def svgp_terms(strategy, kernel: LeanKernel, prior_mean: MeanFunction, x: Tensor, draws: Tensor | None):
    r"""GPyTorch's whitened SVGP (:class:`~gpytorch.variational.VariationalStrategy`): the marginals
    :math:`\mu_0(\mathbf x) + \mathbf W^\top\mathbf m` and variances of :func:`_whitened_block`, and
    :math:`\mathrm{KL}[q(\mathbf u)\Vert\mathcal N(\mathbf 0, \mathbf I)]`. Batch-generic: a kernel returning
    ``(C, ...)`` blocks and a distribution with batch shape ``(C,)`` give ``(C, N)`` marginals and ``(C,)`` KLs (the
    candidates of :class:`~gpytorch_decoupled.models.KernelSelectionGP`)."""
    _, interp, variance, q = _whitened_block(strategy, kernel, x)
    mean = prior_mean(x) + (q.mean.unsqueeze(-2) @ interp).squeeze(-2)
    return mean, variance, q.kl(), None


def unwhitened_svgp_terms(strategy, kernel: LeanKernel, prior_mean: MeanFunction, x: Tensor, draws: None):
    r"""
    GPyTorch's unwhitened SVGP (:class:`~gpytorch.variational.UnwhitenedVariationalStrategy` of a
    :class:`~gpytorch.variational.CholeskyVariationalDistribution`, :math:`q(\mathbf u) = \mathcal N(\mathbf m,
    \mathbf R\mathbf R^\top)` in the function's coordinates) in training mode: with :math:`\mathbf L` the factor of
    :math:`\mathbf K_{\mathbf{uu}} + \epsilon\mathbf I`, :math:`\boldsymbol\delta = \mathbf m - \mu_0(\mathbf Z)`,
    :math:`\mathbf W = \mathbf L^{-1}\mathbf K_{\mathbf u\mathbf x}` and :math:`[\mathbf d, \mathbf V] =
    \mathbf L^{-1}[\boldsymbol\delta, \mathbf R]`, the marginals :math:`\mu_0(\mathbf x_n) + \mathbf d^\top
    \mathbf w_n` and :math:`\lVert\mathbf V^\top\mathbf w_n\rVert^2 + \max(0, k(\mathbf x_n, \mathbf x_n) -
    \lVert\mathbf w_n\rVert^2)` (no jitter on the data's variance, as GPyTorch), and
    :math:`\mathrm{KL} = \tfrac12(\log\lvert\mathbf L\mathbf L^\top\rvert - \log\lvert\mathbf R\mathbf R^\top
    \rvert + \lVert[\mathbf d, \mathbf V]\rVert_F^2 - M)`. Batch-generic as :func:`svgp_terms`. GPyTorch returns
    :math:`q(\mathbf u)` itself for a batch equal to the inducing points; this function does not check for it.
    """
    z = strategy.inducing_points
    # the Cholesky distribution's mean, root and log-determinant, here in the function's coordinates
    q = whitened_q(strategy._variational_distribution)
    factor, interp = _inducing_block(strategy, kernel, x)
    difference = q.mean - prior_mean(z)
    coordinates = solve_lower(factor, torch.cat([difference.unsqueeze(-1), q.root], dim=-1))
    products = coordinates.mT @ interp
    mean = prior_mean(x) + products[..., 0, :]
    data_variance = (kernel.diagonal(x) - interp.pow(2).sum(-2)).clamp(0, math.inf)
    variance = products[..., 1:, :].pow(2).sum(-2) + data_variance
    logdet_prior = 2.0 * factor.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    kl = 0.5 * (logdet_prior - q.logdet + coordinates.pow(2).sum((-2, -1)) - z.size(-2))
    return mean, variance, kl, None


def _residual_mean_terms(strategy, kernel: LeanKernel, prior_mean: MeanFunction, x: Tensor, draws: tuple | None):
    r"""
    The hybrid and orthogonally decoupled strategies: the whitened SVGP block on :math:`\beta` plus the mean basis
    :math:`\mathbf K_{\cdot\gamma}\mathbf a_\gamma` at :math:`[\beta; \mathbf x]` from one kernel product, the
    residual coordinates :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma` and
    :math:`\mathbf a_\gamma^\top\mathbf K_\gamma\mathbf a_\gamma` (Salimbeni et al. 2018, eqs. 11-12, App. A): exact
    for a mean basis of at most ``exact_kl_size`` points, swept in tiles as the general path does
    (:meth:`~gpytorch_decoupled.linalg.LeanKernel.quadratic_form`); for a larger one, the strategy's own estimate from
    this step's drawn rows :math:`C` (``draws``: indices and probabilities, from :func:`_mean_basis_draws`), their
    values in the same product as :math:`[\beta; \mathbf x]`'s: with the control variate, :math:`\beta` and the batch
    as landmarks (:func:`~gpytorch_decoupled.linalg.data_landmark_residual`) or, with ``kl_data_landmarks=False``,
    :math:`\beta` alone (:func:`~gpytorch_decoupled.linalg.landmark_controlled_estimate`), else the column-sampled
    estimate.
    """
    basis = strategy.mean_basis
    gamma, coefficients = basis.inducing_points, basis.coefficients
    beta = strategy.inducing_points
    drawn = None if draws is None else gamma[draws[0]]
    rows = [beta, x] if drawn is None else [beta, drawn, x]
    stacked = torch.cat(rows, dim=-2)
    values = kernel.matvec(stacked, gamma, coefficients)
    beta_values, *row_values, data_values = values.split([row.size(-2) for row in rows], dim=-1)
    factor, interp, variance, q = _whitened_block(strategy, kernel, x)
    coordinates = torch.linalg.solve_triangular(factor, beta_values.unsqueeze(-1), upper=False).squeeze(-1)
    if draws is None:
        quadratic_form = kernel.quadratic_form(gamma, coefficients)
        residual = quadratic_form - coordinates.pow(2).sum(-1)
    elif basis.importance_sampling and not strategy.kl_data_landmarks:  # beta alone as landmarks
        indices, probabilities = draws
        residual = landmark_controlled_estimate(
            coefficients[..., indices], row_values[0], kernel(drawn, beta), coordinates, factor, probabilities
        )
        quadratic_form = coordinates.pow(2).sum(-1) + residual
    elif basis.importance_sampling:  # R = a^T K a - ||c||^2, with beta and the batch as landmarks
        indices, probabilities = draws
        landmark_covariance, row_block = landmark_blocks(kernel(stacked, stacked), beta.size(-2), indices.numel())
        residual = data_landmark_residual(
            coefficients[..., indices],
            row_values[0],
            row_block,
            torch.cat([beta_values, data_values], -1),
            landmark_covariance,
            coordinates,
            probabilities,
            strategy.jitter_val,
        )
        quadratic_form = coordinates.pow(2).sum(-1) + residual
    else:  # the column-sampled estimate of a^T K a
        quadratic_form = basis.column_sampled_estimate(coefficients, draws[0], row_values[0])
        residual = quadratic_form - coordinates.pow(2).sum(-1)
    if type(strategy) is OrthogonallyDecoupledVariationalStrategy:
        block_mean = q.mean - coordinates
        kl = q.kl() + 0.5 * residual
    else:
        block_mean = q.mean
        kl = q.kl() + (q.mean * coordinates).sum(-1) + 0.5 * quadratic_form
    mean = prior_mean(x) + interp.mT @ block_mean + data_values
    return mean, variance, kl, None


def _mean_basis_draws(strategy) -> tuple[Tensor, Tensor | None] | None:
    """This step's rows of a strategy's estimated mean-basis KL and their probabilities (None for the uniform draw; None
    instead of both where the KL is exact), drawn by the mean basis as the strategy's training pass draws them (the
    same generator calls)."""
    basis = strategy.mean_basis
    return basis.draw_rows(basis.coefficients)


def _decoupled_terms(strategy, kernel: LeanKernel, prior_mean: MeanFunction, x: Tensor, draws: tuple | None):
    r"""
    The decoupled strategy's training pass (Cheng & Boots 2017, App. B): :math:`\mathbf a` and :math:`\mathbf L_B`
    (Jacobi-scaled where the strategy is), the float64 factor :math:`\mathbf R` of :math:`\mathbf H = \mathbf I +
    \mathbf L_B^\top\mathbf K_\beta\mathbf L_B`, the marginals :math:`\mu_0 + \mathbf K_{\mathbf x\alpha}\mathbf a`
    (swept in tiles) and :math:`k(\mathbf x_n, \mathbf x_n) - \lVert\mathbf v_n\rVert^2`, :math:`\mathbf V =
    \mathbf R^{-1}\mathbf L_B^\top\mathbf K_{\beta\mathbf x}`, and the KL :math:`\tfrac12\mathbf a^\top\mathbf
    K_\alpha\mathbf a + \tfrac12[\log\lvert\mathbf H\rvert + \operatorname{tr}\mathbf H^{-1} - M_\beta]`, its
    quadratic form swept exactly over the tiles of the upper triangle (a mean basis of at most ``exact_kl_size``
    points) or, for a larger one, estimated without bias from this step's rows :math:`C` of :math:`\mathbf K_\alpha`
    (``draws``, :math:`b` of them drawn uniformly by :func:`_mean_basis_draws`) as
    :math:`\tfrac{M_\alpha}{b}\mathbf a_C^\top\mathbf K_{C\alpha}\mathbf a`, whose values come out of the same
    product as the data's, :math:`\mathbf K_{[C;\mathbf x]\alpha}\mathbf a`; the terms themselves are the statistics
    (:class:`DecoupledTerms`).
    """
    beta, alpha = strategy.inducing_points, strategy.mean_inducing_points
    coefficients, factor = strategy._variational_distribution()
    if strategy.jacobi_preconditioning:
        coefficients = coefficients / kernel.diagonal(alpha)
        factor = factor / kernel.diagonal(beta).unsqueeze(-1)
    beta_covariance = kernel(beta, beta)
    inner = factor.double().mT @ beta_covariance.double() @ factor.double()
    chol = jittered_cholesky(
        add_to_diagonal(inner, 1.0), jitter=strategy._jitter_val, name="DecoupledVariationalStrategy H"
    )
    reduction = solve_lower(chol.to(x.dtype), factor.mT @ kernel(beta, x))
    if draws is None:
        data_values = kernel.matvec(x, alpha, coefficients)
        quadratic_form = kernel.quadratic_form(alpha, coefficients)
    else:  # the drawn rows and the data in one product, as the strategy's own training pass computes them
        indices = draws[0]
        values = kernel.matvec(torch.cat([alpha[indices], x], dim=-2), alpha, coefficients)
        row_values, data_values = values.split([indices.numel(), x.size(-2)], dim=-1)
        quadratic_form = strategy.mean_basis.column_sampled_estimate(coefficients, indices, row_values)
    mean = prior_mean(x) + data_values
    variance = kernel.diagonal(x) - reduction.pow(2).sum(-2)
    kl = 0.5 * quadratic_form + whitened_kl(chol).to(x.dtype)
    return mean, variance, kl, DecoupledTerms(x, mean, variance, kl, None if draws is None else draws[0])


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
    prior = add_to_diagonal(rows[..., :size], strategy.jitter_val)
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
    if not supports_whitened_q(strategy._variational_distribution):
        name = type(strategy._variational_distribution).__name__
        return f"{name} (supported: FastNaturalVariationalDistribution, CholeskyVariationalDistribution)"
    return None


def _supports_residual_mean(strategy) -> str | None:
    if strategy.inducing_points.dim() != 2:
        return "the inducing points have a batch shape"
    if not supports_whitened_q(strategy._variational_distribution):
        name = type(strategy._variational_distribution).__name__
        return f"{name} (supported: FastNaturalVariationalDistribution, CholeskyVariationalDistribution)"
    # Run eagerly, the lean path sweeps its products in tiles as the general path does; compiled, it forms the block
    # of beta, the drawn rows and the batch by the basis densely.
    return None


def _supports_decoupled(strategy) -> str | None:
    if strategy.inducing_points.dim() != 2 or strategy._variational_distribution.precision_factor.dim() != 2:
        return "the inducing points or the variational parameters have a batch shape"
    basis = strategy.mean_basis
    if basis.importance_sampling:
        return "a mean basis whose KL rows are drawn by |a| (importance_sampling)"
    return None


def _supports_dual(strategy) -> str | None:
    if strategy.inducing_points.dim() != 2 or strategy._variational_distribution.batch_shape != torch.Size([]):
        return "the inducing points or the sites have a batch shape"
    if strategy._variational_distribution.per_datum:
        return "per-datum sites (datum_inputs): their E-step updates only the batch's sites"
    return None


# strategy type -> (why it is unsupported or None, the step's random draws, the terms)
STRATEGY_TERMS: dict[type, tuple[Callable, Callable, Callable]] = {
    VariationalStrategy: (_supports_svgp, lambda strategy: None, svgp_terms),
    OrthogonallyDecoupledVariationalStrategy: (_supports_residual_mean, _mean_basis_draws, _residual_mean_terms),
    HybridVariationalStrategy: (_supports_residual_mean, _mean_basis_draws, _residual_mean_terms),
    DualVariationalStrategy: (_supports_dual, lambda strategy: None, _dual_terms),
    DecoupledVariationalStrategy: (_supports_decoupled, _mean_basis_draws, _decoupled_terms),
}
