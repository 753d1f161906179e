from __future__ import annotations

from collections.abc import Callable

import gpytorch
import torch
from torch import Tensor


class ApproximateRegressionModel(gpytorch.models.ApproximateGP):
    r"""
    The benchmark model: zero mean (targets are standardized) and, by default, a scaled ARD squared-exponential kernel,

    .. math::

        k(\mathbf x, \mathbf x') = \sigma_f^2 \exp\big(-\tfrac12 (\mathbf x - \mathbf x')^\top
        \Lambda^{-2} (\mathbf x - \mathbf x')\big),

    with any variational strategy. The strategy is built by ``make_strategy(self)`` because GPyTorch strategies take
    the model they belong to. Classification benchmarks pass their own kernel (e.g. Matérn-5/2) and, for one latent
    GP per class, a ``batch_shape``.

    :param make_strategy: Builds the variational strategy for this model.
    :param num_dims: Input dimension (one length-scale per dimension).
    :param covar_module: The kernel (default: the scaled ARD squared exponential above).
    :param batch_shape: Batch shape of independent latent GPs (of the mean and the default kernel).
    """

    def __init__(
        self,
        make_strategy: Callable[[gpytorch.models.ApproximateGP], object],
        num_dims: int,
        covar_module: gpytorch.kernels.Kernel | None = None,
        batch_shape: torch.Size = torch.Size([]),
    ):
        super().__init__(make_strategy(self))
        self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch_shape)
        if covar_module is None:
            covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=num_dims, batch_shape=batch_shape), batch_shape=batch_shape
            )
        self.covar_module = covar_module

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
