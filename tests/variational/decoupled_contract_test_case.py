"""The contract of this package's decoupled strategies (Decoupled, Hybrid, ODVGP) and t-SVGP: the shipped
:class:`~gpytorch_decoupled.test.StrategyContractTestCase` with the project's own rules on top."""

import gpytorch
import torch

from gpytorch_decoupled.test import StrategyContractTestCase


class DecoupledStrategyContractTestCase(StrategyContractTestCase):
    """
    The contract for this package's decoupled strategies (Decoupled, Hybrid, ODVGP): defaults for the test matrix,
    no iterative solver anywhere (every factorization is an explicit Cholesky), and no fantasy model (online
    variational conditioning is defined for the single-basis SVGP only). Subclasses name ``strategy_cls``.
    """

    @property
    def batch_shape(self):
        return torch.Size([])

    @property
    def distribution_cls(self):
        return gpytorch.variational.CholeskyVariationalDistribution

    @property
    def mll_cls(self):
        return gpytorch.mlls.VariationalELBO

    def test_training_iteration(self, *args, **kwargs):
        cg_mock, cholesky_mock, ciq_mock = super().test_training_iteration(*args, **kwargs)
        self.assertFalse(cg_mock.called)
        self.assertFalse(ciq_mock.called)

    def test_eval_iteration(self, *args, **kwargs):
        cg_mock, cholesky_mock, ciq_mock = super().test_eval_iteration(*args, **kwargs)
        self.assertFalse(cg_mock.called)
        self.assertFalse(ciq_mock.called)

    def test_fantasy_call(self, *args, **kwargs):
        with self.assertRaises(NotImplementedError):
            super().test_fantasy_call(*args, **kwargs)


def residual_mean_strategy(
    strategy_cls, model, inducing_points, variational_distribution, learn_inducing_locations=True
):
    """A test-case factory (bind ``strategy_cls`` with :func:`functools.partial`): a hybrid or orthogonal strategy
    with a mean basis of 24 points next to the 16 covariance points of the contract's model."""
    mean_inducing_points = torch.randn(24, inducing_points.size(-1), dtype=inducing_points.dtype)
    return strategy_cls(
        model, inducing_points, variational_distribution, mean_inducing_points, learn_inducing_locations
    )
