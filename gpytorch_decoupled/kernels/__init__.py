"""Kernels and hyperparameter initialisation for the decoupled sparse variational GPs."""

from .generalized_rbf_kernel import GeneralizedRBFKernel
from .median_heuristic import initialize_hyperparameters, median_lengthscales

__all__ = ["GeneralizedRBFKernel", "initialize_hyperparameters", "median_lengthscales"]
