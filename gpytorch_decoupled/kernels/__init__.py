"""Kernels and hyperparameter initialisation for the decoupled sparse variational GPs, and the kernel spaces of
variational Bayesian kernel selection."""

from .candidate_kernel_bank import CandidateKernelBank
from .generalized_rbf_kernel import GeneralizedRBFKernel
from .kernel_expression import KernelExpression
from .kernel_space import KernelSpace
from .median_heuristic import initialize_hyperparameters, median_lengthscales

__all__ = [
    "CandidateKernelBank",
    "GeneralizedRBFKernel",
    "KernelExpression",
    "KernelSpace",
    "initialize_hyperparameters",
    "median_lengthscales",
]
