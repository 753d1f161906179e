"""Complete models that are more than a strategy: variational Bayesian kernel selection (VBKS) with its kernel
space, kernel belief and Bayesian-model-averaging predictive."""

from ..kernels import KernelExpression, KernelSpace
from .candidate_bank_gp import CandidateBankGP
from .gaussian_mixture_predictive import GaussianMixturePredictive
from .hyperparameter_posterior import HyperparameterPosterior
from .kernel_belief import KernelBelief
from .kernel_posterior import KernelPosterior
from .kernel_selection_gp import KernelSelectionGP

__all__ = [
    "CandidateBankGP",
    "GaussianMixturePredictive",
    "HyperparameterPosterior",
    "KernelBelief",
    "KernelExpression",
    "KernelPosterior",
    "KernelSelectionGP",
    "KernelSpace",
]
