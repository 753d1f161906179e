"""Variational strategies and distributions (one class per file, GPyTorch naming), and the parts they share: the
mean-basis component of the decoupled strategies, the joint prior of inducing points and data, input validation and
the public protocol of the Kalman strategy's update (its statistics, terms and increments)."""

from ._kalman_terms import KalmanIncrements, KalmanStatistics, ObservationTerms
from .checked_inputs import checked_inputs
from .convert_mean_basis import convert_mean_basis
from .decoupled_variational_distribution import DecoupledVariationalDistribution, DecoupledVariationalParameters
from .decoupled_variational_strategy import DecoupledCurvature, DecoupledVariationalStrategy
from .dual_variational_distribution import DualSites, DualVariationalDistribution
from .dual_variational_strategy import DualPosteriorFactors, DualSiteStatistics, DualVariationalStrategy
from .fast_natural_variational_distribution import FastNaturalVariationalDistribution
from .hybrid_variational_strategy import HybridVariationalStrategy
from .independent_multitask_variational_strategy import IndependentMultitaskVariationalStrategy
from .initialize_from_prior import initialize_from_prior
from .joint_prior import JointPrior, joint_prior
from .kalman_variational_distribution import KalmanVariationalDistribution
from .kalman_variational_strategy import KalmanVariationalStrategy
from .lmc_variational_strategy import LMCVariationalStrategy
from .mean_basis import MeanBasis, MeanBasisValues
from .orthogonally_decoupled_variational_strategy import OrthogonallyDecoupledVariationalStrategy

__all__ = [
    "DecoupledCurvature",
    "DecoupledVariationalDistribution",
    "DecoupledVariationalParameters",
    "DecoupledVariationalStrategy",
    "DualPosteriorFactors",
    "DualSiteStatistics",
    "DualSites",
    "DualVariationalDistribution",
    "DualVariationalStrategy",
    "FastNaturalVariationalDistribution",
    "HybridVariationalStrategy",
    "IndependentMultitaskVariationalStrategy",
    "JointPrior",
    "KalmanIncrements",
    "KalmanStatistics",
    "KalmanVariationalDistribution",
    "KalmanVariationalStrategy",
    "LMCVariationalStrategy",
    "MeanBasis",
    "MeanBasisValues",
    "ObservationTerms",
    "OrthogonallyDecoupledVariationalStrategy",
    "checked_inputs",
    "convert_mean_basis",
    "initialize_from_prior",
    "joint_prior",
]
