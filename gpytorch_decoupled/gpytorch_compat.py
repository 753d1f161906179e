r"""
The one module through which the package uses private parts of GPyTorch and linear_operator.

Every private name of GPyTorch or linear_operator that the package needs is imported or called here, and nowhere
else (``tests/test_architecture.py`` enforces it), so that a GPyTorch release that moves one of them breaks this
module alone. Each entry says what it relies on and the versions it was checked against; the package is tested
with GPyTorch 1.15 and linear_operator 0.6.

Classes the package subclasses (in GPyTorch since 1.0, private by name only: every strategy and distribution of
GPyTorch derives from them):

* :data:`VariationalStrategyBase` is ``gpytorch.variational._variational_strategy._VariationalStrategy``. Besides
  its public interface the package relies on its ``_variational_distribution`` attribute, ``jitter_val``,
  ``_expand_inputs(x, inducing_points)``, the ``variational_params_initialized`` buffer and its ``__call__``, which
  clears the memoized caches in training mode (``_clear_cache``), initializes :math:`q(\mathbf u)` from the prior on
  the first call and calls ``forward(x, inducing_points, inducing_values, variational_inducing_covar, diag=...)``.
* :data:`VariationalDistributionBase` is ``gpytorch.variational._variational_distribution._VariationalDistribution``:
  ``named_variational_parameters`` yields exactly the parameters registered directly on one.
* :data:`GaussianLikelihoodBase` is ``gpytorch.likelihoods.gaussian_likelihood._GaussianLikelihoodBase``, the base of
  every Gaussian likelihood (also the fixed-noise and multitask ones).

Functions wrapping private methods:

* :func:`whitened_cholesky_factor` calls ``VariationalStrategy._cholesky_factor`` (GPyTorch 1.9 to 1.15): the
  float64 Cholesky factor of :math:`\mathbf K_{\mathbf{uu}}` memoized under ``"cholesky_factor"``.
* :func:`initialize_variational_distribution` does what ``_VariationalStrategy.__call__`` does on a strategy's first
  call (GPyTorch 1.0 to 1.15): initialize ``_variational_distribution`` from ``prior_distribution`` once, marked by the
  ``variational_params_initialized`` buffer.
* :func:`compute_predictive_updates` calls ``VariationalStrategy._compute_predictive_updates`` (GPyTorch 1.15, which
  added it with the fused training-mode variance; it reads nothing of the strategy but ``training``).

Cache safety (GPyTorch's memoize cache lives in each module's ``_memoize_cache`` dict and is emptied by the module's
``_clear_cache()``, which GPyTorch calls on ``train()``/``eval()``, ``load_state_dict`` and every training call of a
strategy, in every version since 1.0): the class decorator :func:`cache_safe` also empties it after ``.to()`` /
``.double()`` / ``.cuda()``, which GPyTorch does not (GPyTorch issues #1619 and #1859: stale float32 or CPU factors
after a conversion), and keeps it out of copies and pickles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from gpytorch.likelihoods.gaussian_likelihood import _GaussianLikelihoodBase
from gpytorch.module import Module
from gpytorch.variational import VariationalStrategy
from gpytorch.variational._variational_distribution import _VariationalDistribution
from gpytorch.variational._variational_strategy import _VariationalStrategy
from linear_operator.operators import LinearOperator, TriangularLinearOperator
from torch import Tensor

VariationalStrategyBase = _VariationalStrategy
VariationalDistributionBase = _VariationalDistribution
GaussianLikelihoodBase = _GaussianLikelihoodBase

__all__ = [
    "GaussianLikelihoodBase",
    "VariationalDistributionBase",
    "VariationalStrategyBase",
    "cache_safe",
    "clear_caches",
    "compute_predictive_updates",
    "initialize_variational_distribution",
    "whitened_cholesky_factor",
]

ModuleType = TypeVar("ModuleType", bound=type[Module])


def whitened_cholesky_factor(strategy: VariationalStrategyBase, covariance: LinearOperator) -> TriangularLinearOperator:
    r"""
    GPyTorch's factor :math:`\mathbf L` of a whitened strategy's :math:`\mathbf K_{\mathbf{uu}}` (with the jitter
    already added to ``covariance``): a float64 Cholesky with escalating jitter, memoized on ``strategy`` under
    ``"cholesky_factor"`` whatever the argument, exactly as GPyTorch's
    :class:`~gpytorch.variational.VariationalStrategy` computes and caches it.
    """
    return VariationalStrategy._cholesky_factor(strategy, covariance)


def compute_predictive_updates(
    strategy: VariationalStrategyBase,
    chol: LinearOperator,
    induc_data_covar: Tensor,
    inducing_values: Tensor,
    variational_inducing_covar: LinearOperator | None,
    prior_covar: LinearOperator,
    diag: bool = True,
) -> tuple[Tensor, LinearOperator]:
    r"""
    GPyTorch's whitened predictive updates :math:`\mathbf k_{\mathbf x\mathbf u}\mathbf L^{-\top}\mathbf m` and
    :math:`\mathbf k_{\mathbf x\mathbf u}\mathbf L^{-\top}(\mathbf S - \mathbf I)\mathbf L^{-1}\mathbf k_{\mathbf u
    \mathbf x}` (only the diagonal, by GPyTorch's fused backward pass, in training mode with ``diag=True`` and more
    data than inducing points), as :class:`~gpytorch.variational.VariationalStrategy` computes them.
    """
    return VariationalStrategy._compute_predictive_updates(
        strategy,
        chol=chol,
        induc_data_covar=induc_data_covar,
        inducing_values=inducing_values,
        variational_inducing_covar=variational_inducing_covar,
        prior_covar=prior_covar,
        diag=diag,
    )


def initialize_variational_distribution(strategy: VariationalStrategyBase) -> None:
    r"""Initializes :math:`q(\mathbf u)` from the strategy's prior as GPyTorch does on the strategy's first call, unless
    that has happened (for code that computes a strategy's terms without calling it)."""
    if not strategy.variational_params_initialized.item():
        with torch.no_grad():
            strategy._variational_distribution.initialize_variational_distribution(strategy.prior_distribution)
        strategy.variational_params_initialized.fill_(1)


def clear_caches(module: Module) -> None:
    """Empties GPyTorch's memoized caches of ``module`` and of every GPyTorch module below it (and their kept values,
    for classes decorated with :func:`cache_safe`)."""
    for child in module.modules():
        if isinstance(child, Module):
            child._clear_cache()


def _forget_kept_values(module: torch.nn.Module) -> None:
    for child in module.modules():
        child.__dict__.update(dict.fromkeys(getattr(child, "_step_attributes", ())))


def cache_safe(cls: ModuleType) -> ModuleType:
    r"""
    A class decorator that keeps GPyTorch's memoized caches, and the values a module keeps between computations, from
    outliving the tensors they were computed from. The kept values are the explicit attributes that the class names in
    ``_step_attributes`` (each documented by its class, None until computed: a factor that the forward pass and the KL
    of one training step share, or that eval-mode predictions reuse). The class gets

    * ``_clear_cache``: GPyTorch's, and it forgets the kept values of every module below;
    * ``_apply`` (behind ``.to()``, ``.double()``, ``.cuda()``): after the conversion, clears the caches of every
      module below (GPyTorch keeps them: issues #1619 and #1859);
    * ``__getstate__``: copies and pickles carry neither caches nor kept values (right after a training step they
      hold tensors of an autograd graph, which cannot be deep-copied); they are recomputed on the next call.

    A decorator rather than a base class, so that the classes keep GPyTorch's hierarchy: the strategies of this package
    are one class deeper than GPyTorch's at most.
    """

    def _clear_cache(self) -> None:
        super(cls, self)._clear_cache()
        _forget_kept_values(self)

    def _apply(self, fn: Callable[[Tensor], Tensor], *args, **kwargs):
        result = super(cls, self)._apply(fn, *args, **kwargs)
        clear_caches(self)
        return result

    def __getstate__(self) -> dict[str, Any]:
        state = super(cls, self).__getstate__()
        return {**state, "_memoize_cache": {}, **dict.fromkeys(getattr(self, "_step_attributes", ()))}

    cls._clear_cache, cls._apply, cls.__getstate__ = _clear_cache, _apply, __getstate__
    return cls
