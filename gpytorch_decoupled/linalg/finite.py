from __future__ import annotations

import cmath
import functools
import operator

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
    sums = [tensor.detach().sum() for tensor in tensors if tensor.numel()]
    if not sums:
        return True
    # One host read for all the tensors (one synchronization on a GPU), and no elementwise test on the common path:
    # this check runs before every training step.
    if cmath.isfinite(functools.reduce(operator.add, sums).item()):
        return True
    return all(bool(torch.isfinite(tensor.detach()).all()) for tensor in tensors)
