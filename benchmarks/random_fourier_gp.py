"""Synthetic GP regression data of any size, generated batch by batch (``python -m benchmarks recursive``; Schürch
et al. 2020, Sec. 5.1, whose data generation at large N is unspecified: docs/derivations.md, "Paper errata")."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor


class RandomFourierGP:
    r"""
    One draw :math:`f` from a zero-mean GP with the squared-exponential kernel
    :math:`\sigma_0^2\exp(-\lVert\mathbf x - \mathbf x'\rVert^2 / 2\ell^2)`, approximated with :math:`F` random Fourier
    features (Rahimi & Recht, 2007),

    .. math::

        f(\mathbf x) = \sigma_0\sqrt{2/F}\,\textstyle\sum_{j=1}^F w_j\cos(\boldsymbol\omega_j^\top\mathbf x + b_j),
        \qquad \boldsymbol\omega_j \sim \mathcal N(\mathbf 0, \ell^{-2}\mathbf I),\ b_j \sim \mathcal U[0, 2\pi),\
        w_j \sim \mathcal N(0, 1),

    whose covariance over the draw of :math:`\boldsymbol\omega, b, w` is the SE kernel (exactly as
    :math:`F \to \infty`). Unlike exact sampling, which costs :math:`O(N^3)`, it can be evaluated at any number of
    inputs, in blocks of ``block_rows`` rows so that the features never take more than ``block_rows`` :math:`\times F`
    numbers.

    :param dims: Input dimension :math:`D`.
    :param lengthscale: :math:`\ell`.
    :param outputscale: :math:`\sigma_0`.
    :param num_features: :math:`F`.
    :param seed: Seed of the draw.
    :param dtype: Floating-point type.
    :param block_rows: Rows per block of the feature evaluation.
    """

    def __init__(
        self,
        dims: int,
        lengthscale: float,
        outputscale: float = 1.0,
        num_features: int = 2048,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
        block_rows: int = 256,
    ):
        generator = torch.Generator().manual_seed(seed)
        self.frequencies = torch.randn(dims, num_features, generator=generator, dtype=dtype) / lengthscale
        self.phases = 2 * math.pi * torch.rand(num_features, generator=generator, dtype=dtype)
        self.weights = torch.randn(num_features, generator=generator, dtype=dtype)
        self.weights *= outputscale * math.sqrt(2.0 / num_features)
        self.block_rows = block_rows

    def __call__(self, x: Tensor) -> Tensor:
        return torch.cat(
            [torch.cos(block @ self.frequencies + self.phases) @ self.weights for block in x.split(self.block_rows)]
        )


def synthetic_batches(
    function: RandomFourierGP, num_rows: int, batch_size: int, noise_std: float, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """``num_rows`` rows ``(x, y)`` in mini-batches of ``batch_size``, each generated when it is asked for (nothing
    else is kept): :math:`\\mathbf x` uniform on :math:`[-1, 1]^D`, :math:`y = f(\\mathbf x) + \\varepsilon`,
    :math:`\\varepsilon \\sim \\mathcal N(0, \\sigma_n^2)`, all from one generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    dims, dtype = function.frequencies.shape[0], function.frequencies.dtype
    for start in range(0, num_rows, batch_size):
        rows = min(batch_size, num_rows - start)
        x = 2 * torch.rand(rows, dims, generator=generator, dtype=dtype) - 1
        yield x, function(x) + noise_std * torch.randn(rows, generator=generator, dtype=dtype)


def synthetic_rows(function: RandomFourierGP, num_rows: int, noise_std: float, seed: int) -> tuple[Tensor, Tensor]:
    """``num_rows`` rows of :func:`synthetic_batches`, all at once."""
    batches = list(synthetic_batches(function, num_rows, 4096, noise_std, seed))
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
