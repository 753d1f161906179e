from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from .approximate_gp_method import ApproximateGPMethod
from .approximate_regression_model import ApproximateRegressionModel
from .inducing_points import initial_inducing_points


class GPyTorchOrthogonalMethod(ApproximateGPMethod):
    r"""
    GPyTorch's own :class:`~gpytorch.variational.OrthogonallyDecoupledVariationalStrategy`, trained with Adam.

    The baseline that this package's orthogonally decoupled strategy is measured against: a mean basis of
    :math:`M_\gamma` points (a :class:`~gpytorch.variational.DeltaVariationalDistribution`) on top of a whitened
    covariance strategy with :math:`M_\beta` points. Natural gradients are not supported for it upstream
    (GPyTorch issue #1267), so Adam drives everything.

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized).
    :param num_inducing: Covariance basis size :math:`M_\beta`.
    :param num_mean_inducing: Mean basis size :math:`M_\gamma`.
    :param lr: Adam learning rate.
    :param seed: Seed for the inducing-point draws and initial parameters.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        num_inducing: int = 200,
        num_mean_inducing: int = 1000,
        lr: float = 0.01,
        seed: int = 0,
    ):
        torch.manual_seed(seed)
        covariance_points = initial_inducing_points(train_x, num_inducing, seed)
        mean_points = initial_inducing_points(train_x, num_mean_inducing, seed + 1)

        def make_strategy(model):
            covariance_strategy = gpytorch.variational.VariationalStrategy(
                model,
                covariance_points,
                gpytorch.variational.CholeskyVariationalDistribution(num_inducing),
                learn_inducing_locations=True,
            )
            return gpytorch.variational.OrthogonallyDecoupledVariationalStrategy(
                covariance_strategy, mean_points, gpytorch.variational.DeltaVariationalDistribution(num_mean_inducing)
            )

        model = ApproximateRegressionModel(make_strategy, train_x.size(-1)).to(train_x)
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(train_x)
        optimizers = [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)]
        super().__init__(
            "GPyTorch ODVGP (Adam)",
            f"Mγ={num_mean_inducing}, Mβ={num_inducing}",
            model,
            likelihood,
            optimizers,
            train_x,
            train_y,
        )
