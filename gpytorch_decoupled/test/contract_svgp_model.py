from __future__ import annotations

import gpytorch
import torch
from torch import Tensor


class ContractSVGPModel(gpytorch.models.ApproximateGP):
    r"""
    The model of :class:`~gpytorch_decoupled.test.StrategyContractTestCase`: the test model of
    :class:`gpytorch.test.VariationalTestCase` (a constant or zero mean and a scaled RBF kernel) with the strategy
    under test, at module level so that it can be pickled.

    :param inducing_points: The inducing inputs, ``(*inducing_batch, M, d)``.
    :param strategy_cls: The strategy class, or a factory with its signature
        ``(model, inducing_points, variational_distribution, learn_inducing_locations)``.
    :param distribution_cls: The variational distribution class (``(num_inducing, batch_shape)``).
    :param batch_shape: Batch shape of the variational distribution.
    :param constant_mean: A constant mean initialized at 1 (else a zero mean).

    Example:
        >>> model = ContractSVGPModel(
        ...     torch.randn(16, 2),
        ...     gpytorch.variational.VariationalStrategy,
        ...     gpytorch.variational.CholeskyVariationalDistribution,
        ...     torch.Size([]),
        ...     constant_mean=True,
        ... )
        >>> model(torch.randn(5, 2)).mean.shape
        torch.Size([5])
    """

    def __init__(
        self,
        inducing_points: Tensor,
        strategy_cls,
        distribution_cls,
        batch_shape: torch.Size,
        constant_mean: bool,
    ):
        variational_distribution = distribution_cls(inducing_points.size(-2), batch_shape=batch_shape)
        variational_strategy = strategy_cls(
            self, inducing_points, variational_distribution, learn_inducing_locations=True
        )
        super().__init__(variational_strategy)
        if constant_mean:
            self.mean_module = gpytorch.means.ConstantMean()
            self.mean_module.initialize(constant=1.0)
        else:
            self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
