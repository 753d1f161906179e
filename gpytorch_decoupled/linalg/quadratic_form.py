#!/usr/bin/env python3

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .kernel_matvec import fused_block
from .kernel_quadratic_form import blocked_bilinear_form, kernel_quadratic_form


def column_sampled_quadratic_form(
    kernel: Callable[[Tensor, Tensor], Tensor],
    gamma: Tensor,  # shape: (*batch, M_gamma, D)
    v_gamma: Tensor,  # shape: (*batch, M_gamma)
    beta: Tensor | None = None,  # shape: (*batch, M_beta, D)
    v_beta: Tensor | None = None,  # shape: (*batch, M_beta)
    num_columns: int | None = None,
    generator: torch.Generator | None = None,
    indices: Tensor | None = None,  # shape: (b,)
    block_size: int = 4096,
) -> Tensor:  # shape: (*batch)
    r"""
    Unbiased estimate (or exact value) of the quadratic form

    .. math::

        Q = \mathbf v^\top \mathbf K_{\alpha \alpha} \mathbf v,
        \qquad
        \alpha = \begin{bmatrix} \gamma \\ \beta \end{bmatrix},
        \quad
        \mathbf v = \begin{bmatrix} \mathbf v_\gamma \\ \mathbf v_\beta \end{bmatrix},

    that never forms an :math:`M_\gamma \times M_\gamma` matrix (`Salimbeni et al. (2018)`_, App. A.3). A set
    :math:`C \subset \{1, \ldots, M_\gamma\}` of :math:`b` rows of :math:`\gamma` is drawn uniformly without
    replacement, and

    .. math::

        \widehat Q = \frac{M_\gamma}{b} \sum_{i \in C} v_{\gamma, i} \, [\mathbf K_{\gamma_i \alpha} \mathbf v]
        + \mathbf v_\beta^\top \mathbf K_{\beta \alpha} \mathbf v,
        \qquad
        \mathbb E_C \widehat Q = Q.

    :math:`\widehat Q` is linear in the inclusion indicators of :math:`C`, so its gradient (with respect to
    :math:`\mathbf v`, the inputs and the kernel hyperparameters) is unbiased too. With ``beta=None`` all of
    :math:`\alpha = \gamma` is sampled, as in the Decoupled model of `Cheng and Boots (2017)`_.

    **Cost.** :math:`O(b (M_\gamma + M_\beta) + M_\beta (M_\gamma + M_\beta))` kernel evaluations. Without
    sampling (``num_columns=None`` or :math:`\geq M_\gamma`) :math:`Q` is computed exactly with
    :math:`O((M_\gamma + M_\beta)^2)` evaluations. In both modes the rows are processed in blocks of
    :attr:`block_size`, so memory is :math:`O(\texttt{block\_size} \cdot (M_\gamma + M_\beta))`; when there is more
    than one block and autograd is recording, each block is checkpointed (its kernel block is recomputed in the
    backward pass), because keeping every block for backward would cost as much memory as the full matrix.

    Batch dimensions broadcast: :attr:`v_gamma` and :attr:`v_beta` may carry leading dimensions for several
    independent latents that share the bases (all latents then share the sample :math:`C`), and :attr:`kernel`
    may return batched matrices. The result has the broadcast batch shape.

    :param kernel: ``kernel(x1, x2)`` returns the kernel matrix of shape ``(*batch, len(x1), len(x2))``, dense or a
        GPyTorch lazy kernel block such as ``covar_module(x1, x2)``, whose products with :math:`\mathbf v` are then
        fused (:func:`~gpytorch_decoupled.linalg.kernel_matvec`).
    :param gamma: Inputs :math:`\gamma` whose rows are sampled.
    :param v_gamma: Coefficients :math:`\mathbf v_\gamma`.
    :param beta: Inputs :math:`\beta` that are always summed exactly (optional).
    :param v_beta: Coefficients :math:`\mathbf v_\beta`; given exactly when :attr:`beta` is.
    :param num_columns: Sample size :math:`b`. ``None`` or :math:`\geq M_\gamma` computes :math:`Q` exactly.
    :param generator: Random generator on the device of :attr:`gamma` used to draw :math:`C`.
    :param indices: An explicit sample :math:`C` (distinct indices into :math:`\gamma`), e.g. for reproducibility
        across processes. Replaces the random draw; :attr:`num_columns`, if given, must equal its length.
    :param block_size: Number of rows of :math:`\alpha` whose kernel block is evaluated at once.
    :return: :math:`\widehat Q` (or :math:`Q`).

    Example:
        >>> alpha = torch.randn(1000, 2)
        >>> a = torch.randn(1000)
        >>> rbf = lambda x1, x2: torch.exp(-0.5 * torch.cdist(x1, x2).pow(2))
        >>> exact = column_sampled_quadratic_form(rbf, alpha, a, block_size=256)
        >>> estimate = column_sampled_quadratic_form(rbf, alpha, a, num_columns=64)
        >>> exact.shape, estimate.shape
        (torch.Size([]), torch.Size([]))

    .. _Salimbeni et al. (2018):
        https://arxiv.org/abs/1809.08820
    .. _Cheng and Boots (2017):
        https://arxiv.org/abs/1711.10127
    """
    if (beta is None) != (v_beta is None):
        raise ValueError("beta and v_beta must be given together.")
    _check_basis(gamma, v_gamma, "gamma")
    if beta is not None:
        _check_basis(beta, v_beta, "beta")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    if num_columns is not None and num_columns < 1:
        raise ValueError(f"num_columns must be positive, got {num_columns}.")

    m_gamma = gamma.shape[-2]
    if indices is not None:
        _check_indices(indices, m_gamma, num_columns)
    elif num_columns is not None and num_columns < m_gamma:
        indices = torch.randperm(m_gamma, generator=generator, device=gamma.device)[:num_columns]

    columns, v = (gamma, v_gamma) if beta is None else (_cat(gamma, beta, -2), _cat(v_gamma, v_beta, -1))
    if indices is None:
        rows, u = columns, v
    else:
        rows = gamma.index_select(-2, indices)
        u = (m_gamma / indices.numel()) * v_gamma.index_select(-1, indices)
        if beta is not None:
            rows, u = _cat(rows, beta, -2), _cat(u, v_beta, -1)
    return _bilinear_form(kernel, rows, u, columns, v, block_size)


def _check_basis(x: Tensor, v: Tensor, name: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (*batch, M, D), got {tuple(x.shape)}.")
    if v.dim() < 1 or v.shape[-1] != x.shape[-2]:
        raise ValueError(f"v_{name} must have shape (*batch, {x.shape[-2]}) to match {name}, got {tuple(v.shape)}.")


def _check_indices(indices: Tensor, m_gamma: int, num_columns: int | None) -> None:
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be a 1-D integer tensor, got shape {tuple(indices.shape)}, {indices.dtype}.")
    if indices.numel() == 0 and m_gamma > 0:
        raise ValueError("indices must not be empty.")
    if num_columns is not None and num_columns != indices.numel():
        raise ValueError(f"num_columns={num_columns} does not match the {indices.numel()} given indices.")
    # A repeated or out-of-range index would silently bias the estimate.
    if indices.numel() > 0 and (indices.min() < 0 or indices.max() >= m_gamma):
        raise ValueError(f"indices must lie in [0, {m_gamma}).")
    if torch.unique(indices).numel() != indices.numel():
        raise ValueError("indices must be distinct (the sample is drawn without replacement).")


def _cat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    batch = torch.broadcast_shapes(a.shape[:dim], b.shape[:dim])
    return torch.cat([a.expand(*batch, *a.shape[dim:]), b.expand(*batch, *b.shape[dim:])], dim)


def _bilinear_form(
    kernel: Callable[[Tensor, Tensor], Tensor],
    rows: Tensor,  # shape: (*batch, R, D)
    u: Tensor,  # shape: (*batch, R)
    columns: Tensor,  # shape: (*batch, C, D)
    v: Tensor,  # shape: (*batch, C)
    block_size: int,
) -> Tensor:  # shape: (*batch)
    # A block of no rows tells whether the kernel has a fused path; only then is the whole (lazy) block requested,
    # since a kernel that evaluates eagerly would allocate all of it.
    if fused_block(kernel(rows[..., :0, :], columns)) is not None:
        quadratic = rows is columns and u is v
        return kernel_quadratic_form(kernel(rows, columns), u, None if quadratic else v)
    return blocked_bilinear_form(lambda start, end: kernel(rows[..., start:end, :], columns), u, v, block_size)
