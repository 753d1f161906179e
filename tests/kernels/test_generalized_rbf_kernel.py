#!/usr/bin/env python3

from __future__ import annotations

import math
import unittest

import gpytorch
import torch
from torch.func import functional_call

from gpytorch_decoupled.kernels import GeneralizedRBFKernel

D = 3


def _reference(x1: torch.Tensor, x2: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Eq. (6.1) entry by entry; rows of width D have c = 1, rows of width 2D are [z, log c]."""

    def split(x):
        return (x[:D], torch.ones(D, dtype=x.dtype)) if x.numel() == D else (x[:D], x[D:].exp())

    s = s.detach()
    out = torch.empty(len(x1), len(x2), dtype=x1.dtype)
    for i in range(len(x1)):
        for j in range(len(x2)):
            (z, c), (zp, cp) = split(x1[i]), split(x2[j])
            value = 1.0
            for d in range(D):
                l, lp = s[d] * c[d], s[d] * cp[d]
                denominator = l**2 + lp**2
                value *= math.sqrt(2 * l * lp / denominator) * math.exp(-((z[d] - zp[d]) ** 2) / denominator)
            out[i, j] = value
    return out


class TestGeneralizedRBFKernel(unittest.TestCase):
    def setUp(self):
        self.generator = torch.Generator().manual_seed(0)
        self.kernel = GeneralizedRBFKernel(ard_num_dims=D).double()
        self.kernel.lengthscale = torch.tensor([0.7, 1.3, 2.1], dtype=torch.float64)
        self.x = self._randn(8, D)
        self.z = GeneralizedRBFKernel.basis_points(self._randn(5, D), self._randn(5, D).mul(0.7).exp())

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64)

    def _dense(self, x1, x2=None, kernel=None, **params):
        return (kernel or self.kernel)(x1, x2, **params).to_dense()

    def test_unit_multipliers_equal_rbf(self):
        rbf = gpytorch.kernels.RBFKernel(ard_num_dims=D).double()
        rbf.lengthscale = self.kernel.lengthscale
        x2 = self._randn(6, D)
        expected = rbf(self.x, x2).to_dense()
        padded1, padded2 = GeneralizedRBFKernel.basis_points(self.x), GeneralizedRBFKernel.basis_points(x2)
        for a, b in [(self.x, x2), (padded1, padded2), (self.x, padded2), (padded1, x2)]:
            torch.testing.assert_close(self._dense(a, b), expected, rtol=0, atol=1e-12)
            torch.testing.assert_close(self.kernel.forward(a, b), expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(self._dense(padded1), rbf(self.x).to_dense(), rtol=0, atol=1e-12)

    def test_matches_formula(self):
        s = self.kernel.lengthscale.squeeze(0)
        joint = torch.cat([GeneralizedRBFKernel.basis_points(self.x), self.z])
        for a, b in [(self.z, self.z), (self.x, self.z), (self.z, self.x), (joint, joint)]:
            torch.testing.assert_close(self._dense(a, b), _reference(a, b, s), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(self.kernel.forward(self.x, self.z), _reference(self.x, self.z, s))

    def test_symmetric_and_psd(self):
        multipliers = self._randn(30, D).exp()  # strongly varying length-scales
        joint = torch.cat([GeneralizedRBFKernel.basis_points(self._randn(20, D)), self.z])
        joint = torch.cat([joint, GeneralizedRBFKernel.basis_points(self._randn(30, D), multipliers)])
        K = self._dense(joint)
        torch.testing.assert_close(K, K.mT, rtol=0, atol=0)
        self.assertGreater(torch.linalg.eigvalsh(K).min().item(), -1e-10)
        torch.testing.assert_close(K.diagonal(), torch.ones(len(joint), dtype=torch.float64), rtol=0, atol=1e-14)

    def test_diag(self):
        z2 = GeneralizedRBFKernel.basis_points(self._randn(5, D), self._randn(5, D).exp())
        x2 = self._randn(5, D)
        for a, b in [(self.z, z2), (self.x[:5], z2), (self.z, x2), (self.x[:5], x2), (self.z, self.z)]:
            full = self._dense(a, b)
            torch.testing.assert_close(self.kernel(a, b, diag=True), full.diagonal(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(self.kernel.forward(a, b, diag=True), full.diagonal(), rtol=1e-12, atol=1e-14)

    def test_batch_shape(self):
        kernel = GeneralizedRBFKernel(ard_num_dims=D, batch_shape=torch.Size([2])).double()
        kernel.lengthscale = self._randn(2, 1, D).exp()
        self.assertEqual(kernel.lengthscale.shape, torch.Size([2, 1, D]))
        for a, b in [(self.x, self.z), (self.z, self.z), (self.x, self.x)]:
            K = self._dense(a, b, kernel=kernel)
            self.assertEqual(K.shape, torch.Size([2, len(a), len(b)]))
            for i in range(2):
                torch.testing.assert_close(K[i], _reference(a, b, kernel.lengthscale[i, 0]), rtol=1e-12, atol=1e-14)
        batched_z = torch.stack([self.z, self.z.flip(0)])
        K = self._dense(batched_z, self.x, kernel=kernel)
        torch.testing.assert_close(K[1], _reference(self.z.flip(0), self.x, kernel.lengthscale[1, 0]))
        torch.testing.assert_close(kernel(batched_z, diag=True), torch.ones(2, 5, dtype=torch.float64))

    def test_gradcheck(self):
        def covariance(x1, x2, raw_lengthscale):
            with gpytorch.settings.lazily_evaluate_kernels(False):
                return functional_call(self.kernel, {"raw_lengthscale": raw_lengthscale}, (x1, x2)).to_dense()

        raw = self.kernel.raw_lengthscale.detach().clone().requires_grad_(True)
        for a, b in [(self.x[:3], self.z[:4]), (self.z[:4], self.z[1:3]), (self.x[:3], self.x[3:5])]:
            inputs = (a.clone().requires_grad_(True), b.clone().requires_grad_(True), raw)
            self.assertTrue(torch.autograd.gradcheck(covariance, inputs))
            covariance(*inputs).sum().backward()
            self.assertTrue(all(torch.isfinite(t.grad).all() for t in inputs))

    def test_float32(self):
        kernel = GeneralizedRBFKernel(ard_num_dims=D)
        kernel.lengthscale = self.kernel.lengthscale.float()
        K = kernel(self.x.float(), self.z.float()).to_dense()
        self.assertEqual(K.dtype, torch.float32)
        torch.testing.assert_close(K, self._dense(self.x, self.z).float(), rtol=1e-5, atol=1e-6)

    def test_scale_kernel(self):
        covar_module = gpytorch.kernels.ScaleKernel(self.kernel).double()
        covar_module.outputscale = 2.5
        expected = 2.5 * _reference(self.x, self.z, self.kernel.lengthscale.squeeze(0))
        torch.testing.assert_close(covar_module(GeneralizedRBFKernel.basis_points(self.x), self.z).to_dense(), expected)
        torch.testing.assert_close(covar_module.forward(self.x, self.z), expected)
        torch.testing.assert_close(covar_module(self.z, diag=True), torch.full((5,), 2.5, dtype=torch.float64))

    def test_basis_point_helpers(self):
        points, multipliers = self._randn(4, D), self._randn(4, D).exp()
        z = GeneralizedRBFKernel.basis_points(points, multipliers)
        self.assertEqual(z.shape, torch.Size([4, 2 * D]))
        for result, expected in zip(self.kernel.split_basis_points(z), (points, multipliers)):
            torch.testing.assert_close(result, expected)
        locations, ones = self.kernel.split_basis_points(points)
        self.assertIs(locations, points)
        torch.testing.assert_close(ones, torch.ones_like(points))
        log_two = GeneralizedRBFKernel.basis_points(points, torch.tensor(2.0, dtype=torch.float64))[:, D:]
        torch.testing.assert_close(log_two, torch.full((4, D), math.log(2.0), dtype=torch.float64))
        self.assertEqual(self.kernel.data_dim, D)

    def test_bad_inputs(self):
        with self.assertRaisesRegex(ValueError, "ard_num_dims"):
            GeneralizedRBFKernel()
        with self.assertRaisesRegex(ValueError, "active_dims"):
            GeneralizedRBFKernel(ard_num_dims=D, active_dims=(0, 1, 2))
        bad = self._randn(4, D + 1)
        for a, b in [(bad, None), (self.x, bad), (bad, self.z), (bad, bad)]:
            with self.assertRaisesRegex(ValueError, f"width {D} .* or {2 * D} .*got width {D + 1}"):
                self.kernel(a, b)
        with self.assertRaisesRegex(ValueError, f"got width {D + 1}"):
            self.kernel.forward(bad, self.z)
        with self.assertRaises(ValueError):
            self.kernel.split_basis_points(bad)


if __name__ == "__main__":
    unittest.main()


def test_padded_data_rows_take_the_matrix_product_path_with_the_same_values_and_gradients():
    """Zero-padded data rows (as the strategies pass them) against learned basis rows: the O(NM) expansion agrees
    with the pairwise formula, values and gradients, in both argument orders."""
    torch.manual_seed(3)
    kernel = GeneralizedRBFKernel(ard_num_dims=3).double()
    kernel.lengthscale = torch.tensor([[0.7, 1.3, 2.0]], dtype=torch.float64)
    data = torch.nn.functional.pad(torch.randn(9, 3, dtype=torch.float64) * 3 + 5, (0, 3))
    basis = GeneralizedRBFKernel.basis_points(
        torch.randn(4, 3, dtype=torch.float64) * 3 + 5, torch.rand(4, 3, dtype=torch.float64) + 0.3
    ).requires_grad_(True)
    fast = kernel(data, basis).to_dense()
    (fast_grad,) = torch.autograd.grad(fast.square().sum(), basis)
    pairwise_data = data.clone().requires_grad_(True)  # a side with a gradient takes the general, pairwise path
    pairwise = kernel(pairwise_data, basis).to_dense()
    (pairwise_grad,) = torch.autograd.grad(pairwise.square().sum(), basis)
    torch.testing.assert_close(fast, pairwise, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(fast_grad, pairwise_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kernel(basis, data).to_dense(), pairwise.mT, rtol=1e-12, atol=1e-13)


def test_mixed_rows_with_unit_multipliers_keep_exact_values_and_first_derivatives():
    """Rows with c = 1 that need a gradient (fresh basis rows), data rows and other basis rows in one call, as the
    strategies concatenate them: values and first derivatives equal the term-by-term formula."""
    from gpytorch_decoupled.kernels.generalized_rbf_kernel import _pairwise_covariance

    torch.manual_seed(4)
    kernel = GeneralizedRBFKernel(ard_num_dims=2).double()
    rows = torch.randn(7, 2, dtype=torch.float64)
    log_c = torch.randn(7, 2, dtype=torch.float64) * 0.4
    log_c[[1, 4, 5]] = 0.0  # unit rows among the others
    x1 = torch.cat([rows, log_c], -1).requires_grad_(True)
    x2 = torch.cat([torch.randn(5, 2, dtype=torch.float64), torch.zeros(5, 2, dtype=torch.float64)], -1)
    x2 = torch.cat([x2, x1[:3]]).detach().requires_grad_(True)
    blocked = kernel(x1, x2).to_dense()
    scaled = [x[..., :2] / kernel.lengthscale for x in (x1, x2)]
    reference = _pairwise_covariance(
        scaled[0].unsqueeze(-2), x1[..., 2:].unsqueeze(-2), scaled[1].unsqueeze(-3), x2[..., 2:].unsqueeze(-3)
    )
    torch.testing.assert_close(blocked, reference, rtol=1e-12, atol=1e-13)
    weights = torch.randn_like(reference)
    grads = torch.autograd.grad((blocked * weights).sum(), (x1, x2, kernel.raw_lengthscale))
    reference_grads = torch.autograd.grad((reference * weights).sum(), (x1, x2, kernel.raw_lengthscale))
    for grad, expected in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_values_below_the_floor_are_raised_to_it_on_every_path_and_kept_above():
    """Far pairs (up to hundreds of length-scales) against basis rows, through the matrix-product path (data rows), the
    pairwise path (rows with a gradient) and the diagonal: no subnormal value, every value at least the floor of the
    dtype, and the formula's value (the reference, entry by entry in float64) wherever it is well above the floor."""
    from gpytorch_decoupled.linalg import exponent_floor

    # float32: the tail values carry the rounding of their exponents (up to about 70 here) times float32's epsilon
    # (float64: exponents up to about 500)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.float64, 1e-11)):
        kernel = GeneralizedRBFKernel(ard_num_dims=D).to(dtype)
        kernel.lengthscale = torch.tensor([[0.3, 0.5, 0.2]], dtype=dtype)
        floor = 2.0 ** exponent_floor(dtype)
        generator = torch.Generator().manual_seed(5)
        spread = 2.0 if dtype == torch.float32 else 12.0  # float64's floor is far: the points must be farther apart
        data = torch.randn(30, D, generator=generator, dtype=dtype) * spread
        basis = GeneralizedRBFKernel.basis_points(
            torch.randn(12, D, generator=generator, dtype=dtype) * spread,
            torch.rand(12, D, generator=generator, dtype=dtype) + 0.5,
        )
        reference = _reference(data.double(), basis.double(), kernel.lengthscale.double()[0])
        assert (reference < floor).float().mean() > 0.2  # many pairs are beyond the floor
        for block in (kernel(data, basis).to_dense(), kernel(data.clone().requires_grad_(True), basis).to_dense()):
            assert (block >= floor).all() and not ((block < torch.finfo(dtype).tiny) & (block != 0)).any()
            kept = reference > 1e6 * floor
            torch.testing.assert_close(block.double()[kept], reference[kept], rtol=tolerance, atol=0)
        pairs = torch.cat([data[:12].double(), torch.zeros(12, D, dtype=torch.float64)], -1).to(dtype)
        diagonal = kernel(pairs, basis, diag=True)
        assert (diagonal >= floor).all()
