#!/usr/bin/env python3

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._kernel_tiles import KernelTiles, TileReduction, bilinear_sums, flatten_batch, scaled_inputs, unflatten_batch
from .settings import kernel_keep_size


class _SquaredDistanceKernelMatvec(torch.autograd.Function):
    r"""
    :math:`\mathbf v = s\,\mathbf F\mathbf a` with :math:`F_{ij} = f(D_{ij})`, :math:`D_{ij} = \lVert\mathbf x_i -
    \mathbf z_j\rVert^2` for the scaled inputs :math:`\mathbf x_i = (\mathbf x^{(1)}_i - \mathbf c) / \boldsymbol\ell`,
    :math:`\mathbf z_j = (\mathbf x^{(2)}_j - \mathbf c) / \boldsymbol\ell`, one profile :math:`f` of
    :data:`~gpytorch_decoupled.linalg._kernel_tiles.PROFILES` and an optional output scale :math:`s`. All arguments
    broadcast over batch dimensions; gradients are summed back to each argument's shape.

    Forward and backward sweep :math:`\mathbf F` in cache-sized tiles (:class:`~gpytorch_decoupled.linalg._kernel_tiles.
    KernelTiles`): no :math:`n \times m` matrix is allocated, and the backward pass evaluates the tiles again rather
    than keeping them. With :math:`\mathbf F' = f'(\mathbf D)` and the gradient :math:`\mathbf g` of
    :math:`\mathbf F\mathbf a`,

    .. math::

        \nabla_{\mathbf x_i} = 2 g_i \big(\mathbf x_i [\mathbf F'\mathbf a]_i - [\mathbf F'(\mathbf a \circ
        \mathbf Z)]_i\big), \qquad
        \nabla_{\mathbf z_j} = 2 a_j \big(\mathbf z_j [\mathbf F'^\top\mathbf g]_j - [\mathbf F'^\top(\mathbf g \circ
        \mathbf X)]_j\big), \qquad
        \nabla_{\mathbf a} = \mathbf F^\top\mathbf g,

    reductions of each tile against thin matrices with :math:`d + 1` columns; the length-scale gradient follows from
    the scaled inputs' (:math:`\nabla_{\boldsymbol\ell} = -\sum_i \nabla_{\mathbf x_i} \circ \mathbf x_i /
    \boldsymbol\ell - \sum_j \nabla_{\mathbf z_j} \circ \mathbf z_j / \boldsymbol\ell`). For the RBF profile
    :math:`\mathbf F' = -\tfrac12\mathbf F`, so one reduction serves :math:`\nabla_{\mathbf z}` and
    :math:`\nabla_{\mathbf a}`. ``recording`` says whether autograd records the call (so that a small block is kept
    for the backward pass, :class:`~gpytorch_decoupled.linalg.settings.kernel_keep_size`).
    """

    @staticmethod
    def forward(
        ctx,
        x1: Tensor,
        x2: Tensor,
        a: Tensor,
        lengthscale: Tensor,
        outputscale: Tensor | None,
        profile: str,
        recording: bool = True,
    ) -> Tensor:
        scale_operand = () if outputscale is None else (outputscale.unsqueeze(-1),)
        x, z, batch_shape = scaled_inputs(x1, x2, lengthscale, a, *scale_operand)
        coefficients = flatten_batch(a, batch_shape, 1)
        product = x.new_zeros(x.size(0), 1, x.size(-2))
        reduction = TileReduction(False, column_thin=coefficients.unsqueeze(-2), row_result=product)
        # A small block is kept for the backward pass (when there will be one) instead of being evaluated again.
        # Inside forward autograd is off, so whether it records is asked of the inputs' flags and the caller's mode.
        keep = recording and x.size(0) * x.size(-2) * z.size(-2) <= kernel_keep_size.value()
        tiles = KernelTiles(x, z, profile, keep=keep)
        tiles.reduce([reduction])
        ctx.tiles = tiles if keep else None
        product = product.view(*batch_shape, x.size(-2))
        ctx.profile, ctx.shapes = profile, (x1.shape, x2.shape, a.shape)
        ctx.save_for_backward(x, z, coefficients, lengthscale, outputscale, product)
        return product if outputscale is None else product * outputscale.unsqueeze(-1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, z, a, lengthscale, outputscale, product = ctx.saved_tensors
        x1_shape, x2_shape, a_shape = ctx.shapes
        needs_x1, needs_x2, needs_a, needs_lengthscale, needs_outputscale, *_ = ctx.needs_input_grad
        grad_outputscale = None
        if outputscale is not None:
            if needs_outputscale:
                grad_outputscale = (grad * product).sum(-1).sum_to_size(outputscale.shape)
            grad = grad * outputscale.unsqueeze(-1)
        grad = flatten_batch(grad, product.shape[:-1], 1)
        needs_x, needs_z = needs_x1 or needs_lengthscale, needs_x2 or needs_lengthscale
        tiles = KernelTiles(x, z, ctx.profile) if ctx.tiles is None else ctx.tiles
        grad_x, grad_z, grad_a, _ = bilinear_sums(tiles, x, z, grad, a, needs_x, needs_z, needs_a, False)
        batch_shape = product.shape[:-1]
        grad_lengthscale = None
        if needs_lengthscale:
            scaled = (grad_x * x).sum(-2, keepdim=True) + (grad_z * z).sum(-2, keepdim=True)
            grad_lengthscale = (
                unflatten_batch(scaled, batch_shape).div(lengthscale).neg_().sum_to_size(lengthscale.shape)
            )
        grad_x1 = unflatten_batch(grad_x, batch_shape).div(lengthscale).sum_to_size(x1_shape) if needs_x1 else None
        grad_x2 = unflatten_batch(grad_z, batch_shape).div(lengthscale).sum_to_size(x2_shape) if needs_x2 else None
        grad_a = unflatten_batch(grad_a, batch_shape).sum_to_size(a_shape) if needs_a else None
        return grad_x1, grad_x2, grad_a, grad_lengthscale, grad_outputscale, None, None


def squared_distance_kernel_matvec(
    x1: Tensor, x2: Tensor, a: Tensor, lengthscale: Tensor, outputscale: Tensor | None, profile: str
) -> Tensor:
    """:class:`_SquaredDistanceKernelMatvec`, keeping a small block for the backward pass only when autograd records
    the call."""
    arguments = (x1, x2, a, lengthscale, outputscale)
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in arguments)
    return _SquaredDistanceKernelMatvec.apply(*arguments, profile, recording)
