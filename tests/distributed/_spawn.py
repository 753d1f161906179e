"""Runs a function on several gloo processes (``torch.multiprocessing``, start method ``spawn``) and returns what each
rank returned: the harness of the 2-process tests, safe under pytest-xdist (the ranks meet through a file store in the
test's own temporary directory, not a port)."""

from __future__ import annotations

import datetime
import importlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(
    target: str, world_size: int, directory: Path, timeout_seconds: float = 30.0, wall_seconds: float = 120.0
):
    """
    Calls ``target`` (``"module:function"``, called as ``function(rank, world_size, directory)``) on ``world_size``
    processes joined in a gloo group with the collective timeout ``timeout_seconds``, and returns the ranks' return
    values in rank order (``None`` for a rank that returned nothing). Fails if the job takes over ``wall_seconds``.
    """
    directory = Path(directory)
    store = directory / "file_store"
    context = mp.start_processes(
        _rank_main,
        args=(target, world_size, str(directory), str(store), timeout_seconds),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + wall_seconds
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{target} on {world_size} processes ran over {wall_seconds} s.")
    results = []
    for rank in range(world_size):
        path = directory / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return results


def _rank_main(rank: int, target: str, world_size: int, directory: str, store: str, timeout_seconds: float) -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks share this machine
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(rank, world_size, Path(directory))
    if result is not None:
        save_result(Path(directory), rank, result)
    # Out at once, without destroy_process_group: after a test broke the group on purpose (a hung or dead rank),
    # gloo's threads may abort the process while they are torn down.
    os._exit(0)


def save_result(directory: Path, rank: int, result) -> None:
    """What :func:`run_ranks` returns for ``rank``; for a rank that will not return (it exits on purpose)."""
    torch.save(result, directory / f"rank{rank}.pt")
