"""Roots of a PSD matrix and of its pseudo-inverse (the decoupled step's whitener and curvature root): from the Cholesky
factor where it is provably exact, from the eigendecomposition otherwise, and the same under torch.compile (one graph,
either branch, equal to eager)."""

from __future__ import annotations

import pytest
import torch

from gpytorch_decoupled.linalg import positive_part_root, pseudo_inverse_root
from tests.float64_problems import generator, randn

F64 = torch.float64
EPS = torch.finfo(torch.float32).eps


def _psd(eigenvalues: torch.Tensor, seed: int) -> torch.Tensor:
    basis = torch.linalg.qr(randn(eigenvalues.numel(), eigenvalues.numel(), gen=generator(seed)))[0]
    return (basis * eigenvalues) @ basis.mT


KEPT = torch.logspace(0, -3, 8, dtype=F64)
DROPPED = torch.cat([KEPT[:5], torch.full((3,), 1e-20, dtype=F64)])  # three eigenvalues below the tolerance
SINGULAR = torch.tensor([2.0, 1.0, 0.5, 0.0, 0.0, -1e-17, 0.3, 0.1], dtype=F64)


def test_pseudo_inverse_root_from_cholesky_or_eigenvalues() -> None:
    # Well conditioned: the Cholesky path (X = L^-T); eigenvalues at 1e-20 of the largest: the eigendecomposition
    # drops them. Either way X X^T is the pseudo-inverse at the tolerance (eps * size * largest).
    for eigenvalues in (KEPT, DROPPED):
        matrix = _psd(eigenvalues, 5)
        root = pseudo_inverse_root(matrix, EPS)
        expected = torch.linalg.pinv(matrix, rtol=EPS * 8, hermitian=True)
        torch.testing.assert_close(root @ root.mT, expected, rtol=1e-10, atol=1e-10 * expected.norm().item())
    cholesky_root = pseudo_inverse_root(_psd(KEPT, 5), EPS)
    assert torch.equal(cholesky_root.tril(-1), torch.zeros(8, 8, dtype=F64))  # L^-T: the Cholesky path was taken
    assert cholesky_root.is_contiguous()  # as the operator's fake declares it to the compiler


def test_positive_part_root_of_a_singular_matrix_falls_back_to_its_positive_part() -> None:
    for eigenvalues in (torch.logspace(0, -3, 6, dtype=F64), SINGULAR):
        matrix = _psd(eigenvalues, 6)
        root = positive_part_root(matrix)
        torch.testing.assert_close(root @ root.mT, _psd(eigenvalues.clamp_min(0), 6), rtol=0, atol=1e-14)
        assert root.is_contiguous()


def test_one_member_without_the_proof_takes_the_whole_batch_to_the_eigendecomposition() -> None:
    matrices = torch.stack([_psd(KEPT, 5), _psd(DROPPED, 5)])
    roots = pseudo_inverse_root(matrices, EPS)
    assert not torch.equal(roots[0].tril(-1), torch.zeros(8, 8, dtype=F64))  # not L^-T: the eigenvectors' root
    for root, matrix in zip(roots, matrices, strict=True):
        expected = torch.linalg.pinv(matrix, rtol=EPS * 8, hermitian=True)
        torch.testing.assert_close(root @ root.mT, expected, rtol=1e-10, atol=1e-10 * expected.norm().item())


@pytest.mark.parametrize("eigenvalues", [KEPT, DROPPED, SINGULAR], ids=["cholesky", "dropped", "singular"])
def test_compiled_roots_are_one_graph_and_equal_eager(eigenvalues: torch.Tensor) -> None:
    # The branch is taken inside an operator: fullgraph compilation succeeds for matrices that take either branch, and
    # the compiled roots are the eager ones (the same arithmetic).
    matrix = _psd(eigenvalues, 7)

    def roots(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pseudo_inverse_root(matrix, EPS), positive_part_root(matrix)

    compiled = torch.compile(roots, backend="aot_eager", fullgraph=True)
    for value, expected in zip(compiled(matrix), roots(matrix), strict=True):
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
