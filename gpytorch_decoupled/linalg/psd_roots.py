r"""
Roots of a symmetric PSD matrix and of its pseudo-inverse, from its Cholesky factor where that is provably exact and
from its eigendecomposition otherwise, without data-dependent Python control flow: the choice is made in an operator
(``gpytorch_decoupled::eigen_root_unless_proven``) that is opaque to :func:`torch.compile`, so a compiled training step
holds either root in one graph (as :func:`~gpytorch_decoupled.linalg.jittered_cholesky` holds its jitter escalation).
Neither is differentiable: they serve updates computed without gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cholesky import _CUDAGRAPH_UNSAFE, _LIBRARY
from .diagonal import identity_like
from .triangular import solve_lower


def pseudo_inverse_root(matrix: Tensor, eps: float) -> Tensor:
    r"""
    A root :math:`\mathbf X` of the pseudo-inverse of a symmetric PSD matrix, :math:`\mathbf A^+ = \mathbf X
    \mathbf X^\top`, with the eigenvalues below the pseudo-inverse's tolerance (``eps`` times the size times the largest
    eigenvalue) dropped. Where the Cholesky factor :math:`\mathbf L` proves that no eigenvalue is dropped (the smallest
    is at least :math:`1/\operatorname{tr}(\mathbf A^{-1}) = 1/\lVert\mathbf L^{-1}\rVert_F^2` and the largest at most
    the largest absolute row sum), :math:`\mathbf X = \mathbf L^{-\top}`; otherwise :math:`\mathbf X = \mathbf U
    \boldsymbol\Lambda_+^{-1/2}` from the eigendecomposition :math:`\mathbf U\boldsymbol\Lambda\mathbf U^\top`
    (for every member of a batch, if one member lacks the proof). The two roots differ by a rotation:
    :math:`\mathbf X\mathbf Q`.

    :param matrix: Symmetric PSD matrix or batch of them, ``(..., M, M)``.
    :param eps: The relative tolerance (typically the machine epsilon of the data's dtype).
    :return: :math:`\mathbf X`, ``(..., M, M)``.

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> X = pseudo_inverse_root(A, 1e-7)
        >>> torch.allclose(X @ X.mT, torch.linalg.inv(A))
        True
    """
    factor, info = torch.linalg.cholesky_ex(matrix)
    inverse_factor = solve_lower(factor, identity_like(matrix))  # L^-1 (not used where the factorization failed)
    largest_bound = matrix.abs().sum(-1).amax(-1)
    proven = (info == 0) & (inverse_factor.pow(2).sum((-2, -1)) * (eps * matrix.size(-1)) * largest_bound < 1)
    return _eigen_root_unless_proven(matrix, inverse_factor.mT, proven, eps)


def positive_part_root(matrix: Tensor) -> Tensor:
    r"""
    :math:`\mathbf R` with :math:`\mathbf R\mathbf R^\top` the positive part of a symmetric matrix that is PSD up to
    rounding: its Cholesky factor, or, where rounding or a null space makes that fail (for any member of a batch), the
    eigenvectors scaled by the square roots of the eigenvalues clamped at zero.

    :param matrix: Symmetric matrix or batch of them, ``(..., M, M)``.
    :return: :math:`\mathbf R`, ``(..., M, M)``.

    Example:
        >>> A = torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)  # singular: no Cholesky factor
        >>> R = positive_part_root(A)
        >>> torch.allclose(R @ R.mT, A)
        True
    """
    factor, info = torch.linalg.cholesky_ex(matrix)
    return _eigen_root_unless_proven(matrix, factor, info == 0, 0.0)


_LIBRARY.define(
    "eigen_root_unless_proven(Tensor matrix, Tensor candidate, Tensor proven, float inverse_eps) -> Tensor",
    tags=() if _CUDAGRAPH_UNSAFE is None else (_CUDAGRAPH_UNSAFE,),
)


def _eigen_root_unless_proven_kernel(matrix: Tensor, candidate: Tensor, proven: Tensor, inverse_eps: float) -> Tensor:
    r"""``candidate`` where every member is ``proven``, else the root from the eigendecomposition: of the pseudo-inverse
    with the tolerance ``inverse_eps`` (times the size times the largest eigenvalue) where that is positive, of the
    positive part where it is zero. Row-major, as its fake declares it for the compiler (an operator's output may not
    alias its input either: the candidate is copied)."""
    if proven.all():
        return candidate.clone(memory_format=torch.contiguous_format)
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    if inverse_eps == 0.0:
        scales = eigenvalues.clamp_min(0).sqrt()
    else:
        tolerance = inverse_eps * matrix.size(-1) * eigenvalues.amax(-1, keepdim=True)
        scales = torch.where(eigenvalues > tolerance, eigenvalues.clamp_min(tolerance).rsqrt(), 0)
    return (eigenvectors * scales.unsqueeze(-2)).contiguous()


_LIBRARY.impl("eigen_root_unless_proven", _eigen_root_unless_proven_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("gpytorch_decoupled::eigen_root_unless_proven", lib=_LIBRARY)
def _(matrix: Tensor, candidate: Tensor, proven: Tensor, inverse_eps: float) -> Tensor:
    return torch.empty_like(candidate, memory_format=torch.contiguous_format)


_eigen_root_unless_proven = torch.ops.gpytorch_decoupled.eigen_root_unless_proven.default
