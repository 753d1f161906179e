#!/usr/bin/env python3

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._kernel_tiles import KernelTiles, bilinear_sums, flatten_batch, scaled_inputs, unflatten_batch


class _SquaredDistanceQuadraticForm(torch.autograd.Function):
    r"""
    :math:`q = s\,\mathbf u^\top\mathbf F\mathbf v` for the block :math:`F_{ij} = f(\lVert\mathbf x_i -
    \mathbf z_j\rVert^2)` of scaled inputs (as in :class:`~gpytorch_decoupled.linalg._squared_distance_kernel_matvec.
    _SquaredDistanceKernelMatvec`), one value per batch element, in one sweep of cache-sized tiles.

    The result is a scalar per batch element, so its gradients with respect to every input are computed in the same
    sweep as the value, when autograd will need them, and the backward pass only scales them by the incoming
    gradient: the block is evaluated once per step. With ``symmetric=True`` the caller guarantees
    :math:`\mathbf x^{(1)} = \mathbf x^{(2)}` and :math:`\mathbf u = \mathbf v` (in value; they may be different
    tensors), and only the tiles on and above the diagonal are evaluated, half the work of the full block. Each of the
    two inputs then receives the gradient of one side (together the gradient of the points), and so do
    :math:`\mathbf u` and :math:`\mathbf v` (:math:`s\,\mathbf F\mathbf v` each).
    """

    @staticmethod
    def forward(
        ctx,
        x1: Tensor,
        x2: Tensor,
        u: Tensor,
        v: Tensor,
        lengthscale: Tensor,
        outputscale: Tensor | None,
        profile: str,
        symmetric: bool,
    ) -> Tensor:
        scale_operand = () if outputscale is None else (outputscale.unsqueeze(-1),)
        x, z, batch_shape = scaled_inputs(x1, x2, lengthscale, u, v, *scale_operand)
        left, right = flatten_batch(u, batch_shape, 1), flatten_batch(v, batch_shape, 1)
        if symmetric:
            z, right = x, left
        needs_x1, needs_x2, needs_u, needs_v, needs_lengthscale, *_ = ctx.needs_input_grad
        needs_x, needs_z = needs_x1 or needs_lengthscale, needs_x2 or needs_lengthscale
        tiles = KernelTiles(x, z, profile, symmetric=symmetric)
        grad_x, grad_z, column_sums, row_sums = bilinear_sums(tiles, x, z, left, right, needs_x, needs_z, needs_v, True)
        value = (left * row_sums).sum(-1)
        ctx.profile, ctx.batch_shape = profile, batch_shape
        ctx.shapes = x1.shape, x2.shape, u.shape, v.shape
        ctx.save_for_backward(x, z, lengthscale, outputscale, value, grad_x, grad_z, column_sums, row_sums)
        value = value.view(batch_shape)
        return value if outputscale is None else value * outputscale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, z, lengthscale, outputscale, value, grad_x, grad_z, column_sums, row_sums = ctx.saved_tensors
        x1_shape, x2_shape, u_shape, v_shape = ctx.shapes
        batch_shape = ctx.batch_shape
        needs_x1, needs_x2, needs_u, needs_v, needs_lengthscale, needs_outputscale, *_ = ctx.needs_input_grad
        grad_outputscale = None
        if outputscale is not None:
            if needs_outputscale:
                grad_outputscale = (grad * value.view(batch_shape)).sum_to_size(outputscale.shape)
            grad = grad * outputscale
        weight = flatten_batch(grad.unsqueeze(-1), batch_shape, 1)  # shape: (B, 1)
        scale = flatten_batch(lengthscale, batch_shape, 2)

        def unflatten(tensor: Tensor, shape: torch.Size) -> Tensor:
            return unflatten_batch(tensor, batch_shape).sum_to_size(shape)

        grad_u = unflatten(weight * row_sums, u_shape) if needs_u else None
        grad_v = unflatten(weight * column_sums, v_shape) if needs_v else None
        grad_x1 = unflatten(weight.unsqueeze(-1) * grad_x / scale, x1_shape) if needs_x1 else None
        grad_x2 = unflatten(weight.unsqueeze(-1) * grad_z / scale, x2_shape) if needs_x2 else None
        grad_lengthscale = None
        if needs_lengthscale:
            scaled = (grad_x * x).sum(-2, keepdim=True) + (grad_z * z).sum(-2, keepdim=True)
            grad_lengthscale = unflatten(-weight.unsqueeze(-1) * scaled / scale, lengthscale.shape)
        return grad_x1, grad_x2, grad_u, grad_v, grad_lengthscale, grad_outputscale, None, None
