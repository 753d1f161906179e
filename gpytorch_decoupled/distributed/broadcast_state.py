from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from ..gpytorch_compat import VariationalStrategyBase
from ..variational import initialize_from_prior
from ._collectives import Group, communicate, group_rank_and_size


@torch.no_grad()
def broadcast_state(modules: Iterable[torch.nn.Module], group: Group = None, source: int = 0) -> None:
    r"""
    Copies every parameter and buffer of ``modules``, and the extra state of their submodules (e.g. the random
    generator of a mean basis's sampled KL), from rank ``source`` to every rank (as
    :class:`~torch.nn.parallel.DistributedDataParallel` does for parameters and buffers when it wraps a model), so
    that all ranks start from one
    state whatever their random initialization, or continue from a checkpoint that only rank ``source`` loaded (the
    optimizers' state is not a module's: load it on every rank). A
    GPyTorch variational strategy that has not initialized its :math:`q(\mathbf u)` yet (GPyTorch does that at the
    first training call, with random noise that would differ between ranks) is initialized first, as that call would.
    The helpers of :mod:`gpytorch_decoupled.distributed` call it when they are built.

    :param modules: The modules (e.g. the model and the likelihood).
    :param group: The process group (default: the default group).
    :param source: The rank whose state is copied.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from gpytorch_decoupled.distributed import broadcast_state, init_process_group
        >>> _ = init_process_group(backend="gloo")  # under torchrun: every rank of the job
        >>> layer = torch.nn.Linear(3, 1)
        >>> broadcast_state([layer])  # rank 0's weights on every rank
        >>> dist.destroy_process_group()
    """
    modules = list(modules)
    group_rank_and_size(group, "broadcast_state")
    source_rank = source if group is None else dist.get_global_rank(group, source)
    for module in modules:
        for strategy in module.modules():
            if isinstance(strategy, VariationalStrategyBase):
                initialize_from_prior(strategy)
    tensors, seen = [], set()
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for (dtype, _), group_tensors in by_kind.items():
        # One message per dtype and device; booleans travel as bytes.
        flat = torch.cat([tensor.detach().reshape(-1) for tensor in group_tensors])
        flat = flat.to(torch.uint8) if dtype == torch.bool else flat
        communicate(dist.broadcast, "broadcast_state", flat, src=source_rank, group=group)
        for tensor, values in zip(group_tensors, flat.split([t.numel() for t in group_tensors]), strict=True):
            tensor.copy_(values.view(tensor.shape).to(dtype))
    holders = [
        submodule
        for module in modules
        for submodule in module.modules()
        if type(submodule).get_extra_state is not torch.nn.Module.get_extra_state
    ]
    if holders:
        states = [holder.get_extra_state() for holder in holders]
        communicate(dist.broadcast_object_list, "broadcast_state", states, src=source_rank, group=group)
        for holder, state in zip(holders, states, strict=True):
            holder.set_extra_state(state)
    for module in modules:
        for strategy in module.modules():
            if hasattr(strategy, "_clear_cache"):
                strategy._clear_cache()
