"""Joining the process group that ``torchrun`` describes."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

#: Seconds a collective waits for every rank before it fails (a hung rank then stops the others).
DEFAULT_TIMEOUT_SECONDS = 300.0


def init_process_group(backend: str | None = None, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> torch.device:
    """
    Joins the default process group and returns the device this rank should compute on.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment) it joins
    that group; without it, a group of one process, so the same script runs with plain ``python``. The backend is
    NCCL when CUDA is available (each rank on ``cuda:LOCAL_RANK``) and gloo on CPU.

    What happens when a rank fails: a rank that raises inside a helper of :mod:`gpytorch_decoupled.distributed`
    stops every rank with the same :class:`~gpytorch_decoupled.distributed.DistributedStepError`; a rank that dies
    breaks its connections, and the others fail at their next collective (gloo reports it at once); a rank that hangs
    makes the others fail after ``timeout_seconds``. With NCCL the timeout needs PyTorch's asynchronous error
    handling, on by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``). ``torchrun`` then stops the remaining workers, and
    a run restarted from the last checkpoint (a ``state_dict`` saved by rank 0) loses nothing: no helper changes any
    state in a step that failed.

    :param backend: ``"gloo"`` or ``"nccl"`` (default: by device, as above).
    :param timeout_seconds: How long a collective waits for every rank.
    :return: ``cuda:LOCAL_RANK`` with NCCL, else the CPU.

    Example:
        >>> import torch.distributed as dist
        >>> from gpytorch_decoupled.distributed import init_process_group
        >>> device = init_process_group(backend="gloo")  # a group of one process outside torchrun
        >>> dist.get_world_size(), device
        (1, device(type='cpu'))
        >>> dist.destroy_process_group()
    """
    if dist.is_initialized():
        raise RuntimeError("a default process group is initialized already; destroy it first.")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
    if timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}.")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device
