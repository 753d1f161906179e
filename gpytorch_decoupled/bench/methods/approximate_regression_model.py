from __future__ import annotations

from collections.abc import Callable

import gpytorch
from torch import Tensor


class ApproximateRegressionModel(gpytorch.models.ApproximateGP):
    r"""
    The benchmark model: zero mean (targets are standardized) and a scaled ARD squared-exponential kernel,

    .. math::

        k(\mathbf x, \mathbf x') = \sigma_f^2 \exp\big(-\tfrac12 (\mathbf x - \mathbf x')^\top
        \Lambda^{-2} (\mathbf x - \mathbf x')\big),

    with any variational strategy. The strategy is built by ``make_strategy(self)`` because GPyTorch strategies take
    the model they belong to.

    :param make_strategy: Builds the variational strategy for this model.
    :param num_dims: Input dimension (one length-scale per dimension).
    """

    def __init__(self, make_strategy: Callable[[gpytorch.models.ApproximateGP], object], num_dims: int):
        super().__init__(make_strategy(self))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=num_dims))

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
