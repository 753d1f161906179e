#!/usr/bin/env python3

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ._squared_distance_quadratic_form import squared_distance_quadratic_form
from .kernel_matvec import fused_block, kernel_matvec


def kernel_quadratic_form(
    covariance: Tensor | LinearOperator,  # shape: (*batch, n, m)
    left: Tensor,  # shape: (*batch, n)
    right: Tensor | None = None,  # shape: (*batch, m)
    block_size: int = 4096,
) -> Tensor:  # shape: (*batch)
    r"""
    The exact bilinear form :math:`\mathbf u^\top\mathbf K\mathbf v` (the quadratic form :math:`\mathbf u^\top\mathbf
    K\mathbf u` when ``right`` is None) of a kernel block, in :math:`O(nm)` time and memory independent of
    :math:`nm`.

    The KL divergence of every decoupled basis holds the quadratic form :math:`\mathbf a^\top\mathbf K_{\gamma}\mathbf
    a` of the mean coefficients (`Cheng and Boots (2017)`_, eq. 11; `Salimbeni et al. (2018)`_, eq. 9), an
    :math:`M_\gamma \times M_\gamma` block. When ``covariance`` is a lazy block of a kernel that
    :func:`~gpytorch_decoupled.linalg.kernel_matvec` fuses (RBF, Matérn 3/2 and 5/2, with or without a
    :class:`~gpytorch.kernels.ScaleKernel`), the block is swept in cache-sized tiles
    (:class:`~gpytorch_decoupled.linalg.settings.kernel_tile_size`) and, because the result is one number per batch
    element, its gradients with respect to the coefficients, both inputs, the length-scales and the output scale are
    reduced in the same sweep as the value: one evaluation of each tile per step, none in the backward pass. A
    quadratic form of a square block whose two inputs are equal (``kernel(gamma, gamma)``) evaluates only the tiles on
    and above the diagonal. Any other block is multiplied in row blocks of ``block_size`` rows, each checkpointed when
    autograd records (its kernel entries are evaluated again in the backward pass rather than kept).

    :param covariance: The kernel block :math:`\mathbf K`, a lazy GPyTorch kernel block, a linear operator or a
        tensor.
    :param left: :math:`\mathbf u` (batch dimensions broadcast with the block's).
    :param right: :math:`\mathbf v`; None for :math:`\mathbf v = \mathbf u`.
    :param block_size: Rows per block for blocks without a fused path.
    :return: :math:`\mathbf u^\top\mathbf K\mathbf v`.

    Example:
        >>> import gpytorch, torch
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))
        >>> gamma, a = torch.randn(2000, 3), torch.randn(2000)
        >>> value = kernel_quadratic_form(kernel(gamma, gamma), a)
        >>> dense = a @ kernel(gamma, gamma).to_dense() @ a
        >>> torch.allclose(value, dense, rtol=1e-4)
        True

    .. _Cheng and Boots (2017):
        https://arxiv.org/abs/1711.10127
    .. _Salimbeni et al. (2018):
        https://arxiv.org/abs/1809.08820
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    block = fused_block(covariance)
    # The sizes from the block's inputs where it is fused: a lazy kernel block's own size costs a walk of its kernel.
    num_rows, num_columns = (block.x1.size(-2), block.x2.size(-2)) if block is not None else covariance.shape[-2:]
    if left.dim() < 1 or left.size(-1) != num_rows:
        raise ValueError(f"left must have shape (*batch, {num_rows}), got {tuple(left.shape)}.")
    quadratic = right is None or right is left
    right = left if right is None else right
    if right.dim() < 1 or right.size(-1) != num_columns:
        raise ValueError(f"right must have shape (*batch, {num_columns}), got {tuple(right.shape)}.")
    if block is not None:
        x1, x2, lengthscale, outputscale, profile = block
        symmetric = quadratic and (x1 is x2 or (x1.shape == x2.shape and torch.equal(x1, x2)))
        return squared_distance_quadratic_form(x1, x2, left, right, lengthscale, outputscale, profile, symmetric)
    return blocked_bilinear_form(lambda start, end: covariance[..., start:end, :], left, right, block_size)


def blocked_bilinear_form(rows, left: Tensor, right: Tensor, block_size: int) -> Tensor:
    r"""
    :math:`\sum_b \mathbf u_b^\top(\mathbf K_b\mathbf v)` over row blocks :math:`\mathbf K_b` = ``rows(start, end)``
    of ``block_size`` rows, each checkpointed when there is more than one and autograd records: keeping every block
    for the backward pass would cost as much memory as the whole block.
    """
    num_rows = left.size(-1)
    use_checkpoint = torch.is_grad_enabled() and num_rows > block_size
    total = None
    # At least one (possibly empty) block, so that the result has its batch shape even without rows.
    for start in range(0, max(num_rows, 1), block_size):
        end = start + block_size
        arguments = (rows, start, end, left[..., start:end], right)
        term = checkpoint(_block_term, *arguments, use_reentrant=False) if use_checkpoint else _block_term(*arguments)
        total = term if total is None else total + term
    return total


def _block_term(rows, start: int, end: int, left: Tensor, right: Tensor) -> Tensor:
    return (left * kernel_matvec(rows(start, end), right)).sum(-1)
