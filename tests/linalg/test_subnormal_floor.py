"""Kernel values that would be subnormal numbers (slow on x86 CPUs) are raised to a floor, with no effect beyond it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

from gpytorch_decoupled.linalg import LeanKernel, exponent_floor, floored_exp, kernel_matvec, kernel_quadratic_form
from gpytorch_decoupled.linalg._kernel_tiles import KernelTiles, scaled_inputs
from tests.linalg.kernel_cases import oracle_block

KERNELS = {
    "rbf": lambda: ScaleKernel(RBFKernel()),
    "matern32": lambda: MaternKernel(nu=1.5),
    "matern52": lambda: ScaleKernel(MaternKernel(nu=2.5)),
}


def _kernel(name: str, dtype: torch.dtype):
    """The kernel, with a length-scale that puts the subnormal range of ``dtype`` inside the points' reach (Matern
    decays slowly: in float64 its values turn subnormal only hundreds of length-scales away)."""
    kernel = KERNELS[name]().to(dtype)
    base = kernel.base_kernel if isinstance(kernel, ScaleKernel) else kernel
    base.lengthscale = 0.125 if name != "rbf" and dtype == torch.float64 else 1.0
    return kernel


def _far_points(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Points on a line whose kernel values run from one down past the smallest normal number of ``dtype`` (unit
    length-scale), spaced finely enough that some pairs' values are subnormal and many are beyond the floor."""
    x = torch.linspace(0.0, 60.0, 241, dtype=dtype).unsqueeze(-1)
    return x, torch.flip(x[::2], [0]) + 0.1


def _oracle(kernel, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The float64 block from the formula, of a float64 copy of ``kernel``."""
    return oracle_block(copy.deepcopy(kernel).double(), x1.detach().double(), x2.detach().double())


def _subnormal(values: torch.Tensor) -> torch.Tensor:
    return (values != 0) & (values.abs() < torch.finfo(values.dtype).tiny)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(KERNELS))
def test_dense_block_has_no_subnormal_value_and_the_oracle_value_above_the_floor(name, dtype):
    kernel = _kernel(name, dtype)
    x1, x2 = _far_points(dtype)
    floor = 2.0 ** exponent_floor(dtype)
    block = LeanKernel.of(kernel)(x1, x2)
    theirs = kernel(x1, x2).to_dense()  # GPyTorch's values (subnormal or zero far away)
    assert not _subnormal(block).any() and (block > 0).all()
    assert _subnormal(theirs).any()
    # the same values where they are well above the floor, and at most the floor times Matern's polynomial factor
    # (up to 1e5 here) and the output scale where they are not
    kept = theirs > 1e7 * floor
    tolerance = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(block[kept], theirs[kept], rtol=tolerance, atol=0)
    assert (block[~kept] <= 1e7 * floor).all()
    oracle = _oracle(kernel, x1, x2)
    assert (oracle < floor).float().mean() > 0.05  # many pairs are beyond the floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(KERNELS))
def test_tiles_hold_no_subnormal_value_and_the_sweeps_match_the_oracle(name, dtype):
    kernel = _kernel(name, dtype)
    x1, x2 = _far_points(dtype)
    lean = LeanKernel.of(kernel)
    x, z, _ = scaled_inputs(x1, x2, lean.base.lengthscale.detach())
    for _, _, values, derivative in KernelTiles(x, z, lean.profile).tiles():
        assert not _subnormal(values).any()
        assert derivative is None or not _subnormal(derivative).any()
    # the products: equal to the oracle's to the rounding of their O(1) terms, and their gradients finite
    a = torch.linspace(-1.0, 1.0, x2.size(0), dtype=dtype, requires_grad=True)
    points = x2.clone().requires_grad_()
    product = kernel_matvec(kernel(x1, points), a)
    oracle = _oracle(kernel, x1, x2) @ a.detach().double()
    # float32: its own rounding (exponents of up to 10^2 amplify it); float64: the rounding of the distances'
    # expansion between points hundreds of length-scales apart (GPyTorch's too), the floor adds none
    tolerance = 1e-3 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(product.double(), oracle, rtol=tolerance, atol=tolerance)
    quadratic = kernel_quadratic_form(kernel(points, points), a)
    gram = _oracle(kernel, x2, x2)
    torch.testing.assert_close(quadratic.double(), a.detach().double() @ gram @ a.detach().double(), rtol=tolerance,
                               atol=tolerance)  # fmt: skip
    gradients = torch.autograd.grad(product.sum() + quadratic, [a, points, *kernel.parameters()])
    assert all(torch.isfinite(gradient).all() for gradient in gradients)


def test_the_floor_sits_below_the_smallest_normal_number_with_room_for_products():
    for dtype in (torch.float32, torch.float64):
        smallest = math.log2(torch.finfo(dtype).tiny)
        floor = exponent_floor(dtype)
        assert smallest < floor <= 0.8 * smallest + 1e-9
        assert floor - smallest > 20  # a value at the floor times factors down to 1e-6 stays normal


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floored_exp_is_exp_above_the_floor_and_the_floor_below_it_without_a_gradient(dtype):
    floor = exponent_floor(dtype) * math.log(2.0)
    exponents = torch.tensor([0.0, -3.0, floor + 1.0, floor - 1.0, 10 * floor], dtype=dtype, requires_grad=True)
    values = floored_exp(exponents)
    torch.testing.assert_close(values[:3], exponents[:3].exp(), rtol=0, atol=0)
    assert torch.equal(values[3:], torch.full((2,), floor, dtype=dtype).exp())
    assert not _subnormal(values).any()
    (gradient,) = torch.autograd.grad(values.sum(), exponents)
    torch.testing.assert_close(gradient[:3], values[:3].detach(), rtol=0, atol=0)
    assert torch.equal(gradient[3:], torch.zeros(2, dtype=dtype))
