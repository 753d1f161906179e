from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled.optim import MeanBasisAdam, OrthogonalMeanNaturalGradient
from gpytorch_decoupled.variational import (
    FastNaturalVariationalDistribution,
    HybridVariationalStrategy,
    IndependentMultitaskVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)

from .approximate_gp_method import ApproximateGPMethod, exact_strategy_kl
from .approximate_regression_model import ApproximateRegressionModel
from .inducing_points import initial_inducing_points


class OrthogonalMethod(ApproximateGPMethod):
    r"""
    This package's :class:`~gpytorch_decoupled.variational.OrthogonallyDecoupledVariationalStrategy`, trained as in
    Salimbeni et al. (2018): **OrthNat** (``natural=True``: natural gradients on the covariance block, Adam on the rest)
    or **Orth** (Adam on everything). With ``strategy_cls=HybridVariationalStrategy`` the same training drives the
    hybrid basis (same inducing inputs for the same seed; Adam on everything is how the papers ran it).

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized).
    :param num_inducing: Covariance basis size :math:`M_\beta`.
    :param num_mean_inducing: Mean basis size :math:`M_\gamma`.
    :param natural: OrthNat (natural gradients on the :math:`\beta` block) instead of Orth.
    :param mean_rule: The step of :math:`\mathbf a_\gamma`: ``"mean-basis-adam"`` (the package's default,
        :class:`~gpytorch_decoupled.optim.MeanBasisAdam`: Adam with its step measured in function space), ``"adam"``
        (plain Adam, the paper's practical scheme) or ``"diagonal"`` (paper eq. 17).
    :param lr: Adam learning rate.
    :param ngd_lr: Natural-gradient step size of the :math:`\beta` block.
    :param mean_lr: Step size of :math:`\mathbf a_\gamma`'s rule: MeanBasisAdam's rate in function space (default
        its own, 0.5), plain Adam's rate (default ``lr``) or the diagonal rule's step (default 0.01).
    :param num_kl_columns: Sampled KL rows :math:`b` (``None``: exact KL).
    :param seed: Seed for the inducing-point draws and initial parameters.
    :param strategy_cls: :class:`~gpytorch_decoupled.variational.OrthogonallyDecoupledVariationalStrategy` or
        :class:`~gpytorch_decoupled.variational.HybridVariationalStrategy`.
    :param likelihood: The likelihood (default: Gaussian).
    :param num_latents: Independent latent GPs (one per class of a softmax likelihood) sharing both bases, batched
        inside an :class:`~gpytorch_decoupled.variational.IndependentMultitaskVariationalStrategy`; ``None``: one.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        num_inducing: int = 200,
        num_mean_inducing: int = 1000,
        natural: bool = True,
        mean_rule: str = "mean-basis-adam",
        lr: float = 0.01,
        ngd_lr: float = 0.1,
        mean_lr: float | None = None,
        num_kl_columns: int | None = 64,
        seed: int = 0,
        strategy_cls: type = OrthogonallyDecoupledVariationalStrategy,
        likelihood: gpytorch.likelihoods.Likelihood | None = None,
        num_latents: int | None = None,
    ):
        if mean_rule not in ("mean-basis-adam", "adam", "diagonal"):
            raise ValueError(f"mean_rule must be 'mean-basis-adam', 'adam' or 'diagonal', got {mean_rule!r}.")
        if mean_rule == "diagonal" and strategy_cls is not OrthogonallyDecoupledVariationalStrategy:
            raise ValueError("the diagonal rule (paper eq. 17) is defined for the orthogonal basis only.")
        torch.manual_seed(seed)
        covariance_points = initial_inducing_points(train_x, num_inducing, seed)
        mean_points = initial_inducing_points(train_x, num_mean_inducing, seed + 1)
        distribution_cls = (
            FastNaturalVariationalDistribution if natural else gpytorch.variational.CholeskyVariationalDistribution
        )

        batch_shape = torch.Size([]) if num_latents is None else torch.Size([num_latents])

        def make_strategy(model):
            distribution = distribution_cls(num_inducing, batch_shape=batch_shape)
            base = strategy_cls(model, covariance_points, distribution, mean_points, num_kl_columns=num_kl_columns)
            if num_latents is None:
                return base
            return IndependentMultitaskVariationalStrategy(base, num_tasks=num_latents)

        model = ApproximateRegressionModel(make_strategy, train_x.size(-1), batch_shape=batch_shape).to(train_x)
        likelihood = (likelihood or gpytorch.likelihoods.GaussianLikelihood()).to(train_x)
        strategy = self._base_strategy(model)
        optimizers = []
        first_order = [*likelihood.parameters()]
        if natural:
            optimizers.append(gpytorch.optim.NGD(model.variational_parameters(), num_data=train_y.size(0), lr=ngd_lr))
            first_order += list(model.hyperparameters())
        else:
            first_order += list(model.parameters())
        others = [p for p in first_order if p is not strategy.mean_coefficients]
        if mean_rule == "diagonal":
            rate = 0.01 if mean_lr is None else mean_lr
            optimizers.append(OrthogonalMeanNaturalGradient(model, num_data=train_y.size(0), lr=rate))
            groups = [{"params": others}]
        elif mean_rule == "mean-basis-adam":
            optimizers.append(MeanBasisAdam(model, **({} if mean_lr is None else {"lr": mean_lr})))
            groups = [{"params": others}]
        else:
            groups = [
                {"params": others},
                {"params": [strategy.mean_coefficients], "lr": lr if mean_lr is None else mean_lr},
            ]
        optimizers.append(torch.optim.Adam(groups, lr=lr))
        family = "Hybrid" if strategy_cls is HybridVariationalStrategy else "Orth"
        label = f"{family}{'Nat' if natural else ''} (ours)"
        sizes = f"Mγ={num_mean_inducing}, Mβ={num_inducing}"
        super().__init__(label, sizes, model, likelihood, optimizers, train_x, train_y)

    @staticmethod
    def _base_strategy(model):
        """The decoupled strategy itself, inside a multitask wrapper or not."""
        return getattr(model.variational_strategy, "base_variational_strategy", model.variational_strategy)

    def _exact_kl(self) -> Tensor:
        return exact_strategy_kl(self._base_strategy(self.model))
