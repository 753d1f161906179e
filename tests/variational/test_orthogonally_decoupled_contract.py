"""The GPyTorch contract for OrthogonallyDecoupledVariationalStrategy (every batch shape, both objectives, both q's)."""

import unittest
import unittest.mock
from functools import partial

import gpytorch
import torch

from gpytorch_decoupled.variational import FastNaturalVariationalDistribution, OrthogonallyDecoupledVariationalStrategy
from tests.variational.decoupled_contract_test_case import DecoupledStrategyContractTestCase, residual_mean_strategy

orthogonal_strategy = partial(residual_mean_strategy, OrthogonallyDecoupledVariationalStrategy)


class TestOrthogonallyDecoupledContract(DecoupledStrategyContractTestCase, unittest.TestCase):
    @property
    def strategy_cls(self):
        return orthogonal_strategy

    def test_eval_predictions_reuse_the_cached_factor(self):
        model, _ = self._fitted_model()
        test_x, _ = self._data(torch.get_default_dtype())
        self._predict(model, test_x)
        # The eval cache holds the Cholesky factor of K_beta and the residual coordinates K_b^-1 K_bg a_g.
        with unittest.mock.patch("torch.linalg.cholesky_ex", wraps=torch.linalg.cholesky_ex) as cholesky:
            self._predict(model, test_x[:5])
        self.assertEqual(cholesky.call_count, 0)


class TestOrthogonallyDecoupledPredictiveContract(TestOrthogonallyDecoupledContract):
    @property
    def mll_cls(self):
        return gpytorch.mlls.PredictiveLogLikelihood


class TestOrthogonallyDecoupledNaturalContract(TestOrthogonallyDecoupledContract):
    @property
    def distribution_cls(self):
        return gpytorch.variational.NaturalVariationalDistribution


class TestOrthogonallyDecoupledBatchContract(TestOrthogonallyDecoupledContract):
    @property
    def batch_shape(self):
        return torch.Size([3])


class TestOrthogonallyDecoupledFastNaturalContract(TestOrthogonallyDecoupledContract):
    @property
    def distribution_cls(self):
        return FastNaturalVariationalDistribution


class TestOrthogonallyDecoupledFastNaturalBatchContract(TestOrthogonallyDecoupledFastNaturalContract):
    @property
    def batch_shape(self):
        return torch.Size([3])
