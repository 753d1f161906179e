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
        """R6 of issue 20: a zero median gave length-scale eps, a NaN loss at step 2 and NaN parameters."""
        for dtype in (torch.float32, torch.float64):
            x = torch.cat([self.x[:, :1], torch.full((40, 1), 3.0, dtype=torch.float64)], dim=-1).to(dtype)
            with self.assertWarnsRegex(RuntimeWarning, "column 1 is constant.*set to"):
                result = median_lengthscales(x)
            self.assertEqual(result.dtype, dtype)
            # the only other column's median stands in for the constant one
            self.assertEqual(result[1].item(), result[0].item())
            self.assertEqual(result[0].item(), median_lengthscales(x[:, :1]).item())
        with self.assertWarnsRegex(RuntimeWarning, "the inputs are constant"):
            self.assertEqual(median_lengthscales(torch.ones(5, 2), ard=False).tolist(), [1.0])
        with self.assertWarnsRegex(RuntimeWarning, "columns 0, 1 are constant.*set to 1 "):
            self.assertEqual(median_lengthscales(torch.ones(5, 2)).tolist(), [1.0, 1.0])

    def test_mostly_repeated_column(self):
        # 30 zeros and 10 fives: 435 + 45 of the 780 pairs are at distance 0, the other 300 at distance 5
        column = torch.cat([torch.zeros(30), torch.full((10,), 5.0)]).double()
        x = torch.stack([column, self.x[:, 1]], dim=-1)
        with self.assertWarnsRegex(RuntimeWarning, "column 0 mostly repeats one value"):
            result = median_lengthscales(x)
        self.assertEqual(result[0].item(), 5.0)
        torch.testing.assert_close(result[1], median_lengthscales(x[:, 1:])[0], rtol=0, atol=0)

    def test_bad_inputs(self):
        for bad in (torch.randn(1, 3), torch.randn(5), torch.randn(2, 4, 3)):
            with self.assertRaisesRegex(ValueError, "N >= 2"):
                median_lengthscales(bad)
        with self.assertRaisesRegex(TypeError, "x must be floating-point"):
            median_lengthscales(torch.ones(4, 2, dtype=torch.int64))
        with self.assertRaisesRegex(TypeError, "x must be a torch.Tensor"):
            median_lengthscales([[0.0], [1.0]])
        for value in (float("nan"), float("inf")):
            x = self.x.clone()
            x[3, 1] = value
            with self.assertRaisesRegex(ValueError, "x contains NaN or inf"):
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
        with self.assertRaisesRegex(ValueError, "x has 2 columns but RBFKernel has 3 length-scales"):
            initialize_hyperparameters(gpytorch.kernels.RBFKernel(ard_num_dims=3), self.x[:, :2])
        with self.assertRaises(TypeError):
            initialize_hyperparameters(
                gpytorch.kernels.RBFKernel(), self.x, self.y, gpytorch.likelihoods.BernoulliLikelihood()
            )

    def test_bad_outputs_change_nothing(self):
        """R3 of issue 20: the length-scales and output scale were set before y was checked."""
        for y, message in (
            (torch.tensor([float("nan"), 1.0]).double(), "y contains NaN or inf"),
            (torch.ones(1).double(), "at least two real values"),
            (torch.ones(5, dtype=torch.int64), "at least two real values"),
        ):
            covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
            likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
            before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (covar_module, likelihood)]
            with self.assertRaisesRegex(ValueError, message):
                initialize_hyperparameters(covar_module, self.x, y, likelihood)
            for module, state in zip((covar_module, likelihood), before):
                for name, value in module.state_dict().items():
                    self.assertTrue(torch.equal(value, state[name]), name)


if __name__ == "__main__":
    unittest.main()
