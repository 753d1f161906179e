from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled.variational import IndependentMultitaskVariationalStrategy

from .approximate_gp_method import ApproximateGPMethod
from .approximate_regression_model import ApproximateRegressionModel
from .inducing_points import initial_inducing_points

#: Builds a model's base strategy from ``(model, inducing_points, batch_shape)``.
StrategyFactory = Callable[[gpytorch.models.ApproximateGP, Tensor, torch.Size], object]


def gradient_step(optimizer: torch.optim.Optimizer, loss: Tensor, parameters: Sequence[torch.nn.Parameter]) -> None:
    """One step of ``optimizer`` with the gradient of ``loss`` with respect to ``parameters`` only: nothing else is
    differentiated (an E-step holds the hyperparameters fixed, an M-step the variational parameters)."""
    gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
    for parameter, gradient in zip(parameters, gradients):
        parameter.grad = gradient
    optimizer.step()


class EMMethod(ApproximateGPMethod):
    r"""
    An approximate GP trained as in Adam et al. (2021, Algorithms 1 and 2): an **E-step** that updates :math:`q` with
    the hyperparameters fixed, then an **M-step**, one Adam step on the hyperparameters and the inducing inputs with
    :math:`q` held fixed as the objective (``mll_cls``) defines it. :meth:`step` is one E-step followed by one M-step
    on the same batch; benchmarks with another schedule call :meth:`e_step` and :meth:`m_step` themselves.

    The model is :class:`ApproximateRegressionModel` (zero mean) with the default or a given kernel and likelihood, so
    the same method runs regression and classification; ``num_latents`` independent latent GPs (e.g. one per class of
    a softmax likelihood) share the inducing inputs, batched inside an
    :class:`~gpytorch_decoupled.variational.IndependentMultitaskVariationalStrategy`.

    Subclasses pass their label, strategy and objective; every other option below is shared (the subclasses forward
    them as keyword arguments).

    :param label: Name shown in tables and plots.
    :param make_strategy: Builds the base strategy from the model, the inducing inputs and the latents' batch shape.
    :param mll_cls: The M-step objective.
    :param train_x: Training inputs.
    :param train_y: Training targets (standardized for regression; labels for classification).
    :param num_inducing: Number of inducing points :math:`M` (drawn from the training inputs with ``seed``).
    :param lr: Adam learning rate of the M-step.
    :param seed: Seed for the inducing-point draw and initial parameters.
    :param inducing_points: Initial inducing inputs, ``M x d`` (overrides the draw).
    :param covar_module: The kernel (default: scaled ARD squared exponential).
    :param likelihood: The likelihood (default: Gaussian).
    :param num_latents: Number of independent latent GPs (one per class of a softmax likelihood), or ``None`` for a
        single one.
    """

    def __init__(
        self,
        label: str,
        make_strategy: StrategyFactory,
        mll_cls: Callable[..., gpytorch.mlls.MarginalLogLikelihood],
        train_x: Tensor,
        train_y: Tensor,
        num_inducing: int = 200,
        lr: float = 0.01,
        seed: int = 0,
        inducing_points: Tensor | None = None,
        covar_module: gpytorch.kernels.Kernel | None = None,
        likelihood: gpytorch.likelihoods.Likelihood | None = None,
        num_latents: int | None = None,
    ):
        torch.manual_seed(seed)
        if inducing_points is None:
            inducing_points = initial_inducing_points(train_x, num_inducing, seed)
        inducing_points = inducing_points.to(train_x).clone()
        batch_shape = torch.Size([]) if num_latents is None else torch.Size([num_latents])

        def strategy(model):
            base = make_strategy(model, inducing_points, batch_shape)
            if num_latents is None:
                return base
            return IndependentMultitaskVariationalStrategy(base, num_tasks=num_latents)

        model = ApproximateRegressionModel(strategy, train_x.size(-1), covar_module, batch_shape).to(train_x)
        likelihood = (likelihood or gpytorch.likelihoods.GaussianLikelihood()).to(train_x)
        self.m_parameters = [*model.hyperparameters(), *likelihood.parameters()]
        optimizers = [torch.optim.Adam(self.m_parameters, lr=lr)]
        sizes = f"M={inducing_points.size(-2)}"
        super().__init__(label, sizes, model, likelihood, optimizers, train_x, train_y, mll_cls)

    @abstractmethod
    def e_step(self, x: Tensor, y: Tensor) -> None:
        """One update of :math:`q` at a batch, the hyperparameters fixed."""

    def m_step(self, x: Tensor, y: Tensor) -> None:
        """One Adam step of the M-step objective at a batch, over the hyperparameters and the inducing inputs."""
        self._set_training(True)
        gradient_step(self.optimizers[0], -self.mll(self.model(x), y), self.m_parameters)

    def step(self, x: Tensor, y: Tensor) -> None:
        self.e_step(x, y)
        self.m_step(x, y)
