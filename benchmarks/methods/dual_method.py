from __future__ import annotations

import torch
from torch import Tensor

from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep
from gpytorch_decoupled.training import eager_training_step
from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy

from .em_method import EMMethod


class DualMethod(EMMethod):
    r"""
    This package's t-SVGP (Adam et al., 2021): a :class:`~gpytorch_decoupled.variational.DualVariationalStrategy`
    whose sites are set by the closed-form natural-gradient E-step :class:`~gpytorch_decoupled.optim.DualEStep`
    (no autograd graph through the model), with an Adam M-step on :class:`~gpytorch_decoupled.mlls.DualVariationalELBO`
    over the hyperparameters and inducing inputs.

    :meth:`step` is the package's default mini-batch schedule (README, :class:`~gpytorch_decoupled.optim.DualEStep`):
    the M-step's forward and backward pass, then the E-step at the same batch, which takes that forward pass's
    marginals instead of evaluating the kernel and factorizing again, then the M-step's Adam step; the E-step size is
    :math:`r_t = \max(1/t, r_{\min})` (the running average of the batch estimates, then a constant floor so that the
    sites keep following the hyperparameters). Full-batch EM (the ``dual`` benchmark's part 2) calls :meth:`e_step`
    and :meth:`m_step` itself, with a constant ``e_step_lr``.

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized for regression; labels for classification).
    :param e_step_lr: E-step size :math:`r \in (0, 1]` of :meth:`e_step`, and :math:`r_{\min}` of :meth:`step`'s
        schedule (default 0.1).
    :param num_likelihood_samples: Monte Carlo samples of the E-step for likelihoods without quadrature.
    :param options: ``num_inducing`` (default 200), ``lr`` (Adam, default 0.01), ``seed``, ``inducing_points``,
        ``covar_module``, ``likelihood``, ``num_latents``: see :class:`EMMethod`.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        e_step_lr: float = 0.1,
        num_likelihood_samples: int | None = None,
        **options,
    ):
        def make_strategy(model, points: Tensor, batch_shape: torch.Size):
            distribution = DualVariationalDistribution(points.size(-2), batch_shape=batch_shape)
            return DualVariationalStrategy(model, points, distribution, learn_inducing_locations=True)

        super().__init__("t-SVGP (dual, ours)", make_strategy, DualVariationalELBO, train_x, train_y, **options)
        self.e_step_lr = e_step_lr
        self.dual_e_step = DualEStep(
            self.model,
            self.likelihood,
            num_data=train_y.size(0),
            lr=e_step_lr,
            num_likelihood_samples=num_likelihood_samples,
        )
        self._steps = 0

    def e_step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        self.dual_e_step.step(x, y)

    def advance_schedule(self) -> None:
        r"""Sets the E-step size of the next step of the default schedule, :math:`r_t = \max(1/t, r_{\min})`."""
        self._steps += 1
        self.dual_e_step.param_groups[0]["lr"] = max(1.0 / self._steps, self.e_step_lr)

    @property
    def step_optimizers(self) -> list[torch.optim.Optimizer]:
        """The E-step and the M-step's optimizer, in the order of the default schedule."""
        return [self.dual_e_step, *self.optimizers]

    def step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        self.advance_schedule()
        # The M-step's forward and backward pass, the E-step at its marginals, then the M-step's Adam step.
        eager_training_step(self.mll, self.step_optimizers, x, y)
