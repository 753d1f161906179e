"""Basis growth (spec §6.1): ``grow_bases`` leaves q unchanged, and OnlineBasisGrowth drives it from mini-batches."""

import unittest
import unittest.mock

import gpytorch
import torch
from linear_operator.utils.errors import NotPSDError

from gpytorch_decoupled import datasets
from gpytorch_decoupled.kernels import GeneralizedRBFKernel
from gpytorch_decoupled.optim import OnlineBasisGrowth
from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)


class GrowthModel(gpytorch.models.ApproximateGP):
    def __init__(self, make_strategy, kernel=None):
        super().__init__(make_strategy(self))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(kernel or gpytorch.kernels.RBFKernel(ard_num_dims=2))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def residual_model(strategy_cls, distribution_cls, beta, gamma):
    def make(model):
        q = distribution_cls(beta.size(-2))
        # float64 with almost no jitter: growth is exact up to the jitter on K_beta
        return strategy_cls(model, beta, q, gamma, num_kl_columns=None, jitter_val=1e-12)

    return GrowthModel(make).double()


def decoupled_model(beta, alpha, kernel=None):
    def make(model):
        q = DecoupledVariationalDistribution(alpha.size(-2), beta.size(-2))
        return DecoupledVariationalStrategy(model, beta, q, alpha, num_kl_columns=None)

    return GrowthModel(make, kernel).double()


def randomize(model, x):
    """Moves every variational parameter and the prior mean away from their initial values."""
    with torch.no_grad():
        model(x)  # GPyTorch initializes q lazily on the first call
        model.mean_module.constant.fill_(0.3)
        strategy = model.variational_strategy
        for name, parameter in strategy._variational_distribution.named_parameters():
            if name == "natural_mat":  # stays negative definite
                parameter.mul_(1.7)
            else:
                parameter.add_(0.3 * torch.randn_like(parameter))
        if not isinstance(strategy, DecoupledVariationalStrategy):
            strategy.mean_coefficients.normal_()
    strategy._clear_cache()


class TestGrowBases(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        self.beta, self.gamma = torch.randn(5, 2).double(), torch.randn(8, 2).double()
        self.x = torch.randn(7, 2).double()

    def assert_process_unchanged(self, model, mean_points, inducing_points, rtol=1e-9):
        strategy = model.variational_strategy
        model.eval()
        before, kl_before = model(self.x), strategy.kl_divergence()
        strategy.grow_bases(mean_points, inducing_points)
        after, kl_after = model(self.x), strategy.kl_divergence()
        torch.testing.assert_close(after.mean, before.mean, rtol=rtol, atol=1e-10)
        torch.testing.assert_close(after.covariance_matrix, before.covariance_matrix, rtol=rtol, atol=1e-10)
        torch.testing.assert_close(kl_after, kl_before, rtol=rtol, atol=1e-10)

    def test_residual_bases_keep_the_process(self):
        distributions = [
            gpytorch.variational.CholeskyVariationalDistribution,
            gpytorch.variational.NaturalVariationalDistribution,
        ]
        for strategy_cls in (OrthogonallyDecoupledVariationalStrategy, HybridVariationalStrategy):
            for distribution_cls in distributions:
                with self.subTest(strategy=strategy_cls.__name__, distribution=distribution_cls.__name__):
                    model = residual_model(strategy_cls, distribution_cls, self.beta, self.gamma)
                    randomize(model, self.x)
                    new_gamma, new_beta = torch.randn(3, 2).double(), torch.randn(4, 2).double()
                    self.assert_process_unchanged(model, new_gamma, new_beta)
                    strategy = model.variational_strategy
                    self.assertEqual(strategy.inducing_points.shape, torch.Size([9, 2]))
                    self.assertEqual(strategy.mean_coefficients.shape, torch.Size([11]))
                    self.assertEqual(strategy._variational_distribution.num_inducing_points, 9)

    def test_growing_one_basis_at_a_time(self):
        model = residual_model(
            OrthogonallyDecoupledVariationalStrategy,
            gpytorch.variational.CholeskyVariationalDistribution,
            self.beta,
            self.gamma,
        )
        randomize(model, self.x)
        self.assert_process_unchanged(model, None, torch.randn(2, 2).double())
        self.assert_process_unchanged(model, torch.randn(2, 2).double(), None)

    def test_decoupled_keeps_the_process_exactly(self):
        model = decoupled_model(self.beta, self.gamma)
        randomize(model, self.x)
        self.assert_process_unchanged(model, torch.randn(3, 2).double(), torch.randn(4, 2).double(), rtol=1e-13)
        distribution = model.variational_strategy._variational_distribution
        self.assertEqual(distribution.mean_coefficients.shape, torch.Size([11]))
        self.assertEqual(distribution.precision_factor.shape, torch.Size([9, 9]))
        self.assertEqual((distribution.num_mean_points, distribution.num_inducing_points), (11, 9))

    def test_generalized_kernel_points_get_unit_multipliers(self):
        kernel = GeneralizedRBFKernel(ard_num_dims=2)
        beta = GeneralizedRBFKernel.basis_points(self.beta, torch.full_like(self.beta, 1.5))
        alpha = GeneralizedRBFKernel.basis_points(self.gamma)
        model = decoupled_model(beta, alpha, kernel)
        randomize(model, self.x)
        self.assert_process_unchanged(model, torch.randn(3, 2).double(), torch.randn(4, 2).double(), rtol=1e-13)
        new_rows = model.variational_strategy.inducing_points[-4:]
        self.assertTrue(new_rows[:, 2:].eq(0).all())  # log-multipliers 0: c = 1

    def test_bad_points_change_nothing(self):
        model = decoupled_model(self.beta, self.gamma)
        state = {name: value.clone() for name, value in model.state_dict().items()}
        with self.assertRaisesRegex(ValueError, "NaN"):
            model.variational_strategy.grow_bases(torch.full((2, 2), float("nan")).double(), None)
        with self.assertRaisesRegex(ValueError, "inducing_points has 3 columns"):
            model.variational_strategy.grow_bases(None, torch.randn(2, 3).double())
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=0, atol=0)


class TestOnlineBasisGrowth(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(1)
        self.x = torch.rand(600, 2).double() * 4
        self.y = torch.sin(self.x[:, 0]) * torch.cos(self.x[:, 1]) + 0.05 * torch.randn(600).double()

    def test_budgets_optimizer_state_and_training(self):
        model = decoupled_model(self.x[:1], self.x[:1])
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=600)
        optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.02)
        growth = OnlineBasisGrowth(
            model, 60, 15, 8, optimizers=[optimizer], likelihood=likelihood, generator=torch.Generator().manual_seed(0)
        )
        losses = []
        for epoch in range(4):
            for batch in torch.randperm(600, generator=torch.Generator().manual_seed(epoch)).split(50):
                growth.step(self.x[batch], self.y[batch])
                optimizer.zero_grad()
                loss = -mll(model(self.x[batch]), self.y[batch])
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        strategy = model.variational_strategy
        self.assertEqual(strategy.mean_inducing_points.size(0), 60)
        self.assertEqual(strategy.inducing_points.size(0), 15)
        for parameter in model.parameters():
            for value in optimizer.state[parameter].values():
                if value.dim():
                    self.assertEqual(value.shape, parameter.shape)
        self.assertEqual(growth.step(self.x[:50], self.y[:50]), (0, 0))
        self.assertLess(sum(losses[-10:]) / 10, sum(losses[:10]) / 10 - 0.3)

    def test_first_step_applies_the_median_trick(self):
        model = decoupled_model(self.x[:1], self.x[:1])
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        growth = OnlineBasisGrowth(model, 10, 5, 5, likelihood=likelihood)
        batch_x, batch_y = self.x[:100], self.y[:100]
        growth.step(batch_x, batch_y)
        distances = (batch_x.unsqueeze(0) - batch_x.unsqueeze(1)).abs()
        upper = torch.triu_indices(100, 100, offset=1)
        expected = distances[upper[0], upper[1]].quantile(0.5, dim=0)
        lengthscale = model.covar_module.base_kernel.lengthscale.squeeze(0)
        torch.testing.assert_close(lengthscale, expected, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(likelihood.noise.squeeze(), batch_y.var(), rtol=1e-4, atol=1e-6)
        lengthscale_after_first = lengthscale.clone()
        growth.step(self.x[100:200], self.y[100:200])  # only the first mini-batch initializes
        torch.testing.assert_close(model.covar_module.base_kernel.lengthscale.squeeze(0), lengthscale_after_first)

    def test_bad_first_batch_changes_nothing(self):
        """R3 of issue 20: the median trick ran before the batch was checked."""
        x, y = self.x[:50], self.y[:50]
        nan_y = y.clone()
        nan_y[3] = float("inf")
        cases = [
            (x.float(), y, "x is torch.float32"),
            (x, y.long(), "y must be real-valued"),
            (x, nan_y, "y contains NaN or inf"),
            (x, torch.empty_like(y, device="meta"), "y is on meta"),
            (x[:1], y[:1], "x has 1 rows, at least 2"),
            (x[:0], y[:0], "x is empty"),
            (x, y[:-1], r"y must have shape \(50,\)"),
            (x.unsqueeze(0), y, r"x must have shape \(n, D\)"),
        ]
        for bad_x, bad_y, message in cases:
            model = decoupled_model(self.x[:1], self.x[:1])
            likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
            growth = OnlineBasisGrowth(
                model, 10, 5, 5, likelihood=likelihood, generator=torch.Generator().manual_seed(0)
            )
            before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (model, likelihood)]
            generator_state = growth.state_dict()["generator"].clone()
            with self.assertRaisesRegex(ValueError, message):
                growth.step(bad_x, bad_y)
            for module, state in zip((model, likelihood), before):
                self.assertEqual(module.state_dict().keys(), state.keys())
                for name, value in module.state_dict().items():
                    self.assertTrue(torch.equal(value, state[name]), name)
            self.assertTrue(growth.initialize)
            self.assertTrue(torch.equal(growth.state_dict()["generator"], generator_state))

    def test_a_failed_growth_undoes_the_median_trick(self):
        model = residual_model(
            HybridVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, self.x[:3], self.x[:4]
        )
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        growth = OnlineBasisGrowth(model, 10, 8, 5, likelihood=likelihood, generator=torch.Generator().manual_seed(0))
        before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (model, likelihood)]
        generator_state = growth.state_dict()["generator"].clone()
        failure = NotPSDError("S_w grown with the covariance basis is not positive definite")
        with unittest.mock.patch.object(model.variational_strategy, "grow_bases", side_effect=failure):
            with self.assertRaisesRegex(RuntimeError, "not positive definite"):
                growth.step(self.x[:50], self.y[:50])
        for module, state in zip((model, likelihood), before):
            for name, value in module.state_dict().items():
                self.assertTrue(torch.equal(value, state[name]), name)
        self.assertTrue(growth.initialize)
        self.assertTrue(torch.equal(growth.state_dict()["generator"], generator_state))

    def test_constant_columns_in_the_first_batch_of_elevators(self):
        """R6 of issue 20: the class docstring's recipe on elevators, whose first batch of 100 has two constant
        columns and two that mostly repeat a value; the zero medians gave length-scales of 2.2e-16, a NaN loss at step 2
        and NaN parameters after Adam's step."""
        x, y, _, _ = datasets.load("elevators", split=0)
        order = torch.randperm(x.size(0), generator=torch.Generator().manual_seed(0))
        model = decoupled_model(x[:1].double(), x[:1].double()).float()
        model.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=18))
        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=x.size(0))
        optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
        growth = OnlineBasisGrowth(model, 200, 20, 10, optimizers=[optimizer], likelihood=likelihood)
        for step, batch in enumerate(order.split(100)[:4]):
            if step == 0:
                with self.assertWarnsRegex(RuntimeWarning, "columns 14, 16 are constant"):
                    growth.step(x[batch], y[batch])
                lengthscale = model.covar_module.base_kernel.lengthscale.detach()
                self.assertGreater(lengthscale.min().item(), 1e-2)
            else:
                growth.step(x[batch], y[batch])
            optimizer.zero_grad()
            loss = -mll(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            self.assertTrue(torch.isfinite(loss))
        for name, parameter in [*model.named_parameters(), *likelihood.named_parameters()]:
            self.assertTrue(torch.isfinite(parameter).all(), name)

    def test_step_returns_what_it_added_and_state_dict_resumes_the_row_choice(self):
        runs = []
        for resume in (False, True):
            model = decoupled_model(self.x[:1], self.x[:1])
            growth = OnlineBasisGrowth(model, 40, 10, 6, generator=torch.Generator().manual_seed(0))
            added = growth.step(self.x[:50], self.y[:50])
            self.assertEqual((added.mean_points, added.inducing_points), (6, 6))
            if resume:  # a fresh object with another generator and no median trick pending takes over
                state = growth.state_dict()
                self.assertFalse(state["initialize"])
                growth = OnlineBasisGrowth(model, 40, 10, 6, generator=torch.Generator().manual_seed(99))
                growth.load_state_dict(state)
                self.assertFalse(growth.initialize)
            growth.step(self.x[50:100], self.y[50:100])
            runs.append(model.variational_strategy.mean_inducing_points.detach().clone())
        self.assertTrue(torch.equal(runs[0], runs[1]))

    def test_refuses_strategies_that_cannot_grow(self):
        class SVGP(gpytorch.models.ApproximateGP):
            def __init__(self):
                q = gpytorch.variational.CholeskyVariationalDistribution(3)
                super().__init__(gpytorch.variational.VariationalStrategy(self, torch.randn(3, 1), q))

        with self.assertRaisesRegex(TypeError, "grow"):
            OnlineBasisGrowth(SVGP(), 10, 10, 1)
        with self.assertRaisesRegex(ValueError, "points_per_step"):
            OnlineBasisGrowth(decoupled_model(self.x[:1], self.x[:1]), 10, 10, 0)


if __name__ == "__main__":
    unittest.main()
