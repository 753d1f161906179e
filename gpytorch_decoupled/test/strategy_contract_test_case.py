from __future__ import annotations

import copy
import pickle
import unittest

import gpytorch
import torch
from gpytorch.test.variational_test_case import VariationalTestCase

from ..variational import IndependentMultitaskVariationalStrategy, LMCVariationalStrategy
from .contract_svgp_model import ContractSVGPModel

# pytest is not needed (the installed-wheel test imports this module without it): where it is present, its mark lets
# `pytest -m cuda` select the device test; without CUDA, unittest skips that test either way.
try:
    from pytest import mark

    _cuda = mark.cuda
except ImportError:

    def _cuda(test):
        return test


class StrategyContractTestCase(VariationalTestCase):
    r"""
    The GPyTorch contract a variational strategy must honour, as a test case to mix into :class:`unittest.TestCase`.

    It extends :class:`gpytorch.test.VariationalTestCase` (gradients reach every parameter, batch shapes, eval
    caching, fantasy models) with what GPyTorch's own suite does not check and what users rely on: ``state_dict``
    round trips, pickling and deep copies with warm eval caches and right after a training step, float64,
    ``.to(dtype)`` / ``.to(device)`` after an eval pass (stale caches, GPyTorch issues #1619 and #1859),
    ``model(x, prior=True)``, and wrapping in
    :class:`~gpytorch_decoupled.variational.IndependentMultitaskVariationalStrategy` and
    :class:`~gpytorch_decoupled.variational.LMCVariationalStrategy`, whose ELBO must use the strategy's own
    :meth:`kl_divergence` (GPyTorch's wrappers compute it from the base's ``variational_distribution``, which is
    wrong for every strategy with a KL of its own). Every strategy of this package passes it.

    A subclass names the strategy under test, as for GPyTorch's case: ``strategy_cls`` (a class, or a factory with
    the signature ``(model, inducing_points, variational_distribution, learn_inducing_locations)``),
    ``distribution_cls``, ``mll_cls`` and ``batch_shape`` (class attributes or properties). The test model is
    :class:`~gpytorch_decoupled.test.ContractSVGPModel`. Tests of behaviour a strategy does not support (e.g. no
    fantasy model) are overridden in the subclass, e.g. to assert the error it raises.

    Example:
        A test module for a strategy of your own (here GPyTorch's, so that the example runs anywhere); pytest or
        ``python -m unittest`` collects every test of the contract:

        >>> import io, unittest
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.test import StrategyContractTestCase
        >>> class TestMyStrategy(StrategyContractTestCase, unittest.TestCase):
        ...     strategy_cls = gpytorch.variational.VariationalStrategy  # yours here
        ...     distribution_cls = gpytorch.variational.CholeskyVariationalDistribution
        ...     mll_cls = gpytorch.mlls.VariationalELBO
        ...     batch_shape = torch.Size([])
        >>> runner = unittest.TextTestRunner(stream=io.StringIO())
        >>> runner.run(TestMyStrategy("test_state_dict_round_trip")).wasSuccessful()
        True
    """

    seed = 0
    num_tasks = 2
    num_latents = 3

    def _make_model_and_likelihood(
        self,
        num_inducing=16,
        batch_shape=torch.Size([]),
        inducing_batch_shape=torch.Size([]),
        strategy_cls=gpytorch.variational.VariationalStrategy,
        distribution_cls=gpytorch.variational.CholeskyVariationalDistribution,
        constant_mean=True,
    ):
        inducing_points = torch.randn(num_inducing, 2).repeat(*inducing_batch_shape, 1, 1)
        model = ContractSVGPModel(inducing_points, strategy_cls, distribution_cls, batch_shape, constant_mean)
        return model, self.likelihood_cls()

    # ------------------------------------------------------------------ helpers
    def _fitted_model(self, iterations: int = 3, batch_shape: torch.Size = torch.Size([])):
        """A model and likelihood moved away from their initial values by a few Adam steps."""
        model, likelihood = self._make_model_and_likelihood(
            batch_shape=batch_shape, distribution_cls=self.distribution_cls, strategy_cls=self.strategy_cls
        )
        x, y = self._data(torch.get_default_dtype())
        self._optimize(model, likelihood, x, y, iterations)
        return model, likelihood

    def _data(self, dtype: torch.dtype, device: torch.device | str = "cpu", num_tasks: int | None = None):
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(32, 2, generator=generator, dtype=dtype).clamp(-2.5, 2.5)
        y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(32, generator=generator, dtype=dtype)
        if num_tasks is not None:
            y = torch.stack([y * (t + 1) for t in range(num_tasks)], dim=-1)
        return x.to(device), y.to(device)

    def _optimize(self, model, likelihood, x, y, iterations: int):
        model.train()
        likelihood.train()
        mll = self.mll_cls(likelihood, model, num_data=x.size(-2))
        optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
        loss = None
        for _ in range(iterations):
            optimizer.zero_grad()
            loss = -mll(model(x), y).sum()
            loss.backward()
            optimizer.step()
        return loss

    def _predict(self, model, x):
        model.eval()
        with torch.no_grad():
            output = model(x)
        return output.mean, output.covariance_matrix

    def _assert_same_prediction(self, first, second, rtol: float = 1e-6, atol: float = 1e-7):
        self.assertAllClose(first[0], second[0], rtol=rtol, atol=atol)
        self.assertAllClose(first[1], second[1], rtol=rtol, atol=atol)

    def _wrapped_model(self, wrapper: str):
        """The test model with its strategy batched over tasks/latents and wrapped in the package's IMT or LMC wrapper
        (``"imt"``, ``"lmc"``) or in GPyTorch's own (``"gpytorch-imt"``, ``"gpytorch-lmc"``)."""
        size = self.num_tasks if wrapper.endswith("imt") else self.num_latents
        model, _ = self._make_model_and_likelihood(
            batch_shape=torch.Size([size]), distribution_cls=self.distribution_cls, strategy_cls=self.strategy_cls
        )
        base = model.variational_strategy
        imt, lmc = IndependentMultitaskVariationalStrategy, LMCVariationalStrategy
        if wrapper.startswith("gpytorch-"):
            imt, lmc = (
                gpytorch.variational.IndependentMultitaskVariationalStrategy,
                gpytorch.variational.LMCVariationalStrategy,
            )
        if wrapper.endswith("imt"):
            model.variational_strategy = imt(base, num_tasks=self.num_tasks)
        else:
            model.variational_strategy = lmc(base, num_tasks=self.num_tasks, num_latents=self.num_latents)
        likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=self.num_tasks)
        return model, likelihood

    # ------------------------------------------------------------------ state
    def test_state_dict_round_trip(self):
        model, likelihood = self._fitted_model()
        test_x, _ = self._data(torch.get_default_dtype())
        expected = self._predict(model, test_x)

        fresh_model, fresh_likelihood = self._make_model_and_likelihood(
            distribution_cls=self.distribution_cls, strategy_cls=self.strategy_cls
        )
        fresh_model.load_state_dict(model.state_dict())
        fresh_likelihood.load_state_dict(likelihood.state_dict())
        for name, value in model.state_dict().items():
            self.assertTrue(torch.equal(value, fresh_model.state_dict()[name]), msg=f"{name} was not restored")
        self._assert_same_prediction(self._predict(fresh_model, test_x), expected)

    def test_pickle_and_deepcopy_with_eval_caches(self):
        model, _ = self._fitted_model()
        test_x, _ = self._data(torch.get_default_dtype())
        expected = self._predict(model, test_x)  # leaves the eval caches filled
        for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            self._assert_same_prediction(self._predict(clone, test_x), expected)

    def test_deepcopy_and_pickle_right_after_a_training_step(self):
        # Keeping the best model during training (early stopping) copies it between steps.
        model, _ = self._fitted_model()
        clones = (copy.deepcopy(model), pickle.loads(pickle.dumps(model)))
        test_x, _ = self._data(torch.get_default_dtype())
        expected = self._predict(model, test_x)
        for clone in clones:
            self._assert_same_prediction(self._predict(clone, test_x), expected)

    def test_to_dtype_after_eval_clears_stale_caches(self):
        model, _ = self._fitted_model()
        model.eval()  # drops the training caches so that the reference copy can be made
        reference = copy.deepcopy(model).double()
        test_x, _ = self._data(torch.float64)
        self._predict(model, test_x.float())  # fills float32 eval caches

        model.double()
        converted = self._predict(model, test_x)
        self.assertEqual(converted[0].dtype, torch.float64)
        self._assert_same_prediction(converted, self._predict(reference, test_x), rtol=1e-10, atol=1e-12)

    @_cuda
    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_to_device_after_eval(self):
        model, _ = self._fitted_model()
        test_x, _ = self._data(torch.get_default_dtype())
        expected = self._predict(model, test_x)
        model.cuda()
        moved = self._predict(model, test_x.cuda())
        self.assertEqual(moved[0].device.type, "cuda")
        self._assert_same_prediction((moved[0].cpu(), moved[1].cpu()), expected, rtol=1e-4, atol=1e-5)

    # ------------------------------------------------------------------ prior
    def test_prior_call_returns_the_prior(self):
        model, _ = self._fitted_model()
        test_x, _ = self._data(torch.get_default_dtype())
        for mode in (True, False):
            model.train(mode)
            with torch.no_grad():
                prior = model(test_x, prior=True)
                expected = model.forward(test_x)
            self.assertAllClose(prior.mean, expected.mean)
            self.assertAllClose(prior.covariance_matrix, expected.covariance_matrix)

    # ------------------------------------------------------------------ multitask wrapping
    def _check_wrapped_kl(self, wrapper: str, reduce_dim: int):
        model, likelihood = self._wrapped_model(wrapper)
        x, y = self._data(torch.get_default_dtype(), num_tasks=self.num_tasks)
        model.train()
        likelihood.train()
        output = model(x)
        self.assertEqual(output.event_shape, torch.Size([32, self.num_tasks]))

        kl = model.variational_strategy.kl_divergence()
        expected_kl = model.variational_strategy.base_variational_strategy.kl_divergence().sum(reduce_dim)
        self.assertAllClose(kl, expected_kl, rtol=1e-6, atol=0)

        # The ELBO must use that KL: ELBO = (E[log p(y|f)] - KL) / N.
        mll = self.mll_cls(likelihood, model, num_data=32)
        loss = -mll(output, y)
        if self.mll_cls is gpytorch.mlls.VariationalELBO:
            expected_log_lik = likelihood.expected_log_prob(y, output).sum(-1)
            self.assertAllClose(-loss, (expected_log_lik - expected_kl) / 32, rtol=1e-5, atol=1e-6)
        loss.backward()
        for name, param in [*model.named_parameters(), *likelihood.named_parameters()]:
            self.assertIsNotNone(param.grad, msg=name)
            self.assertGreater(param.grad.norm().item(), 0, msg=name)

    def test_independent_multitask_wrapping_uses_strategy_kl(self):
        self._check_wrapped_kl("imt", reduce_dim=-1)

    def test_lmc_wrapping_uses_strategy_kl(self):
        self._check_wrapped_kl("lmc", reduce_dim=-1)

    # GPyTorch's wrappers compute the KL from the base's variational and prior distributions; the package's strategies
    # make that the strategy's own KL (it used to be silently wrong: 34.3 instead of 71.6 for ODVGP under LMC).
    def test_gpytorch_independent_multitask_wrapper_gets_strategy_kl(self):
        self._check_wrapped_kl("gpytorch-imt", reduce_dim=-1)

    def test_gpytorch_lmc_wrapper_gets_strategy_kl(self):
        self._check_wrapped_kl("gpytorch-lmc", reduce_dim=-1)
