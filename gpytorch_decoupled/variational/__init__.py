"""Variational strategies and distributions (one class per file, GPyTorch naming)."""

from .independent_multitask_variational_strategy import IndependentMultitaskVariationalStrategy
from .lmc_variational_strategy import LMCVariationalStrategy
from .orthogonally_decoupled_variational_strategy import OrthogonallyDecoupledVariationalStrategy

__all__ = [
    "IndependentMultitaskVariationalStrategy",
    "LMCVariationalStrategy",
    "OrthogonallyDecoupledVariationalStrategy",
]
