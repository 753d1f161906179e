#!/usr/bin/env python3

from __future__ import annotations

import torch
from torch import Tensor

from ._unbound_function import UnboundFunction


def congruence(
    L: Tensor,  # shape: (*batch, n, n)
    A: Tensor,  # shape: (*batch, n, n)
) -> Tensor:  # shape: (*batch, n, n)
    r"""
    The congruence transform of a symmetric matrix :math:`\mathbf A` by :math:`\mathbf L`,

    .. math::

        \mathbf P = \mathbf L^\top \mathbf A \mathbf L,

    with a backward pass that uses the symmetry of :math:`\mathbf A`: for an upstream gradient
    :math:`\bar{\mathbf P}`,

    .. math::

        \bar{\mathbf L} = \mathbf A\mathbf L\,(\bar{\mathbf P} + \bar{\mathbf P}^\top), \qquad
        \bar{\mathbf A} = \mathbf L\,\bar{\mathbf P}\,\mathbf L^\top,

    one product with :math:`n \times n` operands for :math:`\bar{\mathbf L}` (the forward pass's
    :math:`\mathbf L^\top\mathbf A` is kept) where autograd through ``L.mT @ A @ L`` takes three, and
    :math:`\bar{\mathbf A}` only when :attr:`A` requires a gradient. It is the whitened site precision
    :math:`\mathbf P = \mathbf L_K^\top\mathbf L_2\mathbf L_K` of t-SVGP (`Adam et al. (2021)`_, eq. 51), which the
    M-step differentiates through :math:`\mathbf L_K` every step. Double backward and forward mode give the
    derivatives of ``L.mT @ A @ L``.

    :param L: Any square matrix (e.g. a Cholesky factor), batch dimensions broadcast with :attr:`A`'s.
    :param A: A symmetric matrix (only the symmetric case has the backward pass above).
    :return: :math:`\mathbf L^\top\mathbf A\mathbf L`.

    Example:
        >>> L = torch.tensor([[2.0, 0.0], [1.0, 1.0]], requires_grad=True)
        >>> A = torch.tensor([[1.0, 0.5], [0.5, 2.0]])
        >>> P = congruence(L, A)
        >>> torch.equal(P, L.mT @ A @ L)
        True
        >>> P.sum().backward()
        >>> torch.allclose(L.grad, A @ L.detach() @ torch.full((2, 2), 2.0))
        True

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """
    if torch.compiler.is_compiling():
        # Under torch.compile the function's second (non-differentiable) output fails AOTAutograd (torch 2.13:
        # "any_leaf != all_leaf"); the graph differentiates the product itself, the same value bit for bit.
        return L.mT @ A @ L
    return _Congruence.apply(L, A)[0]


class _Congruence(UnboundFunction):
    generate_vmap_rule = True

    @staticmethod
    def forward(L: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
        LtA = L.mT @ A  # (L^T A) L, the association of ``L.mT @ A @ L``, whose value it returns bit for bit
        return LtA @ L, LtA

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor], output: tuple[Tensor, Tensor]) -> None:
        L, A = inputs
        ctx.save_for_backward(L, A)
        ctx.product = output[1]  # L^T A = (A L)^T, for a first-order backward pass
        ctx.mark_non_differentiable(output[1])
        ctx.tangent_inputs = (L, A)  # forward mode has no saved tensors

    @staticmethod
    def backward(ctx, grad_P: Tensor, _grad_product: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        L, A = ctx.saved_tensors
        # Under create_graph the product is recomputed from the saved inputs, so that the graph of the gradient
        # records its dependence on L and A.
        AL = A @ L if torch.is_grad_enabled() else ctx.product.mT
        grad_L = AL @ (grad_P + grad_P.mT) if ctx.needs_input_grad[0] else None
        grad_A = L @ grad_P @ L.mT if ctx.needs_input_grad[1] else None
        return _reduced(grad_L, L), _reduced(grad_A, A)

    @staticmethod
    def jvp(ctx, tangent_L: Tensor | None, tangent_A: Tensor | None) -> tuple[Tensor, None]:
        L, A = ctx.tangent_inputs
        terms = []
        if tangent_L is not None:
            half = tangent_L.mT @ (A @ L)  # dL^T A L; its transpose is L^T A dL since A is symmetric
            terms.append(half + half.mT)
        if tangent_A is not None:
            terms.append(L.mT @ tangent_A @ L)
        tangent = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        return tangent, None


def _reduced(gradient: Tensor | None, like: Tensor) -> Tensor | None:
    """``gradient`` summed over the batch dimensions that ``like`` broadcast over."""
    if gradient is None or gradient.shape == like.shape:
        return gradient
    return gradient.sum_to_size(like.shape)
