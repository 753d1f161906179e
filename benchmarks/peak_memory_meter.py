from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import torch

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> int:
    # /proc/self/statm: size resident shared text lib data dt (in pages); Linux only.
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_SIZE


def _release_free_heap() -> None:
    # glibc keeps freed small and medium blocks; handing them back makes later growth show up in the resident size.
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class PeakMemoryMeter:
    r"""
    Peak memory allocated while a block runs, above what was in use when it started.

    On CUDA this is exact: :func:`torch.cuda.max_memory_allocated` after a reset. On CPU, PyTorch has no allocator
    statistics, so a background thread samples the process's resident set size every ``interval`` seconds (Linux
    ``/proc/self/statm``), after returning the C heap's free blocks to the system. The CPU figure can miss peaks that
    last less than one interval and blocks reused from the heap; it is meant to tell megabytes from gigabytes (e.g.
    an :math:`M_\gamma \times M_\gamma` matrix), not to resolve a few MB. Elsewhere (no ``/proc``) it reports ``nan``.

    :param device: The device whose memory is measured.
    :param interval: CPU sampling interval in seconds.

    Example:
        >>> import torch
        >>> with PeakMemoryMeter(torch.device("cpu")) as meter:
        ...     x = torch.ones(64, 1024, 1024)  # 256 MiB
        ...     del x
        >>> meter.peak_mb > 200 or meter.peak_mb != meter.peak_mb  # nan where /proc is missing
        True
    """

    def __init__(self, device: torch.device | str, interval: float = 5e-4):
        self.device = torch.device(device)
        self.interval = interval
        self.peak_mb = float("nan")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._baseline = 0
        self._peak = 0

    def __enter__(self) -> PeakMemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        elif os.path.exists("/proc/self/statm"):
            _release_free_heap()
            self._baseline = self._peak = _resident_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, _resident_bytes())

    def __exit__(self, *exc_info) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = (torch.cuda.max_memory_allocated(self.device) - self._baseline) / 2**20
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, _resident_bytes())
            self.peak_mb = max(self._peak - self._baseline, 0) / 2**20
