"""Variational strategies and distributions (one class per file, GPyTorch naming)."""

from .convert_mean_basis import convert_mean_basis
from .decoupled_variational_distribution import DecoupledVariationalDistribution, DecoupledVariationalParameters
from .decoupled_variational_strategy import DecoupledVariationalStrategy
from .dual_variational_distribution import DualSites, DualVariationalDistribution
from .dual_variational_strategy import DualPosteriorFactors, DualSiteStatistics, DualVariationalStrategy
from .fast_natural_variational_distribution import FastNaturalVariationalDistribution
from .hybrid_variational_strategy import HybridVariationalStrategy
from .independent_multitask_variational_strategy import IndependentMultitaskVariationalStrategy
from .kalman_variational_strategy import KalmanVariationalStrategy
from .lmc_variational_strategy import LMCVariationalStrategy
from .orthogonally_decoupled_variational_strategy import OrthogonallyDecoupledVariationalStrategy

__all__ = [
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
    "KalmanVariationalStrategy",
    "LMCVariationalStrategy",
    "OrthogonallyDecoupledVariationalStrategy",
    "convert_mean_basis",
]
