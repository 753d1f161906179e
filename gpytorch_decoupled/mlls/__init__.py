"""Training objectives for the strategies of this package, in the style of :mod:`gpytorch.mlls`."""

from .dual_variational_elbo import DualVariationalELBO

__all__ = ["DualVariationalELBO"]
