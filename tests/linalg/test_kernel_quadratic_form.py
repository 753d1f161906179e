#!/usr/bin/env python3

from __future__ import annotations

import itertools
import unittest

import gpytorch
import pytest
import torch
from gpytorch.kernels import PeriodicKernel, RBFKernel, ScaleKernel
from torch import Tensor

from gpytorch_decoupled.linalg import kernel_quadratic_form
from gpytorch_decoupled.linalg._kernel_tiles import PROFILES
from gpytorch_decoupled.linalg._squared_distance_quadratic_form import squared_distance_quadratic_form
from gpytorch_decoupled.linalg.settings import kernel_tile_size
from tests.linalg.kernel_cases import BATCH, kernels, largest_tensor, oracle_block, randomize


def _points(size: int, seed: int, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(size, 3, generator=generator, dtype=dtype)
    points[-1] = points[0]  # two coincident points: distance 0 off the diagonal
    coefficients = torch.randn(*BATCH, size, generator=generator, dtype=dtype)
    return points.requires_grad_(), coefficients.requires_grad_()


def _oracle(kernel, x1: Tensor, x2: Tensor, u: Tensor, v: Tensor) -> Tensor:
    return (u.unsqueeze(-2) @ oracle_block(kernel, x1, x2) @ v.unsqueeze(-1)).squeeze(-1).squeeze(-1)


class TestKernelQuadraticForm(unittest.TestCase):
    def test_quadratic_form_equals_the_dense_oracle_in_value_and_every_gradient(self):
        for name, kernel in kernels().items():
            kernel = randomize(kernel.double())
            gamma, a = _points(29, seed=1)
            leaves = [gamma, a, *kernel.parameters()]
            oracle = _oracle(kernel, gamma, gamma, a, a)
            oracle_grads = torch.autograd.grad(oracle.sum(), leaves)
            # 1 entry per tile; uneven square tiles (6 x 6 on a 29-point block); one tile for the whole block.
            for tile_size in (1, 40, 2**16):
                with self.subTest(kernel=name, tile_size=tile_size), kernel_tile_size(tile_size):
                    value = kernel_quadratic_form(kernel(gamma, gamma), a)
                    self.assertEqual(value.shape, oracle.shape)
                    torch.testing.assert_close(value, oracle, rtol=1e-12, atol=1e-12)
                    grads = torch.autograd.grad(value.sum(), leaves)
                    for grad, expected in zip(grads, oracle_grads, strict=True):
                        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-11)

    def test_bilinear_form_equals_the_dense_oracle_in_value_and_every_gradient(self):
        for name, kernel in kernels().items():
            kernel = randomize(kernel.double())
            x, u = _points(13, seed=2)
            z, v = _points(31, seed=3)
            leaves = [x, u, z, v, *kernel.parameters()]
            oracle = _oracle(kernel, x, z, u, v)
            oracle_grads = torch.autograd.grad(oracle.sum(), leaves)
            for tile_size in (1, 40, 2**16):
                with self.subTest(kernel=name, tile_size=tile_size), kernel_tile_size(tile_size):
                    value = kernel_quadratic_form(kernel(x, z), u, v)
                    torch.testing.assert_close(value, oracle, rtol=1e-12, atol=1e-12)
                    grads = torch.autograd.grad(value.sum(), leaves)
                    for grad, expected in zip(grads, oracle_grads, strict=True):
                        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-11)

    def test_a_slice_of_a_joint_prior_is_symmetric_and_evaluates_half_the_block(self):
        # What a strategy passes: the [gamma; gamma] block of one model.forward, two different but equal inputs.
        kernel = randomize(ScaleKernel(RBFKernel(ard_num_dims=3))).double()
        gamma, a = _points(300, seed=4)
        a = a[0].detach().requires_grad_()
        joint = kernel(torch.cat([gamma, gamma]))[..., :300, 300:]
        with kernel_tile_size(50 * 50):
            with largest_tensor() as sweep:
                value = kernel_quadratic_form(joint, a)
                grads = torch.autograd.grad(value, [gamma, a, *kernel.parameters()])
        # Six 50-row blocks: 21 tiles on and above the diagonal of 36, evaluated once (none in the backward pass).
        self.assertEqual(sweep.exponentials, 21 * 50 * 50)
        self.assertLess(sweep.largest, 300 * 300 / 4)
        oracle = _oracle(kernel, gamma, gamma, a, a)
        torch.testing.assert_close(value, oracle, rtol=1e-12, atol=0)
        for grad, expected in zip(grads, torch.autograd.grad(oracle, [gamma, a, *kernel.parameters()]), strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-11)

    def test_gradcheck(self):
        generator = torch.Generator().manual_seed(6)

        def leaf(*shape: int, offset: float = 0.0) -> Tensor:
            return (offset + torch.rand(*shape, generator=generator, dtype=torch.float64)).requires_grad_()

        x, u, z, v = leaf(2, 5, 2), leaf(2, 5), leaf(7, 2), leaf(2, 7)
        lengthscale, outputscale = leaf(1, 2, offset=0.5), leaf(2, offset=0.5)
        for profile, scale in itertools.product(PROFILES, (outputscale, None)):
            scaled = () if scale is None else (scale,)
            with self.subTest(profile=profile, outputscale=scale is not None), kernel_tile_size(6):

                def bilinear(x, z, u, v, lengthscale, *scale, profile=profile):
                    return squared_distance_quadratic_form(x, z, u, v, lengthscale, *(scale or [None]), profile, False)

                def quadratic(z, v, lengthscale, *scale, profile=profile):
                    return squared_distance_quadratic_form(z, z, v, v, lengthscale, *(scale or [None]), profile, True)

                self.assertTrue(torch.autograd.gradcheck(bilinear, (x, z, u, v, lengthscale, *scaled)))
                self.assertTrue(torch.autograd.gradcheck(quadratic, (z, v, lengthscale, *scaled)))
        # Two batch dimensions from different arguments: (3, 1) row sets against 2 coefficient vectors.
        x, u = leaf(3, 1, 4, 2), leaf(1, 4)
        for profile in PROFILES:
            with self.subTest(profile=profile, batch="(3, 2)"), kernel_tile_size(5):

                def bilinear(x, z, u, v, lengthscale, outputscale, profile=profile):
                    return squared_distance_quadratic_form(x, z, u, v, lengthscale, outputscale, profile, False)

                self.assertTrue(torch.autograd.gradcheck(bilinear, (x, z, u, v, lengthscale, outputscale)))

    def test_float32_matches_a_float64_oracle(self):
        kernel = randomize(ScaleKernel(RBFKernel(ard_num_dims=3)))
        gamma, a = _points(500, seed=7, dtype=torch.float32)
        value = kernel_quadratic_form(kernel(gamma, gamma), a.abs())
        oracle = _oracle(kernel.double(), gamma.double(), gamma.double(), a.abs().double(), a.abs().double())
        torch.testing.assert_close(value.double(), oracle, rtol=1e-5, atol=0)

    def test_unsupported_blocks_use_row_blocks(self):
        gamma, a = _points(40, seed=8)
        for name, kernel in {"periodic": PeriodicKernel(), "sum": RBFKernel() + RBFKernel()}.items():
            kernel = kernel.double()
            for block_size in (7, 4096):
                with self.subTest(kernel=name, block_size=block_size):
                    dense = kernel(gamma, gamma).to_dense()
                    expected = (a.unsqueeze(-2) @ dense @ a.unsqueeze(-1)).squeeze(-1).squeeze(-1)
                    value = kernel_quadratic_form(kernel(gamma, gamma), a, block_size=block_size)
                    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
                    grad, expected_grad = (torch.autograd.grad(q.sum(), [gamma])[0] for q in (value, expected))
                    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
        with self.subTest(kernel="evaluated tensor"):
            dense = RBFKernel().double()(gamma, gamma).to_dense()
            expected = (a.unsqueeze(-2) @ dense @ a.unsqueeze(-1)).squeeze(-1).squeeze(-1)
            torch.testing.assert_close(kernel_quadratic_form(dense, a, block_size=9), expected, rtol=1e-12, atol=0)

    def test_empty_blocks(self):
        kernel = randomize(ScaleKernel(RBFKernel(ard_num_dims=3))).double()
        gamma = torch.randn(0, 3, dtype=torch.float64, requires_grad=True)
        a = torch.randn(*BATCH, 0, dtype=torch.float64, requires_grad=True)
        value = kernel_quadratic_form(kernel(gamma, gamma), a)
        torch.testing.assert_close(value, torch.zeros(BATCH, dtype=torch.float64))
        x, u = _points(4, seed=11)
        value = kernel_quadratic_form(kernel(x, gamma), u, a)
        torch.testing.assert_close(value, torch.zeros(BATCH, dtype=torch.float64))
        (grad_x,) = torch.autograd.grad(value.sum(), [x])
        torch.testing.assert_close(grad_x, torch.zeros_like(x))

    def test_second_derivatives_raise(self):
        # The sweep's gradients are not differentiable: a Hessian raises instead of treating them as constants.
        kernel = randomize(ScaleKernel(RBFKernel())).double()
        gamma, a = _points(12, seed=12)
        (grad,) = torch.autograd.grad(kernel_quadratic_form(kernel(gamma, gamma), a).sum(), [a], create_graph=True)
        with self.assertRaisesRegex(RuntimeError, "no autograd formula"):
            torch.autograd.grad(grad.sum(), [gamma])

    def test_compiles_as_one_graph_equal_to_eager(self):
        # The sweep is one opaque operator in a torch.compile graph (the lean training path compiles it).
        generator = torch.Generator().manual_seed(13)
        gamma = torch.randn(37, 3, generator=generator, dtype=torch.float64).requires_grad_()
        a = torch.randn(37, generator=generator, dtype=torch.float64).requires_grad_()
        lengthscale = torch.tensor([[0.7, 1.1, 0.9]], dtype=torch.float64, requires_grad=True)
        outputscale = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
        leaves = [gamma, a, lengthscale, outputscale]
        for profile in PROFILES:
            with self.subTest(profile=profile), kernel_tile_size(100):

                def value_and_gradients(gamma, a, lengthscale, outputscale, profile=profile):
                    value = squared_distance_quadratic_form(gamma, gamma, a, a, lengthscale, outputscale, profile, True)
                    return value.detach(), *torch.autograd.grad(value, [gamma, a, lengthscale, outputscale])

                expected = value_and_gradients(*leaves)
                with torch._dynamo.config.patch(trace_autograd_ops=True):
                    explanation = torch._dynamo.explain(value_and_gradients)(*leaves)
                    self.assertEqual(explanation.graph_break_count, 0, explanation.break_reasons)
                    torch._dynamo.reset()
                    compiled = torch.compile(value_and_gradients, backend="aot_eager", fullgraph=True)(*leaves)
                for result, reference in zip(compiled, expected, strict=True):
                    torch.testing.assert_close(result, reference, rtol=1e-13, atol=0)

    def test_bad_arguments(self):
        gamma, a = _points(6, seed=9)
        block = RBFKernel().double()(gamma, gamma)
        with self.assertRaisesRegex(ValueError, "left"):
            kernel_quadratic_form(block, a[..., :5])
        with self.assertRaisesRegex(ValueError, "right"):
            kernel_quadratic_form(block, a, a[..., :4])
        with self.assertRaisesRegex(ValueError, "block_size"):
            kernel_quadratic_form(block, a, block_size=0)


@pytest.mark.cuda
class TestCuda(unittest.TestCase):
    def test_cuda(self):
        kernel = randomize(ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=3))).double()
        gamma, a = _points(70, seed=10)
        oracle = _oracle(kernel, gamma, gamma, a, a)
        kernel, gamma, a = kernel.cuda(), gamma.detach().cuda(), a.detach().cuda()
        with kernel_tile_size(100):
            value = kernel_quadratic_form(kernel(gamma, gamma), a)
        self.assertEqual(value.device, gamma.device)
        torch.testing.assert_close(value.cpu(), oracle.detach(), rtol=1e-12, atol=1e-12)


if __name__ == "__main__":
    unittest.main()
