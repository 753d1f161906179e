from __future__ import annotations

import torch
from torch import Tensor

from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep
from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy

from .em_method import EMMethod


class DualMethod(EMMethod):
    r"""
    This package's t-SVGP (Adam et al., 2021): a :class:`~gpytorch_decoupled.variational.DualVariationalStrategy`
    whose sites are set by the closed-form natural-gradient E-step :class:`~gpytorch_decoupled.optim.DualEStep`
    (step ``e_step_lr``, no autograd graph through the model), with an Adam M-step on
    :class:`~gpytorch_decoupled.mlls.DualVariationalELBO` over the hyperparameters and inducing inputs. One
    :meth:`step` is one E-step and one M-step on the same mini-batch.

    The E-step of size :math:`r` is a natural-gradient step on :math:`q` (docs/derivations.md, "The E-step is one
    natural-gradient step"); on mini-batches it
    averages noisy site estimates, so :math:`r < 1`. The default :math:`r = 0.1` (``svgp-ngd``'s NGD step) gave the
    lowest test NLL of 0.03, 0.05, 0.1, 0.2, 0.3, 0.5 and 1 on elevators (batch 256, :math:`M = 200`,
    Adam at 0.01, 20 s); 1 is exact only for a full Gaussian batch.

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized for regression; labels for classification).
    :param e_step_lr: E-step size :math:`r \in (0, 1]`.
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
        self.dual_e_step = DualEStep(
            self.model,
            self.likelihood,
            num_data=train_y.size(0),
            lr=e_step_lr,
            num_likelihood_samples=num_likelihood_samples,
        )

    def e_step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        self.dual_e_step.step(x, y)
