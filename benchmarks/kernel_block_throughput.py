"""How fast the mean basis's kernel block is evaluated, against how fast this machine evaluates ``exp`` in cache.

A training step of a decoupled model spends most of its kernel work in one product
:math:`\\mathbf K_{\\mathbf r\\gamma}\\mathbf a` (:func:`~gpytorch_decoupled.linalg.kernel_matvec`) whose rows
:math:`\\mathbf r` stack the mini-batch, the covariance basis and the sampled KL rows. Every entry of the block costs
one exponential, so the exponential's rate on data already in cache bounds how fast the block can go; the block
reaches it only if its tiles stay in cache (the untiled product streamed an :math:`n \\times M_\\gamma` array through
memory and ran at a fraction of it). Both are measured in the same process, interleaved, on one thread, in CPU time
of the thread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gpytorch
import torch

from gpytorch_decoupled.linalg import kernel_matvec


@dataclass
class BlockThroughput:
    """Entries per second of the product forward and forward + backward, and the reference ``exp`` rate."""

    mean_size: int
    rows: int
    forward: float
    forward_backward: float
    exp: float
    forward_fractions: list[float]
    forward_backward_fractions: list[float]
    exp2: float  # the rate of torch.exp2, which the RBF tiles evaluate (faster than exp on CPUs)

    def to_json(self) -> dict:
        return {
            "mean_size": self.mean_size,
            "rows": self.rows,
            "forward_entries_per_second": self.forward,
            "forward_backward_entries_per_second": self.forward_backward,
            "cache_resident_exp_per_second": self.exp,
            "forward_fraction_of_exp": statistics.median(self.forward_fractions),
            "forward_fraction_range": [min(self.forward_fractions), max(self.forward_fractions)],
            "forward_backward_fraction_of_exp": statistics.median(self.forward_backward_fractions),
            "forward_backward_fraction_range": [
                min(self.forward_backward_fractions),
                max(self.forward_backward_fractions),
            ],
            "cache_resident_exp2_per_second": self.exp2,
            "forward_fraction_of_exp2": self.forward / self.exp2,
            "forward_backward_fraction_of_exp2": self.forward_backward / self.exp2,
        }


def _best_seconds(function: Callable[[], object], repeats: int) -> float:
    """The least CPU time of this thread over ``repeats`` calls (after one warm-up call): on a shared machine, CPU time
    leaves out the time the thread waits for a core, and the least of several calls the most disturbed caches."""
    function()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        function()
        best = min(best, time.thread_time() - start)
    return best


def cache_resident_exp_rate(
    dtype: torch.dtype, entries: int = 2**16, repeats: int = 20, function: Callable = torch.exp
) -> float:
    """Elements per second of ``function`` (``torch.exp``, or ``torch.exp2``) from one array to another, both small
    enough to stay in the second-level cache (``entries`` elements each: 256 KiB in float32), on the current thread
    settings."""
    source = torch.linspace(-8.0, 0.0, entries, dtype=dtype)
    target = torch.empty_like(source)
    calls = 50

    def run() -> None:
        for _ in range(calls):
            function(source, out=target)

    return calls * entries / _best_seconds(run, repeats)


def kernel_block_throughput(
    mean_sizes: Sequence[int], rows: int, dim: int, dtype: torch.dtype, rounds: int = 3, seed: int = 0
) -> list[BlockThroughput]:
    """
    Entries per second of the fused product of a ``rows`` × ``mean_size`` block of a scaled ARD RBF kernel (the
    benchmarks' kernel) with a coefficient vector, forward alone and forward + backward (gradients for the rows, the
    mean basis, the coefficients and every hyperparameter, as in training), for each mean basis size; each round
    measures the cache-resident ``exp`` rate just before the block, and the fractions of it are kept per round; the
    rate of ``exp2`` (what the RBF tiles evaluate, :mod:`gpytorch_decoupled.linalg._kernel_tiles`) is kept beside it.
    """
    generator = torch.Generator().manual_seed(seed)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=dim)).to(dtype)
    results = []
    for size in mean_sizes:
        x = torch.randn(rows, dim, generator=generator, dtype=dtype).requires_grad_()
        z = torch.randn(size, dim, generator=generator, dtype=dtype).requires_grad_()
        a = (1e-2 * torch.randn(size, generator=generator, dtype=dtype)).requires_grad_()
        repeats = max(1, min(20, int(2e7 // (rows * size))))
        forward_rates, step_rates, exp_rates, exp2_rates = [], [], [], []
        for _ in range(rounds):
            exp_rates.append(cache_resident_exp_rate(dtype))
            exp2_rates.append(cache_resident_exp_rate(dtype, function=torch.exp2))
            forward, forward_backward = _block_seconds(kernel, x, z, a, repeats)
            forward_rates.append(rows * size / forward)
            step_rates.append(rows * size / forward_backward)
        results.append(
            BlockThroughput(
                size,
                rows,
                max(forward_rates),
                max(step_rates),
                max(exp_rates),
                [rate / exp for rate, exp in zip(forward_rates, exp_rates)],
                [rate / exp for rate, exp in zip(step_rates, exp_rates)],
                max(exp2_rates),
            )
        )
    return results


def _block_seconds(kernel, x: torch.Tensor, z: torch.Tensor, a: torch.Tensor, repeats: int) -> tuple[float, float]:
    """The best seconds of the product forward alone and forward + backward."""

    def forward() -> None:
        with torch.no_grad():
            kernel_matvec(kernel(x, z), a)

    def forward_backward() -> None:
        kernel_matvec(kernel(x, z), a).sum().backward()

    return _best_seconds(forward, repeats), _best_seconds(forward_backward, repeats)
