from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from .em_method import EMMethod, gradient_step


class QSVGPMethod(EMMethod):
    r"""
    q-SVGP, the baseline of Adam et al. (2021, Algorithm 1) in GPyTorch: the whitened
    :class:`~gpytorch.variational.VariationalStrategy` with a
    :class:`~gpytorch.variational.NaturalVariationalDistribution`, trained EM-style. The E-step is one
    :class:`gpytorch.optim.NGD` step of size ``ngd_lr`` on :class:`~gpytorch.mlls.VariationalELBO` with the
    hyperparameters fixed (only the natural parameters are differentiated); the M-step is one Adam step on the same
    ELBO with :math:`q` (its whitened parameters) fixed.

    Unlike ``svgp-ngd`` (:class:`SVGPMethod` with ``natural=True``), which steps NGD and Adam on one backward pass,
    the two steps here are separate, so that benchmarks can time the E-step alone and run the paper's E/M schedules.

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized for regression; labels for classification).
    :param ngd_lr: NGD step size :math:`r` of the E-step.
    :param options: ``num_inducing`` (default 200), ``lr`` (Adam, default 0.01), ``seed``, ``inducing_points``,
        ``covar_module``, ``likelihood``, ``num_latents``: see :class:`EMMethod`.
    """

    def __init__(self, train_x: Tensor, train_y: Tensor, ngd_lr: float = 0.1, **options):
        def make_strategy(model, points: Tensor, batch_shape: torch.Size):
            distribution = gpytorch.variational.NaturalVariationalDistribution(points.size(-2), batch_shape=batch_shape)
            return gpytorch.variational.VariationalStrategy(model, points, distribution, learn_inducing_locations=True)

        label = "GPyTorch q-SVGP (NGD E-step)"
        super().__init__(label, make_strategy, gpytorch.mlls.VariationalELBO, train_x, train_y, **options)
        self.variational_parameters = list(self.model.variational_parameters())
        self.natural_gradient = gpytorch.optim.NGD(self.variational_parameters, num_data=train_y.size(0), lr=ngd_lr)

    def e_step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        gradient_step(self.natural_gradient, -self.mll(self.model(x), y), self.variational_parameters)
