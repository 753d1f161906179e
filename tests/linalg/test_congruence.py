"""``linalg.congruence``: the value of ``L.mT @ A @ L`` bit for bit, and its first and second derivatives (reverse
and forward mode, batched, under ``torch.func``) against autograd through the plain expression, in float64."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from gpytorch_decoupled.linalg import congruence

F64 = torch.float64


def _operands(batch=(), seed=0):
    generator = torch.Generator().manual_seed(seed)
    L = torch.randn(*batch, 5, 5, generator=generator, dtype=F64).tril()
    A = torch.randn(5, 5, generator=generator, dtype=F64)
    return L, A + A.mT


def _plain(L, A):
    return L.mT @ A @ L


def _symmetric(function):
    """``function`` on the symmetric part of ``A``, so that finite differences stay in the symmetric case."""
    return lambda L, A: function(L, 0.5 * (A + A.mT))


@pytest.mark.parametrize("batch", [(), (3,)])
def test_value_is_the_plain_expression_bit_for_bit(batch):
    L, A = _operands(batch)
    assert torch.equal(congruence(L, A), _plain(L, A))


@pytest.mark.parametrize("batch", [(), (3,)])
def test_gradients_are_those_of_the_plain_expression(batch):
    L, A = _operands(batch)
    L.requires_grad_(True)
    A.requires_grad_(True)
    weights = torch.randn(*batch, 5, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    ours = torch.autograd.grad((congruence(L, A) * weights).sum(), (L, A))
    theirs = torch.autograd.grad((_plain(L, A) * weights).sum(), (L, A))
    for gradient, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(gradient, expected, rtol=1e-13, atol=1e-13)


def test_only_the_needed_gradient_is_computed():
    L, A = _operands()
    L.requires_grad_(True)
    (gradient,) = torch.autograd.grad(congruence(L, A).sum(), (L,))
    torch.testing.assert_close(gradient, A @ L.detach() @ torch.full((5, 5), 2.0, dtype=F64), rtol=1e-13, atol=0)


def test_first_and_second_derivatives_pass_gradcheck():
    L, A = _operands()
    inputs = (L.requires_grad_(True), A.requires_grad_(True))
    assert gradcheck(_symmetric(congruence), inputs)
    assert gradgradcheck(_symmetric(congruence), inputs)
    assert gradcheck(_symmetric(congruence), inputs, check_forward_ad=True, check_backward_ad=False)


def test_hessian_under_torch_func_matches_the_plain_expression():
    L, A = _operands()
    ours = torch.func.hessian(lambda L: congruence(L, A).pow(2).sum())(L)
    theirs = torch.func.hessian(lambda L: _plain(L, A).pow(2).sum())(L)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
