#!/usr/bin/env python3

from __future__ import annotations

import math

import torch
from torch import Tensor

# Isotropic kernels k = f(D) of the squared scaled distance D, with f and its derivative f' = df/dD.
PROFILES = ("rbf", "matern32", "matern52")


class _SquaredDistanceKernelMatvec(torch.autograd.Function):
    r"""
    :math:`\mathbf v = s\,\mathbf F\mathbf a` with :math:`F_{ij} = f(D_{ij})`, :math:`D_{ij} = \lVert\mathbf x_i -
    \mathbf z_j\rVert^2` for the scaled inputs :math:`\mathbf x_i = (\mathbf x^{(1)}_i - \mathbf c) / \boldsymbol\ell`,
    :math:`\mathbf z_j = (\mathbf x^{(2)}_j - \mathbf c) / \boldsymbol\ell`, one profile :math:`f` of :data:`PROFILES`
    and an optional output scale :math:`s`. The shift :math:`\mathbf c` (the mean of :math:`\mathbf x^{(2)}`, as
    GPyTorch centers its distances) leaves :math:`\mathbf D` unchanged, so it carries no gradient. All arguments
    broadcast over batch dimensions; gradients are summed back to each argument's shape.

    The backward pass never forms an :math:`n \times m` gradient matrix: with :math:`\mathbf F' = f'(\mathbf D)` and the
    gradient :math:`\mathbf g` of :math:`\mathbf F\mathbf a`,

    .. math::

        \nabla_{\mathbf x_i} = 2 g_i \big(\mathbf x_i [\mathbf F'\mathbf a]_i - [\mathbf F'(\mathbf a \circ
        \mathbf Z)]_i\big), \qquad
        \nabla_{\mathbf z_j} = 2 a_j \big(\mathbf z_j [\mathbf F'^\top\mathbf g]_j - [\mathbf F'^\top(\mathbf g \circ
        \mathbf X)]_j\big), \qquad
        \nabla_{\mathbf a} = \mathbf F^\top\mathbf g,

    two thin matrix products with :math:`d + 1` columns; the length-scale gradient follows from the scaled inputs'
    (:math:`\nabla_{\boldsymbol\ell} = -\sum_i \nabla_{\mathbf x_i} \circ \mathbf x_i / \boldsymbol\ell - \sum_j
    \nabla_{\mathbf z_j} \circ \mathbf z_j / \boldsymbol\ell`). For the RBF profile :math:`\mathbf F' =
    -\tfrac12\mathbf F`, so only :math:`\mathbf F` is kept.
    """

    @staticmethod
    def forward(
        ctx, x1: Tensor, x2: Tensor, a: Tensor, lengthscale: Tensor, outputscale: Tensor | None, profile: str
    ) -> Tensor:
        center = x2.mean(dim=-2, keepdim=True)
        x, z = (x1 - center) / lengthscale, (x2 - center) / lengthscale
        batch_shape = torch.broadcast_shapes(x.shape[:-2], z.shape[:-2], a.shape[:-1])
        x, z = x.expand(*batch_shape, *x.shape[-2:]), z.expand(*batch_shape, *z.shape[-2:])
        values, derivative = _profile_values(x, z, profile)
        product = (values @ a.unsqueeze(-1)).squeeze(-1)
        ctx.shapes = x1.shape, x2.shape, a.shape
        ctx.save_for_backward(x, z, a, lengthscale, outputscale, values, derivative, product)
        return product if outputscale is None else product * outputscale.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, z, a, lengthscale, outputscale, values, derivative, product = ctx.saved_tensors
        x1_shape, x2_shape, a_shape = ctx.shapes
        needs_x1, needs_x2, needs_a, needs_lengthscale, needs_outputscale, _ = ctx.needs_input_grad
        grad_outputscale = None
        if outputscale is not None:
            if needs_outputscale:
                grad_outputscale = (grad * product).sum(-1).sum_to_size(outputscale.shape)
            grad = grad * outputscale.unsqueeze(-1)
        rbf = derivative is None
        # RBF: F' = -F / 2, so the factor 2 of the gradient formulas becomes -1 with F in place of F'.
        factor, derivative = (-1.0, values) if rbf else (2.0, derivative)
        grad_x = grad_z = grad_a = grad_lengthscale = None
        a_full = a.expand(*x.shape[:-2], a.size(-1))
        if needs_x1 or needs_lengthscale:
            weighted = _thin_product(derivative, torch.cat([a_full.unsqueeze(-1), a_full.unsqueeze(-1) * z], dim=-1))
            grad_x = (factor * grad).unsqueeze(-1) * (x * weighted[..., :1] - weighted[..., 1:])
        if needs_x2 or needs_lengthscale or (needs_a and rbf):
            transposed = _thin_product(derivative.mT, torch.cat([grad.unsqueeze(-1), grad.unsqueeze(-1) * x], dim=-1))
            if needs_x2 or needs_lengthscale:
                grad_z = (factor * a_full).unsqueeze(-1) * (z * transposed[..., :1] - transposed[..., 1:])
        if needs_a:
            grad_a = transposed[..., 0] if rbf else (values.mT @ grad.unsqueeze(-1)).squeeze(-1)
            grad_a = grad_a.sum_to_size(a_shape)
        if needs_lengthscale:
            scaled = (grad_x * x).sum(-2, keepdim=True) + (grad_z * z).sum(-2, keepdim=True)
            grad_lengthscale = (-scaled / lengthscale).sum_to_size(lengthscale.shape)
        grad_x1 = (grad_x / lengthscale).sum_to_size(x1_shape) if needs_x1 else None
        grad_x2 = (grad_z / lengthscale).sum_to_size(x2_shape) if needs_x2 else None
        return grad_x1, grad_x2, grad_a, grad_lengthscale, grad_outputscale, None


def _thin_product(matrix: Tensor, thin: Tensor) -> Tensor:
    r"""
    :math:`\mathbf A\mathbf B` for a thin :math:`\mathbf B`, computed as :math:`(\mathbf B^\top\mathbf A^\top)^\top`:
    BLAS libraries (MKL on CPU) are several times slower on a product with a few output columns than on the same
    product with a few output rows.
    """
    return (thin.mT @ matrix.mT).mT


def _squared_distances(x: Tensor, z: Tensor, scale: float = 1.0) -> Tensor:
    r"""
    :math:`c\,\lVert\mathbf x_i - \mathbf z_j\rVert^2` (``scale`` :math:`c`) by one matrix product of augmented inputs.
    Rounding can leave entries for coincident points slightly on the wrong side of 0; callers clamp where it matters.
    """
    x_norm = x.pow(2).sum(-1, keepdim=True)
    z_norm = z.pow(2).sum(-1, keepdim=True)
    x_augmented = torch.cat([(-2.0 * scale) * x, scale * x_norm, torch.full_like(x_norm, scale)], dim=-1)
    z_augmented = torch.cat([z, torch.ones_like(z_norm), z_norm], dim=-1)
    return x_augmented @ z_augmented.mT


def _profile_values(x: Tensor, z: Tensor, profile: str) -> tuple[Tensor, Tensor | None]:
    r"""
    :math:`f(\mathbf D)` and :math:`f'(\mathbf D)` (``None`` for the RBF, whose derivative is :math:`-f/2`), computed in
    place in the distance buffer.
    """
    if profile == "rbf":
        # exp(-D / 2) straight from the scaled product; -D / 2 can exceed 0 only by rounding, so no clamp is needed.
        return _squared_distances(x, z, scale=-0.5).exp_(), None
    if profile not in PROFILES:
        raise ValueError(f"unknown kernel profile {profile!r}; available: {', '.join(PROFILES)}.")
    scaled = _squared_distances(x, z).clamp_min_(0.0).sqrt_()
    scaled.mul_(math.sqrt(3.0) if profile == "matern32" else math.sqrt(5.0))  # s = sqrt(2 nu) r
    decay = torch.exp(-scaled)
    if profile == "matern32":
        # f = (1 + s) e^-s with s^2 = 3 D: f' = df/ds * ds/dD = -s e^-s * 3 / (2 s) = -1.5 e^-s
        return (scaled + 1.0).mul_(decay), decay.mul_(-1.5)
    # Matern 5/2: f = (1 + s + s^2 / 3) e^-s with s^2 = 5 D: f' = -(s (1 + s) / 3) e^-s * 5 / (2 s) = -(5/6)(1 + s) e^-s
    values = (scaled * scaled).div_(3.0).add_(scaled).add_(1.0).mul_(decay)
    return values, scaled.add_(1.0).mul_(decay).mul_(-5.0 / 6.0)
