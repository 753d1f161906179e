"""Scalable sparse variational Gaussian processes for GPyTorch.

Decoupled, orthogonally decoupled, dual-parameterized (t-SVGP) and Kalman-recursive sparse variational GPs and
variational Bayesian kernel selection, as drop-in parts of :class:`gpytorch.models.ApproximateGP`.
"""

from . import datasets, distributed, kernels, linalg, mlls, models, optim, training, validation, variational
from .version import __version__

__all__ = [
    "datasets",
    "distributed",
    "kernels",
    "linalg",
    "mlls",
    "models",
    "optim",
    "training",
    "validation",
    "variational",
    "__version__",
]
