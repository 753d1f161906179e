#!/usr/bin/env python3

from __future__ import annotations

import unittest

import gpytorch
import numpy as np
import torch

from gpytorch_decoupled.kernels import GeneralizedRBFKernel, initialize_hyperparameters, median_lengthscales


def _brute_force_medians(x: np.ndarray) -> np.ndarray:
    n = len(x)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    return np.array([np.median([abs(x[i, d] - x[j, d]) for i, j in pairs]) for d in range(x.shape[1])])


class TestMedianLengthscales(unittest.TestCase):
    def setUp(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(40, 3, generator=generator, dtype=torch.float64) * torch.tensor(
            [0.1, 1.0, 5.0], dtype=torch.float64
        )

    def test_matches_brute_force(self):
        for x in (self.x, self.x[:39]):  # even and odd numbers of pairs
            expected = torch.from_numpy(_brute_force_medians(x.numpy()))
            torch.testing.assert_close(median_lengthscales(x), expected, rtol=1e-14, atol=0)
        x = self.x[:39]  # 741 pairs: torch.median is the unique middle value
        euclidean = torch.cdist(x, x)[tuple(torch.triu_indices(39, 39, 1))].median()
        torch.testing.assert_close(median_lengthscales(x, ard=False), euclidean.reshape(1), rtol=1e-12, atol=0)

    def test_uses_leading_rows(self):
        x = torch.cat([self.x, 1e6 * torch.ones(5, 3, dtype=torch.float64)])
        torch.testing.assert_close(median_lengthscales(x, max_rows=40), median_lengthscales(self.x))
        self.assertEqual(median_lengthscales(torch.randn(3000, 2)).shape, torch.Size([2]))

    def test_constant_column(self):
        for dtype in (torch.float32, torch.float64):
            x = torch.cat([self.x[:, :1], torch.full((40, 1), 3.0, dtype=torch.float64)], dim=-1).to(dtype)
            result = median_lengthscales(x)
            self.assertEqual(result.dtype, dtype)
            self.assertEqual(result[1].item(), torch.finfo(dtype).eps)
            self.assertGreater(result[0].item(), 1e-3)

    def test_bad_inputs(self):
        for bad in (torch.randn(1, 3), torch.randn(5), torch.randn(2, 4, 3)):
            with self.assertRaisesRegex(ValueError, "N >= 2"):
                median_lengthscales(bad)
        for value in (float("nan"), float("inf")):
            x = self.x.clone()
            x[3, 1] = value
            with self.assertRaisesRegex(ValueError, "non-finite"):
                median_lengthscales(x)


class TestInitializeHyperparameters(unittest.TestCase):
    def setUp(self):
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(50, 3, generator=generator, dtype=torch.float64) * torch.tensor(
            [0.5, 1.0, 2.0], dtype=torch.float64
        )
        self.y = 3.0 * torch.randn(50, generator=generator, dtype=torch.float64)

    def test_ard_scale_kernel_and_noise(self):
        covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)).double()
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        covar_module.outputscale = 4.0
        initialize_hyperparameters(covar_module, self.x, self.y, likelihood)
        expected = torch.from_numpy(_brute_force_medians(self.x.numpy())).reshape(1, 3)
        torch.testing.assert_close(covar_module.base_kernel.lengthscale.detach(), expected, rtol=1e-10, atol=0)
        torch.testing.assert_close(covar_module.outputscale.detach(), torch.tensor(1.0, dtype=torch.float64))
        torch.testing.assert_close(likelihood.noise.detach(), self.y.var().reshape(1))
        self.assertIsNone(covar_module.base_kernel.raw_lengthscale.grad_fn)

    def test_non_ard_batch_and_generalized_kernel(self):
        base = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).double()
        initialize_hyperparameters(gpytorch.kernels.ScaleKernel(base, batch_shape=torch.Size([2])), self.x)
        torch.testing.assert_close(base.lengthscale.detach(), median_lengthscales(self.x, ard=False).expand(2, 1, 1))
        kernel = GeneralizedRBFKernel(ard_num_dims=3).double()
        initialize_hyperparameters(kernel, self.x)
        torch.testing.assert_close(kernel.lengthscale.detach(), median_lengthscales(self.x).reshape(1, 3))

    def test_noise_floor(self):
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        initialize_hyperparameters(
            gpytorch.kernels.RBFKernel(), self.x, torch.ones(50, dtype=torch.float64), likelihood
        )
        self.assertGreater(likelihood.noise.item(), 1e-4)  # the default GreaterThan(1e-4) constraint
        self.assertTrue(torch.isfinite(likelihood.raw_noise).all())

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "no kernel with a length-scale"):
            initialize_hyperparameters(gpytorch.kernels.LinearKernel(), self.x)
        with self.assertRaisesRegex(ValueError, "3 length-scales but x has width 2"):
            initialize_hyperparameters(gpytorch.kernels.RBFKernel(ard_num_dims=3), self.x[:, :2])
        with self.assertRaises(TypeError):
            initialize_hyperparameters(
                gpytorch.kernels.RBFKernel(), self.x, self.y, gpytorch.likelihoods.BernoulliLikelihood()
            )
        with self.assertRaisesRegex(ValueError, "finite outputs"):
            initialize_hyperparameters(
                gpytorch.kernels.RBFKernel(),
                self.x,
                torch.tensor([float("nan"), 1.0]),
                gpytorch.likelihoods.GaussianLikelihood(),
            )


if __name__ == "__main__":
    unittest.main()
