"""add_to_diagonal and identity_like against torch.eye (float64, exact), with gradients and batches."""

from __future__ import annotations

import torch

from gpytorch_decoupled.linalg import add_to_diagonal, identity_like


def test_add_to_diagonal_equals_the_dense_shift_and_leaves_its_input():
    A = torch.randn(3, 5, 5, dtype=torch.float64)
    before = A.clone()
    torch.testing.assert_close(add_to_diagonal(A, 0.25), A + 0.25 * torch.eye(5, dtype=torch.float64), rtol=0, atol=0)
    values = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    expected = A + values[:, None, None] * torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(add_to_diagonal(A, values), expected, rtol=0, atol=0)
    assert torch.equal(A, before)


def test_add_to_diagonal_passes_gradients_to_the_matrix_and_the_shift():
    A = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    value = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(4, 4, dtype=torch.float64)
    (add_to_diagonal(A, value) * weights).sum().backward()
    torch.testing.assert_close(A.grad, weights, rtol=0, atol=0)
    torch.testing.assert_close(value.grad, weights.diagonal().sum(), rtol=1e-15, atol=0)


def test_identity_like_takes_size_dtype_and_device_from_its_argument():
    identity = identity_like(torch.zeros(2, 3, 6, dtype=torch.float32))
    assert identity.shape == (6, 6) and identity.dtype == torch.float32
    torch.testing.assert_close(identity, torch.eye(6), rtol=0, atol=0)
