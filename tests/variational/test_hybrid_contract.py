"""The GPyTorch contract for HybridVariationalStrategy (both objectives, both q's, batched latents), its eval caches,
its input validation and the exact Hybrid <-> ODVGP map of :func:`convert_mean_basis`."""

from __future__ import annotations

import unittest
import unittest.mock
from functools import partial

import gpytorch
import pytest
import torch

from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
    convert_mean_basis,
)
from tests.variational.decoupled_contract_test_case import DecoupledStrategyContractTestCase, residual_mean_strategy
from tests.variational.mean_basis_cases import assert_same_process, eval_process, set_whitened_q

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


hybrid_strategy = partial(residual_mean_strategy, HybridVariationalStrategy)


class TestHybridContract(DecoupledStrategyContractTestCase, unittest.TestCase):
    @property
    def strategy_cls(self):
        return hybrid_strategy

    def test_eval_predictions_reuse_the_cached_factors(self):
        model, _ = self._fitted_model(batch_shape=self.batch_shape)
        strategy = model.variational_strategy
        test_x, _ = self._data(torch.get_default_dtype())
        first = self._predict(model, test_x)
        cached = dict(strategy._memoize_cache)
        self.assertTrue(cached, "eval mode cached nothing")
        # The eval cache holds the Cholesky factor of K_beta and the residual coordinates L_b^-1 K_bg a_g: a second
        # prediction neither factors nor re-evaluates K_beta-gamma.
        with (
            unittest.mock.patch("torch.linalg.cholesky_ex", wraps=torch.linalg.cholesky_ex) as cholesky,
            unittest.mock.patch.object(
                strategy, "_set_residual_coordinates", wraps=strategy._set_residual_coordinates
            ) as residual,
        ):
            second = self._predict(model, test_x)
            subset = self._predict(model, test_x[:5])
            third = self._predict(model, test_x)
        self.assertEqual(cholesky.call_count, 0)
        self.assertEqual(residual.call_count, 0)
        # The first pass evaluates k_x-gamma fused with K_beta-gamma, later ones alone: equal up to rounding.
        self._assert_same_prediction(second, first, rtol=1e-5, atol=1e-6)
        self._assert_same_prediction(subset, (second[0][..., :5], second[1][..., :5, :5]), rtol=1e-5, atol=1e-6)
        self._assert_same_prediction(third, second, rtol=0, atol=0)
        for key, value in cached.items():
            self.assertIs(strategy._memoize_cache[key], value, msg=f"cache entry {key} was recomputed")


class TestHybridPredictiveContract(TestHybridContract):
    @property
    def mll_cls(self):
        return gpytorch.mlls.PredictiveLogLikelihood


class TestHybridNaturalContract(TestHybridContract):
    @property
    def distribution_cls(self):
        return gpytorch.variational.NaturalVariationalDistribution


class TestHybridBatchContract(TestHybridContract):
    @property
    def batch_shape(self):
        return torch.Size([3])


# ------------------------------------------------------------------------------------------ float64 test models
class MeanBasisGP(gpytorch.models.ApproximateGP):
    """A float64 hybrid or orthogonal model on fixed bases; the same seed gives the same hyperparameters."""

    def __init__(self, strategy_cls, distribution_cls, beta, gamma, num_kl_columns=None):
        q_beta = distribution_cls(beta.size(-2))
        super().__init__(strategy_cls(self, beta, q_beta, gamma, num_kl_columns=num_kl_columns, jitter_val=1e-10))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.double()

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    grid = torch.cartesian_prod(*(2 * [torch.linspace(-2.0, 2.0, 4, dtype=F64)]))
    beta = grid[::2] + 0.05 * torch.randn(8, 2, generator=gen, dtype=F64)
    gamma = 4.0 * torch.rand(20, 2, generator=gen, dtype=F64) - 2.0
    X = 4.4 * torch.rand(40, 2, generator=gen, dtype=F64) - 2.2
    y = torch.sin(1.5 * X[:, 0]) + 0.5 * torch.cos(2.0 * X[:, 1]) + 0.2 * torch.randn(40, generator=gen, dtype=F64)
    return beta, gamma, X, y


def _random_state(model: MeanBasisGP, seed: int) -> None:
    """Moves every hyperparameter and both variational blocks away from their initial values, reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    strategy = model.variational_strategy
    m_beta = strategy.inducing_points.size(-2)
    with torch.no_grad():
        model.covar_module.base_kernel.raw_lengthscale.fill_(0.3)
        model.covar_module.raw_outputscale.fill_(0.4)
        model.mean_module.constant.fill_(0.25)
        strategy.mean_coefficients.copy_(torch.randn(strategy.mean_coefficients.shape, generator=gen, dtype=F64))
        m_w = torch.randn(m_beta, generator=gen, dtype=F64)
        A = 0.3 * torch.randn(m_beta, m_beta, generator=gen, dtype=F64)
        S_w = A @ A.mT + 0.2 * torch.eye(m_beta, dtype=F64)  # cond(S_w) ~ 10: the natural parameters are exact
    set_whitened_q(model, m_w, S_w)
    strategy.variational_params_initialized.fill_(1)


# ----------------------------------------------------------------------------------------- convert_mean_basis
@pytest.mark.parametrize(
    "source_q, target_q",
    [
        (gpytorch.variational.CholeskyVariationalDistribution, gpytorch.variational.CholeskyVariationalDistribution),
        (gpytorch.variational.CholeskyVariationalDistribution, gpytorch.variational.NaturalVariationalDistribution),
        (gpytorch.variational.NaturalVariationalDistribution, gpytorch.variational.CholeskyVariationalDistribution),
    ],
)
def test_convert_mean_basis_round_trip_is_exact(source_q, target_q) -> None:
    beta, gamma, X, _ = _problem(3)
    hybrid = MeanBasisGP(HybridVariationalStrategy, source_q, beta, gamma)
    _random_state(hybrid, 4)
    orthogonal = MeanBasisGP(OrthogonallyDecoupledVariationalStrategy, target_q, beta + 0.3, gamma - 0.3)
    back = MeanBasisGP(HybridVariationalStrategy, source_q, beta - 0.2, gamma + 0.2)
    expected = eval_process(hybrid, X)
    assert expected[2].item() > 1.0  # a process well away from the prior, so that a wrong shift shows

    convert_mean_basis(hybrid.variational_strategy, orthogonal.variational_strategy)
    assert_same_process(eval_process(orthogonal, X), expected)
    convert_mean_basis(orthogonal.variational_strategy, back.variational_strategy)
    assert_same_process(eval_process(back, X), expected)
    assert_same_process(eval_process(hybrid, X), expected, tol=0.0)  # the source is left as it was
    for name, value in hybrid.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=1e-10, atol=1e-10, msg=name)

    # The training-mode objective agrees too (exact KL: num_kl_columns=None).
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    y = torch.sin(X[:, 0])
    elbos = []
    for model in (hybrid, orthogonal, back):
        model.train()
        with torch.no_grad():
            elbos.append(gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(0))(model(X), y))
    torch.testing.assert_close(elbos[1], elbos[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(elbos[2], elbos[0], rtol=1e-10, atol=1e-10)


def test_convert_mean_basis_after_sampled_kl_steps() -> None:
    # A trained model whose KL rows were sampled carries its generator's state (module extra state); a fresh target
    # has none. The generator is not part of the process: the conversion maps the process and leaves it alone.
    beta, gamma, X, y = _problem(6)
    hybrid = MeanBasisGP(
        HybridVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, beta, gamma, 4
    )
    _random_state(hybrid, 7)
    hybrid.variational_strategy.mean_basis.exact_kl_size = 0  # sample 4 of the 20 rows in training
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    hybrid.train()
    gpytorch.mlls.VariationalELBO(likelihood, hybrid, num_data=X.size(0))(hybrid(X), y).backward()
    assert hybrid.state_dict()["variational_strategy.mean_basis._extra_state"].numel() > 0  # the generator drew
    expected = eval_process(hybrid, X)
    orthogonal = MeanBasisGP(
        OrthogonallyDecoupledVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, beta, gamma, 4
    )
    convert_mean_basis(hybrid.variational_strategy, orthogonal.variational_strategy)
    assert_same_process(eval_process(orthogonal, X), expected)
    assert orthogonal.state_dict()["variational_strategy.mean_basis._extra_state"].numel() == 0


def test_convert_mean_basis_initializes_a_fresh_source_as_gpytorch_would() -> None:
    beta, gamma, X, _ = _problem(5)
    torch.manual_seed(0)
    hybrid = MeanBasisGP(HybridVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, beta, gamma)
    orthogonal = MeanBasisGP(
        OrthogonallyDecoupledVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, beta, gamma
    )
    assert not hybrid.variational_strategy.variational_params_initialized.item()
    convert_mean_basis(hybrid.variational_strategy, orthogonal.variational_strategy)
    assert hybrid.variational_strategy.variational_params_initialized.item()
    assert orthogonal.variational_strategy.variational_params_initialized.item()
    assert_same_process(eval_process(orthogonal, X), eval_process(hybrid, X))


class _DecoupledGP(gpytorch.models.ApproximateGP):
    def __init__(self, beta, alpha):
        q = DecoupledVariationalDistribution(alpha.size(-2), beta.size(-2))
        super().__init__(DecoupledVariationalStrategy(self, beta, q, alpha))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.double()

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, beta):
        q = gpytorch.variational.CholeskyVariationalDistribution(beta.size(-2))
        super().__init__(gpytorch.variational.VariationalStrategy(self, beta, q))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.double()

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def test_convert_mean_basis_refuses_other_strategies() -> None:
    beta, gamma, _, _ = _problem(6)
    hybrid = MeanBasisGP(HybridVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, beta, gamma)
    state = {name: value.clone() for name, value in hybrid.state_dict().items()}
    others = [
        _DecoupledGP(beta, gamma).variational_strategy,
        _SVGP(beta).variational_strategy,
        hybrid.variational_strategy._variational_distribution,
        None,
    ]
    for other in others:
        with pytest.raises(TypeError, match="convert_mean_basis maps between"):
            convert_mean_basis(hybrid.variational_strategy, other)
        with pytest.raises(TypeError, match="convert_mean_basis maps between"):
            convert_mean_basis(other, hybrid.variational_strategy)
    for name, value in hybrid.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_convert_mean_basis_to_a_mean_field_target_is_exact_or_refused() -> None:
    beta, gamma, X, _ = _problem(7)
    hybrid = MeanBasisGP(HybridVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, beta, gamma)
    _random_state(hybrid, 8)  # a full S_w
    orthogonal = MeanBasisGP(
        OrthogonallyDecoupledVariationalStrategy, gpytorch.variational.MeanFieldVariationalDistribution, beta, gamma
    )
    state = {name: value.clone() for name, value in orthogonal.state_dict().items()}
    with pytest.raises(ValueError, match="MeanFieldVariationalDistribution"):
        convert_mean_basis(hybrid.variational_strategy, orthogonal.variational_strategy)
    for name, value in orthogonal.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_convert_mean_basis_to_a_mean_field_target_with_a_diagonal_covariance_is_exact() -> None:
    beta, gamma, X, _ = _problem(9)
    hybrid = MeanBasisGP(HybridVariationalStrategy, gpytorch.variational.CholeskyVariationalDistribution, beta, gamma)
    _random_state(hybrid, 10)
    with torch.no_grad():
        chol = hybrid.variational_strategy._variational_distribution.chol_variational_covar
        chol.copy_(torch.diag_embed(chol.diagonal(dim1=-2, dim2=-1)))  # a diagonal S_w, which mean-field can hold
    orthogonal = MeanBasisGP(
        OrthogonallyDecoupledVariationalStrategy, gpytorch.variational.MeanFieldVariationalDistribution, beta, gamma
    )
    convert_mean_basis(hybrid.variational_strategy, orthogonal.variational_strategy)
    assert_same_process(eval_process(orthogonal, X), eval_process(hybrid, X))
