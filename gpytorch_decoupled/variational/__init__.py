"""Variational strategies and distributions (one class per file, GPyTorch naming)."""

from .independent_multitask_variational_strategy import IndependentMultitaskVariationalStrategy
from .lmc_variational_strategy import LMCVariationalStrategy

__all__ = ["IndependentMultitaskVariationalStrategy", "LMCVariationalStrategy"]
