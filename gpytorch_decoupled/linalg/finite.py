from __future__ import annotations

import torch
from torch import Tensor


def all_finite(*tensors: Tensor) -> bool:
    r"""
    Whether every entry of every tensor is finite (no NaN, no :math:`\pm\infty`).

    A NaN or infinite entry makes a sum NaN or infinite (IEEE arithmetic), so a finite sum of all the entries proves
    them all finite in one reduction per tensor, several times cheaper than the elementwise test on the small tensors
    of a training step. Only where that sum is not finite (a non-finite entry, or finite entries whose sum overflowed)
    does the elementwise test decide. Tensors are read without an autograd graph.

    Example:
        >>> all_finite(torch.ones(3), torch.zeros(2, 2))
        True
        >>> all_finite(torch.tensor([1.0, float("nan")]))
        False
        >>> all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows float32; the entries are finite
        True
    """
    with torch.no_grad():
        total = sum(tensor.sum() for tensor in tensors if tensor.numel())
        if not isinstance(total, Tensor) or bool(torch.isfinite(total)):
            return True
        return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)
