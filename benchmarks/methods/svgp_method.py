from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled.variational import FastNaturalVariationalDistribution

from .approximate_gp_method import ApproximateGPMethod
from .approximate_regression_model import ApproximateRegressionModel
from .inducing_points import initial_inducing_points


class SVGPMethod(ApproximateGPMethod):
    r"""
    GPyTorch's SVGP baseline (Hensman et al., 2015): whitened :class:`~gpytorch.variational.VariationalStrategy`.

    With ``natural=False``, a :class:`~gpytorch.variational.CholeskyVariationalDistribution` and Adam on everything.
    With ``natural=True``, a :class:`~gpytorch.variational.NaturalVariationalDistribution` stepped by
    :class:`gpytorch.optim.NGD` and Adam on the hyperparameters and inducing inputs, as in GPyTorch's NGD tutorial.

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized).
    :param num_inducing: Number of inducing points :math:`M`.
    :param natural: Natural-gradient variant.
    :param lr: Adam learning rate.
    :param ngd_lr: NGD step size (``natural=True`` only).
    :param seed: Seed for the inducing-point draw and initial parameters.
    :param likelihood: The likelihood (default: Gaussian).
    :param fast_natural: With ``natural=True``, this package's
        :class:`~gpytorch_decoupled.variational.FastNaturalVariationalDistribution` (same parameters and steps).
    :param strategy_cls: GPyTorch's :class:`~gpytorch.variational.VariationalStrategy` or a subclass with the same
        parameters, e.g. :class:`~gpytorch.variational.LargeBatchVariationalStrategy` (its predictive terms in
        float64, built for large batches on data-centre GPUs).
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        num_inducing: int = 200,
        natural: bool = False,
        lr: float = 0.01,
        ngd_lr: float = 0.1,
        seed: int = 0,
        likelihood: gpytorch.likelihoods.Likelihood | None = None,
        fast_natural: bool = False,
        strategy_cls: type = gpytorch.variational.VariationalStrategy,
    ):
        torch.manual_seed(seed)
        inducing_points = initial_inducing_points(train_x, num_inducing, seed)
        distribution_cls = (
            (
                FastNaturalVariationalDistribution
                if fast_natural
                else gpytorch.variational.NaturalVariationalDistribution
            )
            if natural
            else gpytorch.variational.CholeskyVariationalDistribution
        )

        def make_strategy(model):
            distribution = distribution_cls(num_inducing)
            return strategy_cls(model, inducing_points, distribution, learn_inducing_locations=True)

        model = ApproximateRegressionModel(make_strategy, train_x.size(-1)).to(train_x)
        likelihood = (likelihood or gpytorch.likelihoods.GaussianLikelihood()).to(train_x)
        if natural:
            optimizers = [
                gpytorch.optim.NGD(model.variational_parameters(), num_data=train_y.size(0), lr=ngd_lr),
                torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=lr),
            ]
        else:
            optimizers = [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)]
        label = "GPyTorch SVGP (NGD)" if natural else "GPyTorch SVGP (Adam)"
        if natural and fast_natural:
            label = "SVGP (NGD, FastNatural q)"
        if strategy_cls is not gpytorch.variational.VariationalStrategy:
            label = label.replace("SVGP", strategy_cls.__name__.removesuffix("VariationalStrategy") + " SVGP")
        super().__init__(label, f"M={num_inducing}", model, likelihood, optimizers, train_x, train_y)
