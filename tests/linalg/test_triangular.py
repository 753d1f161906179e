#!/usr/bin/env python3

from __future__ import annotations

import functools
import unittest

import torch

from gpytorch_decoupled.linalg import cholesky_logdet, cholesky_solve, solve_lower, solve_lower_transpose


class TestTriangularSolves(unittest.TestCase):
    def setUp(self):
        generator = torch.Generator().manual_seed(0)
        X = torch.randn(2, 3, 6, 6, generator=generator, dtype=torch.float64)
        self.K = X @ X.mT / 6 + torch.eye(6, dtype=torch.float64)
        self.L = torch.linalg.cholesky(self.K)
        # Broadcasts against the (2, 3) batch of factors.
        self.B = torch.randn(3, 6, 4, generator=generator, dtype=torch.float64)

    def test_solve_lower(self):
        X = solve_lower(self.L, self.B)
        self.assertEqual(X.shape, (2, 3, 6, 4))
        torch.testing.assert_close(X, torch.linalg.solve(self.L, self.B), rtol=1e-10, atol=1e-12)

    def test_solve_lower_transpose(self):
        X = solve_lower_transpose(self.L, self.B)
        self.assertEqual(X.shape, (2, 3, 6, 4))
        torch.testing.assert_close(X, torch.linalg.solve(self.L.mT, self.B), rtol=1e-10, atol=1e-12)

    def test_cholesky_solve(self):
        X = cholesky_solve(self.L, self.B)
        self.assertEqual(X.shape, (2, 3, 6, 4))
        torch.testing.assert_close(X, torch.linalg.inv(self.K) @ self.B, rtol=1e-10, atol=1e-12)
        # Batched right-hand sides against a single factor.
        X = cholesky_solve(self.L[0, 0], self.B)
        torch.testing.assert_close(X, torch.linalg.solve(self.K[0, 0], self.B), rtol=1e-10, atol=1e-12)

    def test_cholesky_logdet(self):
        logdet = cholesky_logdet(self.L)
        self.assertEqual(logdet.shape, (2, 3))
        torch.testing.assert_close(logdet, torch.logdet(self.K), rtol=1e-12, atol=1e-12)

    def test_gradients_match_dense(self):
        L = self.L[0, 0].clone().requires_grad_(True)
        B = self.B[0].clone().requires_grad_(True)
        ours = torch.autograd.grad(cholesky_solve(L, B).sum() + cholesky_logdet(L), (L, B))
        K = L @ L.mT
        dense = torch.autograd.grad(torch.linalg.solve(K, B).sum() + torch.logdet(K), (L, B))
        # Only the lower triangle of L is read, so its upper triangle gets no gradient.
        torch.testing.assert_close(ours[0], dense[0].tril(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ours[1], dense[1], rtol=1e-10, atol=1e-12)

    def test_one_and_many_columns_agree(self):
        # One right-hand side is solved from the left, several from the right (the faster form on the CPU): the same
        # solution, gradient and forward-mode derivative either way.
        for solve, dense in ((solve_lower, self.L[0, 0]), (solve_lower_transpose, self.L[0, 0].mT)):
            L = self.L[0, 0].clone().requires_grad_(True)
            B = self.B[0].clone().requires_grad_(True)
            many = solve(L, B)
            columns = torch.cat([solve(L, B[:, j : j + 1]) for j in range(B.size(-1))], dim=-1)
            torch.testing.assert_close(many, columns, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(many, torch.linalg.solve(dense, B), rtol=1e-10, atol=1e-12)
            weights = torch.randn_like(B)
            gradients = torch.autograd.grad((many * weights).sum(), (L, B))
            by_column = torch.autograd.grad((columns * weights).sum(), (L, B))
            for ours, reference in zip(gradients, by_column):
                torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
            tangent = torch.randn_like(B)
            _, derivative = torch.func.jvp(functools.partial(solve, self.L[0, 0]), (B.detach(),), (tangent,))
            torch.testing.assert_close(derivative, solve(self.L[0, 0], tangent), rtol=1e-12, atol=1e-13)


if __name__ == "__main__":
    unittest.main()
