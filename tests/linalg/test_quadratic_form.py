#!/usr/bin/env python3

from __future__ import annotations

import itertools
import math
import unittest
from collections.abc import Callable

import gpytorch
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gpytorch_decoupled.linalg import column_sampled_quadratic_form

Kernel = Callable[[Tensor, Tensor], Tensor]


def _rbf(lengthscale: Tensor | float) -> Kernel:
    # Elementwise differences (no matmul trick), so that every entry of a kernel block is bitwise equal to the
    # corresponding entry of the dense matrix.
    def kernel(x1: Tensor, x2: Tensor) -> Tensor:
        return torch.exp(-0.5 * (x1.unsqueeze(-2) - x2.unsqueeze(-3)).pow(2).sum(-1) / lengthscale**2)

    return kernel


def _dense_quadratic_form(kernel: Kernel, alpha: Tensor, v: Tensor) -> Tensor:
    return (v.unsqueeze(-2) @ kernel(alpha, alpha) @ v.unsqueeze(-1)).squeeze(-1).squeeze(-1)


def _dense_estimator(kernel: Kernel, gamma: Tensor, v_gamma: Tensor, beta: Tensor, v_beta: Tensor, indices: Tensor):
    # The spec formula, written with the full dense K_{alpha alpha}.
    alpha, v = torch.cat([gamma, beta], -2), torch.cat([v_gamma, v_beta], -1)
    K_times_v = (kernel(alpha, alpha) @ v.unsqueeze(-1)).squeeze(-1)
    m_gamma = gamma.shape[-2]
    sampled = (m_gamma / indices.numel()) * (v_gamma[..., indices] * K_times_v[..., indices]).sum(-1)
    return sampled + (v_beta * K_times_v[..., m_gamma:]).sum(-1)


def _data(m_gamma: int, m_beta: int, *latents: int, seed: int = 0, dim: int = 2):
    generator = torch.Generator().manual_seed(seed)
    gamma = torch.randn(m_gamma, dim, generator=generator, dtype=torch.float64)
    beta = torch.randn(m_beta, dim, generator=generator, dtype=torch.float64)
    v_gamma = torch.randn(*latents, m_gamma, generator=generator, dtype=torch.float64)
    v_beta = torch.randn(*latents, m_beta, generator=generator, dtype=torch.float64)
    return gamma, v_gamma, beta, v_beta


class TestExactMode(unittest.TestCase):
    def test_blocked_matches_dense(self):
        gamma, v_gamma, beta, v_beta = _data(37, 11, 3)
        # Kernel batch (2, 1) broadcasts against the 3 latents.
        kernel = _rbf(torch.tensor([0.7, 1.3], dtype=torch.float64).view(2, 1, 1, 1))
        alpha, v = torch.cat([gamma, beta]), torch.cat([v_gamma, v_beta], -1)
        expected = _dense_quadratic_form(kernel, alpha, v)
        self.assertEqual(expected.shape, (2, 3))
        for block_size in (5, 48, 4096):
            q = column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, block_size=block_size)
            torch.testing.assert_close(q, expected, rtol=1e-12, atol=0)
            q = column_sampled_quadratic_form(kernel, alpha, v, block_size=block_size)
            torch.testing.assert_close(q, expected, rtol=1e-12, atol=0)

    def test_num_columns_at_least_m_gamma_is_exact(self):
        gamma, v_gamma, beta, v_beta = _data(9, 4)
        kernel = _rbf(1.0)
        expected = _dense_quadratic_form(kernel, torch.cat([gamma, beta]), torch.cat([v_gamma, v_beta]))
        for num_columns in (9, 20):
            q = column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, num_columns=num_columns)
            torch.testing.assert_close(q, expected, rtol=1e-12, atol=0)

    def test_batched_inputs_broadcast(self):
        generator = torch.Generator().manual_seed(1)
        gamma = torch.randn(2, 13, 2, generator=generator, dtype=torch.float64)
        _, v_gamma, beta, v_beta = _data(13, 5, seed=2)
        kernel = _rbf(0.9)
        q = column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, block_size=4)
        self.assertEqual(q.shape, (2,))
        for i in range(2):
            alpha = torch.cat([gamma[i], beta])
            expected = _dense_quadratic_form(kernel, alpha, torch.cat([v_gamma, v_beta]))
            torch.testing.assert_close(q[i], expected, rtol=1e-12, atol=0)

    def test_blocked_gradient_matches_dense(self):
        gamma, v_gamma, beta, v_beta = _data(23, 6, 2)
        leaves = [gamma, v_gamma, beta, v_beta, torch.tensor(0.8, dtype=torch.float64)]
        for leaf in leaves:
            leaf.requires_grad_(True)
        lengthscale = leaves[-1]

        q = column_sampled_quadratic_form(_rbf(lengthscale), gamma, v_gamma, beta, v_beta, block_size=4)
        ours = torch.autograd.grad(q.sum(), leaves)
        alpha, v = torch.cat([gamma, beta]), torch.cat([v_gamma, v_beta], -1)
        dense = torch.autograd.grad(_dense_quadratic_form(_rbf(lengthscale), alpha, v).sum(), leaves)
        for grad, expected in zip(ours, dense, strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)

    @settings(max_examples=30, deadline=None)
    @given(
        m_gamma=st.integers(min_value=0, max_value=25),
        m_beta=st.integers(min_value=0, max_value=8),
        block_size=st.integers(min_value=1, max_value=30),
        latents=st.sampled_from([(), (2,)]),
        seed=st.integers(min_value=0, max_value=2**31 - 1),
    )
    def test_exact_matches_dense_property(self, m_gamma, m_beta, block_size, latents, seed):
        gamma, v_gamma, beta, v_beta = _data(m_gamma, m_beta, *latents, seed=seed)
        kernel = _rbf(1.1)
        alpha, v = torch.cat([gamma, beta]), torch.cat([v_gamma, v_beta], -1)
        expected = _dense_quadratic_form(kernel, alpha, v)
        scale = _dense_quadratic_form(kernel, alpha, v.abs())
        if m_beta == 0:
            beta = v_beta = None
        q = column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, block_size=block_size)
        self.assertEqual(q.shape, expected.shape)
        self.assertTrue(((q - expected).abs() <= 1e-12 * scale + 1e-300).all())


class TestSampledMode(unittest.TestCase):
    def test_explicit_indices_match_dense_formula(self):
        gamma, v_gamma, beta, v_beta = _data(15, 6, 3)
        kernel = _rbf(torch.tensor([0.7, 1.3], dtype=torch.float64).view(2, 1, 1, 1))
        indices = torch.tensor([4, 0, 9, 14])
        expected = _dense_estimator(kernel, gamma, v_gamma, beta, v_beta, indices)
        self.assertEqual(expected.shape, (2, 3))
        # block_size 3 splits the 4 sampled rows and the 6 beta rows over several blocks.
        for block_size in (3, 4096):
            q = column_sampled_quadratic_form(
                kernel, gamma, v_gamma, beta, v_beta, indices=indices, num_columns=4, block_size=block_size
            )
            torch.testing.assert_close(q, expected, rtol=1e-12, atol=0)

        empty = torch.empty(0, 2, dtype=torch.float64)
        no_beta = _dense_estimator(kernel, gamma, v_gamma, empty, v_beta[..., :0], indices)
        q = column_sampled_quadratic_form(kernel, gamma, v_gamma, indices=indices)
        torch.testing.assert_close(q, no_beta, rtol=1e-12, atol=0)

    def _average_over_all_subsets(self, with_beta: bool):
        gamma, v_gamma, beta, v_beta = _data(5, 3, 2, seed=3)
        covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
        covar_module.base_kernel.lengthscale = torch.tensor([0.6, 1.4])
        covar_module.outputscale = 1.7
        kernel = lambda x1, x2: covar_module(x1, x2).to_dense()  # noqa: E731
        if not with_beta:
            beta = v_beta = None
        leaves = [gamma, v_gamma, *(() if beta is None else (beta, v_beta))]
        for leaf in leaves:
            leaf.requires_grad_(True)
        leaves += list(covar_module.parameters())

        if beta is None:
            exact = _dense_quadratic_form(kernel, gamma, v_gamma)
        else:
            exact = _dense_quadratic_form(kernel, torch.cat([gamma, beta]), torch.cat([v_gamma, v_beta], -1))
        exact_grads = torch.autograd.grad(exact.sum(), leaves)

        subsets = list(itertools.combinations(range(5), 2))
        self.assertEqual(len(subsets), math.comb(5, 2))
        total, total_grads = 0.0, [torch.zeros_like(leaf) for leaf in leaves]
        for subset in subsets:
            q = column_sampled_quadratic_form(
                kernel, gamma, v_gamma, beta, v_beta, num_columns=2, indices=torch.tensor(subset)
            )
            total = total + q.detach()
            for accumulated, grad in zip(total_grads, torch.autograd.grad(q.sum(), leaves), strict=True):
                accumulated += grad
        torch.testing.assert_close(total / len(subsets), exact.detach(), rtol=1e-12, atol=1e-12)
        for accumulated, expected in zip(total_grads, exact_grads, strict=True):
            torch.testing.assert_close(accumulated / len(subsets), expected, rtol=1e-12, atol=1e-12)

    def test_average_over_all_subsets_is_exact(self):
        self._average_over_all_subsets(with_beta=True)

    def test_average_over_all_subsets_is_exact_without_beta(self):
        self._average_over_all_subsets(with_beta=False)

    def test_monte_carlo_unbiased(self):
        gamma, v_gamma, beta, v_beta = _data(200, 10, seed=4)
        # Positive coefficients keep the spread small relative to Q, so the 5 s.e. band is tight (about 3 %).
        v_gamma = v_gamma.abs()
        kernel = _rbf(1.0)
        exact = _dense_quadratic_form(kernel, torch.cat([gamma, beta]), torch.cat([v_gamma, v_beta]))
        generator = torch.Generator().manual_seed(5)
        draws = torch.stack(
            [
                column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, num_columns=20, generator=generator)
                for _ in range(1000)
            ]
        )
        standard_error = draws.std() / math.sqrt(draws.numel())
        self.assertGreater(draws.std().item(), 1e-3 * exact.abs().item())  # the estimator really is random
        self.assertLess((draws.mean() - exact).abs().item(), 5 * standard_error.item())

    def test_generator_reproducible(self):
        gamma, v_gamma, beta, v_beta = _data(50, 4, seed=6)
        kernel = _rbf(0.5)

        def estimate(seed: int) -> Tensor:
            generator = torch.Generator().manual_seed(seed)
            return column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, 5, generator=generator)

        torch.testing.assert_close(estimate(7), estimate(7), rtol=0, atol=0)
        self.assertNotEqual(estimate(7).item(), estimate(8).item())


class TestMemory(unittest.TestCase):
    def test_exact_mode_never_requests_a_full_block(self):
        m_gamma, block_size = 20_000, 1_000
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(m_gamma, 3, generator=generator, dtype=torch.float64)
        v = torch.randn(m_gamma, generator=generator, dtype=torch.float64)
        requested = []

        def linear_kernel(x1: Tensor, x2: Tensor) -> Tensor:
            if x1.shape[-2] > 0:  # a block of no rows (the probe for a fused path) evaluates nothing
                requested.append((x1.shape[-2], x2.shape[-2]))
            return x1 @ x2.mT

        with torch.no_grad():
            q = column_sampled_quadratic_form(linear_kernel, x, v, block_size=block_size)
        self.assertEqual(len(requested), m_gamma // block_size)
        self.assertTrue(all(rows <= block_size for rows, _ in requested))
        # For the linear kernel, v^T X X^T v = ||X^T v||^2 without any M x M matrix.
        torch.testing.assert_close(q, (x.mT @ v).pow(2).sum(), rtol=1e-10, atol=0)

    def test_autograd_does_not_keep_kernel_blocks(self):
        m_gamma, m_beta, block_size = 3_000, 100, 250
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(m_gamma + m_beta, 3, generator=generator, dtype=torch.float64, requires_grad=True)
        v = torch.randn(m_gamma + m_beta, generator=generator, dtype=torch.float64, requires_grad=True)
        requested_rows = []

        def linear_kernel(x1: Tensor, x2: Tensor) -> Tensor:
            requested_rows.append(x1.shape[-2])
            return x1 @ x2.mT

        largest_saved = 0

        def pack(tensor: Tensor) -> Tensor:
            nonlocal largest_saved
            largest_saved = max(largest_saved, tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            q = column_sampled_quadratic_form(
                linear_kernel, x[:m_gamma], v[:m_gamma], x[m_gamma:], v[m_gamma:], block_size=block_size
            )
        grad_x, grad_v = torch.autograd.grad(q, (x, v))
        self.assertLess(largest_saved, block_size * (m_gamma + m_beta))
        self.assertTrue(all(rows <= block_size for rows in requested_rows))

        projection = x.detach().mT @ v.detach()
        torch.testing.assert_close(q, projection.pow(2).sum(), rtol=1e-10, atol=0)
        torch.testing.assert_close(grad_v, 2 * x.detach() @ projection, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grad_x, 2 * v.detach().unsqueeze(-1) * projection, rtol=1e-10, atol=1e-10)


class TestValidation(unittest.TestCase):
    def test_bad_arguments(self):
        gamma, v_gamma, beta, v_beta = _data(6, 2)
        kernel = _rbf(1.0)
        cases = [
            ({"beta": beta}, "together"),
            ({"v_beta": v_beta}, "together"),
            ({"v_gamma": v_gamma[:5]}, "v_gamma"),
            ({"beta": beta, "v_beta": v_beta[:1]}, "v_beta"),
            ({"gamma": gamma[0]}, "gamma"),
            ({"num_columns": 0}, "num_columns"),
            ({"block_size": 0}, "block_size"),
            ({"indices": torch.tensor([1, 1])}, "distinct"),
            ({"indices": torch.tensor([0, 6])}, r"\[0, 6\)"),
            ({"indices": torch.tensor([0.0, 1.0])}, "integer"),
            ({"indices": torch.tensor([0, 1]), "num_columns": 3}, "does not match"),
        ]
        for overrides, message in cases:
            arguments = {"gamma": gamma, "v_gamma": v_gamma, **overrides}
            with self.subTest(overrides=list(overrides)), self.assertRaisesRegex(ValueError, message):
                column_sampled_quadratic_form(kernel, **arguments)


@pytest.mark.cuda
class TestCuda(unittest.TestCase):
    def test_cuda(self):
        gamma, v_gamma, beta, v_beta = (t.cuda() for t in _data(40, 7, 2))
        kernel = _rbf(0.8)
        expected = _dense_quadratic_form(kernel, torch.cat([gamma, beta]), torch.cat([v_gamma, v_beta], -1))
        q = column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, block_size=6)
        torch.testing.assert_close(q, expected, rtol=1e-12, atol=0)
        generator = torch.Generator(device="cuda").manual_seed(0)
        q = column_sampled_quadratic_form(kernel, gamma, v_gamma, beta, v_beta, num_columns=5, generator=generator)
        self.assertEqual(q.device, gamma.device)
        self.assertTrue(torch.isfinite(q).all())


if __name__ == "__main__":
    unittest.main()
