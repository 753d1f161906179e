from __future__ import annotations

import torch
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ApproximateGP
from torch import Tensor

from ..linalg import symmetrized
from ..variational import KalmanIncrements, KalmanVariationalStrategy
from ._collectives import Group, all_gather_rows, all_reduce_sum, group_rank_and_size
from .broadcast_state import broadcast_state


class DistributedKalmanUpdate:
    r"""
    :meth:`KalmanVariationalStrategy.update <gpytorch_decoupled.variational.KalmanVariationalStrategy.update>` on
    ``torch.distributed``: every rank absorbs the union of all ranks' mini-batches, so every rank holds the same
    information-form state, equal to that of one process updating with the union batch.

    The state is a sum over the data of per-batch terms (:ref:`derivations-information-form`),
    :math:`\tilde{\boldsymbol\eta} \mathrel{+}= \sum_r\Delta\tilde{\boldsymbol\eta}_r`,
    :math:`\tilde{\boldsymbol\Lambda} \mathrel{+}= \sum_r \Delta\tilde{\boldsymbol\Lambda}_r` with
    :math:`\Delta\tilde{\boldsymbol\eta}_r = \mathbf K_{\mathbf u r} \mathbf V_r^{-1}(\mathbf y_r - \mu_0)` and
    :math:`\Delta\tilde{\boldsymbol\Lambda}_r = \mathbf K_{\mathbf u r} \mathbf V_r^{-1}\mathbf K_{r\mathbf u}`, each
    computed by its rank; the ranks exchange them (an all-gather of :math:`1 + M + M^2` values per latent per rank) and
    each adds them all. The union's bound term is, by the chain rule of
    :math:`\log p(\mathbf y_1, \dots, \mathbf y_R \mid \text{past})`, the sum of each rank's term given the state and
    the increments of the ranks before it,

    .. math::

        \psi_{\mathcal B} = \sum_r \psi_r\Big(\tilde{\boldsymbol\eta} + \sum_{s<r}\Delta\tilde{\boldsymbol\eta}_s,\;
            \tilde{\boldsymbol\Lambda} + \sum_{s<r}\Delta\tilde{\boldsymbol\Lambda}_s\Big),

    which each rank computes for itself before one more (scalar) all-reduce, so ``recursive_bound`` agrees too. This
    holds for VFE, DTC, FITC and PEP, whose noise :math:`\mathbf V` is diagonal; for PITC each rank's part of a step is
    its own block, so the state is that of one process updating with the ranks' batches one after another.

    An error or a NaN on any rank (bad data, a matrix that is not positive definite) raises the same
    :class:`~gpytorch_decoupled.distributed.DistributedStepError` on every rank, and no rank changes its state.
    Hyperparameters are learned across ranks with :class:`~gpytorch_decoupled.distributed.DistributedCollapsedBound`.

    :param model: An :class:`~gpytorch.models.ApproximateGP` with a
        :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`; its state is broadcast from rank 0.
    :param likelihood: The strategy's :class:`~gpytorch.likelihoods.GaussianLikelihood`.
    :param group: The process group (default: the default group).
    :param broadcast: Broadcast the state of the model and likelihood from rank 0 now (default True).

    Example:
        >>> import gpytorch, torch, torch.distributed as dist
        >>> from gpytorch_decoupled.distributed import DistributedKalmanUpdate, ShardedBatches, init_process_group
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
        >>> x = torch.linspace(-3, 3, 400).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1))
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = RecursiveGP(torch.linspace(-3, 3, 10).unsqueeze(-1), likelihood)
        >>> kalman = DistributedKalmanUpdate(model, likelihood)
        >>> for x_batch, y_batch in ShardedBatches(torch.utils.data.TensorDataset(x, y), batch_size=100):
        ...     psi = kalman.update(x_batch, y_batch)  # the union batch's bound term, on every rank
        >>> model.variational_strategy.num_observed
        400
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, model: ApproximateGP, likelihood: GaussianLikelihood, group: Group = None, broadcast: bool = True
    ):
        self.rank, self.world_size = group_rank_and_size(group, type(self).__name__)
        self.strategy = KalmanVariationalStrategy.of_model(model, likelihood, type(self).__name__)
        self.group = group
        if broadcast:
            broadcast_state([model, likelihood], group)

    @torch.no_grad()
    def update(self, x: Tensor, y: Tensor) -> Tensor:
        r"""
        Absorbs the union of every rank's mini-batch; every rank calls it with its own batch.

        :param x: This rank's inputs, ``(B_r, D)`` (or ``(*batch, B_r, D)``).
        :param y: Its targets, ``(B_r,)`` (or ``(*batch, B_r)``).
        :return: The union batch's bound term :math:`\psi_{\mathcal B}`, one value per latent, the same on every rank.
        :raises DistributedStepError: On every rank, if any rank's batch or terms fail; no state changes.
        """
        strategy = self.strategy
        vector, matrix = strategy.statistics
        bound = strategy.recursive_bound
        what = "the distributed Kalman update"
        contribution = terms = inducing_covariance = failure = None
        try:
            x, y = strategy.checked_data(x, y)
            terms, inducing_covariance = strategy.observation_terms(x, y)
            count = torch.tensor([float(x.size(-2))], dtype=vector.dtype, device=vector.device)
            increments = (terms.information_vector, symmetrized(terms.information_matrix))
            contribution = torch.cat([count, *(increment.reshape(-1) for increment in increments)])
        except Exception as error:
            failure = error
        sizes = [1, vector.numel(), matrix.numel()]
        rows = all_gather_rows(contribution, sum(sizes), vector, what, self.group, failure=failure)
        counts, vectors, matrices = rows.split(sizes, dim=1)

        psi = failure = None
        try:
            before = vectors[: self.rank].sum(0).view(vector.shape), matrices[: self.rank].sum(0).view(matrix.shape)
            psi = strategy.bound_term(terms, inducing_covariance, vector + before[0], matrix + before[1])
        except Exception as error:
            failure = error
        psi = all_reduce_sum(psi, bound.numel(), vector, what, self.group, failure=failure).view(bound.shape)
        increments = KalmanIncrements(vectors.sum(0).view(vector.shape), matrices.sum(0).view(matrix.shape), psi)
        strategy.absorb(increments, int(counts.sum().item()))
        return psi.to(strategy.inducing_points.dtype)
