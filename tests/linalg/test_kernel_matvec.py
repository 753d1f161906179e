#!/usr/bin/env python3

from __future__ import annotations

import itertools
import unittest

import gpytorch
import torch
from gpytorch.kernels import MaternKernel, PeriodicKernel, RBFKernel, ScaleKernel
from torch import Tensor

from gpytorch_decoupled.linalg import kernel_matvec
from gpytorch_decoupled.linalg._kernel_tiles import PROFILES
from gpytorch_decoupled.linalg._squared_distance_kernel_matvec import _SquaredDistanceKernelMatvec
from gpytorch_decoupled.linalg.kernel_matvec import _fused_kernel_matvec
from gpytorch_decoupled.linalg.settings import kernel_keep_size, kernel_tile_size
from tests.linalg.kernel_cases import BATCH, kernels, largest_tensor, oracle_block, randomize


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
        for name, kernel in kernels().items():
            with self.subTest(kernel=name):
                kernel = randomize(kernel.double())
                x1, x2, a = _inputs()
                self.assertIsNotNone(_fused_kernel_matvec(kernel(x1, x2), a), "the fused path must be taken")
                fused, fused_grads = _value_and_gradients(kernel, x1, x2, a, fused=True)
                dense, dense_grads = _value_and_gradients(kernel, x1, x2, a, fused=False)
                self.assertEqual(fused.shape, dense.shape)
                torch.testing.assert_close(fused, dense, rtol=1e-12, atol=1e-12)
                for fused_grad, dense_grad in zip(fused_grads, dense_grads):
                    torch.testing.assert_close(fused_grad, dense_grad, rtol=1e-11, atol=1e-12)

    def test_float32_matches_a_float64_oracle(self):
        kernel = randomize(ScaleKernel(RBFKernel(ard_num_dims=3)))
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


def _tiled_inputs(rows: int, columns: int, dtype=torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(5)
    x1 = torch.randn(rows, 3, generator=generator, dtype=dtype)
    x2 = torch.cat([torch.randn(columns - 2, 3, generator=generator, dtype=dtype), x1[:2]])  # coincident points
    a = torch.randn(*BATCH, columns, generator=generator, dtype=dtype)
    return x1.requires_grad_(), x2.requires_grad_(), a.requires_grad_()


class TestTiledKernelMatvec(unittest.TestCase):
    """The product is swept in tiles; every tiling (one entry per tile, uneven edge tiles, one tile for all) must give
    the dense product's value and gradients."""

    def test_every_tiling_equals_the_dense_oracle_in_value_and_every_gradient(self):
        for name, kernel in kernels().items():
            kernel = randomize(kernel.double())
            x1, x2, a = _tiled_inputs(23, 41)
            leaves = [x1, x2, a, *kernel.parameters()]
            weights = torch.linspace(-1.0, 2.0, x1.size(-2), dtype=torch.float64)
            oracle = (oracle_block(kernel, x1, x2) @ a.unsqueeze(-1)).squeeze(-1)
            oracle_grads = torch.autograd.grad((oracle * weights).sum(), leaves)
            for tile_size in (1, 7, 60, 2**16):
                with self.subTest(kernel=name, tile_size=tile_size), kernel_tile_size(tile_size):
                    fused = kernel_matvec(kernel(x1, x2), a)
                    grads = torch.autograd.grad((fused * weights).sum(), leaves)
                    torch.testing.assert_close(fused, oracle, rtol=1e-12, atol=1e-12)
                    for grad, expected in zip(grads, oracle_grads, strict=True):
                        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-11)

    def test_gradcheck_across_tiles(self):
        generator = torch.Generator().manual_seed(2)
        x = torch.randn(2, 6, 2, generator=generator, dtype=torch.float64, requires_grad=True)
        z = torch.randn(9, 2, generator=generator, dtype=torch.float64, requires_grad=True)
        a = torch.randn(2, 9, generator=generator, dtype=torch.float64, requires_grad=True)
        lengthscale = (0.5 + torch.rand(2, 1, 2, generator=generator, dtype=torch.float64)).requires_grad_()
        outputscale = (0.5 + torch.rand(2, generator=generator, dtype=torch.float64)).requires_grad_()
        for profile in PROFILES:
            with self.subTest(profile=profile), kernel_tile_size(10):  # 2 x 3 x 3 tiles with edges

                def function(x, z, a, lengthscale, outputscale, profile=profile):
                    return _SquaredDistanceKernelMatvec.apply(x, z, a, lengthscale, outputscale, profile)

                self.assertTrue(torch.autograd.gradcheck(function, (x, z, a, lengthscale, outputscale)))
        # Two batch dimensions from different arguments: (3, 1) data sets, 2 coefficient vectors, 2 output scales.
        x = torch.randn(3, 1, 4, 2, generator=generator, dtype=torch.float64, requires_grad=True)
        lengthscale = (0.5 + torch.rand(1, 2, generator=generator, dtype=torch.float64)).requires_grad_()
        with kernel_tile_size(7):
            for profile in PROFILES:
                with self.subTest(profile=profile, batch="(3, 2)"):

                    def function(x, z, a, lengthscale, outputscale, profile=profile):
                        return _SquaredDistanceKernelMatvec.apply(x, z, a, lengthscale, outputscale, profile)

                    self.assertTrue(torch.autograd.gradcheck(function, (x, z, a, lengthscale, outputscale)))

    def test_float32_tiles_match_a_float64_oracle(self):
        kernel = randomize(ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=3)))
        x1, x2, a = _tiled_inputs(50, 300, torch.float32)
        with kernel_tile_size(999):
            fused = kernel_matvec(kernel(x1, x2), a)
        oracle = oracle_block(kernel.double(), x1.double(), x2.double()) @ a.double().unsqueeze(-1)
        torch.testing.assert_close(fused.double(), oracle.squeeze(-1), rtol=1e-5, atol=1e-5)

    def test_no_operation_creates_the_block_or_its_gradient(self):
        # A (2, 300, 2000) block has 1.2 million entries; the tiles have 2^14, every other tensor O((n + m) d).
        kernel = ScaleKernel(RBFKernel(batch_shape=BATCH, ard_num_dims=3), batch_shape=BATCH)
        kernel = randomize(kernel).double()
        x1, x2, a = _tiled_inputs(300, 2000)
        block_entries = BATCH.numel() * 300 * 2000
        with kernel_tile_size(2**14), kernel_keep_size(0):
            with largest_tensor() as tiled:
                values = kernel_matvec(kernel(x1, x2), a)
                torch.autograd.grad(values.sum(), [x1, x2, a, *kernel.parameters()])
        self.assertLessEqual(tiled.largest, max(2**14, BATCH.numel() * 2000 * 5))
        # Forward and backward each evaluate every entry once.
        self.assertEqual(tiled.exponentials, 2 * block_entries)
        # The mode does see the block where the dense product makes one.
        with largest_tensor() as dense:
            values = (kernel(x1, x2).to_dense() @ a.unsqueeze(-1)).squeeze(-1)
            torch.autograd.grad(values.sum(), [x1, x2, a])
        self.assertGreaterEqual(dense.largest, block_entries)

    def test_a_small_block_is_kept_for_the_backward_pass(self):
        kernel = randomize(MaternKernel(nu=2.5, ard_num_dims=3, batch_shape=BATCH)).double()
        x1, x2, a = _tiled_inputs(40, 90)
        block_entries = BATCH.numel() * 40 * 90
        results = {}
        for keep in (0, block_entries - 1, block_entries):
            with self.subTest(keep=keep), kernel_tile_size(500), kernel_keep_size(keep), largest_tensor() as mode:
                values = kernel_matvec(kernel(x1, x2), a)
                grads = torch.autograd.grad(values.sum(), [x1, x2, a, *kernel.parameters()])
                kept = keep >= block_entries
                self.assertEqual(mode.exponentials, (1 if kept else 2) * block_entries)
                # Kept: the values and the derivative, one array each; otherwise nothing near the block's size.
                if kept:
                    self.assertEqual(mode.largest, block_entries)
                else:
                    self.assertLess(mode.largest, block_entries / 4)
                results[keep] = (values, *grads)
        for kept, recomputed in zip(results[block_entries], results[0], strict=True):
            torch.testing.assert_close(kept, recomputed, rtol=1e-14, atol=1e-14)
        # Without a backward pass to come, nothing is kept.
        with kernel_tile_size(500), kernel_keep_size(block_entries), largest_tensor() as mode, torch.no_grad():
            kernel_matvec(kernel(x1, x2), a)
        self.assertLess(mode.largest, block_entries)

    def test_empty_blocks(self):
        kernel = randomize(ScaleKernel(RBFKernel(ard_num_dims=3))).double()
        for rows, columns in ((0, 5), (4, 0), (0, 0)):
            with self.subTest(rows=rows, columns=columns):
                x1 = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
                x2 = torch.randn(columns, 3, dtype=torch.float64, requires_grad=True)
                a = torch.randn(*BATCH, columns, dtype=torch.float64, requires_grad=True)
                values = kernel_matvec(kernel(x1, x2), a)
                torch.testing.assert_close(values, torch.zeros(*BATCH, rows, dtype=torch.float64))
                grads = torch.autograd.grad(values.sum(), [x1, x2, a, *kernel.parameters()], allow_unused=True)
                for grad in grads:
                    self.assertTrue(grad is None or (grad == 0).all())

    def test_tile_size_setting(self):
        default = kernel_tile_size.value()
        with kernel_tile_size(5):
            self.assertEqual(kernel_tile_size.value(), 5)
            with kernel_tile_size(9):
                self.assertEqual(kernel_tile_size.value(), 9)
            self.assertEqual(kernel_tile_size.value(), 5)
        self.assertEqual(kernel_tile_size.value(), default)
        for bad in (0, -3, 2.5, True, "4096"):
            with self.subTest(value=bad), self.assertRaisesRegex(ValueError, "kernel_tile_size"):
                kernel_tile_size(bad)
        with kernel_keep_size(0):
            self.assertEqual(kernel_keep_size.value(), 0)
        for bad in (-1, 1.5, False):
            with self.subTest(value=bad), self.assertRaisesRegex(ValueError, "kernel_keep_size"):
                kernel_keep_size(bad)
