#!/usr/bin/env python3

from __future__ import annotations

import itertools
import unittest

import gpytorch
import torch
from gpytorch.kernels import MaternKernel, PeriodicKernel, RBFKernel, ScaleKernel
from torch import Tensor

from gpytorch_decoupled.linalg import kernel_matvec
from gpytorch_decoupled.linalg._squared_distance_kernel_matvec import PROFILES, _SquaredDistanceKernelMatvec
from gpytorch_decoupled.linalg.kernel_matvec import _fused_kernel_matvec

BATCH = torch.Size([2])


def _kernels() -> dict[str, gpytorch.kernels.Kernel]:
    return {
        "rbf": RBFKernel(),
        "rbf-ard": RBFKernel(ard_num_dims=3),
        "scaled-rbf-ard": ScaleKernel(RBFKernel(ard_num_dims=3)),
        "matern32": MaternKernel(nu=1.5, ard_num_dims=3),
        "scaled-matern52": ScaleKernel(MaternKernel(nu=2.5)),
        "batched-scaled-rbf": ScaleKernel(RBFKernel(batch_shape=BATCH, ard_num_dims=3), batch_shape=BATCH),
        "batched-matern52": MaternKernel(nu=2.5, batch_shape=BATCH),
        "active-dims-rbf": RBFKernel(active_dims=(0, 2)),
    }


def _randomize(kernel: gpytorch.kernels.Kernel) -> gpytorch.kernels.Kernel:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in kernel.parameters():
            parameter.add_(0.4 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return kernel


def _inputs(dtype=torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    x1 = torch.randn(9, 3, generator=generator, dtype=dtype)
    x2 = torch.randn(13, 3, generator=generator, dtype=dtype)
    # Coincident points: the distance 0 where Matern's derivative in r is singular.
    x2 = torch.cat([x2, x1[:3]])
    a = torch.randn(*BATCH, x2.size(0), generator=generator, dtype=dtype)
    return x1.requires_grad_(), x2.requires_grad_(), a.requires_grad_()


def _value_and_gradients(kernel, x1, x2, a, fused: bool):
    block = kernel(x1, x2)
    if fused:
        values = kernel_matvec(block, a)
    else:
        values = (block.to_dense() @ a.unsqueeze(-1)).squeeze(-1)
    weights = torch.linspace(-1.0, 2.0, values.size(-1), dtype=values.dtype)
    inputs = [x1, x2, a, *kernel.parameters()]
    return values, torch.autograd.grad((values * weights).sum(), inputs)


class TestKernelMatvec(unittest.TestCase):
    def test_fused_product_equals_the_dense_product_in_value_and_every_gradient(self):
        for name, kernel in _kernels().items():
            with self.subTest(kernel=name):
                kernel = _randomize(kernel.double())
                x1, x2, a = _inputs()
                self.assertIsNotNone(_fused_kernel_matvec(kernel(x1, x2), a), "the fused path must be taken")
                fused, fused_grads = _value_and_gradients(kernel, x1, x2, a, fused=True)
                dense, dense_grads = _value_and_gradients(kernel, x1, x2, a, fused=False)
                self.assertEqual(fused.shape, dense.shape)
                torch.testing.assert_close(fused, dense, rtol=1e-12, atol=1e-12)
                for fused_grad, dense_grad in zip(fused_grads, dense_grads):
                    torch.testing.assert_close(fused_grad, dense_grad, rtol=1e-11, atol=1e-12)

    def test_float32_matches_a_float64_oracle(self):
        kernel = _randomize(ScaleKernel(RBFKernel(ard_num_dims=3)))
        x1, x2, a = _inputs(torch.float32)
        fused = kernel_matvec(kernel(x1, x2), a)
        oracle = kernel.double()(x1.double(), x2.double()).to_dense() @ a.double().unsqueeze(-1)
        torch.testing.assert_close(fused.double(), oracle.squeeze(-1), rtol=1e-5, atol=1e-5)

    def test_unsupported_blocks_use_the_dense_product(self):
        x1, x2, a = _inputs()
        unsupported = {
            "matern12": MaternKernel(nu=0.5),
            "periodic": PeriodicKernel(),
            "sum": RBFKernel() + MaternKernel(nu=2.5),
            "rbf-subclass": type("MyRBF", (RBFKernel,), {})(),
        }
        for name, kernel in unsupported.items():
            with self.subTest(kernel=name):
                kernel = kernel.double()
                block = kernel(x1, x2)
                self.assertIsNone(_fused_kernel_matvec(block, a))
                expected = (block.to_dense() @ a.unsqueeze(-1)).squeeze(-1)
                torch.testing.assert_close(kernel_matvec(block, a), expected, rtol=0, atol=0)
        kernel = RBFKernel().double()
        with self.subTest(kernel="evaluated tensor"):
            dense = kernel(x1, x2).to_dense()
            torch.testing.assert_close(kernel_matvec(dense, a), (dense @ a.unsqueeze(-1)).squeeze(-1))
        with self.subTest(kernel="lazily_evaluate_kernels(False)"), gpytorch.settings.lazily_evaluate_kernels(False):
            block = kernel(x1, x2)
            self.assertIsNone(_fused_kernel_matvec(block, a))
            torch.testing.assert_close(kernel_matvec(block, a), (block.to_dense() @ a.unsqueeze(-1)).squeeze(-1))

    def test_autograd_function_passes_gradcheck_for_every_profile(self):
        # Broadcast shapes: a batch of 2 data sets against one shared z, ARD length-scales, one output scale per batch.
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(2, 4, 3, generator=generator, dtype=torch.float64, requires_grad=True)
        z = torch.randn(5, 3, generator=generator, dtype=torch.float64, requires_grad=True)
        a = torch.randn(2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
        lengthscale = (0.5 + torch.rand(1, 3, generator=generator, dtype=torch.float64)).requires_grad_()
        outputscale = (0.5 + torch.rand(2, generator=generator, dtype=torch.float64)).requires_grad_()
        for profile, scale in itertools.product(PROFILES, [outputscale, None]):
            with self.subTest(profile=profile, outputscale=scale is not None):

                def function(x, z, a, lengthscale, *scale, profile=profile):
                    return _SquaredDistanceKernelMatvec.apply(x, z, a, lengthscale, *(scale or [None]), profile)

                inputs = (x, z, a, lengthscale) if scale is None else (x, z, a, lengthscale, scale)
                self.assertTrue(torch.autograd.gradcheck(function, inputs))

    def test_only_the_requested_gradients_are_computed(self):
        kernel = RBFKernel().double()
        x1, x2, a = _inputs()
        values = kernel_matvec(kernel(x1.detach(), x2.detach()), a)
        (grad_a,) = torch.autograd.grad(values.sum(), [a])
        expected = kernel(x1, x2).to_dense().detach().sum(-2).expand_as(a)
        torch.testing.assert_close(grad_a, expected)
