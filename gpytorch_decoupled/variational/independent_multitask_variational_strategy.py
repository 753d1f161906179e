from __future__ import annotations

from gpytorch import variational
from torch import Tensor

from ..gpytorch_compat import cache_safe


@cache_safe
class IndependentMultitaskVariationalStrategy(variational.IndependentMultitaskVariationalStrategy):
    r"""
    Independent multitask wrapper whose KL is the base strategy's own KL, summed over tasks.

    A drop-in replacement for :class:`gpytorch.variational.IndependentMultitaskVariationalStrategy`. GPyTorch's wrapper
    computes :math:`\mathrm{KL}[q(\mathbf u) \Vert p(\mathbf u)]` with ``torch.distributions.kl_divergence`` on the
    base's ``variational_distribution`` and ``prior_distribution``, bypassing the base's ``kl_divergence()``. For any
    strategy whose KL is not that of a single Gaussian over :math:`\mathbf u` (decoupled bases, orthogonal bases, dual
    sites), the resulting ELBO is silently wrong (for GPyTorch's own orthogonally decoupled strategy the KL even comes
    out negative). This wrapper returns

    .. math::

        \mathrm{KL} = \sum_{t=1}^{T} \mathrm{KL}_t, \qquad \mathrm{KL}_t = \texttt{base.kl\_divergence()}[\ldots, t],

    summing over the task batch dimension ``task_dim`` (GPyTorch always sums over the last one). When the base has no
    task dimension (one latent shared by all tasks), the base KL is returned unchanged. It also clears eval caches on
    ``.to()`` / ``.double()``.

    :param base_variational_strategy: Base variational strategy, batched over tasks in ``task_dim``.
    :param num_tasks: Number of tasks.
    :param task_dim: (Default: -1) Which batch dimension of the base is the task dimension.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import IndependentMultitaskVariationalStrategy
        >>> class MultitaskSVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, num_tasks: int = 2, num_inducing: int = 8):
        ...         batch = torch.Size([num_tasks])
        ...         q_u = gpytorch.variational.CholeskyVariationalDistribution(num_inducing, batch_shape=batch)
        ...         base = gpytorch.variational.VariationalStrategy(self, torch.randn(num_inducing, 1), q_u)
        ...         super().__init__(IndependentMultitaskVariationalStrategy(base, num_tasks=num_tasks))
        ...         self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch)
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(batch_shape=batch))
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> model = MultitaskSVGP()
        >>> model(torch.randn(5, 1)).event_shape
        torch.Size([5, 2])
        >>> model.variational_strategy.kl_divergence().shape
        torch.Size([])
    """

    def kl_divergence(self) -> Tensor:
        kl = self.base_variational_strategy.kl_divergence()
        if -kl.dim() <= self.task_dim < kl.dim():
            return kl.sum(dim=self.task_dim)
        return kl
