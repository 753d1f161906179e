r"""
The floor below which this package's kernel evaluations raise an exponential: kernel values that would be subnormal
floating-point numbers, which an x86 CPU handles about a hundred times slower than normal ones (a microcode assist per
subnormal operand).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_LN_2 = math.log(2.0)


def exponent_floor(dtype: torch.dtype) -> float:
    r"""
    The smallest power of two :math:`t` whose :math:`2^t` the kernel evaluations keep: 80% of the way to the smallest
    normal number of ``dtype`` (:math:`2^{-100.8}` in float32, :math:`2^{-817.6}` in float64). Smaller kernel values
    would be subnormal numbers, or turn subnormal once multiplied in a product's reductions, and an x86 CPU takes a
    microcode assist of about a hundred cycles for each subnormal operand: on bike (17 inputs), as the length-scales
    shrank in training, most far pairs of the mean basis fell there and an OrthNat step grew from 11 to 47 ms. Raised
    to :math:`2^t`, such a value changes a sum by at most :math:`2^t` per entry, far below the rounding of the sum's
    :math:`O(1)` terms (the diagonal is one of them).

    :param dtype: A floating dtype.
    :return: :math:`t`.

    Example:
        >>> round(exponent_floor(torch.float32), 1), round(exponent_floor(torch.float64), 1)
        (-100.8, -817.6)
    """
    return 0.8 * math.log2(torch.finfo(dtype).tiny)


def floored_exp(exponent: Tensor) -> Tensor:
    r"""
    :math:`\exp(\max(x, t\ln 2))` with :math:`t` the :func:`exponent_floor` of ``exponent``'s dtype: the exponential
    of a kernel's log-values without subnormal results (a value raised to the floor has no gradient).

    :param exponent: Log-values :math:`x`.
    :return: Their floored exponentials.

    Example:
        >>> floored_exp(torch.tensor([0.0, -1000.0])) > 0
        tensor([True, True])
    """
    return exponent.clamp_min(_LN_2 * exponent_floor(exponent.dtype)).exp()
