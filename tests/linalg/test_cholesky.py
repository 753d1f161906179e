#!/usr/bin/env python3

from __future__ import annotations

import unittest
import warnings

import pytest
import torch
from gpytorch.utils.warnings import NumericalWarning
from hypothesis import given, settings
from hypothesis import strategies as st
from linear_operator.utils.errors import NotPSDError
from torch._dynamo.utils import counters

from gpytorch_decoupled.linalg import jittered_cholesky, reset_jitter_warnings
from gpytorch_decoupled.linalg.cholesky import _escalated_if_failed


def _random_spd(n: int, *batch: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(*batch, n, n, generator=generator, dtype=torch.float64)
    return (X @ X.mT / n + torch.eye(n, dtype=torch.float64)).to(dtype)


def _rank_deficient_kernel(n: int = 30, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    # Duplicated inputs make the RBF matrix exactly singular; rounding then makes it indefinite.
    x = torch.linspace(0, 1, n // 2, dtype=torch.float64).repeat(2).unsqueeze(-1)
    return torch.exp(-0.5 * torch.cdist(x, x).pow(2) / 0.3**2).to(dtype)


def _numerical_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, NumericalWarning)]


class TestJitteredCholesky(unittest.TestCase):
    def setUp(self):
        reset_jitter_warnings()

    def test_matches_torch_on_spd(self):
        for dtype in (torch.float32, torch.float64):
            A = _random_spd(7, 3, dtype=dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("error", NumericalWarning)
                L = jittered_cholesky(A)
            self.assertEqual(L.dtype, dtype)
            self.assertEqual(L.shape, A.shape)
            torch.testing.assert_close(L, torch.linalg.cholesky(A.double()).to(dtype), rtol=0, atol=0)
            torch.testing.assert_close(L, torch.linalg.cholesky(A), rtol=1e-5, atol=1e-6)

    def test_rank_deficient_escalates_and_warns_once(self):
        K = _rank_deficient_kernel()
        self.assertTrue(torch.linalg.cholesky_ex(K).info.item() > 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L = jittered_cholesky(K, name="K_duplicates")
            L_again = jittered_cholesky(K, name="K_duplicates")
        numerical = _numerical_warnings(caught)
        self.assertEqual(len(numerical), 1)
        self.assertIn("K_duplicates", str(numerical[0].message))
        torch.testing.assert_close(L, L_again, rtol=0, atol=0)

        # The factor is that of K + eps I with eps one of the escalation steps 1e-8 * 10^k * mean(diag K).
        residual = L @ L.mT - K
        eps = residual.diagonal().mean()
        torch.testing.assert_close(residual, eps * torch.eye(K.shape[-1], dtype=K.dtype), rtol=0, atol=1e-13)
        steps = 1e-8 * 10.0 ** torch.arange(6, dtype=K.dtype)
        self.assertTrue(torch.isclose(steps, eps, rtol=1e-6).any(), f"jitter {eps} is not an escalation step")

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jittered_cholesky(K, name="another_name")
        self.assertEqual(len(_numerical_warnings(caught)), 1)

    def test_reset_jitter_warnings(self):
        K = _rank_deficient_kernel()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jittered_cholesky(K, name="K_reset")
            reset_jitter_warnings()
            jittered_cholesky(K, name="K_reset")
        self.assertEqual(len(_numerical_warnings(caught)), 2)

    def test_float32_rank_deficient(self):
        K = _rank_deficient_kernel(dtype=torch.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L = jittered_cholesky(K, name="K_float32")
        self.assertEqual(len(_numerical_warnings(caught)), 1)
        self.assertEqual(L.dtype, torch.float32)
        self.assertTrue(torch.isfinite(L).all())
        torch.testing.assert_close(L @ L.mT, K, rtol=0, atol=1e-4)

    def test_only_failing_members_get_jitter(self):
        good = _random_spd(30)
        batch = torch.stack([good, _rank_deficient_kernel(), good])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumericalWarning)
            L = jittered_cholesky(batch, name="batch")
        exact = torch.linalg.cholesky(good)
        torch.testing.assert_close(L[0], exact, rtol=0, atol=0)
        torch.testing.assert_close(L[2], exact, rtol=0, atol=0)
        self.assertGreater((L[1] @ L[1].mT - batch[1]).diagonal().min().item(), 0.0)

    def test_given_jitter_is_added_to_every_member(self):
        A = _random_spd(5, 2)
        L = jittered_cholesky(A, jitter=1e-3)
        torch.testing.assert_close(L @ L.mT, A + 1e-3 * torch.eye(5, dtype=A.dtype), rtol=1e-12, atol=1e-12)

    def test_given_jitter_escalates_from_it(self):
        K = _rank_deficient_kernel()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L = jittered_cholesky(K, jitter=1e-20, name="K_given_jitter")
        self.assertEqual(len(_numerical_warnings(caught)), 1)
        eps = (L @ L.mT - K).diagonal().mean()
        steps = 1e-19 * 10.0 ** torch.arange(6, dtype=K.dtype)
        self.assertTrue(torch.isclose(steps, eps, rtol=1e-3).any(), f"jitter {eps} is not an escalation step")

    def test_indefinite_raises(self):
        A = torch.diag(torch.tensor([1.0, -1.0]))
        with self.assertRaises(NotPSDError) as context:
            jittered_cholesky(A, name="K_indefinite")
        message = str(context.exception)
        self.assertIn("K_indefinite", message)
        self.assertIn("(2, 2)", message)
        self.assertIn("float32", message)
        self.assertIn("1.0e-01", message)  # largest jitter tried: 1e-6 * 10^5 * mean |diag|

    def test_no_escalation_allowed_raises(self):
        with self.assertRaises(NotPSDError):
            jittered_cholesky(_rank_deficient_kernel(), max_tries=0, name="K_no_tries")

    def test_bad_input_raises_value_error(self):
        for bad in (float("nan"), float("inf")):
            A = _random_spd(3)
            A[0, 1] = bad
            with self.assertRaisesRegex(ValueError, "K_bad.*contains NaN or inf"):
                jittered_cholesky(A, name="K_bad")
        with self.assertRaisesRegex(ValueError, "square"):
            jittered_cholesky(torch.ones(2, 3))
        with self.assertRaisesRegex(ValueError, "square"):
            jittered_cholesky(torch.ones(3))

    def test_gradcheck(self):
        A = _random_spd(4, seed=1).requires_grad_(True)
        self.assertTrue(torch.autograd.gradcheck(lambda X: jittered_cholesky((X + X.mT) / 2), (A,)))

    def test_gradient_matches_torch(self):
        for dtype in (torch.float32, torch.float64):
            A = _random_spd(6, 2, seed=2, dtype=dtype)
            upstream = torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(3), dtype=dtype)
            ours = torch.autograd.grad((jittered_cholesky(A.requires_grad_(True)) * upstream).sum(), A)[0]
            reference = torch.autograd.grad((torch.linalg.cholesky(A.double()) * upstream).sum(), A)[0]
            self.assertEqual(ours.dtype, dtype)
            torch.testing.assert_close(ours, reference.to(dtype), rtol=1e-5, atol=1e-6)

    def test_gradient_through_jitter(self):
        K = _rank_deficient_kernel().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumericalWarning)
            L = jittered_cholesky(K, name="K_grad")
        eps = (L @ L.mT - K).diagonal().mean().detach()
        upstream = torch.randn(K.shape, generator=torch.Generator().manual_seed(4), dtype=K.dtype)
        ours = torch.autograd.grad((L * upstream).sum(), K)[0]
        shifted = torch.linalg.cholesky(K + eps * torch.eye(K.shape[-1], dtype=K.dtype))
        reference = torch.autograd.grad((shifted * upstream).sum(), K)[0]
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)

    @settings(max_examples=40, deadline=None)
    @given(
        n=st.integers(min_value=1, max_value=16),
        batch=st.sampled_from([(), (3,), (2, 2)]),
        seed=st.integers(min_value=0, max_value=2**31 - 1),
        log_scale=st.floats(min_value=-6.0, max_value=6.0),
    )
    def test_reconstruction_property(self, n, batch, seed, log_scale):
        A = 10.0**log_scale * _random_spd(n, *batch, seed=seed)
        L = jittered_cholesky(A)
        self.assertTrue(torch.equal(L, L.tril()))
        self.assertTrue((L.diagonal(dim1=-2, dim2=-1) > 0).all())
        torch.testing.assert_close(L @ L.mT, A, rtol=1e-12, atol=1e-12 * 10.0**log_scale)

    @pytest.mark.cuda
    def test_cuda(self):
        batch = torch.stack([_random_spd(30), _rank_deficient_kernel()]).cuda().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumericalWarning)
            L = jittered_cholesky(batch, name="K_cuda")
        self.assertEqual(L.device, batch.device)
        torch.testing.assert_close(L[0], torch.linalg.cholesky(batch[0]), rtol=1e-12, atol=1e-12)
        L.sum().backward()
        self.assertTrue(torch.isfinite(batch.grad).all())
        with self.assertRaises(NotPSDError):
            jittered_cholesky(torch.diag(torch.tensor([1.0, -1.0], device="cuda")))

    @pytest.mark.cuda
    def test_cuda_compiled_escalation_equals_eager(self):
        # On a GPU the compiled escalation's operator runs outside CUDA graphs.
        self._assert_compiled_equals_eager("cuda")

    def test_compiled_escalation_equals_eager(self):
        self._assert_compiled_equals_eager("cpu")

    def _assert_compiled_equals_eager(self, device: str):
        never = torch.diag(torch.tensor([1.0, -1.0], dtype=torch.float64))
        cases = [
            (torch.stack([_random_spd(6), _rank_deficient_kernel(6)]), None),  # one member escalates
            (_random_spd(6, 2), None),  # no escalation
            (_rank_deficient_kernel(6, dtype=torch.float32), None),  # float32's relative jitter
            (_rank_deficient_kernel(6), 1e-9),  # escalation from a given jitter
        ]
        for A, jitter in cases:
            A = A.to(device)
            compiled = torch.compile(
                lambda A, jitter=jitter: jittered_cholesky(A, jitter=jitter), backend="aot_eager", fullgraph=True
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NumericalWarning)
                torch.testing.assert_close(compiled(A), jittered_cholesky(A, jitter=jitter), rtol=1e-12, atol=0)
        # a member that never factorizes: NaN instead of an error
        compiled = torch.compile(jittered_cholesky, backend="aot_eager", fullgraph=True)
        L = compiled(torch.stack([never, torch.eye(2, dtype=torch.float64)]).to(device))
        self.assertTrue(L[0].isnan().all())
        torch.testing.assert_close(L[1], torch.eye(2, dtype=torch.float64, device=device))

    def test_escalation_operator(self):
        # The operator of the compiled escalation, called directly: the eager factor (transposed, row-major), and a
        # valid operator.
        A = torch.stack([_random_spd(6), _rank_deficient_kernel(6)])
        for matrix in (A, A[:1]):
            first, info = torch.linalg.cholesky_ex(matrix)
            member_jitter = torch.zeros(matrix.shape[:-2], dtype=torch.float64)
            arguments = (matrix, first, info, member_jitter, 0.0, 1e-8, 6)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NumericalWarning)
                expected = jittered_cholesky(matrix)
            upper = _escalated_if_failed(*arguments)
            self.assertTrue(upper.is_contiguous())
            torch.testing.assert_close(upper.mT, expected, rtol=1e-12, atol=0)
            torch.library.opcheck(_escalated_if_failed, arguments)

    @pytest.mark.inductor
    def test_compiled_factorization_is_cached_on_disk(self):
        # The escalation is an operator, not a torch.cond branch, so Inductor's on-disk graph cache keeps graphs that
        # factorize (it skips graphs with torch.cond): a second process does not compile the training step from scratch.
        counters.clear()
        compiled = torch.compile(lambda A: jittered_cholesky(A).sum(), fullgraph=True)
        A = _random_spd(6)
        torch.testing.assert_close(compiled(A), jittered_cholesky(A).sum(), rtol=1e-12, atol=0)
        self.assertEqual(counters["inductor"]["fxgraph_cache_bypass"], 0)
        self.assertGreaterEqual(
            counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"], 1
        )


if __name__ == "__main__":
    unittest.main()


def _spd(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    root = torch.randn(3, n, n, generator=generator, dtype=torch.float64)
    return (root @ root.mT + n * torch.eye(n, dtype=torch.float64)).to(dtype)


def test_derivatives_are_those_of_torch_cholesky() -> None:
    # float64: the gradient and the forward-mode tangent (vectorized, as SRGP takes them) equal torch.linalg.cholesky's
    # to rounding; float32: the backward runs in float32 from the float32 factor, within float32 accuracy of float64.
    A = _spd(7, torch.float64)
    weights = torch.randn(3, 7, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours, theirs = A.clone().requires_grad_(True), A.clone().requires_grad_(True)
    (jittered_cholesky(ours) * weights).sum().backward()
    (torch.linalg.cholesky(theirs) * weights).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    tangents = torch.stack([weights + weights.mT, weights.mT @ weights])  # two directions, each of the batch of 3
    ours_tangent = torch.func.vmap(lambda t: torch.func.jvp(jittered_cholesky, (A,), (t,))[1])(tangents)
    theirs_tangent = torch.func.vmap(lambda t: torch.func.jvp(torch.linalg.cholesky, (A,), (t,))[1])(tangents)
    torch.testing.assert_close(ours_tangent, theirs_tangent, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a: jittered_cholesky(0.5 * (a + a.mT)), (A[0].clone().requires_grad_(True),))

    single = A.float().requires_grad_(True)
    (jittered_cholesky(single) * weights.float()).sum().backward()
    assert single.grad.dtype == torch.float32
    relative = (single.grad.double() - theirs.grad).abs().max() / theirs.grad.abs().max()
    assert relative < 1e-5


def test_second_derivatives_are_those_of_torch_cholesky() -> None:
    # Hessians (double backward) flow through the factor as through torch.linalg.cholesky: the dual family's Hessian
    # identities differentiate twice through jittered_cholesky.
    A = _spd(5, torch.float64)[0]
    weights = torch.randn(5, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def objective(cholesky):
        return lambda a: (cholesky(0.5 * (a + a.mT)) * weights).sum() ** 2

    ours = torch.autograd.functional.hessian(objective(jittered_cholesky), A)
    theirs = torch.autograd.functional.hessian(objective(torch.linalg.cholesky), A)
    assert theirs.abs().max() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradgradcheck(
        lambda a: jittered_cholesky(0.5 * (a + a.mT)), (A.clone().requires_grad_(True),)
    )
