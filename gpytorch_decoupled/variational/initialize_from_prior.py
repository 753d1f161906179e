from __future__ import annotations

import torch

from ..gpytorch_compat import VariationalStrategyBase
from ._direct_variational_strategy import _DirectVariationalStrategy


@torch.no_grad()
def initialize_from_prior(strategy: VariationalStrategyBase) -> bool:
    r"""
    Initializes a strategy's :math:`q(\mathbf u)` from the prior, as GPyTorch's first call of the strategy would (with
    the distribution's random noise), unless it was called or initialized before, or its state needs no such
    initialization: this package's Decoupled, Dual and Kalman strategies, whose parameters, sites or statistics are set
    on construction or by their update steps, and whose first call only records itself. Code that must agree on a model
    before its first call, e.g. several processes that broadcast one rank's state
    (:func:`~gpytorch_decoupled.distributed.broadcast_state`), calls this first.

    :param strategy: A GPyTorch variational strategy (GPyTorch's own or this package's).
    :return: Whether the distribution was initialized now.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import initialize_from_prior
        >>> class SVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z):
        ...         q = gpytorch.variational.CholeskyVariationalDistribution(z.size(0))
        ...         super().__init__(gpytorch.variational.VariationalStrategy(self, z, q))
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(torch.zeros_like(x[..., 0]), self.covar_module(x))
        >>> strategy = SVGP(torch.randn(4, 1)).variational_strategy
        >>> initialize_from_prior(strategy), initialize_from_prior(strategy)
        (True, False)
    """
    if isinstance(strategy, _DirectVariationalStrategy) or strategy.variational_params_initialized.item():
        return False
    strategy._variational_distribution.initialize_variational_distribution(strategy.prior_distribution)
    strategy.variational_params_initialized.fill_(1)
    strategy._clear_cache()
    return True
