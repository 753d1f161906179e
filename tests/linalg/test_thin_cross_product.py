"""thin_cross_product: the value of a @ b.mT exactly, its gradients (first and second order) and forward-mode
derivatives equal to the plain product's (float64)."""

from __future__ import annotations

import torch
from torch.func import jvp, vmap

from gpytorch_decoupled.linalg import thin_cross_product


def _factors():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(7, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    b = torch.randn(5, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    weights = torch.randn(7, 5, dtype=torch.float64, generator=generator)
    return a, b, weights


def test_value_and_gradients_equal_the_plain_product():
    a, b, weights = _factors()
    value = thin_cross_product(a, b)
    assert torch.equal(value, a @ b.mT)
    grads = torch.autograd.grad((value * weights).sum(), (a, b))
    expected = torch.autograd.grad(((a @ b.mT) * weights).sum(), (a, b))
    for grad, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-14, atol=1e-14)


def test_second_derivatives_equal_the_plain_product():
    a, b, weights = _factors()

    def hessian_vector(product):
        (grad_a,) = torch.autograd.grad((product(a, b).pow(2) * weights).sum(), a, create_graph=True)
        return torch.autograd.grad(grad_a.sum(), (a, b))

    ours = hessian_vector(thin_cross_product)
    plain = hessian_vector(lambda x, y: x @ y.mT)
    for grad, reference in zip(ours, plain, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-13, atol=1e-13)


def test_forward_mode_and_vmap_take_the_plain_product():
    a, b, _ = _factors()
    a, b = a.detach(), b.detach()
    tangents = torch.randn(3, *a.shape, dtype=torch.float64)
    derivatives = vmap(lambda t: jvp(lambda x: thin_cross_product(x, b), (a,), (t,))[1])(tangents)
    torch.testing.assert_close(derivatives, tangents @ b.mT, rtol=1e-14, atol=1e-14)
