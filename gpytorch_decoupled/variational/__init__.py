"""Variational strategies and distributions (one class per file, GPyTorch naming)."""

from .convert_mean_basis import convert_mean_basis
from .decoupled_variational_distribution import DecoupledVariationalDistribution, DecoupledVariationalParameters
from .decoupled_variational_strategy import DecoupledVariationalStrategy
from .hybrid_variational_strategy import HybridVariationalStrategy
from .independent_multitask_variational_strategy import IndependentMultitaskVariationalStrategy
from .lmc_variational_strategy import LMCVariationalStrategy
from .orthogonally_decoupled_variational_strategy import OrthogonallyDecoupledVariationalStrategy

__all__ = [
    "DecoupledVariationalDistribution",
    "DecoupledVariationalParameters",
    "DecoupledVariationalStrategy",
    "HybridVariationalStrategy",
    "IndependentMultitaskVariationalStrategy",
    "LMCVariationalStrategy",
    "OrthogonallyDecoupledVariationalStrategy",
    "convert_mean_basis",
]
