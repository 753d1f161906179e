#!/usr/bin/env python3
r"""
Freed CPU memory kept for reuse: a training step that allocates megabytes of temporaries should not fault its pages
in again every step.

PyTorch's CPU tensors come from the C library's ``malloc``. With glibc's defaults a block of 128 KiB or more is mapped
from the operating system when it is allocated and unmapped when it is freed, and free memory at the top of the heap
is returned to the system beyond a threshold; glibc raises both thresholds as large blocks are freed, but only up to
32 MiB and only while no threshold was set by hand. A step whose temporaries are large (the mean basis's vectors and
kernel tiles at :math:`M_\gamma = 10^5`, the decoupled step's :math:`M_\beta \times M_\alpha` blocks, a compiled
step after a second compilation has reshaped the heap) then maps fresh pages every step, and every first touch of a
4 KiB page costs a page fault: thousands per step, a tenth to a third of the step (measured in the compiling guide,
"Freed memory on the CPU"). :func:`keep_freed_cpu_memory` sets glibc's thresholds so that freed blocks stay in the heap
for the next step.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: ``mallopt`` parameters of glibc's ``malloc.h``.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Set to ``0`` to leave the C library's allocator as it is.
OPT_OUT_VARIABLE = "GPYTORCH_DECOUPLED_KEEP_FREED_MEMORY"
#: glibc's largest mmap threshold on 64-bit systems (blocks above it are always mapped and unmapped).
LARGEST_MMAP_THRESHOLD = 32 * 2**20
DEFAULT_TRIM_THRESHOLD = 512 * 2**20

_applied: dict[str, int] | None = None


def keep_freed_cpu_memory(
    trim_threshold: int = DEFAULT_TRIM_THRESHOLD, mmap_threshold: int = LARGEST_MMAP_THRESHOLD
) -> dict[str, int] | None:
    r"""
    Keeps freed CPU memory in this process's heap for reuse, instead of returning it to the operating system, so that
    the temporaries of the next training step do not fault their pages in again. Process-wide and done once:
    later calls return the settings of the first. The package's training steps
    (:class:`~gpytorch_decoupled.training.TrainingStep`, :class:`~gpytorch_decoupled.training.RecursiveTrainingStep`,
    :class:`~gpytorch_decoupled.training.KalmanUpdateStep`) and its mean bases (the decoupled strategies) call it when
    they are built; call it yourself for other code.

    It sets glibc's ``M_MMAP_THRESHOLD`` (blocks smaller than this come from the heap rather than from fresh mappings)
    and ``M_TRIM_THRESHOLD`` (free memory at the top of the heap beyond this is returned to the system) with
    ``mallopt``. The cost is memory: up to ``trim_threshold`` bytes of freed memory stay resident, and blocks of up to
    ``mmap_threshold`` bytes are carved from the heap, where they can fragment it. It does nothing (and returns None)
    where the C library is not glibc (macOS, Windows, musl), where the environment variable
    ``GPYTORCH_DECOUPLED_KEEP_FREED_MEMORY`` is ``0``, or where ``GLIBC_TUNABLES`` already sets ``malloc`` options
    (the user's choice wins). GPU memory is not concerned: PyTorch caches it itself.

    :param trim_threshold: Bytes of free memory kept at the top of the heap (default 512 MiB).
    :param mmap_threshold: Blocks of at least this many bytes are mapped from the system (at most glibc's largest,
        32 MiB, the default).
    :return: The settings in force, ``{"trim_threshold": ..., "mmap_threshold": ...}``, or None if nothing was set.
    :raises ValueError: If a threshold is not a positive integer, ``mmap_threshold`` exceeds 32 MiB or
        ``trim_threshold`` is 2 GiB or more.

    Example:
        >>> from gpytorch_decoupled.linalg import keep_freed_cpu_memory
        >>> settings = keep_freed_cpu_memory()  # None where the C library is not glibc
        >>> settings is None or settings["mmap_threshold"] <= 32 * 2**20
        True
    """
    global _applied
    for name, value in (("trim_threshold", trim_threshold), ("mmap_threshold", mmap_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer (bytes), got {value!r}.")
    if mmap_threshold > LARGEST_MMAP_THRESHOLD or trim_threshold >= 2**31:
        raise ValueError(
            f"mmap_threshold is at most glibc's largest, {LARGEST_MMAP_THRESHOLD} bytes, and trim_threshold less than "
            f"2 GiB (a C int), got {mmap_threshold} and {trim_threshold}."
        )
    if _applied is not None:
        return dict(_applied)
    if os.environ.get(OPT_OUT_VARIABLE, "1").strip() == "0" or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # The mmap threshold first: setting either threshold ends glibc's own adjustment of both.
    if not (mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)):
        return None
    _applied = {"trim_threshold": trim_threshold, "mmap_threshold": mmap_threshold}
    return dict(_applied)
