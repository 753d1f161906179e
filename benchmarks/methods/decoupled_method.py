from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled.optim import MeanBasisAdam
from gpytorch_decoupled.variational import DecoupledVariationalDistribution, DecoupledVariationalStrategy

from .approximate_gp_method import ApproximateGPMethod, exact_strategy_kl
from .approximate_regression_model import ApproximateRegressionModel
from .inducing_points import initial_inducing_points


def stacked_mean_basis(train_x: Tensor, covariance_points: Tensor, num_mean_inducing: int, seed: int) -> Tensor:
    r"""The Decoupled mean basis :math:`\alpha = \gamma \cup \beta` of Salimbeni et al. (2018, App. F): the
    :math:`M_\alpha - M_\beta` points :math:`\gamma` that :class:`OrthogonalMethod` draws with the same seed, stacked on
    the covariance points :math:`\beta`, so that Decoupled and ODVGP start from the same inducing inputs.

    :param train_x: Training inputs.
    :param covariance_points: :math:`\beta`, ``M_beta x d``.
    :param num_mean_inducing: :math:`M_\alpha \ge M_\beta`.
    :param seed: The run's seed (:math:`\gamma` is drawn with ``seed + 1``, as the ODVGP methods do).
    """
    num_extra = num_mean_inducing - covariance_points.size(0)
    if num_extra < 0:
        raise ValueError(
            f"num_mean_inducing (M_alpha={num_mean_inducing}) must be at least num_inducing "
            f"(M_beta={covariance_points.size(0)}): the mean basis contains the covariance basis"
        )
    if num_extra == 0:
        return covariance_points.clone()
    return torch.cat([initial_inducing_points(train_x, num_extra, seed + 1), covariance_points])


class DecoupledMethod(ApproximateGPMethod):
    r"""
    This package's :class:`~gpytorch_decoupled.variational.DecoupledVariationalStrategy` (SVDGP, Cheng & Boots 2017),
    trained with Adam (the inverse parametrization has no practical natural gradient): by default the mean coefficients
    take :class:`~gpytorch_decoupled.optim.MeanBasisAdam` (the package's scale-free step) and the rest Adam; with
    ``mean_basis_adam=False``, Adam on every parameter at one rate, as in both papers.

    The mean basis is :math:`\alpha = \gamma \cup \beta` (Salimbeni et al. 2018, App. F): ``num_mean_inducing -
    num_inducing`` extra points, the same :math:`\gamma` that :class:`OrthogonalMethod` would draw, stacked on the
    covariance basis :math:`\beta`. So ``num_mean_inducing=1200, num_inducing=200`` is comparable with OrthNat at
    :math:`M_\gamma=1000, M_\beta=200`.

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized).
    :param num_inducing: Covariance basis size :math:`M_\beta`.
    :param num_mean_inducing: Mean basis size :math:`M_\alpha \ge M_\beta` (covariance points included).
    :param lr: Adam learning rate.
    :param mean_basis_adam: Step the mean coefficients with :class:`~gpytorch_decoupled.optim.MeanBasisAdam`.
    :param mean_lr: MeanBasisAdam's rate (default: its own).
    :param num_kl_columns: Sampled KL rows :math:`b` (``None``: exact KL).
    :param jacobi_preconditioning: Optimize the Jacobi-scaled parameters (Cheng & Boots 2017,
        App. A.1; docs/derivations.md, "Jacobi preconditioning of the decoupled parameters").
    :param seed: Seed for the inducing-point draws and initial parameters.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        num_inducing: int = 200,
        num_mean_inducing: int = 1200,
        lr: float = 0.01,
        mean_basis_adam: bool = True,
        mean_lr: float | None = None,
        num_kl_columns: int | None = 64,
        jacobi_preconditioning: bool = False,
        seed: int = 0,
    ):
        torch.manual_seed(seed)
        covariance_points = initial_inducing_points(train_x, num_inducing, seed)
        mean_points = stacked_mean_basis(train_x, covariance_points, num_mean_inducing, seed)

        def make_strategy(model):
            return DecoupledVariationalStrategy(
                model,
                covariance_points,
                DecoupledVariationalDistribution(num_mean_inducing, num_inducing),
                mean_points,
                num_kl_columns=num_kl_columns,
                jacobi_preconditioning=jacobi_preconditioning,
            )

        model = ApproximateRegressionModel(make_strategy, train_x.size(-1)).to(train_x)
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(train_x)
        parameters = [*model.parameters(), *likelihood.parameters()]
        optimizers = []
        if mean_basis_adam:
            optimizers.append(MeanBasisAdam(model, **({} if mean_lr is None else {"lr": mean_lr})))
            coefficients = model.variational_strategy.mean_basis.coefficients
            parameters = [p for p in parameters if p is not coefficients]
        optimizers.append(torch.optim.Adam(parameters, lr=lr))
        super().__init__(
            "Decoupled (ours)",
            f"Mα={num_mean_inducing}, Mβ={num_inducing}",
            model,
            likelihood,
            optimizers,
            train_x,
            train_y,
        )

    def _exact_kl(self) -> Tensor:
        return exact_strategy_kl(self.model.variational_strategy)
