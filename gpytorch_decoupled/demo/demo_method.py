from __future__ import annotations

import contextlib
from collections.abc import Callable

import gpytorch
import torch
from torch import Tensor


class DemoMethod:
    r"""
    One model of the demo: an approximate GP with a Gaussian likelihood, and the training step of its family.

    :param label: Name shown in the table and the plot.
    :param sizes: Inducing-set sizes for the table, e.g. ``"M=200"``.
    :param model: The approximate GP.
    :param likelihood: Its Gaussian likelihood.
    :param step: One training iteration on a mini-batch ``(x, y)``.
    :param start_epoch: Called before every pass over the training data (SRGP restarts its recursion there).
    :param posterior: Returns the context in which predictions are made (SRGP predicts from the posterior of every
        training row at the current hyperparameters); by default predictions need none.
    :param batch_size: Test rows per predictive evaluation.
    """

    def __init__(
        self,
        label: str,
        sizes: str,
        model: gpytorch.models.ApproximateGP,
        likelihood: gpytorch.likelihoods.GaussianLikelihood,
        step: Callable[[Tensor, Tensor], object],
        start_epoch: Callable[[], None] | None = None,
        posterior: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        batch_size: int = 1024,
    ):
        self.label = label
        self.sizes = sizes
        self.model = model
        self.likelihood = likelihood
        self.step = step
        self.start_epoch = start_epoch or (lambda: None)
        self.posterior = posterior
        self.batch_size = batch_size

    @torch.no_grad()
    def predict(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of :math:`y` (noise included) at ``x``, in the standardized units."""
        means, variances = [], []
        with self.posterior():
            self.model.eval()
            self.likelihood.eval()
            try:
                for x_batch in x.split(self.batch_size):
                    predictive = self.likelihood(self.model(x_batch))
                    means.append(predictive.mean)
                    variances.append(predictive.variance)
            finally:
                self.model.train()
                self.likelihood.train()
        return torch.cat(means), torch.cat(variances)
