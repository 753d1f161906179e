"""Test cases for variational strategies, for this package's tests and for users who write strategies of their own
(as :mod:`gpytorch.test` serves GPyTorch's). Importing it needs GPyTorch's ``gpytorch.test``, not pytest."""

from .contract_svgp_model import ContractSVGPModel
from .strategy_contract_test_case import StrategyContractTestCase

__all__ = ["ContractSVGPModel", "StrategyContractTestCase"]
