"""FastNaturalVariationalDistribution against GPyTorch's NaturalVariationalDistribution and dense oracles (float64)."""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.utils.warnings import NumericalWarning
from linear_operator.operators import DenseLinearOperator, DiagLinearOperator
from linear_operator.utils.errors import NotPSDError

from gpytorch_decoupled.linalg import reset_jitter_warnings
from gpytorch_decoupled.variational import FastNaturalVariationalDistribution
from gpytorch_decoupled.variational._natural_multivariate_normal import _NaturalMultivariateNormal
from tests.float64_problems import F64, generator, randn, random_spd

M = 6
BATCH = torch.Size([3])


def _set_natural(distribution, mean: torch.Tensor, covariance: torch.Tensor) -> None:
    precision = torch.linalg.inv(covariance)
    with torch.no_grad():
        distribution.natural_vec.copy_((precision @ mean.unsqueeze(-1)).squeeze(-1))
        distribution.natural_mat.copy_(-0.5 * precision)


def _pair(batch_shape=BATCH, seed: int = 0):
    """GPyTorch's and this package's distribution with the same random natural parameters."""
    gen = generator(seed)
    mean = randn(*batch_shape, M, gen=gen)
    covariance = torch.stack([random_spd(M, gen) for _ in range(batch_shape.numel())]).reshape(*batch_shape, M, M)
    ours = FastNaturalVariationalDistribution(M, batch_shape=batch_shape).to(F64)
    theirs = gpytorch.variational.NaturalVariationalDistribution(M, batch_shape=batch_shape).to(F64)
    for distribution in (ours, theirs):
        _set_natural(distribution, mean, covariance)
    return ours, theirs, mean, covariance


def _kl_oracle(mean, covariance, prior_mean, prior_covariance) -> torch.Tensor:
    solved = torch.linalg.solve(prior_covariance, covariance)
    difference = prior_mean - mean
    quadratic = (difference.unsqueeze(-2) @ torch.linalg.solve(prior_covariance, difference.unsqueeze(-1))).flatten(-2)
    logdets = torch.logdet(prior_covariance) - torch.logdet(covariance)
    return 0.5 * (solved.diagonal(dim1=-2, dim2=-1).sum(-1) + quadratic.squeeze(-1) - M + logdets)


def test_mean_and_covariance_equal_gpytorch_and_the_dense_inverse() -> None:
    ours, theirs, mean, covariance = _pair()
    q, reference = ours(), theirs()
    assert isinstance(q, _NaturalMultivariateNormal)
    torch.testing.assert_close(q.mean, mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q.covariance_matrix, covariance, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q.mean, reference.mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q.covariance_matrix, reference.covariance_matrix, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q.covariance_logdet, torch.logdet(covariance), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prior", ["whitened", "dense"])
def test_kl_equals_the_dense_oracle_and_gpytorch(prior: str) -> None:
    ours, theirs, mean, covariance = _pair()
    gen = generator(1)
    if prior == "whitened":
        prior_mean, prior_covariance = torch.zeros(*BATCH, M, dtype=F64), torch.eye(M, dtype=F64).expand(*BATCH, M, M)
        p = MultivariateNormal(prior_mean, DiagLinearOperator(torch.ones(*BATCH, M, dtype=F64)))
    else:
        prior_mean, prior_covariance = randn(M, gen=gen), random_spd(M, gen)
        p = MultivariateNormal(prior_mean, DenseLinearOperator(prior_covariance))
    kl = torch.distributions.kl_divergence(ours(), p)
    assert kl.shape == BATCH
    torch.testing.assert_close(kl, _kl_oracle(mean, covariance, prior_mean, prior_covariance), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(theirs(), p), rtol=1e-10, atol=1e-12)


def test_kl_broadcasts_against_a_prior_with_more_batch_dimensions() -> None:
    # An unwhitened strategy's prior at inducing points expanded to a batch of data sets has batch dimensions that q
    # lacks (this raised "Tensors must have same number of dimensions").
    ours, theirs, mean, covariance = _pair(batch_shape=torch.Size([]))
    gen = generator(2)
    prior_mean = randn(*BATCH, M, gen=gen)
    prior_covariance = torch.stack([random_spd(M, gen) for _ in range(BATCH.numel())])
    p = MultivariateNormal(prior_mean, DenseLinearOperator(prior_covariance))
    kl = torch.distributions.kl_divergence(ours(), p)
    assert kl.shape == BATCH
    torch.testing.assert_close(kl, _kl_oracle(mean, covariance, prior_mean, prior_covariance), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(theirs(), p), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "strategy_cls",
    [gpytorch.variational.UnwhitenedVariationalStrategy, gpytorch.variational.VariationalStrategy],
    ids=lambda cls: cls.__name__,
)
def test_batched_data_under_gpytorch_strategies_equals_gpytorchs_distribution(strategy_cls) -> None:
    losses = []
    for distribution_cls in (gpytorch.variational.NaturalVariationalDistribution, FastNaturalVariationalDistribution):
        model, likelihood, x, y = _svgp_problem(distribution_cls, strategy_cls=strategy_cls)
        x, y = torch.stack([x, x + 0.1, x - 0.2]), torch.stack([y, y, -y])
        loss = -gpytorch.mlls.VariationalELBO(likelihood, model, num_data=40)(model(x), y)
        loss.sum().backward()
        losses.append((loss.detach(), model.variational_strategy._variational_distribution.natural_vec.grad))
    (loss, gradient), (fast_loss, fast_gradient) = losses
    assert fast_loss.shape == (3,)
    torch.testing.assert_close(fast_loss, loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast_gradient, gradient, rtol=1e-8, atol=1e-10)


class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, inducing_points: torch.Tensor, distribution_cls, strategy_cls=None):
        distribution = distribution_cls(inducing_points.size(-2))
        strategy_cls = strategy_cls or gpytorch.variational.VariationalStrategy
        super().__init__(strategy_cls(self, inducing_points, distribution))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _svgp_problem(distribution_cls, seed: int = 2, strategy_cls=None):
    gen = generator(seed)
    x = torch.linspace(-2, 2, 40, dtype=F64).unsqueeze(-1)
    y = torch.sin(3 * x.squeeze(-1)) + 0.1 * randn(40, gen=gen)
    torch.manual_seed(0)
    model = _SVGP(x[::4].clone(), distribution_cls, strategy_cls).to(F64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(F64)
    return model, likelihood, x, y


@pytest.mark.parametrize("objective", [gpytorch.mlls.VariationalELBO, gpytorch.mlls.PredictiveLogLikelihood])
def test_natural_gradients_and_ngd_trajectory_equal_gpytorch(objective) -> None:
    runs = []
    for distribution_cls in (gpytorch.variational.NaturalVariationalDistribution, FastNaturalVariationalDistribution):
        model, likelihood, x, y = _svgp_problem(distribution_cls)
        mll = objective(likelihood, model, num_data=40)
        ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=40, lr=0.5)
        adam = torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.05)
        losses, gradients = [], []
        for _ in range(4):
            ngd.zero_grad()
            adam.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            gradients.append([p.grad.clone() for p in model.parameters()])
            losses.append(loss.detach())
            ngd.step()
            adam.step()
        runs.append((torch.stack(losses), gradients))
    (losses, gradients), (fast_losses, fast_gradients) = runs
    torch.testing.assert_close(fast_losses, losses, rtol=1e-10, atol=1e-12)
    for step, fast_step in zip(gradients, fast_gradients):
        for gradient, fast_gradient in zip(step, fast_step):
            torch.testing.assert_close(fast_gradient, gradient, rtol=1e-8, atol=1e-10)


def test_one_unit_ngd_step_is_the_optimum_for_a_gaussian_likelihood() -> None:
    model, likelihood, x, y = _svgp_problem(FastNaturalVariationalDistribution)
    for p in [*model.hyperparameters(), *likelihood.parameters()]:
        p.requires_grad_(False)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=40)
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=40, lr=1.0)
    for _ in range(2):
        ngd.zero_grad()
        (-mll(model(x), y)).backward()
        ngd.step()
    # At the optimum the natural gradient (the gradient in the expectation parameters) vanishes.
    ngd.zero_grad()
    (-mll(model(x), y)).backward()
    for parameter in model.variational_parameters():
        torch.testing.assert_close(parameter.grad, torch.zeros_like(parameter), rtol=0, atol=1e-9)
    # And the optimum is the collapsed (Titsias) solution: whitened S_w = (I + A A^T / noise)^-1.
    strategy = model.variational_strategy
    with torch.no_grad():
        z = strategy.inducing_points
        chol = torch.linalg.cholesky(model.covar_module(z).to_dense() + strategy.jitter_val * torch.eye(10, dtype=F64))
        A = torch.linalg.solve_triangular(chol, model.covar_module(z, x).to_dense(), upper=False)
        expected = torch.linalg.inv(torch.eye(10, dtype=F64) + A @ A.mT / likelihood.noise)
        torch.testing.assert_close(strategy.variational_distribution.covariance_matrix, expected, rtol=1e-8, atol=1e-10)


def test_state_dict_is_interchangeable_with_gpytorch() -> None:
    ours, theirs, _, _ = _pair()
    fresh = FastNaturalVariationalDistribution(M, batch_shape=BATCH).to(F64)
    fresh.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(fresh().covariance_matrix, theirs().covariance_matrix, rtol=1e-10, atol=1e-12)
    back = gpytorch.variational.NaturalVariationalDistribution(M, batch_shape=BATCH).to(F64)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back().mean, ours().mean, rtol=1e-10, atol=1e-12)


def test_non_negative_definite_natural_matrix_raises_with_a_hint_and_changes_nothing() -> None:
    ours, _, _, _ = _pair()
    with torch.no_grad():
        ours.natural_mat[1].mul_(-1.0)  # positive definite: the precision -2 Theta_2 is negative definite
    before = {name: value.clone() for name, value in ours.state_dict().items()}
    reset_jitter_warnings()
    with pytest.raises(NotPSDError, match="gpytorch.optim.NGD"), warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)
        ours()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_singular_precision_gets_jitter_once_and_consistent_gradients() -> None:
    gen = generator(4)
    factor = randn(M, M, gen=gen)
    factor[-1] = 0.0  # the last row and column of the precision vanish: an exactly zero Cholesky pivot
    ours = FastNaturalVariationalDistribution(M).to(F64)
    with torch.no_grad():
        ours.natural_vec.copy_(randn(M, gen=gen))
        ours.natural_mat.copy_(-0.5 * factor @ factor.mT)
    reset_jitter_warnings()
    with pytest.warns(NumericalWarning, match="natural precision"):
        q = ours()
    # log|S| of the factorized (jittered) precision, and S its inverse.
    torch.testing.assert_close(q.covariance_logdet, torch.logdet(q.covariance_matrix), rtol=1e-6, atol=1e-8)
    # The log-determinant's expectation-parameter gradient is the precision actually factorized, S^-1.
    q.covariance_logdet.backward()
    expected = torch.linalg.inv(q.covariance_matrix.detach())
    torch.testing.assert_close(ours.natural_mat.grad, expected, rtol=1e-6, atol=1e-6)


def test_rebuilt_distributions_fall_back_to_the_generic_kl() -> None:
    ours, theirs, _, _ = _pair()
    prior = MultivariateNormal(torch.zeros(M, dtype=F64), DiagLinearOperator(torch.ones(M, dtype=F64)))
    expanded = ours().expand(torch.Size([2, *BATCH]))
    assert expanded.covariance_logdet is None
    torch.testing.assert_close(
        torch.distributions.kl_divergence(expanded, prior),
        torch.distributions.kl_divergence(theirs(), prior).expand(2, *BATCH),
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_natural_gradients_equal_eager(dtype) -> None:
    # The compiled training step differentiates the moments with torch.autograd.grad inside the graph. torch 2.11's
    # Dynamo gave zero gradients when the Function returned its float64 outputs through an identity ``.to``.
    q = FastNaturalVariationalDistribution(4).to(dtype)
    gen = generator(3)
    with torch.no_grad():
        q.natural_mat.copy_(-0.5 * random_spd(4, gen=gen, floor=1.0).to(dtype))
        q.natural_vec.copy_(randn(4, gen=gen).to(dtype))
    weights = randn(4, 4, gen=gen).to(dtype)

    def gradients():
        mean, covariance, logdet = q.moments()
        loss = mean.pow(2).sum() + (weights * covariance).sum() + 0.3 * logdet
        return torch.autograd.grad(loss, [q.natural_vec, q.natural_mat])

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(gradients, backend="aot_eager", fullgraph=True)()
    for value, expected in zip(compiled, gradients(), strict=True):
        assert expected.abs().max() > 0.1
        torch.testing.assert_close(value, expected, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=0)
