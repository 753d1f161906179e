from __future__ import annotations

import gpytorch
from torch import Tensor


class ExactRegressionModel(gpytorch.models.ExactGP):
    r"""
    Exact GP regression with zero mean and a scaled ARD squared-exponential kernel, or, given inducing points, the
    collapsed SGPR of Titsias (2009) through :class:`~gpytorch.kernels.InducingPointKernel`, whose marginal likelihood
    is the collapsed bound

    .. math::

        \log \mathcal N(\mathbf y \mid \mathbf 0, \mathbf Q_{ff} + \sigma^2 \mathbf I)
        - \tfrac{1}{2\sigma^2} \operatorname{tr}(\mathbf K_{ff} - \mathbf Q_{ff}).

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized).
    :param likelihood: Gaussian likelihood.
    :param inducing_points: Inducing inputs for SGPR, or ``None`` for the exact GP.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        likelihood: gpytorch.likelihoods.GaussianLikelihood,
        inducing_points: Tensor | None = None,
    ):
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=train_x.size(-1)))
        if inducing_points is not None:
            kernel = gpytorch.kernels.InducingPointKernel(
                kernel, inducing_points=inducing_points, likelihood=likelihood
            )
        self.covar_module = kernel

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
