"""The GPyTorch contract for OrthogonallyDecoupledVariationalStrategy (every batch shape, both objectives, both q's)."""

import unittest
import unittest.mock

import gpytorch
import torch

from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy
from tests.strategy_contract_test_case import StrategyContractTestCase


def orthogonal_strategy(model, inducing_points, variational_distribution, learn_inducing_locations=True):
    """The test-case factory: a mean basis of 24 points next to the 16 covariance points of the contract's model."""
    mean_inducing_points = torch.randn(24, inducing_points.size(-1), dtype=inducing_points.dtype)
    return OrthogonallyDecoupledVariationalStrategy(
        model, inducing_points, variational_distribution, mean_inducing_points, learn_inducing_locations
    )


class TestOrthogonallyDecoupledContract(StrategyContractTestCase, unittest.TestCase):
    @property
    def batch_shape(self):
        return torch.Size([])

    @property
    def distribution_cls(self):
        return gpytorch.variational.CholeskyVariationalDistribution

    @property
    def mll_cls(self):
        return gpytorch.mlls.VariationalELBO

    @property
    def strategy_cls(self):
        return orthogonal_strategy

    def test_training_iteration(self, *args, **kwargs):
        cg_mock, cholesky_mock, ciq_mock = super().test_training_iteration(*args, **kwargs)
        self.assertFalse(cg_mock.called)
        self.assertFalse(ciq_mock.called)

    def test_eval_iteration(self, *args, **kwargs):
        cg_mock, cholesky_mock, ciq_mock = super().test_eval_iteration(*args, **kwargs)
        self.assertFalse(cg_mock.called)
        self.assertFalse(ciq_mock.called)

    def test_eval_predictions_reuse_the_cached_factor(self):
        model, _ = self._fitted_model()
        test_x, _ = self._data(torch.get_default_dtype())
        self._predict(model, test_x)
        # The eval cache holds the Cholesky factor of K_beta and the residual coordinates K_b^-1 K_bg a_g.
        with unittest.mock.patch("torch.linalg.cholesky_ex", wraps=torch.linalg.cholesky_ex) as cholesky:
            self._predict(model, test_x[:5])
        self.assertEqual(cholesky.call_count, 0)

    def test_fantasy_call(self, *args, **kwargs):
        # Online variational conditioning is defined for the single-basis SVGP only.
        with self.assertRaises(NotImplementedError):
            super().test_fantasy_call(*args, **kwargs)


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
