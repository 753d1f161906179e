"""KalmanVariationalStrategy through GPyTorch's own ``VariationalTestCase`` and the package's contract on top, from a
non-degenerate state: the state of a model that has absorbed data (at the prior, all zeros, the marginals would not
depend on the inducing inputs or the length-scale, so GPyTorch's "every parameter gets a gradient" would fail for a
reason that has nothing to do with the strategy; in real use an update comes first, and a training step at the prior
raises an error naming it)."""

from __future__ import annotations

import unittest

import pytest
import torch

from gpytorch_decoupled.variational import KalmanVariationalDistribution, KalmanVariationalStrategy
from tests.variational.decoupled_contract_test_case import DecoupledStrategyContractTestCase

pytestmark = pytest.mark.usefixtures("single_thread")


def kalman_strategy(model, inducing_points, variational_distribution, learn_inducing_locations=True):
    """The contract's factory: a KalmanVariationalStrategy whose state is that of five absorbed points (a random
    information vector and a random rank-5 PSD information matrix)."""
    gen = torch.Generator().manual_seed(0)
    information_vector, information_matrix = variational_distribution()
    M = information_vector.size(-1)
    features = torch.randn(*information_matrix.shape[:-2], 5, M, generator=gen, dtype=information_matrix.dtype)
    vector = torch.randn(information_vector.shape, generator=gen, dtype=information_vector.dtype)
    variational_distribution.absorb(vector, features.mT @ features / M, torch.zeros(()), 5)
    return KalmanVariationalStrategy(model, inducing_points, variational_distribution, learn_inducing_locations)


class TestKalmanGPyTorchContract(DecoupledStrategyContractTestCase, unittest.TestCase):
    """GPyTorch's contract plus the package's (state, copies, dtype, prior, wrappers). The fantasy models differ from
    GPyTorch's by design (see test_fantasy_call)."""

    @property
    def distribution_cls(self):
        return KalmanVariationalDistribution

    @property
    def strategy_cls(self):
        return kalman_strategy

    def test_fantasy_call(
        self, data_batch_shape=None, inducing_batch_shape=None, model_batch_shape=None, expected_batch_shape=None
    ):
        """GPyTorch's test expects the ExactGP of its online variational conditioning; the Kalman strategy conditions
        exactly in closed form and returns a copy of the same model (values in ``test_fantasy_models.py``). Here:
        GPyTorch's batch-shape cases with its data and its model's ``likelihood`` attribute."""
        model_batch_shape = self.batch_shape if model_batch_shape is None else model_batch_shape
        model, likelihood = self._make_model_and_likelihood(
            batch_shape=model_batch_shape,
            inducing_batch_shape=self.batch_shape if inducing_batch_shape is None else inducing_batch_shape,
            distribution_cls=self.distribution_cls,
            strategy_cls=self.strategy_cls,
        )
        model.likelihood = likelihood
        data_batch_shape = self.batch_shape if data_batch_shape is None else data_batch_shape
        x = torch.randn(*data_batch_shape, 10, 2).clamp(-2.5, 2.5)
        fantasy = model.get_fantasy_model(x, torch.linspace(-1, 1, 10).expand(*data_batch_shape, 10))
        self.assertIs(type(fantasy), type(model))
        self.assertEqual(fantasy.variational_strategy.num_observed, model.variational_strategy.num_observed + 10)
        expected_batch_shape = self.batch_shape if expected_batch_shape is None else expected_batch_shape
        self.assertEqual(fantasy.eval()(torch.randn(5, 2)).mean.shape, torch.Size([*expected_batch_shape, 5]))


class TestBatchKalmanGPyTorchContract(TestKalmanGPyTorchContract):
    @property
    def batch_shape(self):
        return torch.Size([3])
