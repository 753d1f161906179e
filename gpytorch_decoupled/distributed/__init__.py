"""Data-parallel training on ``torch.distributed`` (multi-process and multi-GPU, launched with ``torchrun``).

Every family's training state is a sum over the data, so every rank computes the terms of its own shard and one
all-reduce per step makes every rank's state that of one process stepping at the union of the ranks' batches:

- :class:`GradientAllReduce`: gradients of any GPyTorch objective (ELBO, t-SVGP M-step, sums of ELBOs), weighted so
  that the KL is counted once; for models trained by torch optimizers (ODVGP, Decoupled, Hybrid, SVGP...).
- :class:`DistributedEStep`: the t-SVGP E-step, with its site statistics summed.
- :class:`DistributedKalmanUpdate` and :class:`DistributedCollapsedBound`: the Kalman information-form update and the
  collapsed bound's exact gradient, with their information statistics summed.
- :func:`all_reduce_local_elbos`: the optimized local ELBOs of kernel selection over sharded data, so every rank
  fits the same kernel belief.
- :class:`ShardedBatches`: the shard of a data set each rank reads (``DistributedSampler``), so that each step's
  batches together are the single-process batch.
- :func:`broadcast_state`: rank 0's parameters and buffers on every rank (the helpers call it when built).
- :func:`init_process_group`: gloo on CPU, NCCL on GPU, a timeout against hung ranks; :class:`DistributedStepError` is
  raised by every rank when any rank fails a step, before any state changes.

``torchrun --nproc_per_node=2 -m gpytorch_decoupled.distributed.example`` runs the example.
"""

from .all_reduce_local_elbos import all_reduce_local_elbos
from .broadcast_state import broadcast_state
from .distributed_collapsed_bound import DistributedCollapsedBound
from .distributed_e_step import DistributedEStep
from .distributed_kalman_update import DistributedKalmanUpdate
from .distributed_step_error import DistributedStepError
from .gradient_all_reduce import GradientAllReduce
from .process_group import init_process_group
from .sharded_batches import ShardedBatches

__all__ = [
    "DistributedCollapsedBound",
    "DistributedEStep",
    "DistributedKalmanUpdate",
    "DistributedStepError",
    "GradientAllReduce",
    "ShardedBatches",
    "all_reduce_local_elbos",
    "broadcast_state",
    "init_process_group",
]
