"""RecursiveGradientPropagation (SRGP, spec B.3): Proposition 1 (S7), the naive gradient (S8), an epoch at learning
rate 0 and the propagated Jacobians against finite differences (S9), the cheaper propagation variants and their exact
difference from the full one, the structured Jacobians of the inducing inputs (VFE, DTC) against the dense ones, the
memory they take, errors, and a few epochs on a real data set.

Observed (this machine, float64, 2-D SE-ARD, constant mean, learned inducing inputs and noise, P = 25): the summed
gradients of an epoch match autograd through the dense batch bound to <= 3.3e-14 relative to the largest gradient
(which is 7-800 across the models; VFE and DTC, structured: 8e-15 and 1.9e-14), the epoch's bound matches to <= 4e-15
relative, and the Jacobians match central differences (step 1e-6) to <= 1.1e-9 relative (VFE, structured: 7e-10).
The structured propagation gives the dense one's gradients and Jacobians to <= 5e-16 relative.
"""

from __future__ import annotations

import io
import unittest.mock
import warnings

import gpytorch
import pytest
import torch

from gpytorch_decoupled import datasets
from gpytorch_decoupled.optim import RecursiveGradientPropagation
from gpytorch_decoupled.optim import recursive_gradient_propagation as srgp_module
from tests.recursive_problems import (
    F64,
    MODELS,
    RecursiveGP,
    blocks_of,
    make_model,
    oracle_bound,
    problem,
    stream,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _parameters(model, likelihood):
    return [*model.parameters(), *likelihood.parameters()]


def _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks, _srgp=None, **kwargs):
    """One SRGP epoch with a learning rate of 0: the summed gradients of -(-psi_k), the summed psi_k, the SRGP."""
    parameters = _parameters(model, likelihood)
    srgp = _srgp or RecursiveGradientPropagation(model, likelihood, torch.optim.SGD(parameters, lr=0.0), **kwargs)
    srgp.start_epoch()
    totals = [torch.zeros_like(parameter) for parameter in parameters]
    psi = 0.0
    for block in blocks:
        psi += float(srgp.step(X[block], y[..., block]))  # the step returns a 0-dim tensor
        for total, parameter in zip(totals, parameters, strict=True):
            total -= parameter.grad
    return totals, psi, srgp


def _relative_error(actual, expected):
    scale = max(float(value.abs().max()) for value in expected)
    return max(float((a - e).abs().max()) for a, e in zip(actual, expected, strict=True)) / scale


def _spec_problem(approximation="vfe", alpha=None):
    X, y, Z = problem(dims=2)
    model, likelihood = make_model(Z, approximation, alpha, constant_mean=True)
    blocks = blocks_of(60, 7, torch.randperm(60, generator=torch.Generator().manual_seed(4)))
    return model, likelihood, X, y, blocks


@pytest.mark.parametrize("approximation,alpha", MODELS)
def test_s7_epoch_gradients_sum_to_the_batch_gradient(approximation, alpha):
    model, likelihood, X, y, blocks = _spec_problem(approximation, alpha)
    bound = oracle_bound(model, likelihood, X, y, blocks)
    expected = torch.autograd.grad(bound, _parameters(model, likelihood))
    bound = bound.detach()
    totals, psi, srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks)
    # VFE and DTC take the structured path for the inducing inputs, the other models the dense one.
    assert (srgp._inducing_jacobians is not None) == (approximation in ("vfe", "dtc"))
    assert _relative_error(totals, expected) < 1e-10
    # S9, first half: the epoch's cumulative bound is the batch bound.
    assert abs(psi - float(bound)) < 1e-10 * abs(float(bound))
    torch.testing.assert_close(model.variational_strategy.recursive_bound, bound, rtol=1e-12, atol=0.0)


def _statistics_after_a_pass(model, X, y, blocks):
    strategy = model.variational_strategy
    strategy.reset()
    stream(model, X, y, blocks)
    vector, matrix = strategy._variational_distribution()
    return vector.clone(), matrix.clone()


@pytest.mark.parametrize("approximation,alpha", [("vfe", None), ("pep", 0.5)])
def test_s9_propagated_jacobians_match_finite_differences(approximation, alpha):
    model, likelihood, X, y, blocks = _spec_problem(approximation, alpha)
    _, _, srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks)
    vector_jacobian, matrix_jacobian = srgp.information_jacobians()
    assert vector_jacobian.shape == (10, srgp.num_propagated) and matrix_jacobian.shape == (10, 10, 25)

    step, column = 1e-6, 0
    differences = ([], [])
    for parameter in srgp.propagated_parameters:
        flat = parameter.data.view(-1)
        for index in range(flat.numel()):
            original = flat[index].item()
            flat[index] = original + step
            plus = _statistics_after_a_pass(model, X, y, blocks)
            flat[index] = original - step
            minus = _statistics_after_a_pass(model, X, y, blocks)
            flat[index] = original
            for target, high, low in zip(differences, plus, minus, strict=True):
                target.append((high - low) / (2 * step))
            column += 1
    assert column == srgp.num_propagated
    for jacobian, difference in zip((vector_jacobian, matrix_jacobian), differences, strict=True):
        difference = torch.stack(difference, dim=-1)
        error = (jacobian - difference).abs().max() / difference.abs().max()
        assert error < 1e-7, float(error)


def test_s8_and_the_cheaper_variants():
    model, likelihood, X, y, blocks = _spec_problem("fitc")
    parameters = _parameters(model, likelihood)
    expected = torch.autograd.grad(oracle_bound(model, likelihood, X, y, blocks), parameters)
    full, _, full_srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks)
    hyper, _, hyper_srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks, propagate="hyperparameters")
    naive, _, naive_srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks, propagate="none")
    inducing = [i for i, parameter in enumerate(parameters) if parameter is model.variational_strategy.inducing_points]
    assert inducing == [0]

    # "hyperparameters": exact for the kernel, mean and noise, the naive gradient for Z.
    assert _relative_error(hyper[1:], expected[1:]) < 1e-10
    torch.testing.assert_close(hyper[0], naive[0], rtol=1e-12, atol=1e-12)
    # The naive gradient is the sum of the bound terms' gradients at fixed statistics ...
    strategy = model.variational_strategy
    strategy.reset()
    direct = [torch.zeros_like(parameter) for parameter in parameters]
    for block in blocks:
        statistics = [statistic.clone() for statistic in strategy.statistics]
        terms, inducing_covariance = strategy.observation_terms(X[block], y[block])
        psi = strategy.bound_term(terms, inducing_covariance, *statistics)
        for total, gradient in zip(direct, torch.autograd.grad(psi, parameters), strict=True):
            total += gradient
        strategy.update(X[block], y[block])
    assert _relative_error(naive, direct) < 1e-12
    # ... and far from the batch gradient (S8), for Z as for the hyperparameters.
    assert _relative_error(naive, expected) > 0.1
    assert float((naive[0] - expected[0]).abs().max()) > 0.1 * float(expected[0].abs().max())
    assert _relative_error(full, expected) < 1e-10

    # Memory: the packed triangle of J_Lambda plus J_eta, float64, per propagated scalar.
    per_parameter = 8 * (10 + 10 * 11 // 2)
    assert full_srgp.jacobian_bytes == per_parameter * 25
    assert hyper_srgp.jacobian_bytes == per_parameter * (25 - 20) and hyper_srgp.num_propagated == 5
    assert naive_srgp.jacobian_bytes == 0


@pytest.mark.parametrize("approximation", ["pitc", "vfe"])
def test_chunked_directions_are_exact(approximation):
    # VFE: the structured inducing inputs are chunked over their input dimensions (D = 2) too.
    model, likelihood, X, y, _ = _spec_problem(approximation)
    blocks = blocks_of(60, 20)
    default, _, _ = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks)
    for chunk_size in (1, 6):
        chunked, _, _ = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks, chunk_size=chunk_size)
        assert _relative_error(chunked, default) < 1e-13


def _dense_epoch(model, likelihood, X, y, blocks, **kwargs):
    """An epoch as in :func:`_epoch_at_zero_learning_rate`, with the inducing inputs' Jacobians propagated densely."""
    parameters = _parameters(model, likelihood)
    srgp = RecursiveGradientPropagation(model, likelihood, torch.optim.SGD(parameters, lr=0.0), **kwargs)
    srgp._structure_allowed = False
    return _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks, _srgp=srgp)


@pytest.mark.parametrize("approximation,latents", [("vfe", 0), ("dtc", 0), ("vfe", 2)])
def test_structured_inducing_jacobians_equal_the_dense_ones(approximation, latents):
    # VFE and DTC (V_k = sigma^2 I): with "full", the Jacobians of the inducing inputs are propagated in their
    # rank-2 structure, and give the dense propagation's gradients and Jacobians.
    if latents:
        X, y, Z = problem(dims=2)
        model, likelihood = make_model(torch.stack([Z, Z + 0.1]), approximation, constant_mean=True)
        y = torch.stack([y, 0.5 * y])
        blocks = blocks_of(60, 12)
    else:
        model, likelihood, X, y, blocks = _spec_problem(approximation)
    structured, psi, srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks)
    assert srgp._inducing_jacobians is not None and srgp._structure_verified
    dense, dense_psi, dense_srgp = _dense_epoch(model, likelihood, X, y, blocks)
    assert dense_srgp._inducing_jacobians is None and srgp.num_propagated == dense_srgp.num_propagated
    assert _relative_error(structured, dense) < 1e-10
    assert abs(psi - dense_psi) < 1e-12 * abs(dense_psi)
    for actual, expected in zip(srgp.information_jacobians(), dense_srgp.information_jacobians(), strict=True):
        assert actual.shape == expected.shape
        assert float((actual - expected).abs().max()) < 1e-10 * float(expected.abs().max())
    # The batch gradient (S7) for latents, as test_batch_of_latents does for FITC.
    expected = torch.autograd.grad(oracle_bound(model, likelihood, X, y, blocks), _parameters(model, likelihood))
    assert _relative_error(structured, expected) < 1e-10


@pytest.mark.parametrize("approximation,alpha", [("fitc", None), ("pitc", None), ("pep", 0.5)])
def test_dense_inducing_jacobians_where_the_noise_depends_on_them(approximation, alpha):
    model, likelihood, X, y, blocks = _spec_problem(approximation, alpha)
    _, _, srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks[:2])
    assert srgp._inducing_jacobians is None


@pytest.mark.parametrize("latents", [0, 3])
def test_jacobian_memory(latents):
    # float64 floats per latent: dense, J_eta and the packed triangle of J_Lambda per propagated scalar; structured
    # (VFE, DTC, "full"), M * D * (M + 1) for the inducing inputs (M = 10, D = 2 here) on top of P - M D dense columns.
    X, y, Z = problem(dims=2)
    Z = Z.expand(latents, *Z.shape).clone() if latents else Z
    count = max(latents, 1)
    expected = {}
    dense_per_parameter = 8 * count * (10 + 10 * 11 // 2)
    hyperparameters = 4 * count + 1  # two lengthscales, the outputscale and the mean per latent, the noise
    expected["full", "fitc"] = dense_per_parameter * (hyperparameters + count * 20)
    expected["full", "vfe"] = dense_per_parameter * hyperparameters + 8 * count * 10 * 2 * 11
    expected["hyperparameters", "vfe"] = dense_per_parameter * hyperparameters
    expected["none", "vfe"] = 0
    for (propagate, approximation), size in expected.items():
        model, likelihood = make_model(Z, approximation, constant_mean=True)
        optimizer = torch.optim.SGD(_parameters(model, likelihood), lr=0.0)
        srgp = RecursiveGradientPropagation(model, likelihood, optimizer, propagate=propagate)
        assert srgp.jacobian_bytes == 0
        srgp.start_epoch()
        assert srgp.jacobian_bytes == size, (propagate, approximation)
        srgp.step(X[:12], y[..., :12] if not latents else y[:12].expand(latents, 12))
        assert srgp.jacobian_bytes == size, (propagate, approximation)


class _ScaledInputsGP(RecursiveGP):
    """Standardizes its inputs jointly (inducing and data inputs together): the kernel matrix is no longer pointwise,
    so K_uk depends on every inducing input."""

    def forward(self, x):
        return super().forward(x / x.std(dim=-2, keepdim=True))


def test_structure_check_falls_back_to_dense_jacobians():
    X, y, Z = problem(dims=2)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = _ScaledInputsGP(Z, likelihood, "vfe", constant_mean=True).double()
    blocks = blocks_of(60, 12)
    with pytest.warns(RuntimeWarning, match="structure"):
        totals, psi, srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks)
    assert srgp._inducing_jacobians is None and not srgp._structure_allowed
    dense, dense_psi, _ = _dense_epoch(model, likelihood, X, y, blocks)
    assert _relative_error(totals, dense) < 1e-12 and psi == pytest.approx(dense_psi, rel=1e-13)


def test_batch_of_latents():
    # Two independent latents (own inducing inputs, length-scales and targets): the gradients of the summed bound.
    X, y, Z = problem()
    model, likelihood = make_model(torch.stack([Z, Z + 0.1]), "fitc", constant_mean=True)
    targets = torch.stack([y, 0.5 * y])
    blocks = blocks_of(60, 12)
    expected = torch.autograd.grad(oracle_bound(model, likelihood, X, targets), _parameters(model, likelihood))
    totals, _, _ = _epoch_at_zero_learning_rate(model, likelihood, X, targets, blocks)
    assert _relative_error(totals, expected) < 1e-10


def test_steps_update_the_parameters_and_the_epoch_bound():
    model, likelihood, X, y, blocks = _spec_problem("vfe")
    optimizer = torch.optim.Adam(_parameters(model, likelihood), lr=0.01)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
    before = model.covar_module.raw_outputscale.detach().clone()
    psis = [srgp.step(X[block], y[block]) for block in blocks[:3]]  # the first step starts the epoch
    assert not torch.equal(model.covar_module.raw_outputscale.detach(), before)
    strategy = model.variational_strategy
    assert strategy.num_observed == sum(len(block) for block in blocks[:3])
    assert abs(float(strategy.recursive_bound) - sum(psis)) < 1e-12
    srgp.start_epoch()
    assert strategy.num_observed == 0 and not srgp.information_jacobians()[1].any()


def _srgp_run(approximation, prior):
    model, likelihood, X, y, blocks = _spec_problem(approximation)
    optimizer = torch.optim.Adam(_parameters(model, likelihood), lr=0.02)
    return model, likelihood, optimizer, RecursiveGradientPropagation(model, likelihood, optimizer, prior=prior), X, y


def _snapshot(model, likelihood, optimizer, srgp) -> bytes:
    buffer = io.BytesIO()
    state = {name: obj.state_dict() for name, obj in zip(_OBJECTS, (model, likelihood, optimizer, srgp), strict=True)}
    torch.save(state, buffer)
    return buffer.getvalue()


_OBJECTS = ("model", "likelihood", "optimizer", "srgp")


@pytest.mark.parametrize("approximation", ["vfe", "fitc"])  # structured and dense Jacobians of Z
@pytest.mark.parametrize("prior", ["frozen", "current"])
def test_checkpoint_mid_epoch_resumes_bit_for_bit(approximation, prior):
    # One run: an epoch, then half of the next; checkpoint (torch.save of the model, likelihood, Adam and SRGP state
    # dicts); the rest of the epoch and one more step of a new one. A fresh process is simulated by new objects (other
    # inducing inputs and hyperparameters) that torch.load the checkpoint and go on with the same mini-batches: every
    # bound term, parameter, statistic, Jacobian and Adam moment equals the uninterrupted run's bit for bit.
    model, likelihood, optimizer, srgp, X, y = _srgp_run(approximation, prior)
    first, second = blocks_of(60, 9, torch.randperm(60, generator=torch.Generator().manual_seed(1))), blocks_of(60, 9)
    srgp.start_epoch()
    for block in first:
        srgp.step(X[block], y[block])
    srgp.start_epoch()
    for block in second[:3]:
        srgp.step(X[block], y[block])
    checkpoint = _snapshot(model, likelihood, optimizer, srgp)

    def finish(srgp):
        psis = [srgp.step(X[block], y[block]) for block in second[3:]]
        srgp.start_epoch()
        return [*psis, srgp.step(X[first[0]], y[first[0]])]

    straight = finish(srgp)

    fresh_model, fresh_likelihood = make_model(torch.zeros(10, 2, dtype=F64), approximation, constant_mean=True)
    fresh_likelihood.noise = 0.3
    fresh_optimizer = torch.optim.Adam(_parameters(fresh_model, fresh_likelihood), lr=0.02)
    fresh = RecursiveGradientPropagation(fresh_model, fresh_likelihood, fresh_optimizer, prior=prior)
    saved = torch.load(io.BytesIO(checkpoint))
    for name, obj in zip(_OBJECTS, (fresh_model, fresh_likelihood, fresh_optimizer, fresh), strict=True):
        obj.load_state_dict(saved[name])
    resumed = finish(fresh)

    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))
    expected, actual = _snapshot(*_objects_of(srgp)), _snapshot(*_objects_of(fresh))
    assert _same_tensors(torch.load(io.BytesIO(actual)), torch.load(io.BytesIO(expected)))
    for a, b in zip(fresh.information_jacobians(), srgp.information_jacobians(), strict=True):
        assert torch.equal(a, b)


def _objects_of(srgp):
    strategy = srgp.strategy
    return strategy.model, strategy.likelihood, srgp.optimizer, srgp


def _same_tensors(actual, expected) -> bool:
    """Nested dicts / lists of tensors and plain values, equal bit for bit."""
    if isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(_same_tensors(actual[k], expected[k]) for k in expected)
    if isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(map(_same_tensors, actual, expected))
    if torch.is_tensor(expected):
        return torch.is_tensor(actual) and actual.dtype == expected.dtype and torch.equal(actual, expected)
    return actual == expected


def test_state_dict_of_another_model_is_refused():
    _, _, _, srgp, X, y = _srgp_run("vfe", "frozen")
    srgp.step(X[:12], y[:12])
    model, likelihood, *_ = _other_size_problem()
    other = RecursiveGradientPropagation(model, likelihood, torch.optim.Adam(_parameters(model, likelihood)))
    with pytest.raises(ValueError, match="epoch parameters"):
        other.load_state_dict(srgp.state_dict())
    current = RecursiveGradientPropagation(
        model, likelihood, torch.optim.Adam(_parameters(model, likelihood)), prior="current"
    )
    state = {**srgp.state_dict(), "prior": "current", "epoch_parameters": None}
    with pytest.raises(ValueError, match="Jacobians"):
        current.load_state_dict(state)
    with pytest.raises(ValueError, match="prior"):
        current.load_state_dict(srgp.state_dict())
    assert other.jacobian_bytes == 0 and current.jacobian_bytes == 0


def _other_size_problem():
    X, y, Z = problem(dims=2, num_inducing=6)
    model, likelihood = make_model(Z, "vfe", None, constant_mean=True)
    return model, likelihood, X, y


def test_errors_and_failed_steps():
    model, likelihood, X, y, blocks = _spec_problem("vfe")
    parameters = _parameters(model, likelihood)
    optimizer = torch.optim.Adam(parameters, lr=0.01)
    with pytest.raises(ValueError, match="propagate"):
        RecursiveGradientPropagation(model, likelihood, optimizer, propagate="diagonal")
    with pytest.raises(ValueError, match="chunk_size"):
        RecursiveGradientPropagation(model, likelihood, optimizer, chunk_size=0)
    with pytest.raises(ValueError, match="likelihood"):
        RecursiveGradientPropagation(model, gpytorch.likelihoods.GaussianLikelihood(), optimizer)
    with pytest.raises(ValueError, match="not a parameter"):
        RecursiveGradientPropagation(model, likelihood, torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))]))
    svgp = gpytorch.models.ApproximateGP(
        gpytorch.variational.VariationalStrategy(
            model, torch.zeros(3, 1), gpytorch.variational.CholeskyVariationalDistribution(3)
        )
    )
    with pytest.raises(TypeError, match="KalmanVariationalStrategy"):
        RecursiveGradientPropagation(svgp, likelihood, optimizer)

    srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
    srgp.step(X[blocks[0]], y[blocks[0]])
    state = {name: value.clone() for name, value in model.state_dict().items()}
    jacobians = [jacobian.clone() for jacobian in srgp.information_jacobians()]
    bad_y = y[blocks[1]].clone()
    bad_y[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        srgp.step(X[blocks[1]], bad_y)
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in state.items())
    assert all(torch.equal(a, b) for a, b in zip(jacobians, srgp.information_jacobians(), strict=True))

    model.variational_strategy.update(X[blocks[1]], y[blocks[1]])
    with pytest.raises(RuntimeError, match="start_epoch"):
        srgp.step(X[blocks[2]], y[blocks[2]])

    # A failure while the Jacobians are accumulated: neither the state nor the parameters change, and the epoch
    # must be restarted.
    srgp.start_epoch()
    srgp.step(X[blocks[0]], y[blocks[0]])
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with unittest.mock.patch.object(srgp_module, "vmap", side_effect=RuntimeError("out of memory")):
        with pytest.raises(RuntimeError, match="out of memory"):
            srgp.step(X[blocks[1]], y[blocks[1]])
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in state.items())
    with pytest.raises(RuntimeError, match="out of step"):
        srgp.step(X[blocks[1]], y[blocks[1]])


def test_srgp_learns_a_real_data_set():
    # elevators (embedded with the package): 1,500 training points of 18 inputs, M = 20 inducing inputs from the
    # data, SE-ARD, all hyperparameters and Z learned with full propagation (P = 381), 3 epochs of 5 mini-batches.
    train_x, train_y, test_x, test_y = datasets.load("elevators", split=0, dtype=F64)
    generator = torch.Generator().manual_seed(0)
    subset = torch.randperm(train_x.size(0), generator=generator)[:1500]
    train_x, train_y, test_x, test_y = train_x[subset], train_y[subset], test_x[:1000], test_y[:1000]
    model, likelihood = make_model(train_x[:20].clone(), "vfe", constant_mean=True, jitter_val=1e-6)
    model.covar_module.base_kernel.lengthscale = torch.full((1, 18), 3.0, dtype=F64)
    likelihood.noise = torch.tensor(0.5, dtype=F64)

    def clean_pass():
        strategy = model.variational_strategy
        strategy.reset()
        stream(model, train_x, train_y, blocks_of(1500, 500))
        model.eval()
        with torch.no_grad():
            rmse = (model(test_x).mean - test_y).pow(2).mean().sqrt()
        model.train()
        return float(strategy.recursive_bound) / 1500, float(rmse)

    initial_bound, initial_rmse = clean_pass()
    optimizer = torch.optim.Adam(_parameters(model, likelihood), lr=0.05)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
    assert srgp.num_propagated == 20 * 18 + 18 + 3
    epoch_bounds = []
    for _ in range(3):
        srgp.start_epoch()
        for block in torch.randperm(1500, generator=generator).split(300):
            srgp.step(train_x[block], train_y[block])
        epoch_bounds.append(float(model.variational_strategy.recursive_bound) / 1500)
    bound, rmse = clean_pass()
    assert epoch_bounds[0] < epoch_bounds[-1]
    assert bound > initial_bound + 0.3
    assert rmse < 0.55 < initial_rmse


class _Terms(torch.nn.Module):
    """The model and likelihood as submodules, so that functional_call evaluates a mini-batch's terms (or the prior)
    at any parameter values."""

    def __init__(self, model, likelihood):
        super().__init__()
        self.model, self.likelihood = model, likelihood

    def forward(self, x=None, y=None):
        strategy = self.model.variational_strategy
        return strategy.inducing_covariance() if x is None else strategy.observation_terms(x, y)[0]


@pytest.mark.parametrize("prior", ["frozen", "current"])
@pytest.mark.parametrize("approximation", ["vfe", "fitc"])
def test_gradients_while_the_parameters_move(prior, approximation):
    # With a nonzero learning rate every step's gradient is the derivative of psi_k(theta_k) where each earlier
    # mini-batch's increments are functions of the parameters at which it was absorbed, theta_j, and the state's prior
    # K_uu is a function of the epoch's first parameters theta_1 ("frozen", as the reference code) or of theta_k
    # ("current"); the oracle unrolls that with autograd, one leaf per step and parameter.
    model, likelihood, X, y, blocks = _spec_problem(approximation)
    parameters = dict((name, p) for name, p in _Terms(model, likelihood).named_parameters())
    optimizer = torch.optim.SGD(parameters.values(), lr=0.02)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer, prior=prior, drift_tolerance=None)
    terms_module, strategy = _Terms(model, likelihood), model.variational_strategy
    history = []
    srgp.start_epoch()
    for k, block in enumerate(blocks[:5]):
        history.append({name: p.detach().clone() for name, p in parameters.items()})
        srgp.step(X[block], y[block])
        actual = [-p.grad for p in parameters.values()]
        leaves = [{name: value.clone().requires_grad_(True) for name, value in values.items()} for values in history]
        vector = matrix = 0.0
        for j in range(k):
            terms = torch.func.functional_call(terms_module, leaves[j], (X[blocks[j]], y[blocks[j]]))
            vector, matrix = vector + terms.information_vector, matrix + terms.information_matrix
        terms = torch.func.functional_call(terms_module, leaves[k], (X[block], y[block]))
        state_prior = torch.func.functional_call(terms_module, leaves[0 if prior == "frozen" else k], ())
        zeros = torch.zeros_like(terms.information_matrix)
        psi = strategy.bound_term(terms, state_prior, vector + zeros[..., 0], matrix + zeros)
        grads = torch.autograd.grad(psi, [leaf for values in leaves for leaf in values.values()], allow_unused=True)
        expected = [torch.zeros_like(p) for p in parameters.values()]
        for index, gradient in enumerate(grads):
            if gradient is not None:
                expected[index % len(parameters)] += gradient
        assert _relative_error(actual, expected) < 1e-10, k
    # the two choices differ once the parameters have moved
    assert not torch.equal(
        history[0]["model.covar_module.raw_outputscale"], history[-1]["model.covar_module.raw_outputscale"]
    )


def test_warns_once_per_epoch_when_the_hyperparameters_drift():
    model, likelihood, X, y, blocks = _spec_problem("vfe")
    quiet = RecursiveGradientPropagation(model, likelihood, torch.optim.Adam(_parameters(model, likelihood), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for block in blocks:  # small steps: no warning in an epoch
            quiet.step(X[block], y[block])
    optimizer = torch.optim.Adam(_parameters(model, likelihood), lr=0.4)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
    for _ in range(2):
        srgp.start_epoch()
        with pytest.warns(RuntimeWarning, match="since the start of the epoch") as caught:
            for block in blocks:
                srgp.step(X[block], y[block])
        # Adam moves a raw value by about lr per step: more than 1 after three steps, and one warning per epoch.
        assert sum("drift_tolerance" in str(w.message) for w in caught) == 1
    assert "drift" in srgp.state_dict()["warned"]


def test_warns_when_a_bound_term_falls_far_below_the_epoch():
    model, likelihood, X, y, blocks = _spec_problem("vfe")
    optimizer = torch.optim.SGD(_parameters(model, likelihood), lr=0.0)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer, drift_tolerance=None)
    for block in blocks[:3]:
        srgp.step(X[block], y[block])
    with torch.no_grad():  # a jump of the noise to a tiny value: the next term is far worse than the epoch's
        likelihood.noise = 2e-3
    with pytest.warns(RuntimeWarning, match="bound term of this mini-batch"):
        srgp.step(X[blocks[3]], y[blocks[3]])
    quiet = RecursiveGradientPropagation(model, likelihood, optimizer, bound_tolerance=None, drift_tolerance=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for block in blocks[:3]:
            quiet.step(X[block], y[block])
        likelihood.noise = 2e-3
        quiet.step(X[blocks[3]], y[blocks[3]])


@pytest.mark.parametrize("option", ["bound_tolerance", "drift_tolerance"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_tolerances_must_be_positive(option, value):
    model, likelihood, *_ = _spec_problem("vfe")
    with pytest.raises(ValueError, match=option):
        RecursiveGradientPropagation(
            model, likelihood, torch.optim.Adam(_parameters(model, likelihood)), **{option: value}
        )


def _kernel(kind: str, dims: int, batch_shape: torch.Size) -> gpytorch.kernels.Kernel:
    ard = None if kind == "scaled-isotropic" else dims
    kernel = gpytorch.kernels.RBFKernel(ard_num_dims=ard, batch_shape=batch_shape).double()
    kernel.lengthscale = torch.linspace(0.6, 1.1, ard or 1, dtype=F64).expand(*batch_shape, 1, ard or 1)
    if kind == "unscaled":
        return kernel
    scaled = gpytorch.kernels.ScaleKernel(kernel, batch_shape=batch_shape).double()
    scaled.outputscale = torch.full(batch_shape, 1.3, dtype=F64)
    return scaled


@pytest.mark.parametrize(
    "approximation,kind,latents",
    [
        ("vfe", "scaled", 0),
        ("dtc", "scaled", 0),
        ("vfe", "unscaled", 0),
        ("vfe", "scaled-isotropic", 0),
        ("vfe", "scaled", 2),
    ],
)
def test_closed_form_kernel_tangents_equal_forward_mode(approximation, kind, latents):
    # VFE and DTC with a (scaled) RBF kernel: the tangents of the kernel blocks come in closed form (checked against
    # forward mode at the first mini-batch); the epoch's gradients and Jacobians are those of forward mode through the
    # kernel, for the kernel's, the noise's and the inducing inputs' directions (the constant mean's stay forward mode).
    X, y, Z = problem(dims=2)
    if latents:
        Z, y = torch.stack([Z, Z + 0.1]), torch.stack([y, 0.5 * y])
    model, likelihood = make_model(Z, approximation, constant_mean=True)
    model.covar_module = _kernel(kind, 2, Z.shape[:-2])
    blocks = blocks_of(60, 12)
    runs = []
    for closed_form in (True, False):
        parameters = _parameters(model, likelihood)
        srgp = RecursiveGradientPropagation(model, likelihood, torch.optim.SGD(parameters, lr=0.0))
        assert srgp._closed_form is not None
        if not closed_form:
            srgp._closed_form = None
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            totals, psi, srgp = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks, _srgp=srgp)
        assert (srgp._closed_form is not None and srgp._closed_form_verified) == closed_form
        runs.append((totals, psi, srgp.information_jacobians()))
    (closed, closed_psi, closed_jacobians), (forward, forward_psi, forward_jacobians) = runs
    assert _relative_error(closed, forward) < 1e-12
    assert closed_psi == forward_psi
    assert _relative_error(closed_jacobians, forward_jacobians) < 1e-12
    expected = torch.autograd.grad(oracle_bound(model, likelihood, X, y, blocks), _parameters(model, likelihood))
    assert _relative_error(closed, expected) < 1e-10


class _DoubledInputsGP(RecursiveGP):
    """Doubles its inputs before the kernel: still pointwise (the structured Jacobians of Z hold), but the closed
    form, which reads the kernel's inputs as the model's, does not."""

    def forward(self, x):
        return super().forward(2.0 * x)


def test_closed_form_falls_back_to_forward_mode_where_it_does_not_hold():
    X, y, Z = problem(dims=2)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = _DoubledInputsGP(Z, likelihood, "vfe", constant_mean=True).double()
    optimizer = torch.optim.SGD(_parameters(model, likelihood), lr=0.0)
    runs = {}
    for closed_form in (True, False):  # the oracle reads the kernel, not the model's forward: compare to forward mode
        srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
        if not closed_form:
            srgp._closed_form = None
        with (
            pytest.warns(RuntimeWarning, match="closed-form derivatives") if closed_form else warnings.catch_warnings()
        ):
            runs[closed_form] = _epoch_at_zero_learning_rate(model, likelihood, X, y, blocks_of(60, 12), _srgp=srgp)
        assert srgp._closed_form is None and srgp._inducing_jacobians is not None
    (totals, psi, _), (expected, expected_psi, _) = runs[True], runs[False]
    assert _relative_error(totals, expected) < 1e-13 and psi == expected_psi
