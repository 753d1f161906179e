"""Dense float64 reference computations ("oracles") on a finite input domain.

Every method of ``gpytorch_decoupled`` is tested against these. They are written from the formulas with plain torch
float64 linear algebra, independently of GPyTorch's variational code and marginal log likelihoods, take dense kernel
matrices (so any kernel can be used), add no jitter unless an argument asks for it, and refuse float32 input.

Modules: :mod:`.kernels` (dense SE-ARD and Matérn), :mod:`.gaussian` (KL, log density, expected log-likelihood),
:mod:`.exact_gp` (exact posterior and log marginal likelihood), :mod:`.sparse_gp` (Titsias optimum, collapsed bound,
SVGP ELBO / predictive, whitening), :mod:`.process_kl` (KL between GPs on a finite grid), :mod:`.orthogonal`
(orthogonally decoupled VGP: predictive, KL, ELBO, closed-form optimum and its value), :mod:`.decoupled` (Decoupled /
SVDGP: predictive, KL, ELBO, S-form maps, closed-form optimum, KL gradients) and :mod:`.hybrid` (Hybrid basis:
predictive, KL, ELBO, maps to and from ODVGP, closed-form optimum);
:mod:`.recursive_sparse_gp` (VFE/DTC/FITC/PITC/PEP batch bounds, posterior and predictive, covariance-form Kalman
filter).
"""

from .decoupled import (
    decoupled_covariance_to_s,
    decoupled_elbo,
    decoupled_kl,
    decoupled_kl_gradients,
    decoupled_optimum,
    decoupled_predictive,
    s_to_decoupled_precision,
)
from .exact_gp import exact_log_marginal_likelihood, exact_posterior
from .gaussian import expected_gaussian_loglik, gaussian_kl, gaussian_logpdf
from .hybrid import hybrid_elbo, hybrid_kl, hybrid_optimum, hybrid_predictive, hybrid_to_odvgp, odvgp_to_hybrid
from .kernels import matern, rbf
from .orthogonal import (
    odvgp_conditional_optimum,
    odvgp_elbo,
    odvgp_kl,
    odvgp_optimal_elbo,
    odvgp_optimum,
    odvgp_predictive,
    odvgp_residual_features,
)
from .process_kl import process_kl
from .recursive_sparse_gp import (
    kalman_filter,
    recursive_sparse_bound,
    recursive_sparse_posterior,
    recursive_sparse_predictive,
    sparse_model_noise,
)
from .sparse_gp import (
    collapsed_bound,
    svgp_elbo,
    svgp_kl,
    svgp_marginals,
    svgp_predictive,
    titsias_optimal_qu,
    unwhiten_qu,
    whiten_qu,
)

__all__ = [
    "collapsed_bound",
    "decoupled_covariance_to_s",
    "decoupled_elbo",
    "decoupled_kl",
    "decoupled_kl_gradients",
    "decoupled_optimum",
    "decoupled_predictive",
    "exact_log_marginal_likelihood",
    "exact_posterior",
    "expected_gaussian_loglik",
    "gaussian_kl",
    "gaussian_logpdf",
    "hybrid_elbo",
    "hybrid_kl",
    "hybrid_optimum",
    "hybrid_predictive",
    "hybrid_to_odvgp",
    "kalman_filter",
    "matern",
    "odvgp_conditional_optimum",
    "odvgp_elbo",
    "odvgp_kl",
    "odvgp_optimal_elbo",
    "odvgp_optimum",
    "odvgp_predictive",
    "odvgp_residual_features",
    "odvgp_to_hybrid",
    "process_kl",
    "rbf",
    "recursive_sparse_bound",
    "recursive_sparse_posterior",
    "recursive_sparse_predictive",
    "s_to_decoupled_precision",
    "sparse_model_noise",
    "svgp_elbo",
    "svgp_kl",
    "svgp_marginals",
    "svgp_predictive",
    "titsias_optimal_qu",
    "unwhiten_qu",
    "whiten_qu",
]
