from __future__ import annotations

from gpytorch import variational
from torch import Tensor

from ..gpytorch_compat import cache_safe


@cache_safe
class LMCVariationalStrategy(variational.LMCVariationalStrategy):
    r"""
    Linear model of coregionalization wrapper whose KL is the base strategy's own KL, summed over latents.

    A drop-in replacement for :class:`gpytorch.variational.LMCVariationalStrategy` (same constructor, same
    predictions). GPyTorch's wrapper computes the KL from the base's ``variational_distribution`` and
    ``prior_distribution`` with ``torch.distributions.kl_divergence``, which is wrong for every strategy that defines
    its own ``kl_divergence()``; this one returns

    .. math::

        \mathrm{KL} = \sum_{q=1}^{Q} \texttt{base.kl\_divergence()}[\ldots, q]

    over the latent dimension ``latent_dim``, and clears eval caches on ``.to()`` / ``.double()``.

    :param base_variational_strategy: Base variational strategy, batched over latents in ``latent_dim``.
    :param num_tasks: Number of output tasks.
    :param num_latents: (Default: 1) Number of latent functions.
    :param latent_dim: (Default: -1) Which (negative) batch dimension of the base is the latent dimension.
    :param jitter_val: Optional jitter added to the output covariance.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import LMCVariationalStrategy
        >>> class LMCSVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, num_latents: int = 3, num_tasks: int = 4, num_inducing: int = 8):
        ...         batch = torch.Size([num_latents])
        ...         q_u = gpytorch.variational.CholeskyVariationalDistribution(num_inducing, batch_shape=batch)
        ...         base = gpytorch.variational.VariationalStrategy(self, torch.randn(num_inducing, 1), q_u)
        ...         super().__init__(LMCVariationalStrategy(base, num_tasks=num_tasks, num_latents=num_latents))
        ...         self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch)
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(batch_shape=batch))
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> model = LMCSVGP()
        >>> model(torch.randn(5, 1)).event_shape
        torch.Size([5, 4])
    """

    def kl_divergence(self) -> Tensor:
        return self.base_variational_strategy.kl_divergence().sum(dim=self.latent_dim)
