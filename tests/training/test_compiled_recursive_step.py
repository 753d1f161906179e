"""The Kalman-recursive family's compiled steps: SRGP's whole step (bound term, reverse pass, total gradient with the
propagated Jacobians, Kalman update, forward-mode Jacobians of the increments, Adam step) and the Kalman update alone,
each one graph with no break, equal to the eager ``srgp.step`` / ``strategy.update`` in float64 (``aot_eager``
backend; Inductor in ``test_inductor_step.py``); failures leave everything unchanged; unsupported cases fall back."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from gpytorch_decoupled.optim import RecursiveGradientPropagation
from gpytorch_decoupled.training import KalmanUpdateStep, RecursiveTrainingStep, compile_training_step
from tests.recursive_problems import MODELS, make_model, problem

pytestmark = pytest.mark.usefixtures("single_thread")

# (approximation, alpha, propagate, prior): the structured VFE/DTC Jacobians with both priors, and every other model
# with propagate="none" (the Kalman update and a hyperparameter step on the bound term)
SRGP_CASES = {
    "vfe-full-frozen": ("vfe", None, "full", "frozen"),
    "vfe-full-current": ("vfe", None, "full", "current"),
    "dtc-hyperparameters-frozen": ("dtc", None, "hyperparameters", "frozen"),
    "fitc-none-frozen": ("fitc", None, "none", "frozen"),
    "pitc-none-current": ("pitc", None, "none", "current"),
    "pep-none-frozen": ("pep", 0.5, "none", "frozen"),
}
BATCH = 12


def _srgp(case: str, seed: int = 2, optimizer=torch.optim.Adam, **options):
    approximation, alpha, propagate, prior = SRGP_CASES[case]
    x, y, z = problem(seed=seed, dims=2)
    # PITC's bound term at the empty state does not depend on Z (Q_kk + Delta_k = K_kk): its gradient there is
    # rounding, which Adam scales to a full step; keep Z fixed so that the comparison measures the arithmetic
    learn = approximation != "pitc"
    model, likelihood = make_model(z, approximation, alpha, constant_mean=True, learn_inducing_locations=learn)
    optimizer = optimizer([*model.parameters(), *likelihood.parameters()], lr=0.05, **options)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer, propagate=propagate, prior=prior)
    return srgp, x, y


def _state(srgp) -> list[torch.Tensor]:
    """Every parameter and buffer of the model and likelihood, the propagated Jacobians and the optimizer's state."""
    model, likelihood = srgp.strategy.model, srgp.strategy.likelihood
    tensors = [*model.parameters(), *model.buffers(), *likelihood.parameters()]
    tensors += [srgp._vector_jacobian, srgp._matrix_jacobian]
    if srgp._inducing_jacobians is not None:
        tensors += [srgp._inducing_jacobians.values, srgp._inducing_jacobians.rows]
    tensors += [value for state in srgp.optimizer.state.values() for value in state.values()]
    return [tensor.detach().clone() for tensor in tensors]


def _assert_same_state(srgp, reference, rtol=1e-10, atol=1e-11):
    for value, expected in zip(_state(srgp), _state(reference), strict=True):
        torch.testing.assert_close(value, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", SRGP_CASES)
def test_srgp_step_is_one_graph(case):
    srgp, x, y = _srgp(case)
    step = RecursiveTrainingStep(srgp, compile=False)
    assert step.fallback_reason is None
    srgp.start_epoch()
    statistics = [statistic.detach().clone().requires_grad_(True) for statistic in srgp.strategy.statistics]
    epoch = None
    if srgp.prior == "frozen":
        epoch = {name: value.detach().requires_grad_(True) for name, value in srgp._epoch_parameters.items()}
    rates = torch.full((len(srgp.optimizer.param_groups),), 0.05, dtype=torch.float64)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        explanation = torch._dynamo.explain(step._lean_step)(x[:BATCH], y[:BATCH], *statistics, epoch, rates)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def _assert_steps_equal(step, srgp, reference, x, y):
    """Four steps, the last one after a new epoch, then an eager step of ``srgp`` itself."""
    for index in range(4):
        batch = slice(BATCH * index, BATCH * (index + 1))
        if index == 3:  # a new epoch: the state and the Jacobians restart, compiled steps go on
            srgp.start_epoch()
            reference.start_epoch()
        psi = step(x[batch], y[batch])
        torch.testing.assert_close(psi, reference.step(x[batch], y[batch]), rtol=1e-10, atol=0)
    assert srgp.strategy.num_observed == reference.strategy.num_observed == BATCH
    assert srgp._num_observed == BATCH and srgp._structure_verified == reference._structure_verified
    _assert_same_state(srgp, reference)
    # the state is srgp's own: an eager step follows a compiled one
    batch = slice(-BATCH, None)
    torch.testing.assert_close(srgp.step(x[batch], y[batch]), reference.step(x[batch], y[batch]), rtol=1e-10, atol=0)
    _assert_same_state(srgp, reference)


@pytest.mark.parametrize("case", SRGP_CASES)
def test_lean_srgp_step_equals_eager(case):
    # the lean step's arithmetic, run eagerly (compiling every case would take minutes; the next test compiles)
    srgp, x, y = _srgp(case)
    reference, _, _ = _srgp(case)
    _assert_steps_equal(RecursiveTrainingStep(srgp, compile=False), srgp, reference, x, y)


def test_compiled_srgp_step_equals_eager_and_a_failed_step_changes_nothing():
    srgp, x, y = _srgp("vfe-full-frozen")
    reference, _, _ = _srgp("vfe-full-frozen")
    step = compile_training_step(srgp, backend="aot_eager")
    assert type(step) is RecursiveTrainingStep and step.fallback_reason is None
    _assert_steps_equal(step, srgp, reference, x, y)
    # a NaN noise: srgp.step raises before it changes anything; the compiled step changes nothing either
    with torch.no_grad():
        srgp.strategy.likelihood.noise_covar.raw_noise.fill_(float("nan"))
    before = _state(srgp)
    with pytest.raises(RuntimeError, match="left unchanged"):
        step(x[:BATCH], y[:BATCH])
    for value, expected in zip(_state(srgp), before, strict=True):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True)
    assert srgp.strategy.num_observed == srgp._num_observed == 2 * BATCH


def test_srgp_bad_input_is_refused_before_any_change():
    srgp, x, y = _srgp("vfe-full-frozen")
    step = RecursiveTrainingStep(srgp, compile=False)
    step(x[:BATCH], y[:BATCH])
    before = _state(srgp)
    with pytest.raises(ValueError, match="NaN or inf"):
        step(x[:BATCH], torch.full_like(y[:BATCH], float("nan")))
    for value, expected in zip(_state(srgp), before, strict=True):
        assert torch.equal(value, expected)


def _kalman_pair(approximation, alpha, compile_options):
    x, y, z = problem(dims=2)
    model, likelihood = make_model(z, approximation, alpha, constant_mean=True)
    reference, _ = make_model(z, approximation, alpha, constant_mean=True)
    if compile_options is None:
        step = KalmanUpdateStep(model.variational_strategy, compile=False)
    else:
        step = compile_training_step(model.variational_strategy, **compile_options)
    assert type(step) is KalmanUpdateStep and step.fallback_reason is None
    return step, model, reference, x, y


def _assert_updates_equal(step, model, reference, x, y):
    for batch in torch.arange(x.size(0)).split(BATCH):
        psi = step(x[batch], y[batch])
        torch.testing.assert_close(psi, reference.variational_strategy.update(x[batch], y[batch]), rtol=1e-11, atol=0)
    strategy, expected = model.variational_strategy, reference.variational_strategy
    assert strategy.num_observed == expected.num_observed == x.size(0)
    for value, reference_value in zip(strategy.statistics, expected.statistics, strict=True):
        torch.testing.assert_close(value, reference_value, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(strategy.recursive_bound, expected.recursive_bound, rtol=1e-11, atol=0)
    # the same posterior, predicted through the ordinary (eager) path
    torch.testing.assert_close(model.eval()(x[:5]).mean, reference.eval()(x[:5]).mean, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("approximation, alpha", MODELS)
def test_kalman_update_is_one_graph_and_equals_update(approximation, alpha):
    step, model, reference, x, y = _kalman_pair(approximation, alpha, None)
    explanation = torch._dynamo.explain(step._lean_update)(x[:BATCH], y[:BATCH])
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    model.variational_strategy.reset()  # explain ran the update once
    _assert_updates_equal(step, model, reference, x, y)


def test_compiled_kalman_update_equals_update_and_a_failed_one_keeps_the_state():
    step, model, reference, x, y = _kalman_pair("pitc", None, {"backend": "aot_eager"})
    _assert_updates_equal(step, model, reference, x, y)
    strategy = model.variational_strategy
    statistics, bound = [statistic.clone() for statistic in strategy.statistics], strategy.recursive_bound
    with torch.no_grad():
        strategy.likelihood.noise_covar.raw_noise.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="state was left unchanged"):
        step(x[:BATCH], y[:BATCH])
    for value, expected in zip(strategy.statistics, statistics, strict=True):
        assert torch.equal(value, expected)
    assert torch.equal(strategy.recursive_bound, bound) and strategy.num_observed == x.size(0)


def test_one_kalman_update_compilation_serves_every_batch_size():
    # the batch size is a dynamic dimension from the first compilation: smaller batches take the same graph (SRGP's
    # step specializes on it: its forward-mode Jacobians are sized by the batch)
    x, y, z = problem(dims=2)
    model, _ = make_model(z, "pitc", None, constant_mean=True)
    reference, _ = make_model(z, "pitc", None, constant_mean=True)
    counter = CompileCounterWithBackend("aot_eager")
    update = compile_training_step(model.variational_strategy, backend=counter)
    compiled_frames = None
    for index, size in enumerate((BATCH, 7, BATCH, 5)):
        batch = slice(BATCH * index, BATCH * index + size)
        expected = reference.variational_strategy.update(x[batch], y[batch])
        torch.testing.assert_close(update(x[batch], y[batch]), expected, rtol=1e-11, atol=0)
        compiled_frames = compiled_frames or counter.frame_count
    assert counter.frame_count == compiled_frames
    for value, expected in zip(
        model.variational_strategy.statistics, reference.variational_strategy.statistics, strict=True
    ):
        torch.testing.assert_close(value, expected, rtol=1e-11, atol=1e-12)


def test_fitc_jacobians_fall_back_to_the_eager_step():
    x, y, z = problem(dims=2)
    model, likelihood = make_model(z, "fitc")
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
    with pytest.warns(UserWarning, match="FITC"):
        step = compile_training_step(srgp)
    assert "FITC" in step.fallback_reason
    reference_model, reference_likelihood = make_model(z, "fitc")
    reference_optimizer = torch.optim.Adam([*reference_model.parameters(), *reference_likelihood.parameters()], lr=0.05)
    reference = RecursiveGradientPropagation(reference_model, reference_likelihood, reference_optimizer)
    torch.testing.assert_close(step(x[:BATCH], y[:BATCH]), reference.step(x[:BATCH], y[:BATCH]), rtol=0, atol=0)


def test_compiled_srgp_step_with_sgd_equals_eager():
    # SGD with Nesterov momentum and weight decay: its momentum buffers start as zeros, what its first step gives
    options = {"optimizer": torch.optim.SGD, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}
    srgp, x, y = _srgp("vfe-full-frozen", **options)
    reference, _, _ = _srgp("vfe-full-frozen", **options)
    step = compile_training_step(srgp, backend="aot_eager")
    assert step.fallback_reason is None
    _assert_steps_equal(step, srgp, reference, x, y)


def test_srgp_with_an_unsupported_optimizer_falls_back():
    x, y, z = problem(dims=2)
    model, likelihood = make_model(z)
    srgp = RecursiveGradientPropagation(model, likelihood, torch.optim.RMSprop(model.parameters(), lr=0.01))
    with pytest.warns(UserWarning, match="RMSprop"):
        assert compile_training_step(srgp).fallback_reason.startswith("SRGP with RMSprop")
    dampened = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, dampening=0.5)
    with pytest.warns(UserWarning, match="dampening"):
        compile_training_step(RecursiveGradientPropagation(model, likelihood, dampened))


def test_compile_training_step_arguments():
    x, y, z = problem(dims=2)
    model, likelihood = make_model(z)
    srgp = RecursiveGradientPropagation(model, likelihood, torch.optim.Adam(model.parameters(), lr=0.01))
    with pytest.raises(TypeError, match="takes no optimizers"):
        compile_training_step(srgp, [srgp.optimizer])
    with pytest.raises(TypeError, match="needs the optimizers"):
        compile_training_step(object())
