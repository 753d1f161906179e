from __future__ import annotations

import torch
from torch import Tensor

from ..linalg import keep_freed_cpu_memory
from ..variational import KalmanVariationalStrategy
from .lean_kalman_blocks import NOT_FINITE, LeanKalmanBlocks
from .training_step import _own_code, batch_size_is_dynamic, mark_batch_dynamic, unsupported_torch, warn_fallback


class KalmanUpdateStep:
    r"""
    The Kalman update (:meth:`KalmanVariationalStrategy.update
    <gpytorch_decoupled.variational.KalmanVariationalStrategy.update>`, the information-form absorption of one
    mini-batch in closed form, `Schuerch et al. (2020)`_, Sec. 3.2) as one function that :func:`torch.compile`
    captures whole, ``psi = step(x, y)``: the mini-batch's observation terms from the lean prior blocks
    (:class:`~gpytorch_decoupled.training.LeanKalmanBlocks`), its bound term :math:`\psi_k` from the state before it,
    and the increments :math:`\Delta\tilde{\boldsymbol\eta}_k`, :math:`\Delta\tilde{\boldsymbol\Lambda}_k` added to
    the state, in one graph with no graph break. It returns what ``strategy.update(x, y)`` returns and leaves the
    strategy as it leaves it, to float rounding (the streaming pass at fixed hyperparameters; with a hyperparameter
    step on the bound, see :class:`~gpytorch_decoupled.training.RecursiveTrainingStep`). Built by
    :func:`~gpytorch_decoupled.training.compile_training_step`.

    The input checks (a ``ValueError`` before anything changes) and the count of absorbed points run outside the
    graph. Where ``update`` raises before changing anything (increments not finite; ``NotPSDError`` for a matrix not
    positive definite even at the largest jitter), the compiled step adds nothing to the state and raises a
    ``RuntimeError``. A model whose prior :class:`~gpytorch_decoupled.training.LeanKalmanBlocks` does not support runs
    ``strategy.update`` eagerly, with a warning naming the reason (:attr:`fallback_reason`).

    :param strategy: The strategy, with its likelihood attached (or the model's ``likelihood``).
    :param compile: Compile the step (False runs the same lean step eagerly).
    :param lean: Use the lean path where supported (False: always ``strategy.update``).
    :param compile_options: Keyword arguments of :func:`torch.compile`.
    :raises ValueError: If the strategy has no likelihood.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.training import compile_training_step
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z, likelihood):
        ...         super().__init__(KalmanVariationalStrategy(self, z, likelihood=likelihood))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = RecursiveGP(torch.linspace(-3, 3, 8).unsqueeze(-1), likelihood)
        >>> x = torch.linspace(-3, 3, 200).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1))
        >>> update = compile_training_step(model.variational_strategy, backend="eager")  # "inductor" is faster
        >>> psi = [update(x_batch, y_batch) for x_batch, y_batch in zip(x.split(50), y.split(50))]
        >>> model.variational_strategy.num_observed
        200

    .. _Schuerch et al. (2020):
        https://arxiv.org/abs/1910.08393
    """

    def __init__(self, strategy: KalmanVariationalStrategy, *, compile: bool = True, lean: bool = True, **options):
        keep_freed_cpu_memory()
        self.strategy = strategy
        self.likelihood = strategy.resolved_likelihood(None, "compile_training_step")
        reason = (
            "lean=False"
            if not lean
            else unsupported_torch() or LeanKalmanBlocks.unsupported(strategy.model, self.likelihood)
        )
        self.fallback_reason: str | None = reason
        r"""Why the step runs ``strategy.update`` eagerly, or None when it runs the (compiled) lean step."""
        if reason is not None:
            if lean:
                warn_fallback(reason, "the lean Kalman update", "(strategy.update)")
            self._function = None
            return
        self.blocks = LeanKalmanBlocks(strategy.model, self.likelihood)
        self._function = torch.compile(_own_code(self._lean_update), **options) if compile else self._lean_update
        self._dynamic_batch = compile and batch_size_is_dynamic(options)

    @torch.no_grad()
    def _lean_update(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        terms, inducing_covariance = self.blocks.observation_terms(x, y)
        psi = self.strategy.bound_term(terms, inducing_covariance, *self.strategy.statistics)
        increments, done = self.blocks.increments(terms, psi)
        self.blocks.absorb(increments, done)
        return increments.bound, done

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """Absorbs the mini-batch ``(x, y)``; returns its bound term :math:`\\psi_k` in the model's dtype."""
        strategy = self.strategy
        if self._function is None:
            return strategy.update(x, y, self.likelihood)
        x, y = strategy.checked_data(x, y)
        if self._dynamic_batch:
            mark_batch_dynamic(x, y)
        psi, done = self._function(x, y)
        if not done:
            raise RuntimeError(NOT_FINITE + "the state was left unchanged.")
        self.blocks.count(x.size(-2))
        return psi.to(strategy.inducing_points.dtype)
