"""GPyTorch's approximate objectives with checked targets (:mod:`gpytorch_decoupled.mlls`): drop-in replacements
whose values and gradients are GPyTorch's, bit for bit, for every family, for multitask and softmax outputs, and which
refuse targets GPyTorch would read silently (the hostile-input cases are in ``tests/robustness``)."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch

from gpytorch_decoupled import mlls
from tests.float64_problems import gaussian_likelihood
from tests.robustness.entry_points import MODELS, N, SmallGP, data, points

OBJECTIVES = [
    (mlls.VariationalELBO, gpytorch.mlls.VariationalELBO),
    (mlls.PredictiveLogLikelihood, gpytorch.mlls.PredictiveLogLikelihood),
    (mlls.GammaRobustVariationalELBO, gpytorch.mlls.GammaRobustVariationalELBO),
]


def _svgp() -> SmallGP:
    def make(model):
        q = gpytorch.variational.CholeskyVariationalDistribution(4)
        return gpytorch.variational.VariationalStrategy(model, points(4, 1), q, learn_inducing_locations=True)

    return SmallGP(make).double()


FAMILIES = {"SVGP": _svgp, **MODELS}


def _value_and_gradients(objective_cls, model, likelihood, x, y):
    model.zero_grad()
    value = objective_cls(likelihood, model, num_data=10 * N, beta=0.7)(model(x), y)
    value.backward()
    return value.detach(), [parameter.grad.clone() for parameter in model.parameters()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("ours, theirs", OBJECTIVES, ids=lambda cls: cls.__module__.split(".")[0])
def test_value_and_gradients_are_gpytorchs(family, ours, theirs):
    x, y, _ = data()
    model, likelihood = FAMILIES[family](), gaussian_likelihood()
    with torch.no_grad():  # away from the prior, so that every term is nonzero
        for parameter in model.variational_strategy.parameters():
            parameter.add_(
                0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
            )
    state = copy.deepcopy(model.state_dict())
    torch.manual_seed(0)  # the generator of the sampled KL rows (Decoupled) is seeded from it at its first draw
    expected, expected_gradients = _value_and_gradients(theirs, model, likelihood, x, y)
    model.load_state_dict(state)
    torch.manual_seed(0)
    value, gradients = _value_and_gradients(ours, model, likelihood, x, y)
    assert torch.equal(value, expected)
    assert all(torch.equal(grad, other) for grad, other in zip(gradients, expected_gradients, strict=True))


class _MultitaskGP(gpytorch.models.ApproximateGP):
    """Two independent latent functions (GPyTorch's multitask wrapper around its SVGP strategy)."""

    def __init__(self, num_tasks: int = 2):
        q = gpytorch.variational.CholeskyVariationalDistribution(4, batch_shape=torch.Size([num_tasks]))
        strategy = gpytorch.variational.VariationalStrategy(self, points(4, 1).expand(num_tasks, 4, 2), q)
        super().__init__(gpytorch.variational.IndependentMultitaskVariationalStrategy(strategy, num_tasks))
        self.mean_module = gpytorch.means.ZeroMean(batch_shape=torch.Size([num_tasks]))
        self.covar_module = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([num_tasks]))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def test_multitask_targets_are_accepted_and_checked():
    x, y, _ = data()
    model = _MultitaskGP().double()
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2).double()
    targets = torch.stack([y, -y], dim=-1)
    objective = mlls.VariationalELBO(likelihood, model, num_data=N)
    assert torch.equal(
        objective(model(x), targets), gpytorch.mlls.VariationalELBO(likelihood, model, N)(model(x), targets)
    )
    with pytest.raises(ValueError, match=r"target must have shape \(12, 2\)"):
        objective(model(x), y)


def test_softmax_labels_have_one_entry_per_row():
    x, _, _ = data()
    model = _MultitaskGP(num_tasks=3).double()
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_features=3, num_classes=3, mixing_weights=False).double()
    labels = torch.arange(N) % 3
    objective = mlls.VariationalELBO(likelihood, model, num_data=N)
    assert torch.isfinite(objective(model(x), labels))
    with pytest.raises(ValueError, match=r"SoftmaxLikelihood takes class indices 0, \.\.\., 2"):
        objective(model(x), labels + 1)


def test_column_targets_are_refused_where_gpytorch_broadcasts_them():
    """``y`` of shape ``(B, 1)`` against an output of shape ``(B,)``: GPyTorch sums a B × B broadcast silently."""
    x, y, _ = data()
    model, likelihood = MODELS["ODVGP"](), gaussian_likelihood()
    column = y.unsqueeze(-1)
    silently = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=N)(model(x), column)
    assert not torch.allclose(silently, gpytorch.mlls.VariationalELBO(likelihood, model, num_data=N)(model(x), y))
    with pytest.raises(ValueError, match=r"target must have shape \(12,\) to match the model's output, got \(12, 1\)"):
        mlls.VariationalELBO(likelihood, model, num_data=N)(model(x), column)
