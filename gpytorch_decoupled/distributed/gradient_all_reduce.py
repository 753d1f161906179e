from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ._collectives import Group, all_reduce_sum, group_rank_and_size
from .broadcast_state import broadcast_state


class GradientAllReduce:
    r"""
    Data-parallel gradients for training any GPyTorch model with a torch optimizer on ``torch.distributed``: after
    each rank's backward pass, one all-reduce makes every rank's ``.grad`` the gradient of the loss of the **union**
    of the ranks' mini-batches, with the KL counted once.

    GPyTorch's objectives (:class:`~gpytorch.mlls.VariationalELBO`, ``PredictiveLogLikelihood``,
    :class:`~gpytorch_decoupled.mlls.DualVariationalELBO`, sums of several of them as in kernel selection) are, on
    rank :math:`r`'s mini-batch :math:`\mathcal B_r` of :math:`b_r` points, a data mean plus a term that does not
    depend on the data,

    .. math::

        \ell_r(\theta) = \frac{1}{b_r}\sum_{i\in\mathcal B_r} \ell_i(\theta) + R(\theta), \qquad
        R(\theta) = \frac{\mathrm{KL}[q \Vert p]}{N} - \frac{\log p(\theta)}{N},

    with ``num_data`` :math:`N` the size of the whole data set (not of a shard). The loss of one process at the union
    batch :math:`\mathcal B = \bigcup_r\mathcal B_r` of :math:`B = \sum_r b_r` points is the weighted mean

    .. math::

        \ell(\theta) = \frac1B\sum_{i\in\mathcal B}\ell_i(\theta) + R(\theta)
            = \sum_r \frac{b_r}{B}\,\ell_r(\theta), \qquad\text{so}\qquad
        \nabla\ell = \frac{\sum_r b_r\nabla\ell_r}{\sum_r b_r},

    since :math:`\sum_r b_r/B = 1` counts :math:`R` (the KL) exactly once. :meth:`all_reduce` sends
    :math:`b_r\nabla\ell_r` and :math:`b_r` in one message and divides. With equal :math:`b_r` this is the plain
    average that :class:`~torch.nn.parallel.DistributedDataParallel` computes; the weights keep it exact when the
    last mini-batch of an epoch is split unevenly. Without ``batch_size`` the gradients are summed, for a loss that is
    a sum over the data (a collapsed bound). Natural-gradient optimizers that read ``.grad`` (``gpytorch.optim.NGD``,
    :class:`~gpytorch_decoupled.optim.OrthogonalMeanNaturalGradient`) then take the union batch's step too.

    The parameters and buffers of ``modules`` are broadcast from rank 0 when it is built (as DDP does), so that every
    rank starts from one state; they then stay equal, because every rank takes the same steps. A column-sampled KL
    draws its rows from the mean basis's own generator, which is broadcast with the state, so every rank samples the
    same rows (the hybrid and orthogonal strategies' estimate also uses each rank's shard as landmarks unless built
    with ``kl_data_landmarks=False``: unbiased, but not bitwise the KL of one process); Monte Carlo likelihoods draw
    from each rank's global generator (seed every rank alike with ``torch.manual_seed``; they then still draw
    different samples for different data, unbiased but not bitwise those of one process).

    A NaN or inf in any rank's gradient, or an exception inside :meth:`synchronize`, raises the same
    :class:`~gpytorch_decoupled.distributed.DistributedStepError` on every rank before the optimizer is called, so
    no parameter changes; each rank's ``.grad`` is then left as that rank computed it.

    :param modules: The modules whose parameters are trained (typically the model and the likelihood).
    :param group: The process group (default: the default group).
    :param broadcast: Broadcast the state of ``modules`` from rank 0 now (default True).

    Example:
        >>> import gpytorch, torch, torch.distributed as dist
        >>> from gpytorch_decoupled.distributed import GradientAllReduce, ShardedBatches, init_process_group
        >>> _ = init_process_group(backend="gloo")  # under torchrun: every rank of the job
        >>> _ = torch.manual_seed(0)  # the same on every rank
        >>> class SVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z):
        ...         q = gpytorch.variational.CholeskyVariationalDistribution(z.size(0))
        ...         super().__init__(gpytorch.variational.VariationalStrategy(self, z, q))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 400).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1))
        >>> model, likelihood = SVGP(x[::40].clone()), gpytorch.likelihoods.GaussianLikelihood()
        >>> gradients = GradientAllReduce(model, likelihood)  # rank 0's initial state everywhere
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=400)  # the global N
        >>> optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
        >>> batches = ShardedBatches(torch.utils.data.TensorDataset(x, y), batch_size=100)  # this rank's shard
        >>> for epoch in range(10):
        ...     batches.set_epoch(epoch)
        ...     for x_batch, y_batch in batches:
        ...         optimizer.zero_grad()
        ...         with gradients.synchronize(batch_size=x_batch.size(0)):  # all-reduce on leaving the block
        ...             loss = -mll(model(x_batch), y_batch)
        ...             loss.backward()
        ...         optimizer.step()
        >>> bool(loss < 0.5)
        True
        >>> dist.destroy_process_group()
    """

    def __init__(self, *modules: torch.nn.Module, group: Group = None, broadcast: bool = True):
        if not modules or not all(isinstance(module, torch.nn.Module) for module in modules):
            raise TypeError("GradientAllReduce needs one or more torch.nn.Module (e.g. the model and the likelihood).")
        self.rank, self.world_size = group_rank_and_size(group, type(self).__name__)
        self.group = group
        seen: set[int] = set()
        self.parameters: list[torch.nn.Parameter] = []
        for module in modules:
            for parameter in module.parameters():
                if parameter.requires_grad and id(parameter) not in seen:
                    seen.add(id(parameter))
                    self.parameters.append(parameter)
        if not self.parameters:
            raise ValueError("the modules have no trainable parameters.")
        if broadcast:
            broadcast_state(modules, group)

    @property
    def message_size(self) -> int:
        """Values each rank sends per :meth:`all_reduce`: its weight, one has-a-gradient flag per parameter tensor,
        the gradients (plus one failure flag per rank)."""
        return 1 + len(self.parameters) + sum(parameter.numel() for parameter in self.parameters)

    def all_reduce(self, batch_size: int | None = None) -> None:
        r"""
        Replaces every rank's ``.grad`` by :math:`\sum_r b_r\mathbf g_r / \sum_r b_r` (with ``batch_size``
        :math:`b_r`, the number of points this rank's loss averages over) or by :math:`\sum_r\mathbf g_r` (without).
        A parameter without a gradient on every rank keeps ``.grad = None``.

        :raises DistributedStepError: On every rank, if any rank's gradient is not finite or a rank failed.
        """
        self._all_reduce(batch_size)

    @contextmanager
    def synchronize(self, batch_size: int | None = None) -> Iterator[None]:
        """
        A block for the forward and backward pass, followed by :meth:`all_reduce`. An exception inside the block
        (an error on this rank's data) is reported to every rank, which all raise the same
        :class:`~gpytorch_decoupled.distributed.DistributedStepError`, instead of leaving the other ranks waiting.
        """
        try:
            yield
        except Exception as error:
            self._all_reduce(batch_size, failure=error)
            raise  # unreachable: the collective raised
        self._all_reduce(batch_size)

    @torch.no_grad()
    def _all_reduce(self, batch_size: int | None, failure: BaseException | None = None) -> None:
        if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1):
            failure = failure or ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        dtype = self.parameters[0].dtype
        for parameter in self.parameters[1:]:
            dtype = torch.promote_types(dtype, parameter.dtype)
        like = torch.empty((), dtype=dtype, device=self.parameters[0].device)
        contribution = None
        if failure is None:
            weight = 1.0 if batch_size is None else float(batch_size)
            flags = [float(parameter.grad is not None) for parameter in self.parameters]
            gradients = [
                (parameter.grad * weight if parameter.grad is not None else torch.zeros_like(parameter)).reshape(-1)
                for parameter in self.parameters
            ]
            head = torch.tensor([weight, *flags], dtype=dtype, device=like.device)
            contribution = torch.cat([head, *(gradient.to(dtype) for gradient in gradients)])
        total = all_reduce_sum(
            contribution, self.message_size, like, "the gradient all-reduce", self.group, failure=failure
        )
        weight, flags = total[0], total[1 : 1 + len(self.parameters)]
        gradients = total[1 + len(self.parameters) :]
        if batch_size is not None:
            gradients = gradients / weight
        for parameter, flag, gradient in zip(
            self.parameters, flags.tolist(), gradients.split([p.numel() for p in self.parameters]), strict=True
        ):
            parameter.grad = None if flag == 0 else gradient.view(parameter.shape).to(parameter.dtype).clone()
