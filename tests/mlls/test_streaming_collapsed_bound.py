"""StreamingCollapsedBound: the two-pass gradient of every model's batch bound equals autograd through the dense
oracle for every parameter (inducing inputs, noise, kernel, mean), the value is the bound, the strategy's state is not
touched, every kind of batch source works (a list, a DataLoader, a function) and a one-shot generator or a second pass
over other data is refused; it drives L-BFGS as a closure.

Observed (this machine): gradients within 2e-14 of autograd relative to the largest (7-800), values within 1e-15
relative.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpytorch_decoupled.mlls import StreamingCollapsedBound
from tests.recursive_problems import F64, MODELS, blocks_of, make_model, oracle_bound, problem, stream

pytestmark = pytest.mark.usefixtures("single_thread")


def _setup(approximation="vfe", alpha=None):
    X, y, Z = problem(dims=2)
    model, likelihood = make_model(Z, approximation, alpha, constant_mean=True)
    blocks = blocks_of(60, 7, torch.randperm(60, generator=torch.Generator().manual_seed(8)))
    return model, likelihood, X, y, blocks


def _parameters(model, likelihood):
    return [*model.parameters(), *likelihood.parameters()]


@pytest.mark.parametrize("approximation,alpha", [*MODELS, ("pep", 1.0)])
def test_two_passes_give_the_exact_gradient_of_the_batch_bound(approximation, alpha):
    model, likelihood, X, y, blocks = _setup(approximation, alpha)
    parameters = _parameters(model, likelihood)
    bound = oracle_bound(model, likelihood, X, y, blocks)
    expected = torch.autograd.grad(bound, parameters)
    stream(model, X, y, blocks[:2])  # some state, which must stay as it is
    state = {name: value.clone() for name, value in model.state_dict().items()}

    objective = StreamingCollapsedBound(model, likelihood)
    loss = objective.value_and_backward([(X[block], y[block]) for block in blocks])
    torch.testing.assert_close(loss, -bound.detach(), rtol=1e-13, atol=0.0)
    torch.testing.assert_close(objective.bound, bound.detach(), rtol=1e-13, atol=0.0)
    scale = max(float(gradient.abs().max()) for gradient in expected)
    for parameter, gradient in zip(parameters, expected, strict=True):
        # The accumulated gradient is that of the loss -L.
        assert float((parameter.grad + gradient).abs().max()) < 1e-12 * scale
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in state.items())

    # Gradients accumulate like loss.backward(): a second call doubles them.
    first = [parameter.grad.clone() for parameter in parameters]
    objective.value_and_backward([(X[block], y[block]) for block in blocks])
    for parameter, gradient in zip(parameters, first, strict=True):
        torch.testing.assert_close(parameter.grad, 2 * gradient, rtol=1e-13, atol=1e-13)


def test_batch_sources():
    model, likelihood, X, y, blocks = _setup("fitc")
    objective = StreamingCollapsedBound(model, likelihood)
    dataset = torch.utils.data.TensorDataset(X, y)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)
    values = [
        objective.value_and_backward(loader),  # reshuffled between the passes: fine except for PITC
        objective.value_and_backward(lambda: ((X[block], y[block]) for block in blocks)),
        objective.value_and_backward([(X, y)]),
    ]
    for value in values[1:]:
        torch.testing.assert_close(value, values[0], rtol=1e-12, atol=0.0)
    with pytest.raises(TypeError, match="one-shot"):
        objective.value_and_backward((X[block], y[block]) for block in blocks)
    with pytest.raises(ValueError, match="no mini-batches"):
        objective.value_and_backward([])
    draws = iter([blocks, blocks[:-1]])
    with pytest.raises(RuntimeError, match="other data"):
        objective.value_and_backward(lambda: [(X[block], y[block]) for block in next(draws)])
    y_nan = y.clone()
    y_nan[5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        objective.value_and_backward([(X, y_nan)])


def test_pitc_detects_another_partition_in_the_second_pass():
    model, likelihood, X, y, blocks = _setup("pitc")
    objective = StreamingCollapsedBound(model, likelihood)
    partitions = iter([blocks, blocks_of(60, 12)])
    with pytest.raises(RuntimeError, match="other data"):
        objective.value_and_backward(lambda: [(X[block], y[block]) for block in next(partitions)])


def test_refuses_other_models_and_likelihoods():
    model, likelihood, _, _, _ = _setup()
    with pytest.raises(ValueError, match="likelihood"):
        StreamingCollapsedBound(model, gpytorch.likelihoods.GaussianLikelihood())
    with pytest.raises(TypeError, match="KalmanVariationalStrategy"):
        StreamingCollapsedBound(torch.nn.Module(), likelihood)


def test_lbfgs_closure_improves_the_bound():
    model, likelihood, X, y, blocks = _setup("vfe")
    objective = StreamingCollapsedBound(model, likelihood)
    batches = [(X[block], y[block]) for block in blocks]
    optimizer = torch.optim.LBFGS(_parameters(model, likelihood), max_iter=15, line_search_fn="strong_wolfe")
    initial = float(objective.value_and_backward(batches))

    def closure():
        optimizer.zero_grad()
        return objective.value_and_backward(batches)

    optimizer.step(closure)
    with torch.no_grad():
        final = float(-oracle_bound(model, likelihood, X, y))
    assert final < initial - 5.0
    assert objective.bound.dtype == F64


def test_the_old_location_in_optim_still_works_with_a_deprecation_warning():
    import gpytorch_decoupled.optim

    with pytest.warns(DeprecationWarning, match="moved to gpytorch_decoupled.mlls.StreamingCollapsedBound"):
        old = gpytorch_decoupled.optim.StreamingCollapsedBound
    assert old is StreamingCollapsedBound
    with pytest.raises(AttributeError):
        _ = gpytorch_decoupled.optim.NoSuchStep
