from __future__ import annotations

from collections.abc import Callable, Sequence

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled.training import TrainingStep, eager_training_step

from .method import Method, MethodNotApplicable

#: How a method's steps run: ``eager`` (an ordinary loop on GPyTorch's general path, what a user's own loop does),
#: ``lean`` (the package's :class:`~gpytorch_decoupled.training.TrainingStep` with ``compile=False``) or ``compiled``
#: (the same step under ``torch.compile``; its first call compiles).
STEP_KINDS = ("eager", "lean", "compiled")


def exact_strategy_kl(strategy) -> Tensor:
    """The KL of a mean-basis strategy with :math:`\\mathbf a^\\top\\mathbf K\\mathbf a` computed exactly (in row
    blocks) rather than from this step's sampled rows, for the full-data objective."""
    sampled, strategy.num_kl_columns = strategy.num_kl_columns, None
    try:
        return strategy.kl_divergence().sum()
    finally:
        strategy.num_kl_columns = sampled


class ApproximateGPMethod(Method):
    r"""
    A :class:`gpytorch.models.ApproximateGP` trained on mini-batches of the ELBO.

    Every variational method (GPyTorch's baselines and this package's strategies) is one of these: a model, a Gaussian
    likelihood and a list of optimizers stepped together on :math:`-\mathrm{ELBO}/N`. Its :meth:`objective` is the
    full-data ELBO per datum,

    .. math::

        \frac{1}{N}\Big(\sum_{n=1}^{N} \mathbb E_{q(f_n)}[\log p(y_n \mid f_n)] - \mathrm{KL}[q \Vert p]\Big),

    accumulated over mini-batches with no graph kept.

    :param label: Name shown in tables and plots.
    :param sizes: Inducing-set sizes for the table.
    :param model: The approximate GP.
    :param likelihood: Its Gaussian likelihood.
    :param optimizers: Built from the model and likelihood; all of them step after every backward pass.
    :param train_x: Training inputs (for :meth:`objective`).
    :param train_y: Training targets (for :meth:`objective`).
    :param mll_cls: The training objective (default :class:`gpytorch.mlls.VariationalELBO`).
    :param batch_size: Mini-batch size used to evaluate predictions and the objective.
    """

    def __init__(
        self,
        label: str,
        sizes: str,
        model: gpytorch.models.ApproximateGP,
        likelihood: gpytorch.likelihoods.GaussianLikelihood,
        optimizers: Sequence[torch.optim.Optimizer],
        train_x: Tensor,
        train_y: Tensor,
        mll_cls: Callable[..., gpytorch.mlls.MarginalLogLikelihood] = gpytorch.mlls.VariationalELBO,
        batch_size: int = 1024,
    ):
        super().__init__(label, sizes, model, likelihood, batch_size)
        self.optimizers = list(optimizers)
        self.train_x = train_x
        self.train_y = train_y
        self.mll = mll_cls(likelihood, model, num_data=train_y.size(0))
        self.training_step: TrainingStep | None = None

    def use_training_step(self, kind: str) -> ApproximateGPMethod:
        """Runs the steps as ``kind`` of :data:`STEP_KINDS` says (the label names the kind unless ``eager``).

        :raises MethodNotApplicable: Where the package's training step would fall back to the eager step.
        """
        if kind not in STEP_KINDS:
            raise ValueError(f"step must be one of {', '.join(STEP_KINDS)}, got {kind!r}.")
        if kind == "eager":
            self.training_step = None
            return self
        if type(self).step is not ApproximateGPMethod.step:
            raise MethodNotApplicable(f"{self.label} takes its own steps; it has no {kind} step.")
        step = TrainingStep(self.mll, self.optimizers, lean=True, compile=kind == "compiled")
        if step.fallback_reason is not None:
            raise MethodNotApplicable(f"{self.label} has no {kind} step: {step.fallback_reason}")
        self.training_step = step
        self.label = f"{self.label}, {kind} step"
        return self

    def step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        if self.training_step is None:
            eager_training_step(self.mll, self.optimizers, x, y)
        else:
            self.training_step(x, y)

    @torch.no_grad()
    def objective(self) -> float:
        # Train mode: the marginals q(f_n) are all the ELBO needs, and no eval cache is built.
        self._set_training(True)
        expected_log_lik = sum(
            self.likelihood.expected_log_prob(y_batch, self.model(x_batch)).sum()
            for x_batch, y_batch in zip(self.train_x.split(self.batch_size), self.train_y.split(self.batch_size))
        )
        return ((expected_log_lik - self._exact_kl()) / self.train_y.size(0)).item()

    def _exact_kl(self) -> Tensor:
        """The KL term of :meth:`objective` (methods with a stochastic training KL override this)."""
        return self.model.variational_strategy.kl_divergence().sum()
