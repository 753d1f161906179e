from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from gpytorch.models import ApproximateGP
from torch import Tensor

from ..optim import DualEStep
from ._collectives import Group, all_reduce_sum, group_rank_and_size
from .broadcast_state import broadcast_state
from .distributed_step_error import DistributedStepError


class DistributedEStep(DualEStep):
    r"""
    The t-SVGP E-step (:class:`~gpytorch_decoupled.optim.DualEStep`) on ``torch.distributed``: each rank computes the
    statistics of its own mini-batch, one all-reduce sums them, and every rank applies the same update, so every rank
    holds the same sites, equal to those of one process stepping at the union of the ranks' batches.

    The step of :class:`~gpytorch_decoupled.optim.DualEStep` depends on the data only through sums over the batch
    (in whitened coordinates, :math:`\mathbf w_i = \mathbf L_K^{-1}\mathbf k_{\mathbf u i}`) and its size,

    .. math::

        \mathbf W\mathbf g_1 = \sum_{i\in\mathcal B}\mathbf w_i g_{1,i}, \qquad
        \mathbf W\mathbf G\mathbf W^\top = \sum_{i\in\mathcal B} g_{2,i}\mathbf w_i\mathbf w_i^\top, \qquad
        B = \lvert\mathcal B\rvert,

    and each term :math:`g_{\cdot,i}` depends only on datum :math:`i` and on the sites before the step, which every
    rank shares. For :math:`\mathcal B = \bigcup_r\mathcal B_r` the sums are sums over ranks, so summing the ranks'
    :math:`(\mathbf W_r\mathbf g_{1,r}, \mathbf W_r\mathbf G_r\mathbf W_r^\top, b_r)` before the update gives exactly
    the single-process step, with the unbiased scale :math:`s = n / B` of the union batch (``num_data`` :math:`n` is
    the size of the whole data set). One message of :math:`M + M^2 + 1` values per latent per step, independent of
    :math:`B`; the update itself, :math:`O(M^3)`, is repeated on every rank. With per-datum sites the ranks exchange
    the targets :math:`g_{1,i}, g_{2,i}` of their batches instead (a message of :math:`3n` values) and every rank
    sets them all.

    Every rank validates its batch and checks its statistics before anything changes: an error or a NaN on any rank
    raises the same :class:`~gpytorch_decoupled.distributed.DistributedStepError` on every rank, and no rank changes
    its sites. The M-step's gradients go through :class:`~gpytorch_decoupled.distributed.GradientAllReduce`.

    :param model: As for :class:`~gpytorch_decoupled.optim.DualEStep`; its state is broadcast from rank 0.
    :param likelihood: As for :class:`~gpytorch_decoupled.optim.DualEStep`.
    :param num_data: Number :math:`n` of training points of the whole data set (all shards).
    :param lr: Step size :math:`r \in (0, 1]`.
    :param min_curvature: :math:`\beta_{\min}`.
    :param num_likelihood_samples: Monte Carlo samples for likelihoods without quadrature.
    :param group: The process group (default: the default group).
    :param broadcast: Broadcast the state of the model and likelihood from rank 0 now (default True).

    Example:
        >>> import gpytorch, torch, torch.distributed as dist
        >>> from gpytorch_decoupled.distributed import DistributedEStep, ShardedBatches, init_process_group
        >>> from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy
        >>> _ = init_process_group(backend="gloo")  # under torchrun: every rank of the job
        >>> _ = torch.manual_seed(0)  # the same on every rank
        >>> class DualGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points):
        ...         q = DualVariationalDistribution(inducing_points.size(0))
        ...         super().__init__(DualVariationalStrategy(self, inducing_points, q))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 200).unsqueeze(-1)
        >>> y = (x.squeeze(-1).sin() > 0).float()
        >>> model, likelihood = DualGP(x[::20].clone()), gpytorch.likelihoods.BernoulliLikelihood()
        >>> e_step = DistributedEStep(model, likelihood, num_data=200, lr=0.5)
        >>> batches = ShardedBatches(torch.utils.data.TensorDataset(x, y), batch_size=200, shuffle=False)
        >>> for _ in range(20):
        ...     for x_batch, y_batch in batches:
        ...         e_step.step(x_batch, y_batch)
        >>> _ = model.eval()
        >>> bool((likelihood(model(x)).mean.gt(0.5).float() == y).float().mean() > 0.95)
        True
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        model: ApproximateGP,
        likelihood: Likelihood,
        num_data: int,
        lr: float = 1.0,
        min_curvature: float = 2e-8,
        num_likelihood_samples: int | None = None,
        group: Group = None,
        broadcast: bool = True,
    ):
        self.rank, self.world_size = group_rank_and_size(group, type(self).__name__)
        super().__init__(model, likelihood, num_data, lr, min_curvature, num_likelihood_samples)
        self.group = group
        self._communicated = False
        if broadcast:
            broadcast_state([model, likelihood], group)

    @torch.no_grad()
    def step(self, x: Tensor, y: Tensor, indices: Tensor | None = None) -> None:
        r"""
        One E-step at the union of every rank's mini-batch; every rank calls it with its own batch.

        :param x: This rank's mini-batch inputs, ``(B_r, D)``.
        :param y: Its targets.
        :param indices: Positions of the batch in ``datum_inputs``; required with per-datum sites.
        :raises DistributedStepError: On every rank, if any rank's batch or statistics fail; no sites change.
        """
        self._communicated = False
        try:
            super().step(x, y, indices)
        except DistributedStepError:
            raise
        except Exception as error:
            # After the all-reduce every rank computes the same thing from the same sums, and fails alike.
            if self._communicated:
                raise
            self._send(None, failure=error)
            raise  # unreachable: the collective raised

    def _message_layout(self) -> tuple[torch.Size, torch.Size, int]:
        """The shapes of the two site buffers and the number of counts every rank sends."""
        distribution = self.strategy._variational_distribution
        site_mean, site_precision = distribution()
        counts = distribution.datum_inputs.size(0) if distribution.per_datum else 1
        return site_mean.shape, site_precision.shape, counts

    def _send(self, parts: tuple[Tensor, Tensor, Tensor] | None, failure: BaseException | None = None) -> Tensor:
        """All-reduces ``(first, second, counts)`` shaped as the two site buffers and the counts (a failed rank sends
        nothing but its flag)."""
        first_shape, second_shape, counts = self._message_layout()
        size = first_shape.numel() + second_shape.numel() + counts
        contribution = None
        if failure is None:
            first, second, count = parts
            if first.shape != first_shape or second.shape != second_shape or count.numel() != counts:
                failure = ValueError(
                    f"the step's statistics have shapes {tuple(first.shape)} and {tuple(second.shape)}, where the "
                    f"sites have {tuple(first_shape)} and {tuple(second_shape)}."
                )
            else:
                contribution = torch.cat([first.reshape(-1), second.reshape(-1), count.reshape(-1).to(first.dtype)])
        like = self.strategy._variational_distribution()[0]
        self._communicated = True
        return all_reduce_sum(contribution, size, like, "the distributed E-step", self.group, failure=failure)

    def _combined_sums(self, whitened_mean_sum: Tensor, whitened_gram: Tensor, batch_size: int):
        count = torch.tensor(float(batch_size), dtype=whitened_mean_sum.dtype, device=whitened_mean_sum.device)
        total = self._send((whitened_mean_sum, whitened_gram, count))
        first_shape, second_shape, _ = self._message_layout()
        first, second, count = total.split([first_shape.numel(), second_shape.numel(), 1])
        return first.view(first_shape), second.view(second_shape), int(count.item())

    def _combined_datum_targets(self, indices: Tensor, first_target: Tensor, second_target: Tensor):
        site_mean, _ = self.strategy._variational_distribution()

        def dense(values: Tensor) -> Tensor:
            return torch.zeros_like(site_mean).index_add_(-1, indices, values.expand(*site_mean.shape[:-1], -1))

        counts = torch.zeros(site_mean.size(-1), dtype=site_mean.dtype, device=site_mean.device)
        counts.index_add_(0, indices, torch.ones_like(indices, dtype=site_mean.dtype))
        total = self._send((dense(first_target), dense(second_target), counts))
        first, second, counts = total.split([site_mean.numel(), site_mean.numel(), site_mean.size(-1)])
        union = counts.nonzero().squeeze(-1)
        # A point in several ranks' batches has the same targets on each: take their mean.
        scale = counts[union]
        return union, first.view(site_mean.shape)[..., union] / scale, second.view(site_mean.shape)[..., union] / scale
