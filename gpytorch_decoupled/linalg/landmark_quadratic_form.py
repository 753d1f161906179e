#!/usr/bin/env python3

from __future__ import annotations

from collections.abc import Callable

import torch
from linear_operator import to_dense
from torch import Tensor

from .cholesky import jittered_cholesky
from .kernel_matvec import kernel_matvec
from .kernel_quadratic_form import kernel_quadratic_form
from .triangular import solve_lower, solve_lower_transpose


def landmark_quadratic_form(
    kernel: Callable[[Tensor, Tensor], Tensor],
    points: Tensor,  # shape: (*batch, M, D)
    coefficients: Tensor,  # shape: (*batch, M)
    landmarks: Tensor,  # shape: (*batch, L, D)
    landmark_cholesky: Tensor | None = None,  # shape: (*batch, L, L)
    num_columns: int | None = 64,
    residual: bool = False,
    generator: torch.Generator | None = None,
    indices: Tensor | None = None,  # shape: (b,)
) -> Tensor:  # shape: (*batch)
    r"""
    Unbiased low-variance estimate (or exact value) of :math:`Q = \mathbf a^\top\mathbf K_{\gamma}\mathbf a` for a
    mean basis :math:`\gamma` with coefficients :math:`\mathbf a`, using a set of landmarks :math:`\beta` (a decoupled
    model's covariance basis) as a control variate; with ``residual=True``, of the residual form
    :math:`R = \mathbf a^\top(\mathbf K_{\gamma} - \mathbf K_{\gamma\beta}\mathbf K_\beta^{-1}\mathbf K_{\beta\gamma})
    \mathbf a`, the mean-basis term of the orthogonally decoupled KL (`Salimbeni et al. (2018)`_, eq. 9).

    With :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a` (:math:`\mathbf L_\beta` a Cholesky
    factor of :math:`\mathbf K_\beta`) and :math:`\mathbf h = \mathbf K_{\gamma\beta}\mathbf L_\beta^{-\top}\mathbf c`,
    the Nyström approximation of :math:`\mathbf K_\gamma\mathbf a`, :math:`Q = \lVert\mathbf c\rVert^2 + R` and
    :math:`R = \sum_i r_i` with :math:`r_i = a_i[\mathbf K_\gamma\mathbf a - \mathbf h]_i`. The terms of :math:`R`
    are drawn with probabilities :math:`p_i \propto \lvert a_i\rvert` (summed over the batch), :math:`b` times,
    stratified (:func:`coefficient_proportional_rows`: one draw from each of :math:`b` strata of equal probability, the
    rows ordered by their coefficient, so that every row's expected count is :math:`b p_i`),

    .. math::

        \widehat R = \frac1b\sum_{k=1}^{b} \frac{r_{i_k}}{p_{i_k}},
        \qquad \mathbb E\,\widehat R = R, \qquad \widehat Q = \lVert\mathbf c\rVert^2 + \widehat R,

    and :math:`\mathbf p` is held constant under differentiation, so that the gradients (with respect to
    :math:`\mathbf a`, both point sets and the kernel's hyperparameters) are unbiased too. Each draw costs one row of
    :math:`\mathbf K_\gamma` and of :math:`\mathbf K_{\gamma\beta}`. Against uniformly sampled rows of
    :math:`\mathbf K_\gamma` (:func:`~gpytorch_decoupled.linalg.column_sampled_quadratic_form`), the control variate
    removes the part of :math:`\mathbf a` that the landmarks represent, which in a trained orthogonally decoupled
    model is nearly all of :math:`Q` (:math:`\mathbf a` drifts along directions that :math:`\mathbf K_\gamma -
    \mathbf Q_\gamma` does not see), and the sampling by :math:`\lvert a_i\rvert` follows the heavy tail of the
    coefficients (:ref:`derivations-landmark-kl`).

    Without sampling (``num_columns=None`` or :math:`\geq M`), :math:`Q` is exact
    (:func:`~gpytorch_decoupled.linalg.kernel_quadratic_form`: :math:`O(M^2)` time, memory of one tile).

    :param kernel: ``kernel(x1, x2)`` returns the kernel block ``(*batch, len(x1), len(x2))``, dense or a lazy
        GPyTorch block (then the products are fused, :func:`~gpytorch_decoupled.linalg.kernel_matvec`).
    :param points: The mean basis :math:`\gamma`.
    :param coefficients: :math:`\mathbf a`.
    :param landmarks: The landmarks :math:`\beta`.
    :param landmark_cholesky: A lower Cholesky factor of :math:`\mathbf K_\beta` (with the jitter the caller uses);
        by default :func:`~gpytorch_decoupled.linalg.jittered_cholesky` of ``kernel(landmarks, landmarks)``. Any
        factor keeps the estimate unbiased; a good one makes it precise.
    :param num_columns: Draws :math:`b`; ``None`` for the exact value.
    :param residual: Estimate :math:`R` instead of :math:`Q`.
    :param generator: Random generator (on the device of ``points``) for the draws, so that the caller owns the
        stream and a resumed run draws the same rows.
    :param indices: Explicit draws :math:`i_1, \ldots, i_b` (with the probabilities above) instead of random ones.
    :return: :math:`\widehat Q` (or :math:`\widehat R`), exact without sampling.

    Example:
        >>> import gpytorch, torch
        >>> kernel = gpytorch.kernels.RBFKernel()
        >>> gamma, beta, a = torch.randn(2000, 2), torch.randn(50, 2), torch.randn(2000)
        >>> generator = torch.Generator().manual_seed(0)
        >>> estimate = landmark_quadratic_form(kernel, gamma, a, beta, num_columns=64, generator=generator)
        >>> exact = landmark_quadratic_form(kernel, gamma, a, beta, num_columns=None)
        >>> estimate.shape, exact.shape
        (torch.Size([]), torch.Size([]))

    .. _Salimbeni et al. (2018):
        https://arxiv.org/abs/1809.08820
    """
    if points.dim() < 2 or landmarks.dim() < 2 or points.size(-1) != landmarks.size(-1):
        raise ValueError(
            f"points and landmarks must have shapes (*batch, M, D) and (*batch, L, D), got {tuple(points.shape)} and "
            f"{tuple(landmarks.shape)}."
        )
    if coefficients.dim() < 1 or coefficients.size(-1) != points.size(-2):
        raise ValueError(f"coefficients must have shape (*batch, {points.size(-2)}), got {tuple(coefficients.shape)}.")
    if num_columns is not None and num_columns < 1:
        raise ValueError(f"num_columns must be positive, got {num_columns}.")
    num_points = points.size(-2)
    exact = indices is None and (num_columns is None or num_columns >= num_points)
    if exact and not residual:
        return kernel_quadratic_form(kernel(points, points), coefficients)
    if landmark_cholesky is None:
        landmark_cholesky = jittered_cholesky(to_dense(kernel(landmarks, landmarks)), name="landmark kernel matrix")
    if exact:
        coordinates = solve_lower(
            landmark_cholesky, kernel_matvec(kernel(landmarks, points), coefficients).unsqueeze(-1)
        )
        return kernel_quadratic_form(kernel(points, points), coefficients) - coordinates.squeeze(-1).pow(2).sum(-1)
    if indices is None:
        indices = coefficient_proportional_rows(coefficients, num_columns, generator)[0]
    elif indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64) or indices.numel() == 0:
        raise ValueError(
            f"indices must be a non-empty 1-D integer tensor, got {tuple(indices.shape)}, {indices.dtype}."
        )
    elif indices.min() < 0 or indices.max() >= num_points:
        raise ValueError(f"indices must lie in [0, {num_points}).")
    sampled = points.index_select(-2, indices)
    batch_shape = torch.broadcast_shapes(landmarks.shape[:-2], sampled.shape[:-2])
    rows = torch.cat([landmarks.expand(*batch_shape, -1, -1), sampled.expand(*batch_shape, -1, -1)], dim=-2)
    products = kernel_matvec(kernel(rows, points), coefficients)
    landmark_products, sampled_products = products.split([landmarks.size(-2), indices.numel()], dim=-1)
    coordinates = solve_lower(landmark_cholesky, landmark_products.unsqueeze(-1)).squeeze(-1)
    estimate = landmark_controlled_estimate(
        coefficients.index_select(-1, indices),
        sampled_products,
        to_dense(kernel(sampled, landmarks)),
        coordinates,
        landmark_cholesky,
        row_probabilities(coefficients).index_select(-1, indices),
    )
    return estimate if residual else estimate + coordinates.pow(2).sum(-1)


def landmark_controlled_estimate(
    coefficients: Tensor,  # shape: (*batch, b)
    row_products: Tensor,  # shape: (*batch, b)
    landmark_block: Tensor,  # shape: (*batch, b, L)
    landmark_coordinates: Tensor,  # shape: (*batch, L)
    landmark_cholesky: Tensor,  # shape: (*batch, L, L)
    probabilities: Tensor,  # shape: (b,)
) -> Tensor:  # shape: (*batch)
    r"""
    :math:`\widehat R = \frac1b\sum_k a_{i_k}\big([\mathbf K_\gamma\mathbf a]_{i_k} - [\mathbf K_{\gamma\beta}\mathbf
    L_\beta^{-\top}\mathbf c]_{i_k}\big) / p_{i_k}` of :func:`landmark_quadratic_form` from its pieces, for a caller
    that computes the rows' products with others (a strategy fuses them with the data's).

    :param coefficients: :math:`a_{i_k}` of the drawn rows.
    :param row_products: :math:`[\mathbf K_\gamma\mathbf a]_{i_k}`.
    :param landmark_block: :math:`\mathbf K_{\gamma_{i_k}\beta}`.
    :param landmark_coordinates: :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a`.
    :param landmark_cholesky: :math:`\mathbf L_\beta`.
    :param probabilities: :math:`p_{i_k}` (:func:`row_probabilities`), held constant.
    :return: :math:`\widehat R`; add :math:`\lVert\mathbf c\rVert^2` for :math:`\widehat Q`.
    """
    coordinates = landmark_coordinates.unsqueeze(-1).type(landmark_cholesky.dtype)
    weights = solve_lower_transpose(landmark_cholesky, coordinates).type(landmark_block.dtype)
    control = (landmark_block @ weights).squeeze(-1)
    terms = coefficients * (row_products - control) / probabilities.detach()
    return terms.mean(-1)


def data_landmark_residual(
    drawn_coefficients: Tensor,  # shape: (*batch, b)
    row_products: Tensor,  # shape: (*batch, b)
    row_block: Tensor,  # shape: (*batch, b, L)
    landmark_values: Tensor,  # shape: (*batch, L)
    landmark_covariance: Tensor,  # shape: (*batch, L, L)
    coordinates: Tensor,  # shape: (*batch, M_beta)
    probabilities: Tensor,  # shape: (b,)
    jitter: float | None = None,
) -> Tensor:  # shape: (*batch)
    r"""
    The estimate of :math:`R = \mathbf a^\top\mathbf K_\gamma\mathbf a - \lVert\mathbf c\rVert^2` from drawn rows
    :math:`C` with landmarks :math:`\mathbf Z` (the covariance basis :math:`\beta` and a training step's data), whose
    products :math:`\mathbf K_{\mathbf Z\gamma}\mathbf a` (``landmark_values``) a step computes anyway: with
    :math:`\mathbf c_{\mathbf Z} = \mathbf L_{\mathbf Z}^{-1}\mathbf K_{\mathbf Z\gamma}\mathbf a`,
    :math:`Q = \lVert\mathbf c_{\mathbf Z}\rVert^2 + R_{\mathbf Z}` for any factor :math:`\mathbf L_{\mathbf Z}`
    (:func:`landmark_quadratic_form`), so

    .. math::

        \widehat R = \lVert\mathbf c_{\mathbf Z}\rVert^2 - \lVert\mathbf c\rVert^2 + \widehat R_{\mathbf Z},
        \qquad \mathbb E\,\widehat R = R,

    and :math:`R_{\mathbf Z} \leq R` leaves less to sample (:ref:`derivations-landmark-kl`). The small algebra runs in
    float64 with ``jitter`` (the data may repeat points of :math:`\beta`), so that :math:`\mathbf a^\top\mathbf h =
    \lVert\mathbf c_{\mathbf Z}\rVert^2` holds to rounding; :math:`\mathbf L_{\mathbf Z}` is held constant under
    differentiation (:math:`\mathbb E\,\widehat R` does not depend on it: its gradient would add only zero-mean
    noise, at the cost of differentiating the factorization).

    :param drawn_coefficients: :math:`a_{i_k}` of the drawn rows.
    :param row_products: :math:`[\mathbf K_\gamma\mathbf a]_{i_k}`.
    :param row_block: :math:`\mathbf K_{C\mathbf Z}`, dense.
    :param landmark_values: :math:`\mathbf K_{\mathbf Z\gamma}\mathbf a`.
    :param landmark_covariance: :math:`\mathbf K_{\mathbf Z}`, dense.
    :param coordinates: :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a`.
    :param probabilities: :math:`p_{i_k}` (:func:`row_probabilities`), held constant.
    :param jitter: Initial jitter of :math:`\mathbf K_{\mathbf Z}`'s factorization (escalating where needed).
    :return: :math:`\widehat R`, in the dtype of ``drawn_coefficients``.
    """
    factor = jittered_cholesky(
        landmark_covariance.detach().double(), jitter=jitter, name="kernel matrix of the covariance basis and data"
    )
    landmark_coordinates = solve_lower(factor, landmark_values.double().unsqueeze(-1)).squeeze(-1)
    sampled_part = landmark_controlled_estimate(
        drawn_coefficients.double(),
        row_products.double(),
        row_block.double(),
        landmark_coordinates,
        factor,
        probabilities,
    )
    landmark_part = landmark_coordinates.pow(2).sum(-1) - coordinates.double().pow(2).sum(-1)
    return (landmark_part + sampled_part).type(drawn_coefficients.dtype)


def landmark_blocks(block: Tensor, num_beta: int, num_drawn: int) -> tuple[Tensor, Tensor]:
    r""":math:`\mathbf K_{\mathbf Z}` and :math:`\mathbf K_{C\mathbf Z}` (landmarks :math:`\mathbf Z = [\beta;
    \mathbf x]`) sliced from one kernel block of :math:`[\beta; C; \mathbf x]` with itself (``num_beta`` and
    ``num_drawn`` rows of :math:`\beta` and :math:`C`): every block evaluated separately would cost a gradient as large
    as all its inputs in the backward pass."""
    landmarks = torch.cat(
        [
            torch.arange(num_beta, device=block.device),
            torch.arange(num_beta + num_drawn, block.size(-1), device=block.device),
        ]
    )
    landmark_covariance = block.index_select(-2, landmarks).index_select(-1, landmarks)
    row_block = block[..., num_beta : num_beta + num_drawn, :].index_select(-1, landmarks)
    return landmark_covariance, row_block


def row_probabilities(coefficients: Tensor) -> Tensor:  # shape: (M,)
    r"""
    :math:`p_i \propto \lvert a_i\rvert` (summed over the batch dimensions, which share the draws; uniform when every
    coefficient is 0), the sampling distribution of :func:`landmark_quadratic_form`, detached.
    """
    weights = coefficients.detach().abs().reshape(-1, coefficients.size(-1)).sum(0)
    total = weights.sum()
    if not total > 0:
        return torch.full_like(weights, 1.0 / max(weights.numel(), 1))
    return weights / total


def coefficient_proportional_rows(
    coefficients: Tensor,  # shape: (*batch, M)
    num_draws: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:  # shapes: (num_draws,), (num_draws,)
    r"""
    The draws of :func:`landmark_quadratic_form`: ``num_draws`` indices of the mean basis with probabilities
    :math:`p_i \propto \lvert a_i\rvert` (summed over the batch dimensions, which share the draws; uniform when every
    coefficient is 0), stratified, and their probabilities (detached), for a caller that evaluates the drawn rows
    itself and passes them to :func:`landmark_controlled_estimate`.

    The rows are ordered by their coefficient (summed over the batch), their cumulative probabilities cut
    :math:`[0, 1)` into intervals, and draw :math:`k` is the row whose interval holds :math:`u_k = (k + U_k) / b`,
    :math:`U_k` uniform on :math:`[0, 1)` and independent: one draw from each of :math:`b` strata of equal probability.
    Every row :math:`i` is still drawn :math:`b p_i` times in expectation, so :math:`\frac1b\sum_k r_{i_k}/p_{i_k}` is
    unbiased for :math:`\sum_i r_i`, and its variance is at most that of :math:`b` independent draws (stratified
    sampling of :math:`u`): the spread between strata, rows of very different coefficients whose terms differ most, is
    gone (:ref:`derivations-landmark-kl`).

    :param coefficients: :math:`\mathbf a`.
    :param num_draws: :math:`b`.
    :param generator: Random generator on the device of ``coefficients``.
    :return: The indices and their probabilities.

    Example:
        >>> a = torch.tensor([0.0, 1.0, -3.0])
        >>> indices, probabilities = coefficient_proportional_rows(a, 100, torch.Generator().manual_seed(0))
        >>> bool((indices > 0).all())  # a row with a zero coefficient contributes nothing and is never drawn
        True
        >>> probabilities[indices == 2].unique()
        tensor([0.7500])
        >>> int((indices == 2).sum())  # stratified: exactly 75 of the 100 draws
        75
    """
    probabilities = row_probabilities(coefficients)
    order = torch.argsort(_sortable_integers(coefficients.detach().reshape(-1, coefficients.size(-1)).sum(0)))
    # Cumulative sums in float64, so that the strata of a large basis are not shifted by rounding.
    cumulative = probabilities.index_select(-1, order).double().cumsum(-1)
    strata = torch.arange(num_draws, dtype=cumulative.dtype, device=cumulative.device)
    uniforms = torch.rand(num_draws, generator=generator, dtype=cumulative.dtype, device=cumulative.device)
    points = (strata + uniforms) * (cumulative[-1] / num_draws)
    # right=True: the first row whose cumulative probability exceeds u, so that a row of probability 0 is never drawn.
    positions = torch.searchsorted(cumulative, points, right=True).clamp_max_(cumulative.numel() - 1)
    indices = order.index_select(-1, positions)
    return indices, probabilities.index_select(-1, indices)


_INTEGER_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sortable_integers(values: Tensor) -> Tensor:
    """Integers in the order of the floating-point ``values`` (their IEEE-754 bits, the magnitude bits of negative
    numbers flipped): PyTorch sorts integers by radix, about five times as fast as floats (1e5 values: 1.8 against
    9 ms on one core)."""
    bits = values.contiguous().view(_INTEGER_OF_WIDTH[values.element_size()])
    width = 8 * values.element_size()
    return bits ^ ((bits >> (width - 1)) & ((1 << (width - 1)) - 1))
