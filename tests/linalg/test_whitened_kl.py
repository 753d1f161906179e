"""whitened_kl: the KL divergence from the standard normal, from the Cholesky factor of the precision, against torch's
dense Gaussian KL in float64 (batched, with and without a mean); and symmetrized."""

from __future__ import annotations

import torch

from gpytorch_decoupled.linalg import symmetrized, whitened_kl

F64 = torch.float64


def _precisions(gen: torch.Generator) -> torch.Tensor:
    A = torch.randn(2, 3, 5, 5, generator=gen, dtype=F64)
    return A @ A.mT / 5 + torch.eye(5, dtype=F64)  # H >= I, as for the dual and decoupled strategies


def test_whitened_kl_equals_the_dense_gaussian_kl() -> None:
    gen = torch.Generator().manual_seed(0)
    H = _precisions(gen)
    m = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    standard = torch.distributions.MultivariateNormal(torch.zeros(5, dtype=F64), torch.eye(5, dtype=F64))
    for mean in (m, None):
        q = torch.distributions.MultivariateNormal(torch.zeros_like(m) if mean is None else mean, precision_matrix=H)
        expected = torch.distributions.kl_divergence(q, standard)
        actual = whitened_kl(torch.linalg.cholesky(H), mean)
        assert actual.shape == (2, 3)
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    # The identity precision and a zero mean: the standard normal itself.
    torch.testing.assert_close(whitened_kl(torch.eye(5, dtype=F64)), torch.zeros((), dtype=F64), rtol=0, atol=1e-15)


def test_symmetrized_is_the_symmetric_part() -> None:
    A = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    S = symmetrized(A)
    assert torch.equal(S, S.mT)
    torch.testing.assert_close(S + (A - A.mT) / 2, A, rtol=0, atol=1e-15)
