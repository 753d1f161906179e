"""Small float64 linear-algebra helpers shared by the oracles.

Nothing here adds jitter silently: an oracle must factor exactly the matrix it was given, so that a test compares
like with like (the caller passes the jittered :math:`\\mathbf K_{uu}` the implementation under test uses). A matrix
that is not numerically positive definite raises instead of being repaired.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["cholesky", "logdet_from_cholesky", "require_float64", "check_noise", "tril_solve", "LOG_2PI"]

LOG_2PI = math.log(2.0 * math.pi)


def centred(y: Tensor, prior_mean: Tensor | None) -> Tensor:
    """Targets minus the prior mean (if any): every oracle works with a zero-mean prior."""
    return y if prior_mean is None else y - prior_mean


def require_float64(**tensors: Tensor | None) -> None:
    """Raise ``TypeError`` unless every named argument is a float64 tensor (``None`` is skipped).

    A float32 oracle would agree with a float32 implementation to ~1e-6 and hide exactly the errors the identity
    tests exist to catch, so low precision is refused rather than upcast.
    """
    for name, value in tensors.items():
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"oracle argument {name!r} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype != torch.float64:
            raise TypeError(f"oracle argument {name!r} has dtype {value.dtype}; the oracles run in torch.float64 only")


def check_noise(noise: float | Tensor) -> None:
    """Validate a Gaussian noise variance :math:`\\sigma^2 > 0` (a Python number or a float64 tensor)."""
    if isinstance(noise, Tensor):
        require_float64(noise=noise)
        if not bool((noise > 0).all()):
            raise ValueError("noise variance must be positive")
    elif not noise > 0:
        raise ValueError(f"noise variance must be positive, got {noise}")


def cholesky(A: Tensor, name: str = "matrix") -> Tensor:
    """Lower Cholesky factor :math:`\\mathbf L` with :math:`\\mathbf L\\mathbf L^\\top=\\mathbf A`, no jitter.

    :raises ValueError: if any matrix in the batch is not numerically positive definite.
    """
    L, info = torch.linalg.cholesky_ex(A)
    if bool((info != 0).any()):
        raise ValueError(f"{name} is not positive definite in float64 (Cholesky failed; no jitter is added here)")
    return L


def tril_solve(L: Tensor, B: Tensor) -> Tensor:
    """:math:`\\mathbf L^{-1}\\mathbf B` for lower-triangular :math:`\\mathbf L` (batch dims broadcast)."""
    return torch.linalg.solve_triangular(L, B, upper=False)


def logdet_from_cholesky(L: Tensor) -> Tensor:
    """:math:`\\log\\lvert\\mathbf L\\mathbf L^\\top\\rvert = 2\\sum_i\\log L_{ii}`."""
    return 2.0 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)
