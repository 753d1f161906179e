"""The GPyTorch contract for DecoupledVariationalStrategy (both objectives, batched latents, sampled KL, Jacobi
preconditioning) and what is specific to the decoupled (SVDGP) basis: its distribution, its parameter groups, the
preconditioned parametrization, the column-sampled KL, eval caching, input validation, coinciding covariance points
and a posterior that never exceeds the prior."""

from __future__ import annotations

import math
import unittest
import unittest.mock
import warnings

import gpytorch
import pytest
import torch
from gpytorch.utils.warnings import NumericalWarning

from gpytorch_decoupled.variational import DecoupledVariationalDistribution, DecoupledVariationalStrategy
from gpytorch_decoupled.variational import decoupled_variational_strategy as decoupled_module
from tests.variational.decoupled_contract_test_case import DecoupledStrategyContractTestCase
from tests.variational.mean_basis_cases import assert_same_caches, cache_snapshot, eval_process

F64 = torch.float64
NUM_MEAN_POINTS = 24


pytestmark = pytest.mark.usefixtures("single_thread")


def _decoupled_factory(**strategy_kwargs):
    def factory(model, inducing_points, variational_distribution, learn_inducing_locations=True):
        """Ignores the contract's distribution class but keeps its batch shape: a decoupled distribution for a mean
        basis of 24 points next to the 16 covariance points of the contract's model."""
        mean_inducing_points = torch.randn(NUM_MEAN_POINTS, inducing_points.size(-1), dtype=inducing_points.dtype)
        q = DecoupledVariationalDistribution(
            NUM_MEAN_POINTS, inducing_points.size(-2), batch_shape=variational_distribution.batch_shape
        )
        return DecoupledVariationalStrategy(
            model, inducing_points, q, mean_inducing_points, learn_inducing_locations, **strategy_kwargs
        )

    return factory


# Module-level names, so that models built by them can be pickled.
decoupled_strategy = _decoupled_factory()
sampled_decoupled_strategy = _decoupled_factory(num_kl_columns=8)
preconditioned_decoupled_strategy = _decoupled_factory(jacobi_preconditioning=True)


class TestDecoupledContract(DecoupledStrategyContractTestCase, unittest.TestCase):
    @property
    def strategy_cls(self):
        return decoupled_strategy

    def test_factory_builds_the_decoupled_distribution(self):
        model, _ = self._make_model_and_likelihood(
            batch_shape=self.batch_shape, distribution_cls=self.distribution_cls, strategy_cls=self.strategy_cls
        )
        q = model.variational_strategy._variational_distribution
        self.assertIsInstance(q, DecoupledVariationalDistribution)
        self.assertEqual(q.mean_coefficients.shape, torch.Size([*self.batch_shape, NUM_MEAN_POINTS]))
        self.assertEqual(q.precision_factor.shape, torch.Size([*self.batch_shape, 16, 16]))

    def test_eval_predictions_reuse_the_cached_factor(self):
        model, _ = self._fitted_model(batch_shape=self.batch_shape)
        strategy = model.variational_strategy
        test_x, _ = self._data(torch.get_default_dtype())
        first = self._predict(model, test_x)
        self.assertIsNotNone(strategy._inner_cholesky_factor)
        # jittered_cholesky factors H = I + L_B^T K_beta L_B with torch.linalg.cholesky_ex; eval mode caches it.
        with (
            unittest.mock.patch("torch.linalg.cholesky_ex", wraps=torch.linalg.cholesky_ex) as cholesky,
            unittest.mock.patch.object(
                decoupled_module, "jittered_cholesky", wraps=decoupled_module.jittered_cholesky
            ) as jittered,
        ):
            second = self._predict(model, test_x)
            subset = self._predict(model, test_x[:5])
            with torch.no_grad():
                strategy.kl_divergence()
        self.assertEqual(cholesky.call_count, 0)
        self.assertEqual(jittered.call_count, 0)
        self._assert_same_prediction(second, first, rtol=0, atol=0)
        self._assert_same_prediction(subset, (second[0][..., :5], second[1][..., :5, :5]), rtol=1e-5, atol=1e-6)
        # Training mode drops the factor: the next step factors H again, once, for its forward pass and its KL.
        model.train()
        with unittest.mock.patch.object(
            decoupled_module, "jittered_cholesky", wraps=decoupled_module.jittered_cholesky
        ) as jittered:
            model(test_x)
            strategy.kl_divergence()
        self.assertEqual(jittered.call_count, 1)


class TestDecoupledPredictiveContract(TestDecoupledContract):
    @property
    def mll_cls(self):
        return gpytorch.mlls.PredictiveLogLikelihood


class TestDecoupledBatchContract(TestDecoupledContract):
    @property
    def batch_shape(self):
        return torch.Size([3])


class TestDecoupledSampledKLContract(TestDecoupledContract):
    """8 of the 24 rows of K_alpha per training step: the sampled rows are fused with every data batch shape."""

    @property
    def strategy_cls(self):
        return sampled_decoupled_strategy


class TestDecoupledPreconditionedContract(TestDecoupledContract):
    @property
    def strategy_cls(self):
        return preconditioned_decoupled_strategy


# ------------------------------------------------------------------------------------------ float64 test model
class DecoupledGP(gpytorch.models.ApproximateGP):
    """A float64 decoupled GP; ``linear=True`` adds a linear kernel so that the prior variance varies with x."""

    def __init__(self, beta, alpha, batch_shape=torch.Size([]), linear=False, **strategy_kwargs):
        q = DecoupledVariationalDistribution(alpha.size(-2), beta.size(-2), batch_shape=batch_shape)
        super().__init__(DecoupledVariationalStrategy(self, beta, q, alpha, **strategy_kwargs))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        if linear:
            self.covar_module = self.covar_module + gpytorch.kernels.LinearKernel()
        self.double()
        with torch.no_grad():
            self.mean_module.constant.fill_(0.3)
            for name, parameter in self.named_hyperparameters():
                if name.endswith("raw_lengthscale"):
                    parameter.fill_(0.2)
                elif name.endswith("raw_outputscale"):
                    parameter.fill_(0.5)
                elif name.endswith("raw_variance"):
                    parameter.fill_(-1.0)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _bases(seed: int, num_beta: int = 8, num_alpha: int = NUM_MEAN_POINTS, n: int = 30):
    gen = torch.Generator().manual_seed(seed)
    beta = 4.0 * torch.rand(num_beta, 2, generator=gen, dtype=F64) - 2.0
    alpha = 4.0 * torch.rand(num_alpha, 2, generator=gen, dtype=F64) - 2.0
    X = 4.4 * torch.rand(n, 2, generator=gen, dtype=F64) - 2.2
    y = torch.sin(1.5 * X[:, 0]) + 0.5 * torch.cos(2.0 * X[:, 1]) + 0.1 * torch.randn(n, generator=gen, dtype=F64)
    return beta, alpha, X, y


def _set_parameters(model: DecoupledGP, a: torch.Tensor, L_B: torch.Tensor) -> None:
    q = model.variational_strategy._variational_distribution
    with torch.no_grad():
        q.mean_coefficients.copy_(a)
        q.precision_factor.copy_(L_B)
    model.variational_strategy._clear_cache()


def _random_parameters(model: DecoupledGP, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random a and a lower-triangular L_B of order one (B far from 0), set on the (unpreconditioned) model."""
    gen = torch.Generator().manual_seed(seed)
    q = model.variational_strategy._variational_distribution
    a = torch.randn(q.mean_coefficients.shape, generator=gen, dtype=F64)
    L_B = (scale * torch.randn(q.precision_factor.shape, generator=gen, dtype=F64)).tril()
    _set_parameters(model, a, L_B)
    return a, L_B


def _dense_process(model: DecoupledGP, a, L_B, x):
    """Mean, covariance and KL from dense float64 formulas: the S-form, S = (K_beta^-1 + B)^-1 (spec eq. 3.1-3.2)."""
    strategy = model.variational_strategy
    beta, alpha = strategy.inducing_points.detach(), strategy.mean_inducing_points.detach()
    with torch.no_grad():
        prior = model.forward(x)
        K_xb = model.covar_module(x, beta).to_dense()
        K_bb = model.covar_module(beta, beta).to_dense()
        K_xa = model.covar_module(x, alpha).to_dense()
        K_aa = model.covar_module(alpha, alpha).to_dense()
    B = L_B @ L_B.mT
    S = torch.linalg.inv(torch.linalg.inv(K_bb) + B)
    K_inv_K_bx = torch.linalg.solve(K_bb, K_xb.mT)
    mean = prior.mean + K_xa @ a
    covariance = prior.covariance_matrix - K_inv_K_bx.mT @ (K_bb - S) @ K_inv_K_bx
    covariance_kl = torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(torch.zeros_like(beta[:, 0]), S),
        torch.distributions.MultivariateNormal(torch.zeros_like(beta[:, 0]), K_bb),
    )
    return mean, covariance, 0.5 * a @ K_aa @ a + covariance_kl


# -------------------------------------------------------------------------------------------- construction
def test_wrong_distribution_type_is_refused() -> None:
    beta, alpha, _, _ = _bases(0)
    for q in (
        gpytorch.variational.CholeskyVariationalDistribution(beta.size(0)),
        gpytorch.variational.NaturalVariationalDistribution(beta.size(0)),
    ):
        with pytest.raises(TypeError, match="needs a DecoupledVariationalDistribution"):
            DecoupledVariationalStrategy(gpytorch.models.ApproximateGP(None), beta, q, alpha)


@pytest.mark.parametrize("num_alpha, num_beta", [(NUM_MEAN_POINTS + 1, 8), (NUM_MEAN_POINTS, 7), (8, NUM_MEAN_POINTS)])
def test_size_mismatch_is_refused(num_alpha: int, num_beta: int) -> None:
    beta, alpha, _, _ = _bases(0)
    q = DecoupledVariationalDistribution(num_alpha, num_beta)
    with pytest.raises(ValueError, match=r"M_alpha=.*M_beta=.*bases have sizes \(24, 8\)"):
        DecoupledVariationalStrategy(gpytorch.models.ApproximateGP(None), beta, q, alpha)


@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([3])])
def test_parameter_groups(batch_shape: torch.Size) -> None:
    beta, alpha, _, _ = _bases(1)
    model = DecoupledGP(beta, alpha, batch_shape=batch_shape)
    strategy, q = model.variational_strategy, model.variational_strategy._variational_distribution
    variational = dict(model.named_variational_parameters())
    assert set(variational) == {
        "variational_strategy._variational_distribution.mean_coefficients",
        "variational_strategy._variational_distribution.precision_factor",
    }
    assert [id(p) for p in model.variational_parameters()] == [id(q.mean_coefficients), id(q.precision_factor)]
    hyperparameters = {id(p) for p in model.hyperparameters()}
    assert id(strategy.inducing_points) in hyperparameters
    assert id(strategy.mean_inducing_points) in hyperparameters
    assert hyperparameters.isdisjoint(id(p) for p in model.variational_parameters())
    # Together they are every parameter, each once: one Adam group per kind covers the model.
    assert len(hyperparameters) + len(variational) == len(list(model.parameters()))
    assert q.mean_coefficients.shape == torch.Size([*batch_shape, NUM_MEAN_POINTS])
    assert q.precision_factor.shape == torch.Size([*batch_shape, 8, 8])
    # Near the prior, but not at the saddle point B = 0; only the lower triangle of L_B is read.
    assert 0 < q().precision_factor.abs().max() < 0.1
    assert torch.equal(q().precision_factor, q.precision_factor.tril())


@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([3])])
def test_fixed_inducing_locations_stay_buffers(batch_shape: torch.Size) -> None:
    beta, alpha, X, y = _bases(2)
    model = DecoupledGP(beta, alpha, batch_shape=batch_shape, learn_inducing_locations=False, num_kl_columns=6)
    strategy = model.variational_strategy
    names = {name for name, _ in model.named_parameters()}
    assert not {"variational_strategy.inducing_points", "variational_strategy.mean_basis.inducing_points"} & names
    buffers = dict(model.named_buffers())
    assert torch.equal(buffers["variational_strategy.inducing_points"], beta)
    assert torch.equal(buffers["variational_strategy.mean_basis.inducing_points"], alpha)
    assert {"variational_strategy.inducing_points", "variational_strategy.mean_basis.inducing_points"} <= set(
        model.state_dict()
    )
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(0))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        (-mll(model(X), y)).sum().backward()
        optimizer.step()
    assert torch.equal(strategy.inducing_points, beta) and torch.equal(strategy.mean_inducing_points, alpha)
    assert not strategy.inducing_points.requires_grad and not strategy.mean_inducing_points.requires_grad
    fresh = DecoupledGP(beta + 1.0, alpha - 1.0, batch_shape=batch_shape, learn_inducing_locations=False)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.variational_strategy.inducing_points, beta)
    assert torch.equal(fresh.variational_strategy.mean_inducing_points, alpha)


def test_first_call_marks_the_distribution_initialized_without_resetting_it() -> None:
    # GPyTorch's contract: variational_params_initialized is 1 after the first call. The decoupled distribution is
    # initialized on construction, so values set before the first call must survive it.
    beta, alpha, X, _ = _bases(3)
    model = DecoupledGP(beta, alpha)
    a, L_B = _random_parameters(model, 4)
    strategy = model.variational_strategy
    assert strategy.variational_params_initialized.item() == 0
    with pytest.raises(ValueError):
        model(X[:, :1])  # a refused call changes nothing, the flag included
    assert strategy.variational_params_initialized.item() == 0
    model(X, prior=True)
    assert strategy.variational_params_initialized.item() == 0
    model(X)
    assert strategy.variational_params_initialized.item() == 1
    q = strategy._variational_distribution
    assert torch.equal(q.mean_coefficients, a) and torch.equal(q.precision_factor, L_B)


# ------------------------------------------------------------------------------------------- the process itself
@pytest.mark.parametrize("seed", [5, 6])
def test_eval_process_and_kl_match_dense_formulas(seed: int) -> None:
    beta, alpha, X, _ = _bases(seed)
    model = DecoupledGP(beta, alpha, linear=True)
    a, L_B = _random_parameters(model, seed + 10)
    mean, covariance, kl = eval_process(model, X)
    expected = _dense_process(model, a, L_B, X)
    torch.testing.assert_close(mean, expected[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(covariance, expected[1], rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(kl, expected[2], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([3])])
def test_jacobi_preconditioning_gives_the_same_process(batch_shape: torch.Size) -> None:
    beta, alpha, X, y = _bases(7)
    plain = DecoupledGP(beta, alpha, batch_shape=batch_shape, linear=True, num_kl_columns=None)
    preconditioned = DecoupledGP(
        beta, alpha, batch_shape=batch_shape, linear=True, num_kl_columns=None, jacobi_preconditioning=True
    )
    a, L_B = _random_parameters(plain, 8)
    preconditioned.load_state_dict(plain.state_dict())
    with torch.no_grad():
        d_alpha = plain.forward(alpha).variance
        d_beta = plain.forward(beta).variance
    assert d_alpha.std() > 0.1 * d_alpha.mean()  # a prior variance that varies, so that the scaling matters
    _set_parameters(preconditioned, d_alpha * a, d_beta.unsqueeze(-1) * L_B)  # a0 = D_alpha a, L0 = D_beta L_B

    strategy = preconditioned.variational_strategy
    torch.testing.assert_close(strategy.mean_coefficients, a, rtol=1e-12, atol=0)
    torch.testing.assert_close(strategy.precision_factor, L_B, rtol=1e-12, atol=0)
    expected = eval_process(plain, X)
    for actual, wanted in zip(eval_process(preconditioned, X), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-10)

    # Same training objective; the gradients are those of the plain model by the chain rule.
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    elbos, gradients = [], []
    for model in (plain, preconditioned):
        model.train()
        model.zero_grad()
        elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(0))(model(X), y).sum()
        elbo.backward()
        q = model.variational_strategy._variational_distribution
        elbos.append(elbo.detach())
        gradients.append((q.mean_coefficients.grad, q.precision_factor.grad))
    torch.testing.assert_close(elbos[1], elbos[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gradients[1][0], gradients[0][0] / d_alpha, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(gradients[1][1], gradients[0][1] / d_beta.unsqueeze(-1), rtol=1e-8, atol=1e-12)


def test_sampled_training_kl_is_unbiased_and_leaves_the_covariance_part_exact() -> None:
    beta, alpha, X, _ = _bases(9, num_alpha=24, n=10)
    model = DecoupledGP(beta, alpha, num_kl_columns=4, exact_kl_size=0)
    _random_parameters(model, 10)
    strategy = model.variational_strategy
    model.eval()
    with torch.no_grad():
        exact_kl = strategy.kl_divergence()
        exact_quadratic = strategy.mean_basis_quadratic_form()
    exact_covariance_kl = exact_kl - 0.5 * exact_quadratic
    assert exact_quadratic > 1.0 and exact_covariance_kl > 0.1

    model.train()
    num_draws = 600
    draws = torch.empty(num_draws, dtype=F64)
    torch.manual_seed(11)
    with torch.no_grad():
        for i in range(num_draws):
            model(X)  # draws this step's 4 rows of K_alpha
            kl = strategy.kl_divergence()
            # The covariance part does not depend on the sample: exact in every step.
            covariance_kl = kl - 0.5 * strategy.mean_basis_quadratic_form()
            torch.testing.assert_close(covariance_kl, exact_covariance_kl, rtol=1e-10, atol=1e-10)
            draws[i] = kl
    standard_error = draws.std() / math.sqrt(num_draws)
    assert draws.std() > 0.05 * exact_kl.abs()  # the estimate does vary: 4 of 24 rows
    assert (draws.mean() - exact_kl).abs() < 3 * standard_error, (draws.mean(), exact_kl, standard_error)
    # The forward pass and the KL of one step share their sample.
    model(X)
    torch.testing.assert_close(strategy.kl_divergence(), strategy.kl_divergence(), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- robustness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_coinciding_covariance_points(dtype: torch.dtype) -> None:
    beta, alpha, X, y = _bases(12)
    duplicated = torch.cat([beta, beta[:3], beta[:1]])  # singular K_beta: 12 points, 8 distinct
    model = DecoupledGP(duplicated, alpha, num_kl_columns=6)
    _random_parameters(model, 13, scale=3.0)
    model.to(dtype)
    X, y = X.to(dtype), y.to(dtype)
    strategy = model.variational_strategy
    with torch.no_grad():
        K_beta = model.covar_module(strategy.inducing_points).to_dense()
    assert torch.linalg.matrix_rank(K_beta.double(), hermitian=True, atol=1e-8) < duplicated.size(0)

    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(0))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)  # H >= I: no jitter is ever needed
        model.train()
        for _ in range(5):
            optimizer.zero_grad()
            loss = -mll(model(X), y)
            loss.backward()
            optimizer.step()
            assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        mean, covariance, kl = eval_process(model, X)
        with torch.no_grad():
            H_factor = strategy._inner_cholesky(model.covar_module(strategy.inducing_points).to_dense())
    assert torch.isfinite(mean).all() and torch.isfinite(covariance).all() and torch.isfinite(kl)
    H = H_factor.double() @ H_factor.double().mT
    assert torch.linalg.eigvalsh(H).min() >= 1.0 - 1e-5
    with torch.no_grad():
        prior_variance = model.forward(X).variance
    assert (covariance.diagonal() <= prior_variance + 1e-5).all()


@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([3])])
def test_posterior_variance_never_exceeds_the_prior(batch_shape: torch.Size) -> None:
    beta, alpha, X, _ = _bases(14, num_beta=12)
    model = DecoupledGP(beta, alpha, batch_shape=batch_shape, linear=True)
    _random_parameters(model, 15, scale=10.0)  # a large B: strong variance reduction
    model.eval()
    with torch.no_grad():
        posterior = model(X)
        prior = model(X, prior=True)
        difference = prior.covariance_matrix - posterior.covariance_matrix
    assert posterior.variance.shape == torch.Size([*batch_shape, X.size(0)])
    assert (posterior.variance <= prior.variance + 1e-12).all()
    assert (posterior.variance > 0).all()
    assert torch.linalg.eigvalsh(difference).min() >= -1e-10  # prior - posterior is PSD, not just its diagonal
    assert (prior.variance - posterior.variance).max() > 0.1 * prior.variance.max()
    # The training-mode (diagonal) variances are the same numbers.
    model.train()
    with torch.no_grad():
        training_variance = model(X).variance
    torch.testing.assert_close(training_variance, posterior.variance, rtol=1e-10, atol=1e-12)


def test_prior_call_returns_the_prior() -> None:
    beta, alpha, X, _ = _bases(16)
    model = DecoupledGP(beta, alpha, linear=True)
    _random_parameters(model, 17, scale=5.0)
    for training in (True, False):
        model.train(training)
        snapshot = cache_snapshot(model)
        with torch.no_grad():
            prior = model(X, prior=True)
            expected = model.forward(X)
        torch.testing.assert_close(prior.mean, expected.mean, rtol=0, atol=0)
        torch.testing.assert_close(prior.covariance_matrix, expected.covariance_matrix, rtol=0, atol=0)
        assert_same_caches(model, snapshot)
        with torch.no_grad():
            assert (prior.mean - model(X).mean).abs().max() > 0.1  # the posterior is elsewhere
