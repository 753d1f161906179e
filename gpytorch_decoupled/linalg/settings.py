#!/usr/bin/env python3
"""Settings of the tiled kernel products, as context managers in the style of :mod:`gpytorch.settings`."""

from __future__ import annotations


class _IntegerSetting:
    """An integer setting read through ``value()`` and changed for a ``with`` block (nested blocks restore in order),
    as GPyTorch's settings are; subclasses give the default ``_global_value`` and the smallest allowed ``_minimum``."""

    _global_value: int
    _minimum: int

    @classmethod
    def value(cls) -> int:
        """The current value."""
        return cls._global_value

    def __init__(self, value: int):
        if isinstance(value, bool) or not isinstance(value, int) or value < self._minimum:
            kind = "positive" if self._minimum == 1 else "non-negative"
            raise ValueError(f"{type(self).__name__} must be a {kind} integer, got {value!r}.")
        self._value = value
        self._previous: list[int] = []

    def __enter__(self) -> _IntegerSetting:
        self._previous.append(type(self)._global_value)
        type(self)._global_value = self._value
        return self

    def __exit__(self, *args) -> bool:
        type(self)._global_value = self._previous.pop()
        return False


class kernel_tile_size(_IntegerSetting):
    r"""
    The number of kernel entries the fused kernel products (:func:`~gpytorch_decoupled.linalg.kernel_matvec`,
    :func:`~gpytorch_decoupled.linalg.kernel_quadratic_form`) evaluate at once. A block :math:`\mathbf K` with
    :math:`n \times m` entries is never held whole: it is swept in tiles of about this many entries (all batch
    dimensions together), each computed, passed through the kernel's profile and reduced in place while it is still
    in the processor's cache, and the backward pass recomputes the tiles instead of keeping them.

    The default, :math:`2^{18}` entries (1 MiB in float32, 2 MiB in float64), was the fastest of :math:`2^{15}` to
    :math:`2^{20}` on the CPU it was tuned on (1 MiB of second-level cache per core; float32, one thread, blocks of
    :math:`520 \times 10^3` to :math:`520 \times 10^5` entries): smaller tiles pay a per-tile overhead of a few
    microseconds per operation, larger ones spill to slower memory. On a GPU, where evaluating a tile is cheap and
    launching its operations is not, larger tiles (:math:`2^{22}` or more) are faster.

    :param value: Entries per tile, at least 1.

    Example:
        >>> import gpytorch, torch
        >>> kernel = gpytorch.kernels.RBFKernel()
        >>> x, z, a = torch.randn(100, 2), torch.randn(5000, 2), torch.randn(5000)
        >>> from gpytorch_decoupled.linalg import kernel_matvec
        >>> with kernel_tile_size(2**20):
        ...     product = kernel_matvec(kernel(x, z), a)
        >>> kernel_tile_size.value()
        262144
    """

    _global_value: int = 2**18
    _minimum = 1


class kernel_keep_size(_IntegerSetting):
    r"""
    The largest kernel block (in entries, all batch dimensions together) that
    :func:`~gpytorch_decoupled.linalg.kernel_matvec` keeps from its forward pass for its backward pass. A larger block
    is evaluated again, tile by tile, in the backward pass, so that memory stays at one tile; a block this small costs
    little memory to keep and saves the second evaluation (the distances and the exponential: more than half of the
    backward pass). The tiles are still computed and reduced in cache; they are only not overwritten.

    The default, :math:`2^{23}` entries (32 MiB in float32; twice that for a Matérn kernel, which keeps its
    derivative too), keeps the block of a training step with a mean basis of up to about 16,000 points and a few
    hundred data and inducing points, where keeping saved a fifth of the product's time on the CPU it was tuned on;
    a mean basis of :math:`10^5` points is evaluated twice and needs the memory of one tile. ``0`` never keeps a block.

    :param value: Entries, at least 0.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.linalg import kernel_matvec
        >>> kernel = gpytorch.kernels.RBFKernel()
        >>> x, z = torch.randn(100, 2), torch.randn(5000, 2)
        >>> a = torch.randn(5000, requires_grad=True)
        >>> with kernel_keep_size(0):  # memory of one tile, at the cost of a second evaluation
        ...     kernel_matvec(kernel(x, z), a).sum().backward()
        >>> kernel_keep_size.value()
        8388608
    """

    _global_value: int = 2**23
    _minimum = 0
