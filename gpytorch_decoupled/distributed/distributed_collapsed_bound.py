from __future__ import annotations

import torch
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ApproximateGP
from torch import Tensor

from ..mlls import Batches, CollapsedBoundStatistics, StreamingCollapsedBound
from ._collectives import Group, all_reduce_sum, group_rank_and_size
from .gradient_all_reduce import GradientAllReduce


class DistributedCollapsedBound(StreamingCollapsedBound):
    r"""
    The exact full-data gradient of the collapsed bound (:class:`~gpytorch_decoupled.mlls.StreamingCollapsedBound`)
    with the data sharded across ``torch.distributed`` ranks: each rank streams its own shard, and every rank ends with
    the gradient and the bound of the whole data set.

    The bound is :math:`\mathcal L = \sum_k c_k + F(\tilde{\boldsymbol\eta}, \tilde{\boldsymbol\Lambda})` with the
    statistics sums over the mini-batches of every shard. So (1) each rank's first pass accumulates its shard's
    :math:`(\tilde{\boldsymbol\eta}_r, \tilde{\boldsymbol\Lambda}_r, \sum c_k)` and one all-reduce of
    :math:`M + M^2 + 1` values per latent sums them; (2) every rank evaluates :math:`F` and its adjoints
    :math:`\bar{\boldsymbol\eta}, \bar{\boldsymbol\Lambda}` at the global statistics, and rank 0 alone keeps
    :math:`F`'s direct gradient (through :math:`\mathbf K_{\mathbf{uu}}`), so that it is counted once; (3) each rank's
    second pass back-propagates its own mini-batches' terms, and one all-reduce sums the ranks' gradients:

    .. math::

        \nabla_\theta\mathcal L = \frac{\partial F}{\partial\theta} + \sum_r\sum_{k\in\text{shard }r}
            \nabla_\theta\big(c_k + \langle\bar{\boldsymbol\eta}, \Delta\tilde{\boldsymbol\eta}_k\rangle
            + \langle\bar{\boldsymbol\Lambda}, \Delta\tilde{\boldsymbol\Lambda}_k\rangle\big).

    :meth:`value` (the bound alone) is one all-reduce, and every rank gets the whole data set's bound.
    Two all-reduces per evaluation, whatever the shard sizes; the result is that of one process streaming the union of
    the shards (for PITC, each mini-batch of each shard is a block). Gradients already in ``.grad`` are kept and the
    evaluation's gradient added, as by ``loss.backward()``. An error or a NaN on any rank, in either pass, raises the
    same :class:`~gpytorch_decoupled.distributed.DistributedStepError` on every rank; ``.grad`` is then as before the
    call and the optimizer is not called.

    :param model: An :class:`~gpytorch.models.ApproximateGP` with a
        :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`; its state is broadcast from rank 0.
    :param likelihood: The strategy's :class:`~gpytorch.likelihoods.GaussianLikelihood`.
    :param group: The process group (default: the default group).
    :param broadcast: Broadcast the state of the model and likelihood from rank 0 now (default True).

    Example:
        >>> import gpytorch, torch, torch.distributed as dist
        >>> from gpytorch_decoupled.distributed import DistributedCollapsedBound, ShardedBatches, init_process_group
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> _ = init_process_group(backend="gloo")  # under torchrun: every rank of the job
        >>> _ = torch.manual_seed(0)  # the same on every rank
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points, likelihood):
        ...         super().__init__(KalmanVariationalStrategy(self, inducing_points, likelihood=likelihood))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 1000).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(1000)
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = RecursiveGP(torch.linspace(-3, 3, 10).unsqueeze(-1), likelihood)
        >>> objective = DistributedCollapsedBound(model, likelihood)
        >>> shard = ShardedBatches(torch.utils.data.TensorDataset(x, y), batch_size=250, shuffle=False)
        >>> parameters = [*model.parameters(), *likelihood.parameters()]
        >>> optimizer = torch.optim.LBFGS(parameters, max_iter=20, line_search_fn="strong_wolfe")
        >>> def closure():
        ...     optimizer.zero_grad()
        ...     return objective.value_and_backward(shard)
        >>> _ = optimizer.step(closure)
        >>> bool(likelihood.noise < 0.05)
        True
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, model: ApproximateGP, likelihood: GaussianLikelihood, group: Group = None, broadcast: bool = True
    ):
        self.rank, self.world_size = group_rank_and_size(group, type(self).__name__)
        super().__init__(model, likelihood)
        self.group = group
        self._gradients = GradientAllReduce(model, likelihood, group=group, broadcast=broadcast)

    def value_and_backward(self, batches: Batches) -> Tensor:
        r"""
        Two passes over this rank's shard, with the all-reduces in between and after; every rank calls it.

        :param batches: This rank's mini-batches (e.g. a :class:`~gpytorch_decoupled.distributed.ShardedBatches`), at
            least one: a re-iterable collection or a function returning a fresh iterable.
        :return: The loss :math:`-\mathcal L` of the whole data set (detached), the same on every rank.
        :raises DistributedStepError: On every rank, if any rank fails.
        """
        parameters = self._gradients.parameters
        saved = [parameter.grad for parameter in parameters]
        for parameter in parameters:
            parameter.grad = None
        try:
            shard, total = self._summed_first_pass(batches)
            vector_adjoint, matrix_adjoint, tail = self._tail(total, parameters=self.rank == 0)
            failure = None
            try:
                self._second_pass(batches, shard, vector_adjoint, matrix_adjoint)
            except Exception as error:
                failure = error
            self._gradients._all_reduce(None, failure=failure)
        except Exception:
            for parameter, gradient in zip(parameters, saved, strict=True):
                parameter.grad = gradient
            raise
        for parameter, gradient in zip(parameters, saved, strict=True):
            if gradient is not None:
                parameter.grad = gradient if parameter.grad is None else gradient + parameter.grad
        return self._loss(total.offsets, tail)

    def _total_statistics(self, batches: Batches) -> CollapsedBoundStatistics:
        # value() on every rank: the bound of the whole data set from the all-reduced statistics
        return self._summed_first_pass(batches)[1]

    def _summed_first_pass(self, batches: Batches) -> tuple[CollapsedBoundStatistics, CollapsedBoundStatistics]:
        """This rank's first pass and its statistics summed over every rank."""
        strategy = self.strategy
        vector, matrix = strategy.statistics
        bound = strategy.recursive_bound
        sizes = [vector.numel(), matrix.numel(), bound.numel(), 1]
        shard = contribution = failure = None
        try:
            shard = self._first_pass(batches)
            count = torch.tensor(float(shard.count))
            parts = (shard.vector, shard.matrix, shard.offsets, count)
            contribution = torch.cat([part.reshape(-1).to(vector) for part in parts])
        except Exception as error:
            failure = error
        what = "the distributed collapsed bound's first pass"
        total = all_reduce_sum(contribution, sum(sizes), vector, what, self.group, failure=failure)
        vector_total, matrix_total, offsets, count = total.split(sizes)
        total = CollapsedBoundStatistics(
            vector_total.view(vector.shape), matrix_total.view(matrix.shape), offsets.view(bound.shape), int(count)
        )
        return shard, total
