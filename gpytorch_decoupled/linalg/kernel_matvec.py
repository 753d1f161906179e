#!/usr/bin/env python3

from __future__ import annotations

from typing import NamedTuple

from gpytorch.kernels import Kernel, MaternKernel, RBFKernel, ScaleKernel
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import LinearOperator
from torch import Tensor

from ._squared_distance_kernel_matvec import squared_distance_kernel_matvec


def kernel_matvec(
    covariance: Tensor | LinearOperator,  # shape: (*batch, n, m)
    vector: Tensor,  # shape: (*batch, m)
) -> Tensor:  # shape: (*batch, n)
    r"""
    :math:`\mathbf K\mathbf a` for a kernel block :math:`\mathbf K`, fused and tiled when GPyTorch has not evaluated
    it yet.

    The mean basis of every decoupled strategy costs one product :math:`\mathbf K_{\mathbf x\gamma}\mathbf a_\gamma`
    per step, with :math:`M_\gamma` columns, and autograd through a GPyTorch kernel makes it the dominant cost: every
    intermediate of the kernel (distances, scaling, the exponential, the outer product :math:`\mathbf g\mathbf a^\top`
    of the backward pass) is an :math:`n \times M_\gamma` array in memory, and at large :math:`M_\gamma` the step runs
    at the speed of memory, not of arithmetic. When ``covariance`` is GPyTorch's lazy kernel block (what
    ``kernel(x1, x2)`` or ``model.forward(x).lazy_covariance_matrix`` returns, sliced) of an
    :class:`~gpytorch.kernels.RBFKernel` or a :class:`~gpytorch.kernels.MaternKernel` with :math:`\nu \in
    \{3/2, 5/2\}`, optionally inside a :class:`~gpytorch.kernels.ScaleKernel`, with any length-scale shape and batch
    shape, the block is never held whole: it is swept in tiles of
    :class:`~gpytorch_decoupled.linalg.settings.kernel_tile_size` entries, each one computed from a matrix product of
    augmented inputs, passed through the kernel's profile and multiplied by its slice of :math:`\mathbf a` in place,
    while it is in cache. The backward pass evaluates the tiles again and reduces them with the identity

    .. math::

        \nabla_{\mathbf X}\,\mathbf g^\top\mathbf F\mathbf a = 2\operatorname{diag}(\mathbf g)
        \big(\operatorname{diag}(\mathbf F'\mathbf a)\mathbf X - \mathbf F'\operatorname{diag}(\mathbf a)\mathbf Z
        \big)

    (and its transpose for :math:`\mathbf Z`), so that it needs two thin products per tile and no :math:`n \times
    M_\gamma` gradient matrix; gradients reach the inputs, the coefficients, the length-scales and the output scale.
    Memory is :math:`O((n + M_\gamma) d)` plus one tile. Values and gradients equal the dense product's to rounding.
    Every other block (other kernels, sums and products of kernels, already evaluated tensors, GPyTorch's
    ``lazily_evaluate_kernels(False)``) goes through ``covariance.to_dense() @ vector``. The block's inputs are the
    ones the kernel's ``forward`` would receive (``active_dims`` already applied), so the fused product follows
    GPyTorch's semantics exactly.

    :param covariance: The kernel block, a tensor or a linear operator.
    :param vector: Coefficients :math:`\mathbf a` (batch dimensions broadcast with the block's).
    :return: :math:`\mathbf K\mathbf a`.

    Example:
        >>> import gpytorch, torch
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2))
        >>> x, z, a = torch.randn(5, 2), torch.randn(300, 2), torch.randn(300)
        >>> fused = kernel_matvec(kernel(x, z), a)
        >>> torch.allclose(fused, kernel(x, z).to_dense() @ a, atol=1e-5)
        True
    """
    fused = _fused_kernel_matvec(covariance, vector)
    if fused is not None:
        return fused
    if isinstance(covariance, LinearOperator):
        covariance = covariance.to_dense()
    return (covariance @ vector.unsqueeze(-1)).squeeze(-1)


class FusedBlock(NamedTuple):
    """What the fused kernel products need of a lazy kernel block: its inputs, hyperparameters and profile."""

    x1: Tensor
    x2: Tensor
    lengthscale: Tensor
    outputscale: Tensor | None
    profile: str


def fused_block(covariance: Tensor | LinearOperator) -> FusedBlock | None:
    """The fused form of ``covariance``, or None when it is not a lazy block of a supported kernel."""
    if not isinstance(covariance, LazyEvaluatedKernelTensor) or covariance.last_dim_is_batch or covariance.params:
        return None
    kernel, outputscale = covariance.kernel, None
    if type(kernel) is ScaleKernel:
        kernel, outputscale = kernel.base_kernel, kernel.outputscale
    profile = _profile(kernel)
    if profile is None:
        return None
    return FusedBlock(covariance.x1, covariance.x2, kernel.lengthscale, outputscale, profile)


def _fused_kernel_matvec(covariance: Tensor | LinearOperator, vector: Tensor) -> Tensor | None:
    """The fused product, or None when ``covariance`` is not a lazy block of a supported kernel."""
    block = fused_block(covariance)
    if block is None:
        return None
    x1, x2, lengthscale, outputscale, profile = block
    return squared_distance_kernel_matvec(x1, x2, vector, lengthscale, outputscale, profile)


def _profile(kernel: Kernel) -> str | None:
    """The squared-distance profile of a supported kernel (exact types only: a subclass may change ``forward``)."""
    if type(kernel) is RBFKernel:
        return "rbf"
    if type(kernel) is MaternKernel and kernel.nu in (1.5, 2.5):
        return "matern32" if kernel.nu == 1.5 else "matern52"
    return None
