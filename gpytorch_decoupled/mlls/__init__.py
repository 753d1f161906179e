"""Training objectives for the strategies of this package, in the style of :mod:`gpytorch.mlls`: the M-step ELBO of
t-SVGP, the exact streaming gradient of the Kalman strategy's collapsed bound and its robust fit, and GPyTorch's
approximate objectives with their targets checked before they are read (drop-in replacements: same arguments, same
values)."""

from .dual_variational_elbo import DualVariationalELBO
from .fit_collapsed_bound import CollapsedBoundFit, fit_collapsed_bound
from .gamma_robust_variational_elbo import GammaRobustVariationalELBO
from .predictive_log_likelihood import PredictiveLogLikelihood
from .streaming_collapsed_bound import Batches, CollapsedBoundStatistics, StreamingCollapsedBound
from .variational_elbo import VariationalELBO

__all__ = [
    "Batches",
    "CollapsedBoundFit",
    "CollapsedBoundStatistics",
    "DualVariationalELBO",
    "GammaRobustVariationalELBO",
    "PredictiveLogLikelihood",
    "StreamingCollapsedBound",
    "VariationalELBO",
    "fit_collapsed_bound",
]
