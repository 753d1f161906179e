from __future__ import annotations

import contextlib
from collections.abc import Iterator

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled.optim import RecursiveGradientPropagation
from gpytorch_decoupled.training import compile_training_step
from gpytorch_decoupled.variational import KalmanVariationalStrategy

from .approximate_regression_model import ApproximateRegressionModel
from .inducing_points import initial_inducing_points
from .method import Method


class RecursiveMethod(Method):
    r"""
    This package's SRGP (Schürch et al., 2020): a :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`
    whose posterior over the inducing values is computed in closed form, mini-batch by mini-batch, and whose
    hyperparameters and inducing inputs take one Adam step per mini-batch on the recursive collapsed bound, with the
    gradient of :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation`.

    **Epochs.** SRGP resets the posterior and the propagated Jacobians at the start of every pass over the data. The
    runner hands out shuffled epochs of exactly :math:`N` rows (the last mini-batch of an epoch may be smaller), so
    :meth:`step` starts an epoch (``start_epoch()``) whenever the previous one has seen all :math:`N` rows: every
    :math:`\lceil N/B\rceil` steps.

    **Predictions and the objective.** Within an epoch the posterior mixes mini-batches absorbed at different
    hyperparameters (by design of SRGP). Before predicting or evaluating :meth:`objective`, the method therefore runs
    one clean pass of ``update`` over all training rows at the current hyperparameters (as docs/derivations.md,
    "Predictions", recommends over the authors' code, which predicts from the last mixed state), so that predictions are
    the exact batch posterior of the chosen model (for VFE: Titsias' optimal :math:`q`, the same as collapsed SGPR at
    these hyperparameters) and :meth:`objective` is the model's collapsed bound per datum. The pass uses consecutive
    rows in blocks of ``batch_size`` (only PITC depends on the blocks); it is repeated only after a training step, and
    SRGP's own epoch state is restored afterwards, so evaluating does not change training.

    **Propagation.** ``propagate="full"`` (default) is the published algorithm: the Jacobians of every
    hyperparameter and of the inducing inputs are propagated (for VFE and DTC those of the inducing inputs in their
    low-rank structure, so a step costs little more than with ``"hyperparameters"``, which gives the inducing inputs
    the naive gradient); see :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation`.

    The package's demo uses ``lr=0.05`` (so could a quick benchmark): on elevators (:math:`d = 18`) a step costs some 40
    forward-mode passes (the kernel and noise parameters, and :math:`d` for the inducing inputs), so only 100-200 steps
    fit its 20 s on a shared CPU, and at 0.01 the length-scales are still far from their optimum then (test NLL -0.23
    against -0.81).

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized).
    :param num_inducing: Number of inducing points :math:`M` (drawn from the training inputs with ``seed``).
    :param approximation: The sparse model: ``"vfe"`` (default), ``"dtc"``, ``"fitc"``, ``"pitc"`` or ``"pep"``.
    :param alpha: The power of ``"pep"``.
    :param lr: Adam learning rate of the kernel and noise hyperparameters.
    :param inducing_lr: Adam learning rate of the inducing inputs (default: ``lr``).
    :param propagate: ``"full"`` (default), ``"hyperparameters"`` or ``"none"``.
    :param seed: Seed for the inducing-point draw and initial parameters.
    :param batch_size: Rows per block of the clean pass and of predictions.
    :param compile_options: When given, steps run compiled, through
        :func:`~gpytorch_decoupled.training.compile_training_step` with these options (``{}``: Inductor).
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        num_inducing: int = 100,
        approximation: str = "vfe",
        alpha: float | None = None,
        lr: float = 0.01,
        inducing_lr: float | None = None,
        propagate: str = "full",
        seed: int = 0,
        batch_size: int = 1024,
        compile_options: dict | None = None,
    ):
        torch.manual_seed(seed)
        inducing_points = initial_inducing_points(train_x, num_inducing, seed)
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(train_x)

        def make_strategy(model):
            return KalmanVariationalStrategy(
                model, inducing_points, likelihood=likelihood, approximation=approximation, alpha=alpha
            )

        model = ApproximateRegressionModel(make_strategy, train_x.size(-1)).to(train_x)
        strategy = model.variational_strategy
        inducing = strategy.inducing_points
        hyperparameters = [parameter for parameter in model.parameters() if parameter is not inducing]
        optimizer = torch.optim.Adam(
            [
                {"params": [*hyperparameters, *likelihood.parameters()]},
                {"params": [inducing], "lr": lr if inducing_lr is None else inducing_lr},
            ],
            lr=lr,
        )
        label = f"SRGP (Kalman, {approximation.upper()})"
        super().__init__(label, f"M={num_inducing}", model, likelihood, batch_size)
        self.srgp = RecursiveGradientPropagation(model, likelihood, optimizer, propagate=propagate)
        self._step = self.srgp.step if compile_options is None else compile_training_step(self.srgp, **compile_options)
        self.train_x = train_x
        self.train_y = train_y
        self._epoch_rows = train_y.size(0)  # a full epoch "has been seen": the first step starts one
        self._steps = 0
        self._clean_state: dict[str, Tensor] | None = None
        self._clean_steps = -1

    def step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        if self._epoch_rows >= self.train_y.size(0):
            self.srgp.start_epoch()
            self._epoch_rows = 0
        self._step(x, y)
        self._epoch_rows += y.size(0)
        self._steps += 1

    @contextlib.contextmanager
    def clean_posterior(self) -> Iterator[KalmanVariationalStrategy]:
        """Within the block, the strategy holds the exact posterior of all training rows at the current
        hyperparameters (computed by one pass of ``update``, or reused if no step was taken since); SRGP's epoch
        state is restored on exit."""
        strategy = self.model.variational_strategy
        epoch_state = {name: value.clone() for name, value in strategy.state_dict().items()}
        try:
            if self._clean_steps == self._steps:
                strategy.load_state_dict(self._clean_state)
            else:
                strategy.reset()
                for x, y in zip(self.train_x.split(self.batch_size), self.train_y.split(self.batch_size)):
                    strategy.update(x, y)
                self._clean_state = {name: value.clone() for name, value in strategy.state_dict().items()}
                self._clean_steps = self._steps
            yield strategy
        finally:
            strategy.load_state_dict(epoch_state)

    @torch.no_grad()
    def predict(self, x: Tensor) -> tuple[Tensor, Tensor]:
        with self.clean_posterior():
            return super().predict(x)

    @torch.no_grad()
    def objective(self) -> float:
        """The model's collapsed bound per datum at the current hyperparameters (for VFE: Titsias' bound, which
        equals the ELBO at the optimal :math:`q` and bounds every other :math:`q`'s ELBO from above)."""
        with self.clean_posterior() as strategy:
            return (strategy.recursive_bound.sum() / self.train_y.size(0)).item()
