from __future__ import annotations

from collections.abc import Callable

import gpytorch
from torch import Tensor


class RegressionModel(gpytorch.models.ApproximateGP):
    r"""
    The demo's model: a zero mean (the targets are standardized) and a scaled ARD squared-exponential kernel,

    .. math::

        k(\mathbf x, \mathbf x') = \sigma_f^2 \exp\big(-\tfrac12 (\mathbf x - \mathbf x')^\top
        \Lambda^{-2} (\mathbf x - \mathbf x')\big),

    with any variational strategy, built by ``make_strategy(self)`` because a GPyTorch strategy takes the model it
    belongs to.

    :param make_strategy: Builds the variational strategy for this model.
    :param num_dims: Input dimension (one length-scale per dimension).

    Example:
        >>> import torch
        >>> z = torch.randn(10, 3)
        >>> model = RegressionModel(
        ...     lambda model: gpytorch.variational.VariationalStrategy(
        ...         model, z, gpytorch.variational.CholeskyVariationalDistribution(10)
        ...     ),
        ...     num_dims=3,
        ... )
        >>> model(torch.randn(5, 3)).mean.shape
        torch.Size([5])
    """

    def __init__(self, make_strategy: Callable[[gpytorch.models.ApproximateGP], object], num_dims: int):
        super().__init__(make_strategy(self))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=num_dims))

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
