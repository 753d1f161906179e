#!/usr/bin/env python3

from __future__ import annotations

import math
import unittest

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled.linalg import column_sampled_quadratic_form, landmark_quadratic_form
from gpytorch_decoupled.linalg.landmark_quadratic_form import row_probabilities
from tests.oracles import rbf

F64 = torch.float64


def _problem(m_gamma: int = 60, m_beta: int = 8, *latents: int, seed: int = 0, smooth: float = 0.0):
    r"""Points, landmarks and coefficients; ``smooth`` adds a large component that the landmarks represent well (as
    the coefficients of a trained orthogonally decoupled model have), to standard normal noise."""
    generator = torch.Generator().manual_seed(seed)
    gamma = torch.randn(m_gamma, 2, generator=generator, dtype=F64)
    beta = torch.randn(m_beta, 2, generator=generator, dtype=F64)
    noise = torch.randn(*latents, m_gamma, generator=generator, dtype=F64)
    coefficients = noise + smooth * torch.sin(2.0 * gamma[:, 0]) * torch.cos(gamma[:, 1])
    return gamma.requires_grad_(), beta.requires_grad_(), coefficients.requires_grad_()


def _kernel(lengthscale: Tensor):
    def kernel(x1: Tensor, x2: Tensor) -> Tensor:
        return rbf(x1, x2, lengthscale)

    return kernel


def _factor(kernel, beta: Tensor) -> Tensor:
    return torch.linalg.cholesky(kernel(beta, beta) + 1e-8 * torch.eye(beta.size(-2), dtype=F64))


def _dense(kernel, gamma: Tensor, beta: Tensor, a: Tensor, factor: Tensor) -> tuple[Tensor, Tensor]:
    """:math:`Q` and the residual :math:`R` from dense matrices."""
    quadratic = (a.unsqueeze(-2) @ kernel(gamma, gamma) @ a.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    coordinates = torch.linalg.solve_triangular(factor, kernel(beta, gamma) @ a.unsqueeze(-1), upper=False)
    return quadratic, quadratic - coordinates.squeeze(-1).pow(2).sum(-1)


def _row_terms(kernel, gamma: Tensor, beta: Tensor, a: Tensor, factor: Tensor) -> Tensor:
    """The terms :math:`r_i = a_i[(\\mathbf K_\\gamma - \\mathbf Q_\\gamma)\\mathbf a]_i` of the residual."""
    projection = torch.linalg.solve_triangular(factor, kernel(beta, gamma), upper=False)
    return a * ((kernel(gamma, gamma) - projection.mT @ projection) @ a.unsqueeze(-1)).squeeze(-1)


class TestLandmarkQuadraticForm(unittest.TestCase):
    def test_exact_mode_equals_the_dense_forms_in_value_and_gradient(self):
        gamma, beta, a = _problem(37, 6, 2)
        lengthscale = torch.tensor(0.8, dtype=F64, requires_grad=True)
        leaves = [gamma, beta, a, lengthscale]
        kernel = _kernel(lengthscale)
        for num_columns, is_residual in ((None, False), (37, True)):
            with self.subTest(residual=is_residual):
                factor = _factor(kernel, beta)
                expected = _dense(kernel, gamma, beta, a, factor)[int(is_residual)]
                value = landmark_quadratic_form(
                    kernel, gamma, a, beta, factor, num_columns=num_columns, residual=is_residual
                )
                torch.testing.assert_close(value, expected, rtol=1e-11, atol=1e-11)
                grads = torch.autograd.grad(value.sum(), leaves, retain_graph=True, allow_unused=True)
                oracles = torch.autograd.grad(expected.sum(), leaves, allow_unused=True)
                for grad, oracle in zip(grads, oracles, strict=True):
                    if oracle is None:  # Q does not depend on the landmarks
                        self.assertIsNone(grad)
                    else:
                        torch.testing.assert_close(grad, oracle, rtol=1e-9, atol=1e-10)

    def test_the_average_over_every_single_draw_is_exact_in_value_and_gradient(self):
        # With one draw, E over i ~ p is a finite sum: unbiasedness of the value and of every gradient, exactly.
        covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
        covar_module.base_kernel.lengthscale = torch.tensor([0.7, 1.3])
        covar_module.outputscale = 1.6
        gamma, beta, a = _problem(15, 4, 2, seed=1, smooth=5.0)
        leaves = [gamma, beta, a, *covar_module.parameters()]
        probabilities = row_probabilities(a)
        self.assertAlmostEqual(probabilities.sum().item(), 1.0, places=12)
        for residual in (False, True):
            with self.subTest(residual=residual):
                exact = landmark_quadratic_form(covar_module, gamma, a, beta, num_columns=None, residual=residual)
                exact_grads = torch.autograd.grad(exact.sum(), leaves, allow_unused=True)
                exact_grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, exact_grads)]
                total, total_grads = 0.0, [torch.zeros_like(leaf) for leaf in leaves]
                for index in range(15):
                    draw = landmark_quadratic_form(
                        covar_module, gamma, a, beta, residual=residual, indices=torch.tensor([index])
                    )
                    weight = probabilities[index]
                    total = total + weight * draw.detach()
                    for accumulated, grad in zip(total_grads, torch.autograd.grad(draw.sum(), leaves), strict=True):
                        accumulated += weight * grad
                torch.testing.assert_close(total, exact.detach(), rtol=1e-10, atol=1e-10)
                for accumulated, expected in zip(total_grads, exact_grads, strict=True):
                    torch.testing.assert_close(accumulated, expected, rtol=1e-9, atol=1e-10)

    def test_monte_carlo_unbiased_with_a_fixed_generator(self):
        gamma, beta, a = _problem(300, 12, seed=2, smooth=20.0)
        kernel = _kernel(torch.tensor(0.6, dtype=F64))
        factor = _factor(kernel, beta)
        quadratic, _ = _dense(kernel, gamma, beta, a, factor)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            draws = torch.stack(
                [
                    landmark_quadratic_form(kernel, gamma, a, beta, factor, num_columns=16, generator=generator)
                    for _ in range(1000)
                ]
            )
        standard_error = draws.std() / math.sqrt(draws.numel())
        self.assertGreater(draws.std().item(), 1e-6 * quadratic.abs().item())  # really random
        self.assertLess((draws.mean() - quadratic).abs().item(), 4 * standard_error.item())

    def test_variance_is_far_below_the_uniform_column_sampler(self):
        gamma, beta, a = _problem(400, 15, seed=4, smooth=30.0)
        kernel = _kernel(torch.tensor(1.0, dtype=F64))
        factor = _factor(kernel, beta)
        with torch.no_grad():
            quadratic, _ = _dense(kernel, gamma, beta, a, factor)
            b, m = 16, gamma.size(-2)
            # The variances in closed form: with replacement and p ~ |a| here, uniform without replacement there.
            terms = _row_terms(kernel, gamma, beta, a, factor)
            probabilities = row_probabilities(a)
            landmark_variance = ((terms.pow(2) / probabilities).sum() - terms.sum().pow(2)) / b
            uniform_terms = a * (kernel(gamma, gamma) @ a)
            uniform_variance = m * m * (1 - b / m) * uniform_terms.var() / b
            # ...which the estimators' Monte Carlo spread agrees with.
            generator = torch.Generator().manual_seed(5)
            landmark = torch.stack(
                [
                    landmark_quadratic_form(kernel, gamma, a, beta, factor, num_columns=b, generator=generator)
                    for _ in range(500)
                ]
            )
            uniform = torch.stack(
                [
                    column_sampled_quadratic_form(kernel, gamma, a, num_columns=b, generator=generator)
                    for _ in range(500)
                ]
            )
        for draws, variance in ((landmark, landmark_variance), (uniform, uniform_variance)):
            self.assertLess((draws.var() / variance - 1).abs().item(), 0.25)
        self.assertLess(landmark_variance.item(), uniform_variance.item() / 100)
        self.assertLess(landmark_variance.sqrt().item(), 0.05 * quadratic.item())

    def test_generator_reproducible_and_batch_shares_the_draws(self):
        gamma, beta, a = _problem(50, 5, 3, seed=6)
        kernel = _kernel(torch.tensor(1.0, dtype=F64))

        def estimate(seed: int) -> Tensor:
            generator = torch.Generator().manual_seed(seed)
            return landmark_quadratic_form(kernel, gamma, a, beta, num_columns=7, generator=generator)

        torch.testing.assert_close(estimate(7), estimate(7), rtol=0, atol=0)
        self.assertFalse(torch.equal(estimate(7), estimate(8)))
        self.assertEqual(estimate(7).shape, (3,))
        # Explicit draws: every latent's estimate is the mean of its terms over the shared draws, weighted by the
        # shared probabilities (from all latents' coefficients).
        probabilities = row_probabilities(a)
        indices = torch.multinomial(probabilities, 7, replacement=True, generator=torch.Generator().manual_seed(7))
        factor = _factor(kernel, beta)
        with torch.no_grad():
            terms = _row_terms(kernel, gamma, beta, a, factor)
            expected = (terms[:, indices] / probabilities[indices]).mean(-1)
            estimate = landmark_quadratic_form(kernel, gamma, a, beta, factor, residual=True, indices=indices)
        torch.testing.assert_close(estimate, expected, rtol=1e-10, atol=1e-10)

    def test_zero_coefficients_draw_uniformly(self):
        torch.testing.assert_close(row_probabilities(torch.zeros(2, 4, dtype=F64)), torch.full((4,), 0.25, dtype=F64))

    def test_bad_arguments(self):
        gamma, beta, a = _problem(10, 3)
        kernel = _kernel(1.0)
        cases = [
            ({"coefficients": a[:9]}, "coefficients"),
            ({"landmarks": beta[:, :1]}, "landmarks"),
            ({"num_columns": 0}, "num_columns"),
            ({"indices": torch.tensor([0.5])}, "integer"),
            ({"indices": torch.tensor([10])}, r"\[0, 10\)"),
        ]
        for overrides, message in cases:
            arguments = {"kernel": kernel, "points": gamma, "coefficients": a, "landmarks": beta, **overrides}
            with self.subTest(overrides=list(overrides)), self.assertRaisesRegex(ValueError, message):
                landmark_quadratic_form(**arguments)


if __name__ == "__main__":
    unittest.main()
