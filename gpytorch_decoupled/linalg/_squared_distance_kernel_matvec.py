#!/usr/bin/env python3

from __future__ import annotations

import math

import torch
from torch import Tensor

# Isotropic kernels k = f(D) of the squared scaled distance D, with f and its derivative f' = df/dD.
PROFILES = ("rbf", "matern32", "matern52")


class _SquaredDistanceKernelMatvec(torch.autograd.Function):
    r"""
    :math:`\mathbf v = \mathbf F\mathbf a` with :math:`F_{ij} = f(D_{ij})`, :math:`D_{ij} = \lVert\mathbf x_i -
    \mathbf z_j\rVert^2`, for already scaled inputs :math:`\mathbf X` (``(*batch, n, d)``) and :math:`\mathbf Z`
    (``(*batch, m, d)``), one profile :math:`f` of :data:`PROFILES`, all inputs of one batch shape.

    The backward pass never forms an :math:`n \times m` gradient matrix: with :math:`\mathbf F' = f'(\mathbf D)` and the
    output gradient :math:`\mathbf g`,

    .. math::

        \nabla_{\mathbf x_i} = 2 g_i \big(\mathbf x_i [\mathbf F'\mathbf a]_i - [\mathbf F'(\mathbf a \circ
        \mathbf Z)]_i\big), \qquad
        \nabla_{\mathbf z_j} = 2 a_j \big(\mathbf z_j [\mathbf F'^\top\mathbf g]_j - [\mathbf F'^\top(\mathbf g \circ
        \mathbf X)]_j\big), \qquad
        \nabla_{\mathbf a} = \mathbf F^\top\mathbf g,

    two thin matrix products with :math:`d + 1` columns. For the RBF profile :math:`\mathbf F' = -\tfrac12\mathbf F`,
    so only :math:`\mathbf F` is kept.
    """

    @staticmethod
    def forward(ctx, x: Tensor, z: Tensor, a: Tensor, profile: str) -> Tensor:
        values, derivative = _profile_values(_squared_distances(x, z), profile)
        result = (values @ a.unsqueeze(-1)).squeeze(-1)
        ctx.profile = profile
        ctx.save_for_backward(x, z, a, values, derivative)
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, z, a, values, derivative = ctx.saved_tensors
        needs_x, needs_z, needs_a, _ = ctx.needs_input_grad
        rbf = derivative is None
        # RBF: F' = -F / 2, so the factor 2 of the gradient formulas becomes -1 with F in place of F'.
        factor, derivative = (-1.0, values) if rbf else (2.0, derivative)
        grad_x = grad_z = grad_a = None
        if needs_x:
            weighted = _thin_product(derivative, torch.cat([a.unsqueeze(-1), a.unsqueeze(-1) * z], dim=-1))
            grad_x = (factor * grad).unsqueeze(-1) * (x * weighted[..., :1] - weighted[..., 1:])
        if needs_z or (needs_a and rbf):
            transposed = _thin_product(derivative.mT, torch.cat([grad.unsqueeze(-1), grad.unsqueeze(-1) * x], dim=-1))
            if needs_z:
                grad_z = (factor * a).unsqueeze(-1) * (z * transposed[..., :1] - transposed[..., 1:])
        if needs_a:
            grad_a = transposed[..., 0] if rbf else (values.mT @ grad.unsqueeze(-1)).squeeze(-1)
        return grad_x, grad_z, grad_a, None


def _thin_product(matrix: Tensor, thin: Tensor) -> Tensor:
    r"""
    :math:`\mathbf A\mathbf B` for a thin :math:`\mathbf B`, computed as :math:`(\mathbf B^\top\mathbf A^\top)^\top`:
    BLAS libraries (MKL on CPU) are several times slower on a product with a few output columns than on the same
    product with a few output rows.
    """
    return (thin.mT @ matrix.mT).mT


def _squared_distances(x: Tensor, z: Tensor) -> Tensor:
    r""":math:`\lVert\mathbf x_i - \mathbf z_j\rVert^2` by one matrix product of augmented inputs, clamped at 0."""
    x_norm = x.pow(2).sum(-1, keepdim=True)
    z_norm = z.pow(2).sum(-1, keepdim=True)
    x_augmented = torch.cat([-2.0 * x, x_norm, torch.ones_like(x_norm)], dim=-1)
    z_augmented = torch.cat([z, torch.ones_like(z_norm), z_norm], dim=-1)
    return (x_augmented @ z_augmented.mT).clamp_min_(0.0)


def _profile_values(distances: Tensor, profile: str) -> tuple[Tensor, Tensor | None]:
    r""":math:`f(\mathbf D)` and :math:`f'(\mathbf D)` (``None`` for the RBF, whose derivative is :math:`-f/2`); the
    distance buffer is reused."""
    if profile == "rbf":
        return distances.mul_(-0.5).exp_(), None
    if profile not in PROFILES:
        raise ValueError(f"unknown kernel profile {profile!r}; available: {', '.join(PROFILES)}.")
    scaled = distances.sqrt_().mul_(math.sqrt(3.0) if profile == "matern32" else math.sqrt(5.0))  # s = sqrt(2 nu) r
    decay = torch.exp(-scaled)
    if profile == "matern32":
        # f = (1 + s) e^-s with s^2 = 3 D: f' = df/ds * ds/dD = -s e^-s * 3 / (2 s) = -1.5 e^-s
        return (scaled + 1.0).mul_(decay), decay.mul_(-1.5)
    # Matern 5/2: f = (1 + s + s^2 / 3) e^-s with s^2 = 5 D: f' = -(s (1 + s) / 3) e^-s * 5 / (2 s) = -(5/6)(1 + s) e^-s
    values = (scaled * scaled).div_(3.0).add_(scaled).add_(1.0).mul_(decay)
    return values, scaled.add_(1.0).mul_(decay).mul_(-5.0 / 6.0)
