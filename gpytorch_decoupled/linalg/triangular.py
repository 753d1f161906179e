#!/usr/bin/env python3

from __future__ import annotations

import torch
from torch import Tensor


def solve_lower(
    L: Tensor,  # shape: (*batch, n, n)
    B: Tensor,  # shape: (*batch, n, k)
) -> Tensor:  # shape: (*batch, n, k)
    r"""
    Forward substitution with a lower-triangular matrix:

    .. math::

        \mathbf X = \mathbf L^{-1} \mathbf B.

    Batch dimensions of :attr:`L` and :attr:`B` broadcast.

    :param L: Lower-triangular matrix (only its lower triangle is read), e.g. a Cholesky factor.
    :param B: Right-hand side matrix.
    :return: :math:`\mathbf L^{-1} \mathbf B`.

    Example:
        >>> K = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        >>> L = torch.linalg.cholesky(K)
        >>> A = solve_lower(L, K)  # L^{-1} K = L^T
        >>> torch.allclose(A, L.mT)
        True
    """
    if _solve_from_the_right(B):
        return torch.linalg.solve_triangular(L.mT, B.mT, upper=True, left=False).mT
    return torch.linalg.solve_triangular(L, B, upper=False)


def solve_lower_transpose(
    L: Tensor,  # shape: (*batch, n, n)
    B: Tensor,  # shape: (*batch, n, k)
) -> Tensor:  # shape: (*batch, n, k)
    r"""
    Back substitution with the transpose of a lower-triangular matrix:

    .. math::

        \mathbf X = \mathbf L^{-\top} \mathbf B.

    Batch dimensions of :attr:`L` and :attr:`B` broadcast.

    :param L: Lower-triangular matrix (only its lower triangle is read), e.g. a Cholesky factor.
    :param B: Right-hand side matrix.
    :return: :math:`\mathbf L^{-\top} \mathbf B`.

    Example:
        >>> K = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        >>> L = torch.linalg.cholesky(K)
        >>> X = solve_lower_transpose(L, solve_lower(L, K))  # K^{-1} K
        >>> torch.allclose(X, torch.eye(2), atol=1e-6)
        True
    """
    if _solve_from_the_right(B):
        return torch.linalg.solve_triangular(L, B.mT, upper=False, left=False).mT
    return torch.linalg.solve_triangular(L.mT, B, upper=True)


def _solve_from_the_right(B: Tensor) -> bool:
    r"""Whether to pose :math:`\mathbf L^{-1}\mathbf B` as the transposed system :math:`\mathbf X^\top\mathbf L^\top =
    \mathbf B^\top`: the same solution, but MKL's CPU triangular solve with a row-major right-hand side of many columns
    runs about twice as fast from the right in float32 (and no slower in float64), forward and backward; one column is
    faster from the left."""
    return B.device.type == "cpu" and B.size(-1) > 1


def cholesky_solve(
    L: Tensor,  # shape: (*batch, n, n)
    B: Tensor,  # shape: (*batch, n, k)
) -> Tensor:  # shape: (*batch, n, k)
    r"""
    Solve with a matrix given by its lower Cholesky factor:

    .. math::

        \mathbf X = (\mathbf L \mathbf L^\top)^{-1} \mathbf B = \mathbf L^{-\top} \mathbf L^{-1} \mathbf B.

    Batch dimensions of :attr:`L` and :attr:`B` broadcast. Note the argument order (factor first, as in the other
    helpers here), which is the reverse of :func:`torch.cholesky_solve`. Unlike that function, the gradient with
    respect to :attr:`L` is zero above the diagonal, consistent with only the lower triangle being read.

    :param L: Lower Cholesky factor (only its lower triangle is read).
    :param B: Right-hand side matrix.
    :return: :math:`(\mathbf L \mathbf L^\top)^{-1} \mathbf B`.

    Example:
        >>> K = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        >>> b = torch.tensor([[1.0], [2.0]])
        >>> x = cholesky_solve(torch.linalg.cholesky(K), b)
        >>> torch.allclose(K @ x, b)
        True
    """
    return solve_lower_transpose(L, solve_lower(L, B))


def cholesky_logdet(
    L: Tensor,  # shape: (*batch, n, n)
) -> Tensor:  # shape: (*batch)
    r"""
    Log-determinant of a matrix given by its lower Cholesky factor:

    .. math::

        \log \lvert \mathbf L \mathbf L^\top \rvert = 2 \sum_{i=1}^n \log L_{ii}.

    :param L: Lower Cholesky factor (positive diagonal).
    :return: :math:`\log \lvert \mathbf L \mathbf L^\top \rvert`, one value per batch member.

    Example:
        >>> K = torch.tensor([[4.0, 2.0], [2.0, 3.0]])
        >>> cholesky_logdet(torch.linalg.cholesky(K))  # log(8)
        tensor(2.0794)
    """
    return 2.0 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def symmetrized(
    A: Tensor,  # shape: (*batch, n, n)
) -> Tensor:  # shape: (*batch, n, n)
    r"""
    The symmetric part :math:`\tfrac12(\mathbf A + \mathbf A^\top)` of a matrix that is symmetric up to rounding (a
    sum of Gram matrices, say), so that what is accumulated or factored is exactly symmetric.

    Example:
        >>> A = torch.tensor([[1.0, 2.0], [2.0 + 1e-6, 3.0]])
        >>> torch.equal(symmetrized(A), symmetrized(A).mT)
        True
    """
    return 0.5 * (A + A.mT)


def weighted_gram(
    C: Tensor,  # shape: (*batch, n, k)
    w: Tensor,  # shape: (*batch, k)
) -> Tensor:  # shape: (*batch, n, n)
    r"""
    The weighted Gram matrix :math:`\mathbf C\operatorname{diag}(\mathbf w)\mathbf C^\top` of the columns of
    :attr:`C`, exactly symmetric (:func:`symmetrized`). Batch dimensions broadcast.

    Example:
        >>> C = torch.tensor([[1.0, 0.0], [1.0, 2.0]])
        >>> weighted_gram(C, torch.tensor([2.0, 0.5]))
        tensor([[2., 2.],
                [2., 4.]])
    """
    return symmetrized((C * w.unsqueeze(-2)) @ C.mT)
