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
after a conversion), keeps it out of copies and pickles, and gives the strategies ``_clear_cache_if_stale``, which
empties it when a tensor it may depend on has changed since it was filled (in eval mode GPyTorch keeps its factors
across predictions whatever happens to the hyperparameters). That check reads each tensor's version counter
(``Tensor._version``, which every in-place operation on a tensor increments, also under ``torch.no_grad``), so it
relies on PyTorch's version counters, present since PyTorch 0.4.
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
        child.__dict__.update(dict.fromkeys((*getattr(child, "_step_attributes", ()), "_eval_state")))


# Tensors with at most this many elements are compared by value as well as by version: GPyTorch's hyperparameter
# setters (``kernel.lengthscale = ...``, ``Module.initialize``) write through ``.data``, which has a version counter of
# its own. Hyperparameters are this small; the large tensors (bases, variational parameters) change through optimizers,
# ``load_state_dict`` or ``torch.no_grad`` in-place operations, which all count.
_VALUE_CHECKED_NUMEL = 1024


class _TensorState:
    """What the values computed from the tensors of some modules depend on: each tensor's identity, version counter,
    dtype, device and shape, and the values of the small ones."""

    def __init__(self, modules: tuple[torch.nn.Module, ...], ignore: tuple[Tensor, ...]):
        self.tensors = _tensors(modules, ignore)
        self.signature = _signature(self.tensors)
        self.values = [tensor.detach().clone() for tensor in self.tensors if tensor.numel() <= _VALUE_CHECKED_NUMEL]

    def holds(self, modules: tuple[torch.nn.Module, ...], ignore: tuple[Tensor, ...]) -> bool:
        tensors = _tensors(modules, ignore)
        if len(tensors) != len(self.tensors) or _signature(tensors) != self.signature:
            return False
        small = (tensor for tensor in tensors if tensor.numel() <= _VALUE_CHECKED_NUMEL)
        return all(torch.equal(tensor, value) for tensor, value in zip(small, self.values, strict=True))


def _tensors(modules: tuple[torch.nn.Module, ...], ignore: tuple[Tensor, ...]) -> list[Tensor]:
    seen, tensors = {id(tensor) for tensor in ignore}, []
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


def _signature(tensors: list[Tensor]) -> tuple:
    return tuple((id(tensor), tensor._version, tensor.dtype, tensor.device, tensor.shape) for tensor in tensors)


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
      hold tensors of an autograd graph, which cannot be deep-copied); they are recomputed on the next call;
    * ``_clear_cache_if_stale(*modules, ignore=())``: clears the caches unless no parameter or buffer of ``modules``
      (but the tensors in ``ignore``, e.g. a flag the call itself sets) has changed (in place, through a setter, by
      ``load_state_dict``, by replacement or conversion) since the last call that filled them; the strategies call it
      on every eval-mode call, so that a prediction always reflects the current parameters.

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
        kept = (*getattr(self, "_step_attributes", ()), "_eval_state")
        return {**state, "_memoize_cache": {}, **dict.fromkeys(kept)}

    def _clear_cache_if_stale(self, *modules: torch.nn.Module, ignore: tuple[Tensor, ...] = ()) -> None:
        state = self.__dict__.get("_eval_state")
        if state is None or not state.holds(modules, ignore):
            self._clear_cache()
            self._eval_state = _TensorState(modules, ignore)

    cls._clear_cache, cls._apply, cls.__getstate__ = _clear_cache, _apply, __getstate__
    cls._clear_cache_if_stale = _clear_cache_if_stale
    return cls
