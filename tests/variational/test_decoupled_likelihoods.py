"""The Decoupled, Hybrid and orthogonally decoupled strategies train with GPyTorch's likelihoods: Gaussian regression,
Bernoulli classification and three-class softmax classification through the package's IndependentMultitask wrapper.

Small float64 problems, fixed seeds, a few dozen Adam steps each, with the training KL column-sampled, as in real use.
"""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch

from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    HybridVariationalStrategy,
    IndependentMultitaskVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)

F64 = torch.float64
KINDS = ["decoupled", "hybrid", "orthogonal"]


pytestmark = pytest.mark.usefixtures("single_thread")


class MeanBasisGP(gpytorch.models.ApproximateGP):
    """A float64 GP on a covariance basis ``beta`` and a mean basis ``gamma`` (``alpha`` for the decoupled kind)."""

    def __init__(self, kind: str, beta, gamma, batch_shape=torch.Size([]), num_kl_columns: int = 6):
        if kind == "decoupled":
            q = DecoupledVariationalDistribution(gamma.size(-2), beta.size(-2), batch_shape=batch_shape)
            strategy = DecoupledVariationalStrategy(self, beta, q, gamma, num_kl_columns=num_kl_columns)
        else:
            q = gpytorch.variational.CholeskyVariationalDistribution(beta.size(-2), batch_shape=batch_shape)
            strategy_cls = HybridVariationalStrategy if kind == "hybrid" else OrthogonallyDecoupledVariationalStrategy
            strategy = strategy_cls(self, beta, q, gamma, num_kl_columns=num_kl_columns)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch_shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(batch_shape=batch_shape))
        self.double()

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _train(model, likelihood, X, y, steps: int = 40, lr: float = 0.1) -> list[float]:
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(0))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)
    losses = []
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the sampled KL rows and the Monte-Carlo softmax likelihood
        for _ in range(steps):
            optimizer.zero_grad()
            loss = -mll(model(X), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses)
    return losses


def _assert_loss_decreases(losses: list[float]) -> None:
    assert sum(losses[-5:]) < sum(losses[:5]), (losses[:5], losses[-5:])
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kind", KINDS)
def test_gaussian_regression_trains(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    X = torch.linspace(-3.0, 3.0, 60, dtype=F64).unsqueeze(-1)
    y = torch.sin(2.0 * X[:, 0]) + 0.1 * torch.randn(60, generator=gen, dtype=F64)
    beta = torch.linspace(-2.8, 2.8, 6, dtype=F64).unsqueeze(-1)
    model = MeanBasisGP(kind, beta, X[::3].clone())  # 20 mean-basis points, 6 sampled KL rows per step
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    losses = _train(model, likelihood, X, y)
    _assert_loss_decreases(losses)
    model.eval()
    likelihood.eval()
    with torch.no_grad():
        prediction = likelihood(model(X))
    rmse = (prediction.mean - y).pow(2).mean().sqrt().item()
    assert rmse < 0.3 * y.std().item(), rmse
    assert (prediction.variance > 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_bernoulli_classification_trains(kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    X = 4.0 * torch.rand(120, 2, generator=gen, dtype=F64) - 2.0
    margin = X[:, 0] + 0.7 * X[:, 1]
    X = X[margin.abs() > 0.3][:60]  # separable with a margin
    labels = (X[:, 0] + 0.7 * X[:, 1] > 0).to(F64)
    assert 15 < labels.sum() < 45
    beta = torch.cartesian_prod(*(2 * [torch.linspace(-1.5, 1.5, 3, dtype=F64)]))
    model = MeanBasisGP(kind, beta, X[::3].clone())
    likelihood = gpytorch.likelihoods.BernoulliLikelihood().double()
    losses = _train(model, likelihood, X, labels)
    _assert_loss_decreases(losses)
    model.eval()
    likelihood.eval()
    with torch.no_grad():
        probabilities = likelihood(model(X)).mean
    accuracy = ((probabilities > 0.5).to(F64) == labels).to(F64).mean().item()
    assert accuracy > 0.9, accuracy


@pytest.mark.parametrize("kind", KINDS)
def test_softmax_classification_with_three_latents_trains(kind: str) -> None:
    gen = torch.Generator().manual_seed(2)
    centres = torch.tensor([[-1.5, -1.0], [1.5, -1.0], [0.0, 1.6]], dtype=F64)
    labels = torch.arange(3).repeat_interleave(20)
    X = centres[labels] + 0.4 * torch.randn(60, 2, generator=gen, dtype=F64)
    beta = torch.cartesian_prod(*(2 * [torch.linspace(-2.0, 2.0, 3, dtype=F64)]))
    model = MeanBasisGP(kind, beta, X[::3].clone(), batch_shape=torch.Size([3]))
    base = model.variational_strategy
    assert base.mean_coefficients.shape == torch.Size([3, 20])
    model.variational_strategy = IndependentMultitaskVariationalStrategy(base, num_tasks=3)
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_features=3, num_classes=3, mixing_weights=False).double()
    losses = _train(model, likelihood, X, labels)
    _assert_loss_decreases(losses)

    # In training the wrapper's KL is this step's (sampled) base KL summed over the three latents ...
    with torch.no_grad():
        model(X)
        torch.testing.assert_close(model.variational_strategy.kl_divergence(), base.kl_divergence().sum())
    model.eval()
    likelihood.eval()
    with torch.no_grad():
        output = model(X)
        # ... and in eval mode the exact one.
        base_kl = base.kl_divergence()
        torch.testing.assert_close(model.variational_strategy.kl_divergence(), base_kl.sum(), rtol=1e-12, atol=0)
    assert base_kl.shape == torch.Size([3]) and (base_kl > 0).all()
    assert output.mean.shape == torch.Size([60, 3])
    accuracy = (output.mean.argmax(-1) == labels).to(F64).mean().item()
    assert accuracy > 0.9, accuracy
