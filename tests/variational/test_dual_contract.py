"""The GPyTorch contract for DualVariationalStrategy (both objectives, batched latents) and what is specific to t-SVGP:
sites that are buffers (set by DualEStep, carried by state_dict and pickles, never moved by a gradient optimizer),
float32 and float64, IndependentMultitask wrapping (KL and E-step through the wrapper) and the construction checks.
The E-step's own contract (bad input, the per-datum indices, reused factors) is in ``tests/optim/test_dual_e_step.py``.
"""

from __future__ import annotations

import copy
import pickle
import unittest
import unittest.mock

import gpytorch
import pytest
import torch

from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep
from gpytorch_decoupled.variational import (
    DualVariationalDistribution,
    DualVariationalStrategy,
)
from tests.dual_problems import (
    DualGP,
    MultitaskDualGP,
    assert_same_state,
    em_model,
    oracle_blocks,
    problem,
    site_values,
    state_snapshot,
)
from tests.float64_problems import (
    F64,
    gaussian_likelihood,
    generator,
    randn,
    relative_error,
)
from tests.oracles import gaussian_kl, titsias_optimal_qu
from tests.oracles.dual import dual_qu_from_sites
from tests.variational.decoupled_contract_test_case import DecoupledStrategyContractTestCase

pytestmark = pytest.mark.usefixtures("single_thread")


def dual_strategy(model, inducing_points, variational_distribution, learn_inducing_locations=True):
    """The contract's factory: a DualVariationalStrategy whose sites are fixed random values, not zero.

    With zero sites q is the prior, whose marginals do not depend on Z or on the lengthscale, so the contract's "every
    parameter gets a gradient" would fail for a reason that has nothing to do with the strategy; in real use an E-step
    sets the sites before any M-step."""
    gen = torch.Generator().manual_seed(0)
    site_mean, site_precision = variational_distribution()
    M = site_mean.size(-1)
    with torch.no_grad():
        site_mean.copy_(torch.randn(site_mean.shape, generator=gen))
        A = torch.randn(site_precision.shape, generator=gen)
        site_precision.copy_(0.1 * A @ A.mT / M)
    return DualVariationalStrategy(model, inducing_points, variational_distribution, learn_inducing_locations)


class TestDualContract(DecoupledStrategyContractTestCase, unittest.TestCase):
    """GPyTorch's contract plus the package's (state, copies, dtype, prior, wrappers); the decoupled families' extras
    hold for t-SVGP too: every factorization is an explicit Cholesky (no CG). Its fantasy models differ from
    GPyTorch's by design (see test_fantasy_call)."""

    def test_fantasy_call(
        self, data_batch_shape=None, inducing_batch_shape=None, model_batch_shape=None, expected_batch_shape=None
    ):
        """GPyTorch's test expects the ExactGP of its online variational conditioning (Maddox et al. 2021), built from
        pseudo-points with a ``mean_module``/``covar_module`` of choice. t-SVGP conditions exactly in closed form
        instead: the fantasy model is a copy of the same model with the new points' sites added (values checked
        against the dense posterior in ``test_fantasy_models.py``). Here: GPyTorch's batch-shape cases, its data and its
        model's ``likelihood`` attribute, with the batch shapes it expects, and the original model unchanged."""
        model_batch_shape = self.batch_shape if model_batch_shape is None else model_batch_shape
        model, likelihood = self._make_model_and_likelihood(
            batch_shape=model_batch_shape,
            inducing_batch_shape=self.batch_shape if inducing_batch_shape is None else inducing_batch_shape,
            distribution_cls=self.distribution_cls,
            strategy_cls=self.strategy_cls,
        )
        model.likelihood = likelihood
        before = state_snapshot(model)
        data_batch_shape = self.batch_shape if data_batch_shape is None else data_batch_shape
        x = torch.randn(*data_batch_shape, 10, 2).clamp(-2.5, 2.5)
        fantasy = model.get_fantasy_model(x, torch.linspace(-1, 1, 10).expand(*data_batch_shape, 10))
        self.assertIs(type(fantasy), type(model))
        assert_same_state(model, before)
        expected_batch_shape = self.batch_shape if expected_batch_shape is None else expected_batch_shape
        self.assertEqual(fantasy.eval()(torch.randn(5, 2)).mean.shape, torch.Size([*expected_batch_shape, 5]))

    @property
    def distribution_cls(self):
        return DualVariationalDistribution

    @property
    def strategy_cls(self):
        return dual_strategy

    def _fitted_model(self, iterations: int = 3, batch_shape: torch.Size = torch.Size([])):
        """EM as in real use: an E-step moves the sites (so a fresh model differs from a fitted one in every buffer),
        then a few Adam M-steps move the hyperparameters."""
        model, likelihood = self._make_model_and_likelihood(
            batch_shape=batch_shape, distribution_cls=self.distribution_cls, strategy_cls=self.strategy_cls
        )
        x, y = self._data(torch.get_default_dtype())
        DualEStep(model, likelihood, num_data=x.size(0), lr=0.8).step(x, y)
        self._optimize(model, likelihood, x, y, iterations)
        return model, likelihood

    def test_sites_are_buffers_in_state_dict_not_parameters(self):
        # Adam over model.parameters() cannot move q: the sites are buffers (spec A.3), carried by state_dict.
        model, _ = self._make_model_and_likelihood(
            batch_shape=self.batch_shape, distribution_cls=self.distribution_cls, strategy_cls=self.strategy_cls
        )
        site_names = {"variational_strategy._variational_distribution.site_mean"}
        site_names.add("variational_strategy._variational_distribution.site_precision")
        self.assertTrue(site_names <= set(model.state_dict()))
        self.assertTrue(site_names <= {name for name, _ in model.named_buffers()})
        self.assertFalse(site_names & {name for name, _ in model.named_parameters()})
        self.assertEqual(list(model.variational_parameters()), [])
        q = model.variational_strategy._variational_distribution
        self.assertEqual(q.site_mean.shape, torch.Size([*self.batch_shape, 16]))
        self.assertEqual(q.site_precision.shape, torch.Size([*self.batch_shape, 16, 16]))

    def test_adam_m_steps_leave_the_sites_unchanged(self):
        model, likelihood = self._fitted_model(iterations=0, batch_shape=self.batch_shape)
        sites = [site.clone() for site in model.variational_strategy._variational_distribution()]
        x, y = self._data(torch.get_default_dtype())
        self._optimize(model, likelihood, x, y, iterations=3)
        for site, before in zip(model.variational_strategy._variational_distribution(), sites, strict=True):
            self.assertTrue(torch.equal(site, before))
            self.assertIsNone(site.grad)


class TestDualPredictiveContract(TestDualContract):
    @property
    def mll_cls(self):
        return gpytorch.mlls.PredictiveLogLikelihood


class TestDualBatchContract(TestDualContract):
    @property
    def batch_shape(self):
        return torch.Size([3])


class TestDualObjectiveContract(TestDualContract):
    """The M-step objective itself (DualVariationalELBO) as the contract's mll."""

    @property
    def mll_cls(self):
        return DualVariationalELBO

    def test_lmc_wrapping_uses_strategy_kl(self, wrapper="lmc"):
        # Mixed latents have no per-latent E-step, so the t-SVGP objective refuses an LMC wrapper (the plain
        # VariationalELBO contract above covers the strategy inside LMC).
        model, likelihood = self._wrapped_model(wrapper)
        with self.assertRaisesRegex(TypeError, "DualVariationalELBO needs"):
            self.mll_cls(likelihood, model, num_data=32)

    def test_gpytorch_lmc_wrapper_gets_strategy_kl(self):
        self.test_lmc_wrapping_uses_strategy_kl("gpytorch-lmc")


# ------------------------------------------------------------------------------------------ state and copies
def _eval_prediction(model, x):
    model.eval()
    with torch.no_grad():
        output = model(x)
        return output.mean, output.covariance_matrix


@pytest.mark.parametrize("per_datum", [False, True])
def test_state_dict_round_trip_of_the_sites_after_e_steps(per_datum: bool) -> None:
    model, _, X, _ = em_model(per_datum)
    expected = _eval_prediction(model, X[:20])
    Z, _, _ = problem(1)  # another model: other inducing inputs, zero sites
    fresh = DualGP(Z, datum_inputs=X if per_datum else None)
    fresh.load_state_dict(model.state_dict())
    for site, loaded in zip(model.variational_strategy._variational_distribution(), site_values(fresh), strict=True):
        assert site.abs().max() > 0.1 and torch.equal(site, loaded)
    actual = _eval_prediction(fresh, X[:20])
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_datum", [False, True])
def test_pickle_and_deepcopy_after_e_steps(per_datum: bool) -> None:
    model, likelihood, X, y = em_model(per_datum)
    expected = _eval_prediction(model, X[:20])
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        for a, e in zip(_eval_prediction(clone, X[:20]), expected, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
        # The copy trains on by itself: its E-step moves its sites, not the original's.
        original = site_values(model)
        DualEStep(clone, likelihood, num_data=X.size(0), lr=1.0).step(X, y, torch.arange(60) if per_datum else None)
        assert not torch.equal(site_values(clone)[0], original[0])
        assert all(torch.equal(a, b) for a, b in zip(site_values(model), original, strict=True))


def _oracle_eval_mean(model, X_test: torch.Tensor) -> torch.Tensor:
    """The predictive mean of the model's current sites by the dense oracle (eq. 49 through q(u), zero prior mean)."""
    with torch.no_grad():
        K_uu, K_us, _ = oracle_blocks(model, X_test)
        ell1, L2 = site_values(model)
        m, _ = dual_qu_from_sites(K_uu, ell1, L2)
        return K_us.mT @ torch.linalg.solve(K_uu, m)


def test_e_step_in_eval_mode_refreshes_the_eval_caches() -> None:
    model, likelihood, X, y = em_model()
    before, _ = _eval_prediction(model, X[:20])  # fills the eval caches
    DualEStep(model, likelihood, num_data=X.size(0), lr=1.0).step(X[:30], y[:30])
    assert not model.training
    after, _ = _eval_prediction(model, X[:20])
    assert (after - before).abs().max() > 1e-3
    assert relative_error(after, _oracle_eval_mean(model, X[:20])) < 1e-10


def test_load_state_dict_into_a_model_with_warm_eval_caches() -> None:
    model, _, X, _ = em_model()
    other, _, _, _ = em_model(per_datum=False, batch_shape=torch.Size([]))
    DualEStep(other, gaussian_likelihood(), num_data=X.size(0), lr=1.0).step(X[:20], -X[:20, 0])
    _eval_prediction(model, X[:20])  # warm caches of the old sites
    model.load_state_dict(other.state_dict())
    loaded, _ = _eval_prediction(model, X[:20])
    expected, _ = _eval_prediction(other, X[:20])
    assert relative_error(loaded, expected) < 1e-12
    assert relative_error(loaded, _oracle_eval_mean(model, X[:20])) < 1e-10


def test_float32_and_float64_agree() -> None:
    model64, likelihood64, X, y = em_model()
    model32 = copy.deepcopy(model64).float()
    likelihood32 = copy.deepcopy(likelihood64).float()
    for model, likelihood, dtype in ((model64, likelihood64, F64), (model32, likelihood32, torch.float32)):
        DualEStep(model, likelihood, num_data=X.size(0), lr=1.0).step(X.to(dtype), y.to(dtype))
    mean64, cov64 = _eval_prediction(model64, X[:20])
    mean32, cov32 = _eval_prediction(model32, X[:20].float())
    assert mean32.dtype == torch.float32 and model32.variational_strategy._variational_distribution.site_mean.dtype == (
        torch.float32
    )
    assert relative_error(mean32.double(), mean64) < 1e-4
    assert relative_error(cov32.double(), cov64) < 1e-3


def test_to_float64_after_an_eval_pass() -> None:
    model64, likelihood, X, y = em_model()
    model = copy.deepcopy(model64).float()
    _eval_prediction(model, X[:20].float())  # fills float32 eval caches
    model.double()
    DualEStep(model, likelihood, num_data=X.size(0), lr=1.0).step(X, y)  # works on the converted buffers
    DualEStep(model64, likelihood, num_data=X.size(0), lr=1.0).step(X, y)
    mean, _ = _eval_prediction(model, X[:20])
    assert mean.dtype == F64
    # The sites came back from float32 (rounded), so compare at float32 precision.
    assert relative_error(mean, _eval_prediction(model64, X[:20])[0]) < 1e-5


@pytest.mark.cuda
def test_e_step_and_prediction_on_cuda_match_the_cpu() -> None:
    model, likelihood, X, y = em_model()
    cpu_model, cpu_likelihood = copy.deepcopy(model), copy.deepcopy(likelihood)
    state = state_snapshot(model)
    with pytest.raises(ValueError, match="cuda"):  # a batch on another device than the model
        DualEStep(model, likelihood, num_data=X.size(0), lr=0.5).step(X.cuda(), y)
    assert_same_state(model, state)
    model.cuda()
    likelihood.cuda()
    DualEStep(model, likelihood, num_data=X.size(0), lr=0.5).step(X.cuda(), y.cuda())
    DualEStep(cpu_model, cpu_likelihood, num_data=X.size(0), lr=0.5).step(X, y)
    mean, covariance = _eval_prediction(model, X[:20].cuda())
    assert mean.device.type == "cuda"
    expected_mean, expected_covariance = _eval_prediction(cpu_model, X[:20])
    assert relative_error(mean.cpu(), expected_mean) < 1e-10
    assert relative_error(covariance.cpu(), expected_covariance) < 1e-9


def test_prior_call_ignores_the_sites() -> None:
    model, _, X, _ = em_model()
    for mode in (True, False):
        model.train(mode)
        with torch.no_grad():
            prior = model(X[:10], prior=True)
            torch.testing.assert_close(prior.covariance_matrix, model.covar_module(X[:10]).to_dense())
            assert torch.equal(prior.mean, torch.zeros(10, dtype=F64))


# ------------------------------------------------------------------------------------------ multitask wrappers
def test_e_step_and_kl_through_the_independent_multitask_wrapper() -> None:
    # One r = 1 E-step with a multitask Gaussian likelihood gives each task's Titsias q* with that task's noise, and
    # the wrapper's KL is the sum of the per-task Gaussian KLs.
    Z, X, y = problem()
    Y = torch.stack([y, -0.5 * y + 0.2 * X[:, 0]], dim=-1)
    model = MultitaskDualGP(Z, num_tasks=2)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, has_global_noise=False).double()
    likelihood.task_noises = torch.tensor([0.1, 0.3], dtype=F64)
    DualEStep(model, likelihood, num_data=X.size(0), lr=1.0).step(X, Y)
    base = model.variational_strategy.base_variational_strategy
    K_uu, K_uf, _ = (block.detach() for block in oracle_blocks(model, X))
    ell1, L2 = _sites_of(base)
    expected_kl = 0.0
    for task, noise in enumerate((0.1, 0.3)):
        m, S = dual_qu_from_sites(K_uu, ell1[task], L2[task])
        m_star, S_star = titsias_optimal_qu(K_uu, K_uf, Y[:, task], noise)
        assert relative_error(m, m_star) < 1e-9 and relative_error(S, S_star) < 1e-9, task
        expected_kl = expected_kl + gaussian_kl(m, S, torch.zeros_like(m), K_uu)
    with torch.no_grad():
        kl = model.variational_strategy.kl_divergence()
    assert relative_error(kl, expected_kl) < 1e-10
    # The objective runs through the wrapper and its gradients reach the hyperparameters.
    model.train()
    (-DualVariationalELBO(likelihood, model, num_data=X.size(0))(model(X), Y)).backward()
    assert model.variational_strategy.base_variational_strategy.inducing_points.grad.abs().max() > 0


def _sites_of(strategy) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(site.clone() for site in strategy._variational_distribution())


# -------------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize(
    "distribution",
    [
        gpytorch.variational.CholeskyVariationalDistribution(10),
        gpytorch.variational.NaturalVariationalDistribution(10),
    ],
)
def test_a_non_dual_distribution_is_refused(distribution) -> None:
    Z, _, _ = problem()
    with pytest.raises(TypeError, match="needs a DualVariationalDistribution"):
        DualVariationalStrategy(gpytorch.models.ApproximateGP(None), Z, distribution)


def test_size_mismatch_and_bad_datum_inputs_are_refused() -> None:
    Z, X, _ = problem()
    with pytest.raises(ValueError, match="M=9"):
        DualVariationalStrategy(gpytorch.models.ApproximateGP(None), Z, DualVariationalDistribution(9))
    for datum_inputs in (X[:, 0], X.clone().fill_(float("nan"))):
        with pytest.raises(ValueError, match="datum_inputs"):
            DualVariationalDistribution(10, datum_inputs=datum_inputs)


def test_random_sites_helper_is_deterministic() -> None:
    # The contract factory's sites are reproducible, so a fresh model's state equals another fresh model's.
    first = DualVariationalDistribution(5)
    second = DualVariationalDistribution(5)
    dual_strategy(gpytorch.models.ApproximateGP(None), randn(5, 2, gen=generator(0)).float(), first)
    dual_strategy(gpytorch.models.ApproximateGP(None), randn(5, 2, gen=generator(0)).float(), second)
    assert torch.equal(first.site_mean, second.site_mean) and first.site_mean.abs().max() > 0


def test_one_dimensional_inducing_points_are_one_input_dimension():
    # As in GPyTorch's tutorials: torch.linspace(...) without a trailing dimension (this raised an IndexError).
    x = torch.linspace(-2, 2, 40, dtype=F64).unsqueeze(-1)
    y = torch.sin(3 * x.squeeze(-1))
    predictions = []
    for points in (torch.linspace(-2, 2, 8, dtype=F64), torch.linspace(-2, 2, 8, dtype=F64).unsqueeze(-1)):
        model, likelihood = DualGP(torch.zeros(8, 1, dtype=F64)), gaussian_likelihood()
        model.variational_strategy = DualVariationalStrategy(model, points, DualVariationalDistribution(8))
        model.double()
        assert model.variational_strategy.inducing_points.shape == (8, 1)
        DualEStep(model, likelihood, num_data=40).step(x, y)
        predictions.append(_eval_prediction(model, x))
    torch.testing.assert_close(predictions[0], predictions[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="M=8 inducing points, but 5 were given"):
        DualVariationalStrategy(model, torch.zeros(5), DualVariationalDistribution(8))
