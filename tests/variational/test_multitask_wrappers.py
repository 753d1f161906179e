"""Our IndependentMultitask / LMC wrappers use the base strategy's own KL (GPyTorch's silently do not)."""

import unittest

import gpytorch
import torch
from gpytorch.test.base_test_case import BaseTestCase

from gpytorch_decoupled.variational import IndependentMultitaskVariationalStrategy, LMCVariationalStrategy

NUM_LATENTS = 2


class OrthogonallyDecoupledModel(gpytorch.models.ApproximateGP):
    """GPyTorch's orthogonally decoupled strategy, batched over latents: a strategy with its own ``kl_divergence``."""

    def __init__(self, wrap):
        batch = torch.Size([NUM_LATENTS])
        covariance_q = gpytorch.variational.CholeskyVariationalDistribution(5, batch_shape=batch)
        covariance_strategy = gpytorch.variational.VariationalStrategy(self, torch.randn(5, 1), covariance_q)
        mean_q = gpytorch.variational.DeltaVariationalDistribution(10, batch_shape=batch)
        strategy = gpytorch.variational.OrthogonallyDecoupledVariationalStrategy(
            covariance_strategy, torch.randn(10, 1), mean_q
        )
        super().__init__(wrap(strategy))
        self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class TestMultitaskWrappersKL(BaseTestCase, unittest.TestCase):
    seed = 0

    def _kls(self, ours, theirs, **kwargs):
        torch.manual_seed(0)
        model = OrthogonallyDecoupledModel(lambda base: ours(base, **kwargs))
        model(torch.randn(20, 1))  # initializes the variational parameters
        with torch.no_grad():
            model.variational_strategy.base_variational_strategy._variational_distribution.variational_mean.normal_()
        base_kl = model.variational_strategy.base_variational_strategy.kl_divergence().sum()
        upstream = theirs(model.variational_strategy.base_variational_strategy, **kwargs)
        return model.variational_strategy.kl_divergence(), upstream.kl_divergence(), base_kl

    def test_independent_multitask_kl_is_the_base_kl(self):
        ours, upstream, base_kl = self._kls(
            IndependentMultitaskVariationalStrategy,
            gpytorch.variational.IndependentMultitaskVariationalStrategy,
            num_tasks=NUM_LATENTS,
        )
        self.assertAllClose(ours, base_kl, rtol=1e-6, atol=0)
        self.assertGreater(ours.item(), 0)
        # GPyTorch's wrapper takes KL(Delta || prior) = -log p(m), which is not the ODVGP KL.
        self.assertGreater((upstream - base_kl).abs().item(), 1.0)

    def test_lmc_kl_is_the_base_kl(self):
        ours, upstream, base_kl = self._kls(
            LMCVariationalStrategy, gpytorch.variational.LMCVariationalStrategy, num_tasks=3, num_latents=NUM_LATENTS
        )
        self.assertAllClose(ours, base_kl, rtol=1e-6, atol=0)
        self.assertGreater((upstream - base_kl).abs().item(), 1.0)

    def test_shared_latent_without_task_dimension_keeps_the_kl(self):
        model = OrthogonallyDecoupledModel(lambda base: base)
        strategy = model.variational_strategy
        model(torch.randn(20, 1))
        single = strategy.kl_divergence()[0]
        wrapper = IndependentMultitaskVariationalStrategy(strategy, num_tasks=3, task_dim=-2)
        # task_dim -2 is outside the KL's batch shape [2]: a latent shared by every task, nothing to sum.
        self.assertEqual(wrapper.kl_divergence().shape, torch.Size([NUM_LATENTS]))
        self.assertAllClose(wrapper.kl_divergence()[0], single)


if __name__ == "__main__":
    unittest.main()
