"""Natural-gradient and closed-form update steps, in the style of :mod:`torch.optim` and :mod:`gpytorch.optim`."""

from .dual_e_step import DualEStep
from .online_basis_growth import OnlineBasisGrowth
from .orthogonal_mean_natural_gradient import OrthogonalMeanNaturalGradient

__all__ = ["DualEStep", "OnlineBasisGrowth", "OrthogonalMeanNaturalGradient"]
