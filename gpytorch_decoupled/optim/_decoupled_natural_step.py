from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ..linalg import (
    add_to_diagonal,
    cholesky_solve,
    jittered_cholesky,
    positive_part_root,
    pseudo_inverse_root,
    weighted_gram,
)
from ..variational import DecoupledCurvature, DecoupledVariationalStrategy, JointPrior, joint_prior
from .online_basis_growth import zero_padded


@torch.no_grad()
def decoupled_natural_step(
    strategy: DecoupledVariationalStrategy,
    curvature: DecoupledCurvature,
    gradient: Tensor,
    lr: float | Tensor,
    covariance_lr: float,
    damping: float,
    state: dict[str, Tensor],
    prior_blocks: Callable[..., JointPrior] | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    r"""
    The new raw ``(mean_coefficients, precision_factor)`` of a decoupled strategy after one step of
    :class:`~gpytorch_decoupled.optim.MeanBasisAdam` (:ref:`derivations-decoupled-step`), and the step's new state,
    computed without changing anything.

    From the recorded :class:`~gpytorch_decoupled.variational.DecoupledCurvature` (inputs :math:`\mathbf x`, KL weight
    :math:`c`), the curvature of the data term in the marginal variances, :math:`\boldsymbol\Lambda =
    \operatorname{diag}(2\,\partial\mathcal L/\partial\mathbf s)_+`, and in the marginal means,
    :math:`\boldsymbol\Lambda_m = \boldsymbol\Lambda + \operatorname{diag}(\mathbf w_m)`; with
    :math:`\mathbf K_\beta^{+} = \mathbf X\mathbf X^\top` (the eigenvalues below the pseudo-inverse's tolerance
    dropped), :math:`\mathbf W = \mathbf X^\top\mathbf K_{\beta\alpha}` and :math:`\boldsymbol\Phi = \mathbf X^\top
    \mathbf K_{\beta\mathbf x}`:

    * the covariance block takes a natural-gradient step of size :math:`\rho_B` (``covariance_lr``) towards
      :math:`\hat{\mathbf B} = \mathbf K_\beta^{+}\mathbf K_{\beta\mathbf x}\boldsymbol\Lambda
      \mathbf K_{\mathbf x\beta}\mathbf K_\beta^{+}/c`, as a factor: :math:`\mathbf L_B \leftarrow` the triangular
      factor of :math:`[\sqrt{1-\rho_B}\,\mathbf L_B,\ \sqrt{\rho_B/c}\,\mathbf X\boldsymbol\Phi
      \boldsymbol\Lambda^{1/2}]` from a QR decomposition (nothing is squared);
    * the data's curvature for the mean enters running averages at the rate :math:`\rho_B` (bias-corrected as Adam's
      moments, zero-padded when the bases grow): :math:`\bar{\mathbf P}` of :math:`\mathbf X\boldsymbol\Phi
      \boldsymbol\Lambda_m\boldsymbol\Phi^\top\mathbf X^\top` (a precision on :math:`\beta`, like
      :math:`\mathbf B`) and :math:`\bar{\mathbf r}` of :math:`\operatorname{diag}(\mathbf K_{\alpha\mathbf x}
      \boldsymbol\Lambda_m\mathbf K_{\mathbf x\alpha} - \mathbf W^\top\boldsymbol\Phi\boldsymbol\Lambda_m
      \boldsymbol\Phi^\top\mathbf W)`, what the projection through :math:`\beta` misses on the diagonal;
    * the mean coefficients take a damped Gauss-Newton step of size :math:`\rho` (``lr``),
      :math:`\mathbf a \leftarrow \mathbf a - \rho\,(\tilde{\mathbf H} + \lambda\bar h\mathbf I)^{-1}
      \nabla_{\mathbf a}\mathcal L`, with :math:`\tilde{\mathbf H} = \mathbf E_0 + \mathbf U^\top\mathbf U`,
      :math:`\mathbf U = \mathbf R^\top\mathbf K_{\beta\alpha}`, :math:`\mathbf R` the Cholesky factor of
      :math:`c\,\mathbf X\mathbf X^\top + \bar{\mathbf P}` (its positive part's root from an eigendecomposition
      where rounding makes that fail), and :math:`\mathbf E_0 = c\operatorname{diag}(\mathbf K_\alpha -
      \mathbf W^\top\mathbf W) + \bar{\mathbf r}`: :math:`c\,\mathbf K_\alpha + \mathbf K_{\alpha\mathbf x}
      \boldsymbol\Lambda_m\mathbf K_{\mathbf x\alpha}` through :math:`\beta`, its diagonal exact. :math:`\lambda`
      is the ``damping``, times :math:`M_\alpha / b` where the KL's quadratic form was column-sampled from
      :math:`b` rows, and :math:`\bar h` the mean diagonal of :math:`\tilde{\mathbf H}`; the
      Woodbury identity solves with the :math:`M_\beta \times M_\beta` matrix :math:`\mathbf I + \mathbf U\mathbf E^{-1}
      \mathbf U^\top`, :math:`\mathbf E = \mathbf E_0 + \lambda\bar h\mathbf I`. The step size is
      :math:`\min(\rho, \mathbf d^\top\nabla_{\mathbf a}\mathcal L / \mathbf d^\top\mathbf H_m\mathbf d)` for
      the direction :math:`\mathbf d`, with :math:`\mathbf d^\top\mathbf H_m\mathbf d = \lVert
      \boldsymbol\Lambda_m^{1/2}\mathbf K_{\mathbf x\alpha}\mathbf d\rVert^2 + c\,(\lVert\mathbf W\mathbf d
      \rVert^2 + \mathbf d^\top\operatorname{diag}(\mathbf K_\alpha - \mathbf W^\top\mathbf W)\mathbf d)`: never
      past the minimum along :math:`\mathbf d` of the quadratic model with this step's data curvature (kept as
      ``step_size`` in the state);
    * where the curvature holds column-sampled KLs (rows :math:`C_k` of :math:`b`, weights :math:`c_k`), their
      part of the gradient, :math:`\sum_k c_k\,\mathbf g_{C_k}(\mathbf K_\alpha)` with
      :math:`\mathbf g_C(\mathbf M) = \tfrac{M_\alpha}{2b}(\mathbf 1_C\odot\mathbf M\mathbf a +
      \mathbf M_{\cdot C}\mathbf a_C)`, is replaced first by :math:`c\,(\tilde{\mathbf K}\mathbf a +
      \bar{\mathbf g})`: :math:`\tilde{\mathbf K} = \mathbf W^\top\mathbf W + \operatorname{diag}(\mathbf K_\alpha -
      \mathbf W^\top\mathbf W)` exact (a control variate) and :math:`\bar{\mathbf g}` the running average at the
      rate :math:`\rho` of the weighted mean of :math:`\mathbf g_{C_k}(\mathbf K_\alpha - \tilde{\mathbf K})`,
      unbiased for the rest, :math:`(\mathbf K_\alpha - \tilde{\mathbf K})\mathbf a`, at a fixed :math:`\mathbf a`
      (one evaluation of :math:`\mathbf K_{C\alpha}` per KL).

    The kernel blocks between the mean basis and :math:`[\beta; \mathbf x]` are evaluated in blocks of
    ``kl_block_size`` mean-basis points and kept for the step size; these blocks, the :math:`M_\beta \times
    M_\alpha` products (three :math:`M_\beta \times M_\beta` matrices by :math:`\mathbf K_{\beta\alpha}`) and
    :math:`\mathbf U\mathbf E^{-1}\mathbf U^\top` are in the model's dtype, their reductions and everything else
    in float64,
    :math:`O(M_\alpha (M_\beta^2 + n D))` time (the diagonal's projected
    part is :math:`\operatorname{diag}(\mathbf K_{\alpha\beta}\mathbf P\mathbf K_{\beta\alpha})` with
    :math:`\mathbf P = \mathbf X\boldsymbol\Phi\boldsymbol\Lambda_m\boldsymbol\Phi^\top\mathbf X^\top`)
    and :math:`O(M_\alpha (M_\beta + n))` memory for :math:`n` recorded data. :math:`\mathbf X` is :math:`\mathbf
    L^{-\top}` (:math:`\mathbf L` the Cholesky factor of :math:`\mathbf K_\beta`) where that provably drops no
    eigenvalue, the eigendecomposition's root otherwise; the step does not depend on which. With
    ``jacobi_preconditioning`` the step is the same in the strategy's :math:`\mathbf a` and :math:`\mathbf L_B`,
    mapped to and from the raw parameters.

    :param strategy: The decoupled strategy.
    :param curvature: Its recorded curvature.
    :param gradient: :math:`\nabla\mathcal L` of the raw ``mean_coefficients``.
    :param lr: :math:`\rho`.
    :param covariance_lr: :math:`\rho_B \in (0, 1]`.
    :param damping: :math:`\lambda > 0`.
    :param state: The previous step's state (empty at the first): ``step``, ``mean_precision``
        (:math:`\bar{\mathbf P}`) and ``residual_curvature`` (:math:`\bar{\mathbf r}`), not bias-corrected,
        ``kl_residual_gradient`` (:math:`\bar{\mathbf g}`, with a sampled KL) and the ``step_size`` taken.
    :param prior_blocks: The prior's blocks at stacked input sets, ``prior_blocks(*inputs)``, a
        :class:`~gpytorch_decoupled.variational.JointPrior` (default:
        :func:`~gpytorch_decoupled.variational.joint_prior` of the strategy's model; the lean training step passes
        :meth:`~gpytorch_decoupled.variational.JointPrior.of_kernel` of its kernel: the same values without the
        model's forward pass).
    :return: The new raw ``mean_coefficients`` and ``precision_factor``, in their dtypes, and the new state.
    """
    distribution = strategy._variational_distribution
    coefficients, factor = distribution.mean_coefficients, distribution.precision_factor
    f64 = torch.float64
    beta, inputs = strategy.inducing_points, curvature.inputs
    prior_at = functools.partial(joint_prior, strategy.model) if prior_blocks is None else prior_blocks
    prior = prior_at(beta, inputs)
    beta_covariance = prior.dense(0, 0).to(f64)
    beta_variances = beta_covariance.diagonal(dim1=-2, dim2=-1)
    weight = curvature.kl_weight.to(f64)[..., None, None]
    data_weights = curvature.variance_weights.to(f64).clamp_min(0)  # Lambda
    mean_weights = data_weights + curvature.mean_weights.to(f64)  # Lambda_m
    whitener = pseudo_inverse_root(beta_covariance, torch.finfo(coefficients.dtype).eps)  # X
    pseudo_inverse = whitener @ whitener.mT  # K_beta^+
    data_map = pseudo_inverse @ prior.dense(0, 1).to(f64)  # X Phi = K_beta^+ K_beta,x, (..., M_beta, n)
    precision_target = weighted_gram(data_map, mean_weights)  # X Phi L_m Phi^T X^T
    blocks = _mean_basis_blocks(strategy, prior_at, inputs, mean_weights)
    beta_alpha, alpha_variances, data_diagonal, data_blocks = blocks
    # The M_beta x M_alpha blocks stay in the model's dtype (see _product); their reductions are float64.
    projection = _product(whitener.mT, beta_alpha)  # W
    projected_variances = _squared_column_norms(projection)  # diag(K_ab K_b^+ K_ba)
    # What the projection through beta misses of the data's curvature on the mean basis's diagonal:
    # diag(K_ax L_m K_xa) - diag(K_ab P K_ba), P the precision target.
    data_residual = data_diagonal - (_product(precision_target, beta_alpha) * beta_alpha).sum(-2).to(f64)
    # Running averages of the data's curvature for the mean, at the covariance's rate (bias-corrected as Adam's
    # moments): in the covariance basis, as a precision like B, and on the diagonal of the mean basis.
    steps = state.get("step", torch.zeros((), dtype=f64)).to(f64) + 1
    new_state = {
        "step": steps,
        "mean_precision": torch.lerp(
            _padded(state.get("mean_precision"), precision_target), precision_target, covariance_lr
        ),
        "residual_curvature": torch.lerp(
            _padded(state.get("residual_curvature"), data_residual), data_residual, covariance_lr
        ),
    }
    bias = 1 - (1 - covariance_lr) ** steps
    data_residual = new_state["residual_curvature"] / bias

    a, gradient, L_B = coefficients.to(f64), gradient.to(f64), factor.to(f64).tril()
    if strategy.jacobi_preconditioning:  # a = a_0 / diag(K_alpha), L_B = L_0 / diag(K_beta) (row scaling)
        a, gradient, L_B = a / alpha_variances, gradient * alpha_variances, L_B / beta_variances.unsqueeze(-1)
    residual_variances = (alpha_variances - projected_variances).clamp_min(0)  # diag(K_alpha - W^T W)
    if curvature.kl_samples:  # the sampled KL's gradient: its part through beta exact, the rest averaged over steps
        gradient = gradient + _kl_gradient_correction(
            strategy, prior_at, curvature, projection, residual_variances, a, lr, state, new_state
        )
    # U^T U = K_ab (c K_b^+ + P_avg) K_ba = K_ab R R^T K_ba: M_beta rows.
    curvature_root = positive_part_root(weight * pseudo_inverse + new_state["mean_precision"] / bias)  # R
    rows = _product(curvature_root.mT, beta_alpha)  # U = R^T K_ba
    exact_diagonal = (weight[..., 0] * residual_variances + data_residual).clamp_min(0)
    # A column-sampled KL's gradient is noisier the fewer rows it draws: the damping grows with the sampling ratio.
    sampling_ratio = max([a.size(-1) / drawn.numel() for drawn, _ in curvature.kl_samples] or [1.0])
    damping = damping * sampling_ratio
    diagonal = exact_diagonal + damping * (exact_diagonal + _squared_column_norms(rows)).mean(-1, keepdim=True)  # E
    scaled_rows = rows / diagonal.unsqueeze(-2).to(rows.dtype)
    inner = (scaled_rows @ rows.mT).to(f64)
    inner = add_to_diagonal(inner, 1.0)
    inner_factor = jittered_cholesky(inner, name="MeanBasisAdam I + U E^-1 U^T")
    direction = gradient / diagonal
    solved = cholesky_solve(inner_factor, _matvec(rows, direction).unsqueeze(-1)).squeeze(-1)
    direction = direction - _matvec(scaled_rows.mT, solved)  # d = H~^-1 g
    # No step beyond the minimum along d of the quadratic model with this step's exact data curvature,
    # d^T H d = ||Lambda_m^1/2 K_xa d||^2 + c (||W d||^2 + d^T diag(K_alpha - W^T W) d), against d^T H~ d = d^T g.
    model_curvature = (mean_weights * _data_values(data_blocks, direction).pow(2)).sum(-1) + weight[..., 0, 0] * (
        _matvec(projection, direction).pow(2).sum(-1) + (residual_variances * direction.pow(2)).sum(-1)
    )
    decrease = (direction * gradient).sum(-1)
    step_size = torch.where((decrease > 0) & (lr * model_curvature > decrease), decrease / model_curvature, lr)
    new_state["step_size"] = step_size
    new_a = a - step_size.unsqueeze(-1) * direction

    target_root = data_map * (data_weights / weight[..., 0]).sqrt().unsqueeze(-2)  # X Phi (Lambda / c)^1/2
    stacked = torch.cat([(1 - covariance_lr) ** 0.5 * L_B, covariance_lr**0.5 * target_root], dim=-1)
    new_factor = torch.linalg.qr(stacked.mT, mode="r")[1].mT
    if strategy.jacobi_preconditioning:
        new_a, new_factor = new_a * alpha_variances, new_factor * beta_variances.unsqueeze(-1)
    return new_a.to(coefficients.dtype), new_factor.to(factor.dtype), new_state


def _padded(previous: Tensor | None, like: Tensor) -> Tensor:
    """A running average's previous value, zero-padded to the shape of this step's (bases grow), or zeros."""
    return torch.zeros_like(like) if previous is None else zero_padded(previous.to(like), like.shape)


def _mean_basis_blocks(
    strategy: DecoupledVariationalStrategy, prior_at: Callable[..., JointPrior], inputs: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    r""":math:`\mathbf K_{\beta\alpha}` and the blocks of :math:`\mathbf K_{\alpha\mathbf x}` in the model's dtype,
    :math:`\operatorname{diag}(\mathbf K_\alpha)` and
    :math:`\operatorname{diag}(\mathbf K_{\alpha\mathbf x}\boldsymbol\Lambda_m\mathbf K_{\mathbf x\alpha})` in
    float64, from one evaluation of the prior at :math:`[\beta; \mathbf x; \alpha_{\rm block}]` per block of
    mean-basis points (the :math:`M_\alpha \times n` block is never held whole)."""
    mean_points = strategy.mean_inducing_points
    block_size = strategy.mean_basis.kl_block_size
    f64 = torch.float64
    blocks, data_blocks = [], []
    for start in range(0, mean_points.size(-2), block_size):
        prior = prior_at(strategy.inducing_points, inputs, mean_points[start : start + block_size])
        cross = prior.dense(2, 1)
        data_blocks.append(cross)
        data_diagonal = _matvec(cross * cross, weights)
        blocks.append((prior.dense(0, 2), prior.diagonal(2).to(f64), data_diagonal))
    return *(torch.cat(parts, dim=-1) for parts in zip(*blocks, strict=True)), data_blocks


def _data_values(data_blocks: list[Tensor], coefficients: Tensor) -> Tensor:
    r""":math:`\mathbf K_{\mathbf x\alpha}\mathbf v` in float64, from the blocks of
    :math:`\mathbf K_{\alpha\mathbf x}`."""
    parts = coefficients.split([block.size(-2) for block in data_blocks], dim=-1)
    return sum(_matvec(block.mT, part) for block, part in zip(data_blocks, parts, strict=True))


def _kl_gradient_correction(
    strategy: DecoupledVariationalStrategy,
    prior_at: Callable[..., JointPrior],
    curvature: DecoupledCurvature,
    projection: Tensor,
    residual_variances: Tensor,
    a: Tensor,
    rate: float,
    state: dict[str, Tensor],
    new_state: dict[str, Tensor],
) -> Tensor:
    r"""What turns the gradient of the column-sampled KLs in ``curvature`` into :math:`c\,(\tilde{\mathbf K}\mathbf a
    + \bar{\mathbf g})`: :math:`c = \sum_k c_k` their weights, :math:`\tilde{\mathbf K} = \mathbf W^\top\mathbf W +
    \operatorname{diag}(\mathbf K_\alpha - \mathbf W^\top\mathbf W)` exact, and :math:`\bar{\mathbf g}` the running
    average at ``rate`` (kept in ``new_state``) of the sampled estimates of the rest, :math:`(\mathbf K_\alpha -
    \tilde{\mathbf K})\mathbf a`, from the rows :math:`C_k` of each KL (:func:`_sampled_residual_gradient`)."""
    mean_points, f64 = strategy.mean_inducing_points, torch.float64
    weights = [weight.to(f64).unsqueeze(-1) for _, weight in curvature.kl_samples]
    correction, residual = 0, 0
    for (rows, _), weight in zip(curvature.kl_samples, weights, strict=True):
        row_block = prior_at(mean_points[rows], mean_points).dense(0, 1)  # K_Ca
        sampled, sampled_residual = _sampled_residual_gradient(row_block, projection, residual_variances, a, rows)
        correction = correction - weight * sampled
        residual = residual + weight * sampled_residual
    total = sum(weights)
    residual = residual / total
    previous = state.get("kl_residual_gradient")
    average = residual
    if previous is not None:
        # NaN marks no average yet (the lean training step creates the entry before its first step, as a graph's
        # state must be): the first estimate is taken whole, as without an entry
        previous = _padded(previous, residual)
        average = torch.where(previous.isnan(), residual, torch.lerp(previous, residual, rate))
    new_state["kl_residual_gradient"] = average
    exact = _matvec(projection.mT, _matvec(projection, a)) + residual_variances * a  # K~ a
    return correction + total * (exact + average)


def _sampled_residual_gradient(
    row_block: Tensor, projection: Tensor, residual_variances: Tensor, a: Tensor, rows: Tensor
) -> tuple[Tensor, Tensor]:
    r"""The gradient in :math:`\mathbf a` of the column-sampled estimate of :math:`\tfrac12\mathbf a^\top
    \mathbf K_\alpha\mathbf a` from ``rows`` :math:`C` (:math:`b` of :math:`M_\alpha`; ``row_block``
    :math:`\mathbf K_{C\alpha}`), :math:`\mathbf g_C(\mathbf K_\alpha) = \tfrac{M_\alpha}{2b}(\mathbf 1_C\odot
    \mathbf K_\alpha\mathbf a + \mathbf K_{\alpha C}\mathbf a_C)`, and the same estimate of the residual's,
    :math:`\mathbf g_C(\mathbf K_\alpha - \tilde{\mathbf K})`, :math:`\tilde{\mathbf K} = \mathbf W^\top\mathbf W
    + \operatorname{diag}(\mathbf K_\alpha - \mathbf W^\top\mathbf W)`: unbiased for
    :math:`(\mathbf K_\alpha - \tilde{\mathbf K})\mathbf a` over :math:`C`, whose diagonal is zero."""
    scale = 0.5 * a.size(-1) / rows.numel()
    residual_block = row_block - projection[..., rows].mT @ projection  # rows C of K_alpha - K~
    diagonal = residual_variances[..., rows].to(residual_block.dtype)
    residual_block[..., torch.arange(rows.numel(), device=rows.device), rows] -= diagonal
    return _column_sampled_gradient(row_block, a, rows, scale), _column_sampled_gradient(residual_block, a, rows, scale)


def _column_sampled_gradient(row_block: Tensor, a: Tensor, rows: Tensor, scale: float) -> Tensor:
    r""":math:`s\,(\mathbf 1_C\odot\mathbf M\mathbf a + \mathbf M_{\cdot C}\mathbf a_C)` for a symmetric
    :math:`\mathbf M` of which ``row_block`` holds the rows :math:`C`."""
    gradient = _matvec(row_block.mT, a[..., rows])
    gradient[..., rows] += _matvec(row_block, a)
    return scale * gradient


def _product(left: Tensor, block: Tensor) -> Tensor:
    r"""``left @ block`` (a float64 :math:`M_\beta \times M_\beta` matrix, a kernel block of the model's dtype) in
    the block's dtype. The step's :math:`M_\beta \times M_\alpha` blocks and their products, its costliest
    arithmetic and memory, stay in the model's dtype, and what is reduced from them (column norms, products with
    vectors, :math:`\mathbf U\mathbf E^{-1}\mathbf U^\top`) is taken to float64: for a float32 model their rounding
    perturbs the preconditioner :math:`\tilde{\mathbf H}`, the diagonal estimates, the sampled KL's control variate
    and the step size's curvature by about :math:`10^{-7}` relative, which changes neither the direction's descent
    nor the bound; with float64 models everything is float64."""
    return left.to(block.dtype) @ block


def _matvec(matrix: Tensor, vector: Tensor) -> Tensor:
    """``matrix @ vector`` in the matrix's dtype, returned in float64."""
    return (matrix @ vector.to(matrix.dtype).unsqueeze(-1)).squeeze(-1).to(torch.float64)


def _squared_column_norms(matrix: Tensor) -> Tensor:
    """The squared Euclidean norms of a matrix's columns, in float64."""
    return (matrix * matrix).sum(-2).to(torch.float64)
