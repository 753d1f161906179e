"""
Natural-gradient and closed-form update steps, in the style of :mod:`torch.optim` and :mod:`gpytorch.optim`.

Every update object follows one contract (the documentation's page on update steps has the details):

* **Construction.** From the model whose strategy it updates (the :class:`~gpytorch.models.ApproximateGP`; a strategy
  inside an independent multitask wrapper is found), then what its mathematics needs (the likelihood, the torch
  optimizer it drives, ``num_data``) and keyword settings (``lr`` ...). A model with another strategy is refused with a
  ``TypeError`` naming the strategy it needs. Steps with per-parameter learning rates are :class:`torch.optim.Optimizer`
  subclasses (:class:`DualEStep`, :class:`OrthogonalMeanNaturalGradient`, :class:`MeanBasisAdam`), so learning-rate
  schedulers work.
* **Step.** ``step(closure=None)``, as :class:`torch.optim.Optimizer`, when the update is driven by the gradients
  already in ``.grad`` (:class:`OrthogonalMeanNaturalGradient`, :class:`MeanBasisAdam`); ``step(x, y, ...)`` when it
  needs a mini-batch (:class:`DualEStep`, :class:`RecursiveGradientPropagation`, :class:`OnlineBasisGrowth`). Input is
  validated before anything changes: a failed step leaves the model as it was.
* **Return.** What the step computed of its objective, as a detached 0-dim tensor (the closure's loss; the bound term
  of :class:`RecursiveGradientPropagation`), or None where it computes none (:class:`DualEStep`).
  :class:`OnlineBasisGrowth`, which changes the model's structure rather than its values, returns what it added.
* **State.** ``state_dict()`` / ``load_state_dict()`` on every object that holds state between steps.

Objectives (:class:`~gpytorch_decoupled.mlls.StreamingCollapsedBound`,
:class:`~gpytorch_decoupled.mlls.DualVariationalELBO`) are in :mod:`gpytorch_decoupled.mlls`.
"""

import warnings

from .dual_e_step import DualEStep
from .mean_basis_adam import MeanBasisAdam
from .online_basis_growth import BasisGrowth, OnlineBasisGrowth
from .orthogonal_mean_natural_gradient import OrthogonalMeanNaturalGradient
from .recursive_gradient_propagation import RecursiveGradientPropagation

__all__ = [
    "BasisGrowth",
    "DualEStep",
    "MeanBasisAdam",
    "OnlineBasisGrowth",
    "OrthogonalMeanNaturalGradient",
    "RecursiveGradientPropagation",
]

# Objectives that lived here before they moved to gpytorch_decoupled.mlls: importable from here for one more release.
_MOVED_TO_MLLS = ("StreamingCollapsedBound",)


def __getattr__(name: str):
    if name in _MOVED_TO_MLLS:
        from .. import mlls

        warnings.warn(
            f"gpytorch_decoupled.optim.{name} is an objective and moved to gpytorch_decoupled.mlls.{name}; the old "
            "name will be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(mlls, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
