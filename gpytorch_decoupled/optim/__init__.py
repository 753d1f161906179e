"""Natural-gradient and closed-form update steps, in the style of :mod:`torch.optim` and :mod:`gpytorch.optim`."""

from .dual_e_step import DualEStep
from .online_basis_growth import OnlineBasisGrowth
from .orthogonal_mean_natural_gradient import OrthogonalMeanNaturalGradient
from .recursive_gradient_propagation import RecursiveGradientPropagation
from .streaming_collapsed_bound import StreamingCollapsedBound

__all__ = [
    "DualEStep",
    "OnlineBasisGrowth",
    "OrthogonalMeanNaturalGradient",
    "RecursiveGradientPropagation",
    "StreamingCollapsedBound",
]
