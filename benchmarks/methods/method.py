from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import gpytorch
import torch
from torch import Tensor


class MethodNotApplicable(ValueError):
    """Raised by a method's constructor when it cannot run on the given data (e.g. the exact GP on too many rows)."""


class Method(ABC):
    r"""
    One trainable model in a benchmark: build it, take a training step, predict, score it.

    A method owns its model, likelihood and optimizers; the runner owns data order, timing, memory and metrics, so
    every method is measured by exactly the same code. Predictions are of :math:`y` (latent variance plus noise) in
    the standardized units the model was trained in.

    :param label: Human-readable name shown in tables and plots.
    :param sizes: The inducing-set sizes for tables, e.g. ``"M=200"`` or ``"Mγ=1000, Mβ=200"``.
    :param model: The GPyTorch model.
    :param likelihood: Its likelihood.
    :param batch_size: Rows per batch when predicting or evaluating the objective.
    """

    #: Whether :meth:`step` consumes mini-batches; full-batch methods (collapsed SGPR, exact GP) get all the data.
    uses_minibatches: bool = True

    def __init__(
        self,
        label: str,
        sizes: str,
        model: gpytorch.models.GP,
        likelihood: gpytorch.likelihoods.Likelihood,
        batch_size: int = 1024,
    ):
        self.label = label
        self.sizes = sizes
        self.model = model
        self.likelihood = likelihood
        self.batch_size = batch_size

    @abstractmethod
    def step(self, x: Tensor, y: Tensor) -> None:
        """One training iteration on a mini-batch (or on all data when :attr:`uses_minibatches` is False)."""

    @abstractmethod
    def objective(self) -> float:
        """The training objective per datum on all training data (ELBO / N, or the log marginal likelihood / N)."""

    def _set_training(self, mode: bool) -> None:
        # Switching modes clears GPyTorch's caches, so only switch when the mode really changes.
        if self.model.training != mode:
            self.model.train(mode)
            self.likelihood.train(mode)

    def _numerics(self) -> contextlib.AbstractContextManager:
        """Settings every forward pass of this method runs under."""
        return contextlib.nullcontext()

    def _predictive_batches(self, x: Tensor) -> Iterator:
        """The likelihood's predictive distribution at ``x``, one batch at a time (in eval mode)."""
        self._set_training(False)
        with self._numerics():
            for x_batch in x.split(self.batch_size):
                yield self.likelihood(self.model(x_batch))

    @torch.no_grad()
    def predict(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of :math:`y` at ``x``, computed in batches."""
        means, variances = [], []
        for predictive in self._predictive_batches(x):
            means.append(predictive.mean)
            variances.append(predictive.variance)
        return torch.cat(means), torch.cat(variances)

    @torch.no_grad()
    def predict_probabilities(self, x: Tensor, num_samples: int = 64) -> Tensor:
        r"""Predictive class probabilities at ``x`` of a classification likelihood: :math:`p(y = 1)`, ``(n,)``, for a
        Bernoulli likelihood; :math:`p(y = c)`, ``(n, C)``, for a softmax likelihood, averaged over ``num_samples``
        Monte Carlo draws of the latent functions."""
        probabilities = []
        with gpytorch.settings.num_likelihood_samples(num_samples):
            for predictive in self._predictive_batches(x):
                # A softmax predictive is a batch of categoricals, one per latent draw: (samples, batch, classes).
                probs = predictive.probs
                probabilities.append(probs.mean(0) if probs.dim() == 3 else probs)
        return torch.cat(probabilities)
