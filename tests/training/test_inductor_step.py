"""The compiled step with Inductor, the default backend (marked ``inductor``: compiling takes minutes on two CPU cores,
so CI runs these in their own step, ``make suite-inductor``): equal to the eager step, and ``mode="reduce-overhead"``
(CUDA graphs on a GPU, ordinary Inductor code on a CPU) as well. One compiled step serves the whole module."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from gpytorch_decoupled.optim import RecursiveGradientPropagation
from gpytorch_decoupled.training import KernelSelectionStep, TrainingStep, compile_training_step
from tests.recursive_problems import make_model, problem
from tests.training.test_kernel_selection_step import FULL_RANK_SPACE, N, _adam, _data, _model, assert_steps_equal
from tests.training.training_cases import make_case, optimizers

pytestmark = [pytest.mark.inductor, pytest.mark.usefixtures("single_thread")]


def _pair(seed=0, device="cpu", distribution="fast_natural", likelihood="gaussian", **compile_options):
    strategy = {"dual": "dual", "decoupled": "decoupled"}.get(distribution, "odvgp")
    options = {"strategy": strategy, "distribution": distribution, "likelihood": likelihood}
    model, likelihood, mll, x, y = make_case(seed=seed, **options)
    eager_model, eager_likelihood, eager_mll, _, _ = make_case(seed=seed, **options)
    for module in (model, likelihood, eager_model, eager_likelihood):
        module.to(device)
    x, y = x.to(device), y.to(device)
    compiled = compile_training_step(mll, optimizers(model, likelihood, x.size(0), distribution), **compile_options)
    eager = TrainingStep(eager_mll, optimizers(eager_model, eager_likelihood, x.size(0), distribution), lean=False)
    return compiled, eager, x, y


def _assert_steps_equal(compiled, eager, x, y, steps=3):
    for index in range(steps):
        torch.manual_seed(index)
        loss = compiled(x[:24], y[:24])
        torch.manual_seed(index)
        torch.testing.assert_close(loss, eager(x[:24], y[:24]), rtol=1e-10, atol=0)
    # every parameter and buffer (t-SVGP's sites are buffers)
    parameters = [*compiled.model.parameters(), *compiled.model.buffers(), *compiled.likelihood.parameters()]
    expected = [*eager.model.parameters(), *eager.model.buffers(), *eager.likelihood.parameters()]
    for value, reference in zip(parameters, expected, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-9, atol=1e-11)


def test_inductor_step_equals_eager():
    _assert_steps_equal(*_pair())


@pytest.mark.parametrize("likelihood", ["gaussian", "bernoulli"])
def test_inductor_tsvgp_iteration_equals_eager(likelihood):
    # t-SVGP's E-step (Cholesky factorization with a failure flag, site updates in place) and M-step through Inductor;
    # with a Bernoulli likelihood the E-step's derivatives come from autograd inside the graph's no-grad update.
    _assert_steps_equal(*_pair(distribution="dual", likelihood=likelihood))


def test_inductor_decoupled_step_equals_eager():
    # MeanBasisAdam's curvature step (float64 factorizations, QR, the whitener's operator) through Inductor.
    _assert_steps_equal(*_pair(distribution="decoupled"))


def test_reduce_overhead_mode_runs_and_equals_eager():
    # On a CPU there is nothing to capture in CUDA graphs: the mode compiles as the default one does.
    _assert_steps_equal(*_pair(mode="reduce-overhead"))


@pytest.mark.cuda
@pytest.mark.parametrize("distribution", ["fast_natural", "dual", "decoupled"])
def test_cuda_graphs_step_replays_and_equals_eager(distribution):
    # Inductor skips CUDA graphs (with only a log line) when the graph updates a tensor whose address is not fixed,
    # e.g. an optimizer's state or t-SVGP's sites: none may be skipped.
    counters.clear()
    compiled, eager, x, y = _pair(device="cuda", mode="reduce-overhead", distribution=distribution)
    _assert_steps_equal(compiled, eager, x, y)
    assert counters["inductor"]["cudagraph_skips"] == 0
    # A loss kept from an earlier step stays readable after later replays.
    kept = compiled(x[:24], y[:24])
    expected = kept.item()
    compiled(x[:24], y[:24])
    assert kept.item() == expected


def test_inductor_srgp_step_equals_eager():
    # SRGP's whole step (VFE, every parameter propagated, structured inducing-input Jacobians, the prior frozen at the
    # epoch's start) and the Kalman update through Inductor, against srgp.step and strategy.update.
    x, y, z = problem(dims=2)
    pairs = []
    for _ in range(2):
        model, likelihood = make_model(z, constant_mean=True)
        adam = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
        pairs.append(RecursiveGradientPropagation(model, likelihood, adam))
    srgp, reference = pairs
    step = compile_training_step(srgp)
    for index in range(3):
        batch = slice(12 * index, 12 * (index + 1))
        torch.testing.assert_close(step(x[batch], y[batch]), reference.step(x[batch], y[batch]), rtol=1e-10, atol=0)
    for value, expected in [
        *zip(srgp.strategy.model.state_dict().values(), reference.strategy.model.state_dict().values(), strict=True),
        (srgp._vector_jacobian, reference._vector_jacobian),
        (srgp._matrix_jacobian, reference._matrix_jacobian),
        (srgp._inducing_jacobians.rows, reference._inducing_jacobians.rows),
    ]:
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-11)
    update, expected_model = compile_training_step(srgp.strategy), reference.strategy.model
    expected = expected_model.variational_strategy.update(x[-12:], y[-12:])
    torch.testing.assert_close(update(x[-12:], y[-12:]), expected, rtol=1e-10, atol=0)
    for value, statistic in zip(srgp.strategy.statistics, reference.strategy.statistics, strict=True):
        torch.testing.assert_close(value, statistic, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("posterior", [False, True], ids=["point", "hyperparameter-posterior"])
def test_inductor_kernel_selection_step_equals_eager(posterior):
    # VBKS's step over every base kernel type, products and sums (the lean candidate bank) through Inductor; with a
    # hyperparameter posterior, the unwhitened sub-models at two draws through torch.func.functional_call.
    x, y = _data()
    options = {"space": FULL_RANK_SPACE, "hyperparameter_posterior": True, "num_hyperparameter_samples": 2}
    model, eager_model = (_model(**(options if posterior else {})) for _ in range(2))
    compiled = KernelSelectionStep(model, _adam(model), N)
    eager = KernelSelectionStep(eager_model, _adam(eager_model), N, lean=False)
    batches = [slice(8 * i, 8 * i + 24) for i in range(3)]
    assert_steps_equal(compiled, eager, x, y, batches, rtol=1e-10, parameter_rtol=1e-9)
