"""Fantasy models (``get_fantasy_model``) of the Kalman and dual strategies against the dense posterior of all the data,
in float64: closed-form conditioning on one, several and a batch of fantasy points, the original model unchanged, and
the errors of the strategies without conditioning."""

from __future__ import annotations

import functools
import itertools

import gpytorch
import pytest
import torch

from gpytorch_decoupled.optim import DualEStep
from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from tests import dual_problems, recursive_problems
from tests.dual_problems import DualGP, assert_same_state, state_snapshot
from tests.float64_problems import F64, bernoulli_likelihood, gaussian_likelihood, generator, randn
from tests.oracles import recursive_sparse_bound, recursive_sparse_predictive, titsias_optimal_qu
from tests.oracles.dual import dual_predictive, dual_site_targets, sites_to_summaries

TOLERANCE = 1e-9

#: (inputs batch, targets batch): one point, several, a sample batch of targets for shared inputs (BoTorch's
#: fantasize), and a sample batch over a batch of inputs.
FANTASY_SHAPES = [((), (), 1), ((), (), 5), ((), (4,), 3), ((2,), (3, 2), 2)]


def _fantasy_data(dims: int, inputs_batch: tuple, targets_batch: tuple, k: int, seed: int = 7):
    gen = generator(seed)
    x = 5.0 * torch.rand(*inputs_batch, k, dims, generator=gen, dtype=F64) - 2.5
    return x, randn(*targets_batch, k, gen=gen)


def _max_error(predictive: gpytorch.distributions.MultivariateNormal, mean, covariance) -> float:
    return max(
        (predictive.mean - mean).abs().max().item(), (predictive.covariance_matrix - covariance).abs().max().item()
    )


def _each_fantasy(x: torch.Tensor, y: torch.Tensor):
    """The index, inputs and targets of every member of a fantasy batch (the inputs broadcast over the targets)."""
    shape = torch.broadcast_shapes(x.shape[:-2], y.shape[:-1])
    x, y = x.expand(*shape, *x.shape[-2:]), y.expand(*shape, y.size(-1))
    for index in itertools.product(*(range(size) for size in shape)):
        yield index, x[index], y[index]


# ------------------------------------------------------------------------------------------------------------ Kalman
@pytest.mark.parametrize("inputs_batch, targets_batch, k", FANTASY_SHAPES)
@pytest.mark.parametrize("approximation, alpha", recursive_problems.MODELS)
def test_kalman_fantasy_is_the_batch_posterior_of_all_the_data(approximation, alpha, inputs_batch, targets_batch, k):
    X, y, Z = recursive_problems.problem()
    model, likelihood = recursive_problems.make_model(Z, approximation, alpha, constant_mean=True)
    blocks = recursive_problems.blocks_of(X.size(0), 12)
    recursive_problems.stream(model, X, y, blocks)
    before = state_snapshot(model)
    x_new, y_new = _fantasy_data(1, inputs_batch, targets_batch, k)
    fantasy = model.get_fantasy_model(x_new, y_new)
    assert_same_state(model, before)
    assert type(fantasy) is type(model) and fantasy is not model
    assert fantasy.variational_strategy.num_observed == X.size(0) + k
    X_star = torch.linspace(-3.2, 3.2, 9, dtype=F64).unsqueeze(-1)
    predictive = fantasy.eval()(X_star)
    batch_shape = torch.broadcast_shapes(inputs_batch, targets_batch)
    assert predictive.mean.shape == (*batch_shape, 9)
    bound = fantasy.variational_strategy.recursive_bound
    worst = 0.0
    for index, x_i, y_i in _each_fantasy(x_new, y_new):
        all_X, all_y = torch.cat([X, x_i]), torch.cat([y, y_i])
        dense = recursive_problems.dense_blocks(model, all_X, X_star)
        residual = all_y - dense["mean_f"]
        all_blocks = [*blocks, torch.arange(X.size(0), X.size(0) + k)] if approximation == "pitc" else None
        matrices = dense["K_uu"], dense["K_uf"], dense["K_ff"]
        mean, covariance = recursive_sparse_predictive(
            *matrices,
            dense["K_us"],
            dense["K_ss"],
            residual,
            recursive_problems.NOISE,
            approximation,
            alpha,
            all_blocks,
        )
        member = gpytorch.distributions.MultivariateNormal(predictive.mean[index], predictive.covariance_matrix[index])
        worst = max(worst, _max_error(member, dense["mean_s"] + mean, covariance))
        expected_bound = recursive_sparse_bound(
            *matrices, residual, recursive_problems.NOISE, approximation, alpha, all_blocks
        )
        torch.testing.assert_close(bound[index], expected_bound.detach(), rtol=1e-9, atol=1e-9)
    assert worst <= TOLERANCE, worst


def test_kalman_fantasy_with_known_noise_and_its_errors():
    X, y, Z = recursive_problems.problem()
    model, likelihood = recursive_problems.make_model(Z, "fitc")
    model.variational_strategy.update(X, y)
    x_new, y_new = _fantasy_data(1, (), (), 4)
    noise = torch.tensor([0.01, 0.2, 0.05, 1.0], dtype=F64)
    fantasy = model.get_fantasy_model(x_new, y_new, noise=noise)
    X_star = torch.linspace(-3, 3, 5, dtype=F64).unsqueeze(-1)
    dense = recursive_problems.dense_blocks(model, torch.cat([X, x_new]), X_star)
    all_noise = torch.cat([torch.full((X.size(0),), recursive_problems.NOISE, dtype=F64), noise])
    mean, covariance = recursive_sparse_predictive(
        dense["K_uu"],
        dense["K_uf"],
        dense["K_ff"],
        dense["K_us"],
        dense["K_ss"],
        torch.cat([y, y_new]),
        all_noise,
        "fitc",
    )
    assert _max_error(fantasy.eval()(X_star), mean, covariance) <= TOLERANCE
    before = state_snapshot(model)
    with pytest.raises(ValueError, match="targets"):
        model.get_fantasy_model(x_new, y_new[:3])
    with pytest.raises(ValueError, match="noise"):
        model.get_fantasy_model(x_new, y_new, noise=-noise)
    with pytest.raises(ValueError, match="noise .* must broadcast"):
        model.get_fantasy_model(x_new, y_new.expand(2, 3, 4), noise=noise[:3])
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        model.get_fantasy_model(x_new, y_new, likelihood=gpytorch.likelihoods.BernoulliLikelihood())
    assert_same_state(model, before)


def test_kalman_fantasy_of_a_fantasy_and_float32():
    X, y, Z = recursive_problems.problem()
    model, likelihood = recursive_problems.make_model(Z)
    model.variational_strategy.update(X[:30], y[:30])
    nested = model.get_fantasy_model(X[30:45], y[30:45]).get_fantasy_model(X[45:], y[45:])
    reference, _ = recursive_problems.make_model(Z)
    reference.variational_strategy.update(X, y)
    X_star = torch.linspace(-3, 3, 5, dtype=F64).unsqueeze(-1)
    expected = reference.eval()(X_star)
    assert _max_error(nested.eval()(X_star), expected.mean, expected.covariance_matrix) <= TOLERANCE
    # The state stays float64 in a float32 model; the fantasy follows the model's dtype.
    single = model.float().get_fantasy_model(X[30:].float(), y[30:].float())
    assert single.variational_strategy.statistics.information_vector.dtype == F64
    assert (single.eval()(X_star.float()).mean.double() - expected.mean).abs().max() < 1e-4


# -------------------------------------------------------------------------------------------------------------- Dual
def _dual_model(per_datum: bool = False, constant_mean: float | None = 0.3):
    Z, X, y = dual_problems.problem()
    model = DualGP(Z, datum_inputs=X if per_datum else None, constant_mean=constant_mean)
    return model, gaussian_likelihood(), Z, X, y


def _dense_dual_predictive(model, site_mean, site_precision, X_star):
    K_uu, K_us, k_ss = dual_problems.oracle_blocks(model, X_star)
    kernel = model.covar_module
    K_ss = kernel(X_star).to_dense()
    summaries = sites_to_summaries(K_uu, site_mean, site_precision)
    return dual_predictive(K_uu, K_us, K_ss, *summaries, dual_problems.prior_mean(model, X_star.size(0)))


@pytest.mark.parametrize("inputs_batch, targets_batch, k", FANTASY_SHAPES)
def test_dual_fantasy_adds_the_gaussian_sites_of_the_new_points(inputs_batch, targets_batch, k):
    model, likelihood, Z, X, y = _dual_model()
    site_mean, site_precision = dual_problems.random_sites(model, seed=3)
    before = state_snapshot(model)
    x_new, y_new = _fantasy_data(2, inputs_batch, targets_batch, k)
    fantasy = model.get_fantasy_model(x_new, y_new, likelihood=likelihood)
    assert_same_state(model, before)
    X_star = 5.0 * torch.rand(8, 2, generator=generator(11), dtype=F64) - 2.5
    predictive = fantasy.eval()(X_star)
    assert predictive.mean.shape == (*torch.broadcast_shapes(inputs_batch, targets_batch), 8)
    noise = likelihood.noise.detach()[0]
    worst = 0.0
    for index, x_i, y_i in _each_fantasy(x_new, y_new):
        K_uu, K_un, _ = dual_problems.oracle_blocks(model, x_i)
        projections = torch.linalg.solve(K_uu, K_un)  # a_i = K_uu^{-1} k_ui
        # lambda_1 = (y - m_0) / sigma^2, lambda_2 = 1 / sigma^2 for every new point
        all_mean = site_mean + projections @ (y_i - 0.3) / noise
        all_precision = site_precision + projections @ projections.mT / noise
        mean, covariance = _dense_dual_predictive(model, all_mean, all_precision, X_star)
        member = gpytorch.distributions.MultivariateNormal(predictive.mean[index], predictive.covariance_matrix[index])
        worst = max(worst, _max_error(member, mean, covariance))
    assert worst <= TOLERANCE, worst


@pytest.mark.parametrize("per_datum", [False, True])
def test_dual_fantasy_after_a_converged_e_step_is_titsias_posterior_of_all_the_data(per_datum):
    model, likelihood, Z, X, y = _dual_model(per_datum, constant_mean=None)
    indices = torch.arange(X.size(0)) if per_datum else None
    DualEStep(model, likelihood, num_data=X.size(0)).step(X, y, indices)
    x_new, y_new = _fantasy_data(2, (), (), 6)
    fantasy = model.get_fantasy_model(x_new, y_new, likelihood=likelihood)
    all_X, all_y = torch.cat([X, x_new]), torch.cat([y, y_new])
    K_uu, K_uf, _ = dual_problems.oracle_blocks(model, all_X)
    m, S = titsias_optimal_qu(K_uu, K_uf, all_y, likelihood.noise.detach()[0])
    q = fantasy.variational_strategy.variational_distribution
    assert max((q.mean - m).abs().max().item(), (q.covariance_matrix - S).abs().max().item()) <= TOLERANCE
    if per_datum:
        assert fantasy.variational_strategy._variational_distribution.datum_inputs.size(0) == X.size(0) + 6


def test_dual_fantasy_for_a_non_gaussian_likelihood_is_one_e_step_at_the_new_points():
    """Bernoulli: the new sites are the E-step's targets (r = 1) at the current marginals of the new points."""
    model, _, Z, X, y = _dual_model(constant_mean=None)
    site_mean, site_precision = dual_problems.random_sites(model, seed=5)
    likelihood = bernoulli_likelihood(dual_problems.GH_POINTS)
    x_new, _ = _fantasy_data(2, (), (), 4)
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    fantasy = model.get_fantasy_model(x_new, labels, likelihood=likelihood)
    K_uu, K_un, k_nn = dual_problems.oracle_blocks(model, x_new)
    m, S = (value.detach() for value in dual_problems.q_of(model))
    expected = dual_problems.expected_loglik(likelihood, labels)
    first, second = dual_site_targets(
        K_uu.detach(),
        K_un.detach(),
        k_nn.detach(),
        m,
        S,
        expected,
        min_curvature=model.variational_strategy.DEFAULT_MIN_CURVATURE,
    )
    projections = torch.linalg.solve(K_uu, K_un).detach()
    new_mean, new_precision = fantasy.variational_strategy._variational_distribution()
    torch.testing.assert_close(new_mean, site_mean + projections @ first, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(
        new_precision, site_precision + (projections * second) @ projections.mT, rtol=0, atol=TOLERANCE
    )
    # A sample batch of labels gives a batch of sites (the precisions depend on the labels here).
    batched = model.get_fantasy_model(x_new, torch.stack([labels, 1 - labels]), likelihood=likelihood)
    assert batched.variational_strategy._variational_distribution.site_precision.shape == (2, 10, 10)


def test_dual_fantasy_errors():
    model, likelihood, Z, X, y = _dual_model()
    x_new, y_new = _fantasy_data(2, (), (), 3)
    before = state_snapshot(model)
    with pytest.raises(ValueError, match="likelihood"):
        model.get_fantasy_model(x_new, y_new)
    with pytest.raises(ValueError, match="noise is for Gaussian"):
        model.get_fantasy_model(x_new, y_new, likelihood=bernoulli_likelihood(), noise=torch.ones(3, dtype=F64))
    with pytest.raises(ValueError, match="inputs"):
        model.get_fantasy_model(x_new[:, :1], y_new, likelihood=likelihood)
    with pytest.raises(ValueError, match="labels|values"):
        model.get_fantasy_model(x_new, y_new, likelihood=bernoulli_likelihood())
    assert_same_state(model, before)
    per_datum, likelihood, *_ = _dual_model(per_datum=True)
    with pytest.raises(NotImplementedError, match="per-datum"):
        per_datum.get_fantasy_model(x_new, y_new.expand(2, 3), likelihood=likelihood)


# ---------------------------------------------------------------------------------------- strategies without them
class _DecoupledGP(gpytorch.models.ApproximateGP):
    def __init__(self, strategy_factory, Z):
        super().__init__(strategy_factory(self, Z))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _decoupled(model, Z):
    return DecoupledVariationalStrategy(
        model, Z[:4], DecoupledVariationalDistribution(Z.size(0), 4), mean_inducing_points=Z
    )


def _residual(strategy_cls, model, Z):
    q = gpytorch.variational.CholeskyVariationalDistribution(4)
    return strategy_cls(model, Z[:4], q, mean_inducing_points=Z)


@pytest.mark.parametrize(
    "factory",
    [
        _decoupled,
        functools.partial(_residual, HybridVariationalStrategy),
        functools.partial(_residual, OrthogonallyDecoupledVariationalStrategy),
    ],
    ids=["decoupled", "hybrid", "orthogonal"],
)
def test_strategies_without_conditioning_say_which_have_it(factory):
    model = _DecoupledGP(factory, torch.randn(8, 1))
    with pytest.raises(NotImplementedError, match="KalmanVariationalStrategy and DualVariationalStrategy"):
        model.get_fantasy_model(torch.randn(2, 1), torch.randn(2))


# ------------------------------------------------------------------------------------------------------ gradients
def _kalman_fitted():
    X, y, Z = recursive_problems.problem()
    model, _ = recursive_problems.make_model(Z, "fitc", constant_mean=True)
    model.variational_strategy.update(X, y)
    return model.eval(), 1


def _dual_fitted():
    model, likelihood, Z, X, y = _dual_model()
    DualEStep(model, likelihood, num_data=X.size(0)).step(X, y)
    model.likelihood = likelihood  # read by get_fantasy_model, as GPyTorch's fantasy models read it
    return model.eval(), 2


@pytest.mark.parametrize("fitted", [_kalman_fitted, _dual_fitted], ids=["kalman", "dual"])
def test_fantasy_predictions_are_differentiable_in_the_new_inputs_and_targets(fitted):
    """BoTorch differentiates acquisition values through fantasies: the gradients are those of the closed form."""
    model, dims = fitted()
    x_star = torch.full((2, dims), 0.3, dtype=F64)
    x_star[1] = -1.1

    def predictive(x_new, y_new):
        fantasy = model.get_fantasy_model(x_new, y_new)
        output = fantasy(x_star)
        return output.mean, output.covariance_matrix

    x_new, y_new = _fantasy_data(dims, (), (2,), 2)
    inputs = (x_new.requires_grad_(True), y_new.requires_grad_(True))
    # (the package's Cholesky Function is not built for gradcheck's undefined-output-gradient probe)
    assert torch.autograd.gradcheck(predictive, inputs, check_undefined_grad=False)
    # A fantasy of a fantasy (multi-step lookahead) keeps the graph of the first.
    nested = model.get_fantasy_model(x_new, y_new[0]).get_fantasy_model(x_new + 0.5, y_new[1])
    gradients = torch.autograd.grad(nested(x_star).mean.sum(), inputs)
    assert all(gradient.abs().sum() > 0 for gradient in gradients)
