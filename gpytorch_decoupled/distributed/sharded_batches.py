from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from ._collectives import Group, group_rank_and_size


class ShardedBatches:
    r"""
    This rank's mini-batches of a data set sharded across ``torch.distributed`` ranks, such that at every step the
    union of the ranks' batches is the batch one process would take: training on :math:`R` ranks then follows the
    single-process run step by step.

    Built on :class:`~torch.utils.data.DistributedSampler`: every rank draws the same permutation of the :math:`n`
    points (seeded by ``seed`` and the epoch), and rank :math:`r` takes every :math:`R`-th position from :math:`r`.
    Taking :math:`b = B / R` of those at a time, step :math:`j` of every rank together covers positions
    :math:`[jB, (j+1)B)` of the permutation, which is step :math:`j` of one process with batches of :math:`B`
    (``batch_size``, the global batch size). The sampler drops the last :math:`n \bmod R` positions of the permutation
    rather than repeating some (which would count those points twice in an objective): when :math:`R` does not divide
    :math:`n` an epoch leaves those few points out (other ones each epoch when shuffling), and the single-process run to
    compare with is one over the first :math:`R\lfloor n/R\rfloor` positions. The last step's batches may then differ
    in size by one point; :class:`~gpytorch_decoupled.distributed.GradientAllReduce` weighs ranks by their batch
    sizes, so the step is still exact. ``num_data`` of the objectives stays :math:`n`.

    A :class:`~torch.utils.data.TensorDataset` is indexed directly, one batch at a time (the same tensors a
    :class:`~torch.utils.data.DataLoader` would collate, without its per-item overhead); any other data set goes
    through a :class:`~torch.utils.data.DataLoader` with ``loader_options``. The batches can be iterated any number of
    times (the same ones until :meth:`set_epoch`), as :class:`~gpytorch_decoupled.distributed.DistributedCollapsedBound`
    needs.

    :param dataset: The whole data set (every rank passes the same one; only its shard is read).
    :param batch_size: The global batch size :math:`B`, a multiple of the number of ranks.
    :param shuffle: Draw a new permutation each epoch (default True); otherwise the data set's order.
    :param seed: Seed of the permutations, the same on every rank.
    :param group: The process group (default: the default group).
    :param num_replicas: The number of ranks :math:`R` (default: the group's size); with ``rank``, no process group is
        needed (e.g. ``num_replicas=1, rank=0`` for the single-process run).
    :param rank: This process's rank (default: its rank in the group).
    :param loader_options: Passed to the :class:`~torch.utils.data.DataLoader` (``num_workers``, ``pin_memory``...).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from gpytorch_decoupled.distributed import ShardedBatches
        >>> data = TensorDataset(torch.arange(12.0))
        >>> one = ShardedBatches(data, batch_size=4, num_replicas=1, rank=0)
        >>> two = [ShardedBatches(data, batch_size=4, num_replicas=2, rank=r) for r in range(2)]
        >>> for (batch,), (first,), (second,) in zip(one, *two):
        ...     print(batch.sort().values.tolist() == torch.cat([first, second]).sort().values.tolist())
        True
        True
        True
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        group: Group = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        **loader_options,
    ):
        if num_replicas is None or rank is None:
            group_rank, group_size = group_rank_and_size(group, type(self).__name__)
            num_replicas = group_size if num_replicas is None else num_replicas
            rank = group_rank if rank is None else rank
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if batch_size % num_replicas:
            raise ValueError(
                f"the global batch_size {batch_size} must be a multiple of the number of ranks {num_replicas}, so that "
                "every step's batches together are one batch of the single-process run."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.local_batch_size = batch_size // num_replicas
        self.sampler = DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.loader_options = loader_options
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """
        Selects the permutation of ``epoch`` (call it at the start of every epoch, on every rank, as for
        :class:`~torch.utils.data.DistributedSampler`), and skips its first ``start_batch`` steps, to resume an epoch
        from a checkpoint taken after that many steps.
        """
        if start_batch < 0:
            raise ValueError(f"start_batch must be non-negative, got {start_batch}.")
        self.sampler.set_epoch(epoch)
        self.start_batch = start_batch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        """This rank's number of batches in the epoch (the same on every rank)."""
        return max(0, math.ceil(len(self.sampler) / self.local_batch_size) - self.start_batch)

    def __iter__(self) -> Iterator:
        indices = list(self.sampler)[self.start_batch * self.local_batch_size :]
        if isinstance(self.dataset, TensorDataset) and not self.loader_options:
            for batch in torch.tensor(indices, dtype=torch.long).split(self.local_batch_size):
                yield tuple(tensor[batch] for tensor in self.dataset.tensors)
            return
        yield from DataLoader(self.dataset, batch_size=self.local_batch_size, sampler=indices, **self.loader_options)
