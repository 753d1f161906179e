"""Dense reference kernels, written from the formula (no GPyTorch)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._linalg import require_float64

__all__ = ["matern", "rbf"]


def rbf(X1: Tensor, X2: Tensor, lengthscale: float | Tensor, outputscale: float | Tensor = 1.0) -> Tensor:
    r"""Squared-exponential ARD kernel matrix.

    .. math::
        k(\mathbf x,\mathbf x')=s^2\exp\Big(-\tfrac12\sum_{d=1}^{D}\frac{(x_d-x'_d)^2}{\ell_d^2}\Big)

    :param X1: ``(..., N1, D)`` float64 inputs.
    :param X2: ``(..., N2, D)`` float64 inputs.
    :param lengthscale: :math:`\ell`, a number or a float64 tensor of shape ``(D,)`` (ARD).
    :param outputscale: :math:`s^2`, a number or a 0-d float64 tensor.
    :return: ``(..., N1, N2)``.

    Differences are formed explicitly rather than through :math:`\lVert x\rVert^2-2x^\top x'+\lVert x'\rVert^2`, which
    cancels catastrophically for nearby points and would make :math:`k(x,x)` differ from :math:`s^2`.
    """
    require_float64(
        X1=X1,
        X2=X2,
        lengthscale=lengthscale if isinstance(lengthscale, Tensor) else None,
        outputscale=outputscale if isinstance(outputscale, Tensor) else None,
    )
    diff = (X1.unsqueeze(-2) - X2.unsqueeze(-3)) / lengthscale
    return outputscale * torch.exp(-0.5 * diff.square().sum(-1))


def matern(X1: Tensor, X2: Tensor, nu: float, lengthscale: float | Tensor, outputscale: float | Tensor = 1.0) -> Tensor:
    r"""Matérn ARD kernel matrix for :math:`\nu \in \{3/2, 5/2\}`.

    .. math::
        k = s^2 (1 + \sqrt3 r) e^{-\sqrt3 r} \quad (\nu = 3/2), \qquad
        k = s^2 (1 + \sqrt5 r + \tfrac53 r^2) e^{-\sqrt5 r} \quad (\nu = 5/2), \qquad
        r = \Big(\sum_{d=1}^{D}\frac{(x_d-x'_d)^2}{\ell_d^2}\Big)^{1/2}

    :param X1: ``(..., N1, D)`` float64 inputs.
    :param X2: ``(..., N2, D)`` float64 inputs.
    :param nu: 1.5 or 2.5.
    :param lengthscale: :math:`\ell`, a number or a float64 tensor of shape ``(D,)`` (ARD).
    :param outputscale: :math:`s^2`, a number or a 0-d float64 tensor.
    :return: ``(..., N1, N2)``.

    Differences are formed explicitly, as in :func:`rbf`. The gradient of :math:`r` is singular where two points
    coincide, so there the distance is computed from :math:`r^2` clamped away from zero (the kernel is flat there).
    """
    require_float64(
        X1=X1,
        X2=X2,
        lengthscale=lengthscale if isinstance(lengthscale, Tensor) else None,
        outputscale=outputscale if isinstance(outputscale, Tensor) else None,
    )
    if nu not in (1.5, 2.5):
        raise ValueError(f"nu must be 1.5 or 2.5, got {nu}.")
    diff = (X1.unsqueeze(-2) - X2.unsqueeze(-3)) / lengthscale
    r = diff.square().sum(-1).clamp_min(1e-300).sqrt()
    s = math.sqrt(2.0 * nu) * r
    polynomial = 1.0 + s if nu == 1.5 else 1.0 + s + s.square() / 3.0
    return outputscale * polynomial * torch.exp(-s)
