"""The collectives shared by the data-parallel helpers.

Every sum travels with one failure flag per rank, so that a failure on any rank (an exception, a NaN) is known to
every rank after the same collective, before any of them changes its state; the ranks then exchange their reasons and
raise the same :class:`DistributedStepError`. A collective that cannot complete (a dead or hung rank, reported by the
backend when the connection breaks or the process group's ``timeout`` expires) becomes the same error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .distributed_step_error import DistributedStepError

Group = dist.ProcessGroup | None


def group_rank_and_size(group: Group, owner: str) -> tuple[int, int]:
    """This process's rank and the group's size; a clear error when no process group is initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{owner} needs an initialized torch.distributed process group: launch the script with torchrun and call "
            "gpytorch_decoupled.distributed.init_process_group() (or torch.distributed.init_process_group) first."
        )
    return dist.get_rank(group), dist.get_world_size(group)


def communicate(operation, what: str, *args, **kwargs) -> None:
    try:
        operation(*args, **kwargs)
    except RuntimeError as error:  # gloo and NCCL report broken connections and timeouts as (subclasses of) it
        raise DistributedStepError(
            f"{what}: the collective operation failed, so no rank changed its state (a rank died, raised outside the "
            f"helpers, or did not arrive within the process group's timeout): {error}"
        ) from error


def _raise_if_failed(flags: Tensor, failure: BaseException | None, what: str, group: Group) -> None:
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag != 0]
    if not failed:
        return
    # Only a failed step pays for this second collective: every rank learns every reason.
    reasons = [None] * flags.numel()
    local = None if failure is None else f"{type(failure).__name__}: {failure}"
    communicate(dist.all_gather_object, what, reasons, local, group=group)
    details = "; ".join(f"rank {rank}: {reasons[rank]}" for rank in failed)
    raise DistributedStepError(
        f"{what} failed on rank(s) {failed}, so no rank changed its state ({details}).", ranks=failed
    ) from failure


def _checked(contribution: Tensor | None, size: int, failure: BaseException | None) -> BaseException | None:
    if failure is not None:
        return failure
    if contribution is None or contribution.numel() != size:
        got = None if contribution is None else contribution.numel()
        return ValueError(f"this rank's contribution has {got} values where every rank sends {size}.")
    if not torch.isfinite(contribution).all():
        return FloatingPointError("this rank's contribution contains NaN or inf.")
    return None


def all_reduce_sum(
    contribution: Tensor | None,
    size: int,
    like: Tensor,
    what: str,
    group: Group = None,
    failure: BaseException | None = None,
) -> Tensor:
    r"""
    :math:`\sum_r \mathbf c_r` over the ranks of ``group``, for a 1-D contribution of ``size`` values, in one
    all-reduce that also carries a failure flag per rank.

    :param contribution: This rank's values (``None`` when it failed).
    :param size: The number of values every rank sends.
    :param like: Gives the dtype and device of the message.
    :param what: Names the step in the error.
    :param failure: This rank's exception, if it failed before it could contribute.
    :raises DistributedStepError: On every rank, if any rank failed (or sent non-finite values) or the collective
        could not complete.
    """
    rank, world_size = group_rank_and_size(group, what)
    failure = _checked(contribution, size, failure)
    message = torch.zeros(world_size + size, dtype=like.dtype, device=like.device)
    if failure is None:
        message[world_size:] = contribution.reshape(-1)
    else:
        message[rank] = 1
    communicate(dist.all_reduce, what, message, group=group)
    _raise_if_failed(message[:world_size], failure, what, group)
    return message[world_size:]


def all_gather_rows(
    contribution: Tensor | None,
    size: int,
    like: Tensor,
    what: str,
    group: Group = None,
    failure: BaseException | None = None,
) -> Tensor:
    """Every rank's 1-D contribution of ``size`` values as the rows of a ``(world_size, size)`` tensor, in rank
    order, with the failure protocol of :func:`all_reduce_sum`."""
    rank, world_size = group_rank_and_size(group, what)
    failure = _checked(contribution, size, failure)
    row = torch.zeros(1 + size, dtype=like.dtype, device=like.device)
    if failure is None:
        row[1:] = contribution.reshape(-1)
    else:
        row[0] = 1
    rows = [torch.empty_like(row) for _ in range(world_size)]
    communicate(dist.all_gather, what, rows, row, group=group)
    table = torch.stack(rows)
    _raise_if_failed(table[:, 0], failure, what, group)
    return table[:, 1:]
