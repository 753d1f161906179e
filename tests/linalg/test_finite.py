from __future__ import annotations

import unittest

import torch

from gpytorch_decoupled.linalg import all_finite


class TestAllFinite(unittest.TestCase):
    def test_finite_tensors(self):
        self.assertTrue(all_finite(torch.randn(5, 3), torch.zeros(2, dtype=torch.float64)))
        self.assertTrue(all_finite(torch.empty(0, 3)))
        self.assertTrue(all_finite())

    def test_each_non_finite_value_is_found(self):
        for bad in (float("nan"), float("inf"), -float("inf")):
            for dtype in (torch.float32, torch.float64):
                values = torch.randn(4, 4, dtype=dtype)
                values[2, 1] = bad
                self.assertFalse(all_finite(torch.ones(3, dtype=dtype), values), (bad, dtype))

    def test_opposite_infinities_and_overflowing_sums(self):
        self.assertFalse(all_finite(torch.tensor([float("inf"), -float("inf")])))
        # Finite entries whose sum overflows are finite: the elementwise test decides.
        self.assertTrue(all_finite(torch.full((4,), 3e38)))
        self.assertTrue(all_finite(torch.full((3,), 6e4, dtype=torch.float16)))
        self.assertFalse(all_finite(torch.tensor([3e38, 3e38, float("nan")])))

    def test_mixed_dtypes(self):
        # Sums of float32, float64, complex and integer tensors are combined before the one host read.
        integers, complex_values = torch.arange(4), torch.tensor([1 + 2j, 3 - 1j])
        self.assertTrue(all_finite(torch.ones(2), torch.ones(2, dtype=torch.float64), integers, complex_values))
        self.assertFalse(all_finite(integers, torch.tensor([complex(float("nan"), 0.0)])))
        self.assertFalse(all_finite(torch.tensor([complex(0.0, float("inf"))]), torch.ones(2)))
        # A float32 sum that overflows against a float64 one: the elementwise test decides.
        self.assertTrue(all_finite(torch.full((2,), 3e38), torch.full((2,), 3e38, dtype=torch.float64)))

    def test_no_autograd_graph(self):
        x = torch.randn(3, requires_grad=True)
        self.assertTrue(all_finite(x))
        self.assertIsNone(x.grad)


if __name__ == "__main__":
    unittest.main()
