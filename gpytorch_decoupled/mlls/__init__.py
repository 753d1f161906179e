"""Training objectives for the strategies of this package, in the style of :mod:`gpytorch.mlls`: the M-step ELBO of
t-SVGP and the exact streaming gradient of the Kalman strategy's collapsed bound."""

from .dual_variational_elbo import DualVariationalELBO
from .streaming_collapsed_bound import Batches, CollapsedBoundStatistics, StreamingCollapsedBound

__all__ = ["Batches", "CollapsedBoundStatistics", "DualVariationalELBO", "StreamingCollapsedBound"]
