"""Compiled training steps: one graph with no break for a whole step of every supported family (forward, ELBO,
backward, NGD and Adam), equal to the eager step of GPyTorch's general path; eager fallback, input validation and
non-finite losses. The equality tests compile with the ``aot_eager`` backend (Dynamo and AOTAutograd as in production,
without Inductor's code generation, which takes minutes on two cores); ``tests/training/test_inductor_step.py`` runs
Inductor itself (marked ``inductor``: a separate CI step)."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from gpytorch_decoupled.optim import DualEStep, RecursiveGradientPropagation
from gpytorch_decoupled.training import TrainingStep, compile_training_step, eager_training_step
from gpytorch_decoupled.validation import checks_target_values
from tests.training.training_cases import make_case, optimizers

pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES = {
    "svgp-natural": {"strategy": "svgp", "distribution": "fast_natural"},
    "svgp-cholesky": {"strategy": "svgp", "distribution": "cholesky"},
    "orthnat": {"strategy": "odvgp", "distribution": "fast_natural"},
    "hybrid": {"strategy": "hybrid", "distribution": "cholesky"},
    "tsvgp": {"strategy": "dual", "distribution": "dual"},
    "orthnat-mean-basis-adam": {"strategy": "odvgp", "distribution": "fast_natural", "mean_rule": "mean-basis-adam"},
    "decoupled": {"strategy": "decoupled", "distribution": "decoupled"},
    "decoupled-jacobi": {"strategy": "decoupled", "distribution": "decoupled", "jacobi": True},
    "decoupled-sampled-kl": {"strategy": "decoupled", "distribution": "decoupled", "sampled_kl": True},
    "orthnat-sampled-kl": {"strategy": "odvgp", "distribution": "fast_natural", "sampled_kl": True},
    "hybrid-sampled-kl": {"strategy": "hybrid", "distribution": "cholesky", "sampled_kl": True},
    "orthnat-beta-landmarks": {"strategy": "odvgp", "distribution": "fast_natural", "sampled_kl": True}
    | {"kl_data_landmarks": False},
    "svgp-bernoulli": {"strategy": "svgp", "distribution": "fast_natural", "likelihood": "bernoulli"},
    "orthnat-bernoulli": {"strategy": "odvgp", "distribution": "fast_natural", "likelihood": "bernoulli"},
    "tsvgp-bernoulli": {"strategy": "dual", "distribution": "dual", "likelihood": "bernoulli"},
}


def _training(options, seed=0):
    options = dict(options)
    mean_rule = options.pop("mean_rule", None)
    model, likelihood, mll, x, y = make_case(seed=seed, **options)
    return model, likelihood, mll, optimizers(model, likelihood, x.size(0), options["distribution"], mean_rule), x, y


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_step_is_one_graph(family):
    model, likelihood, mll, opts, x, y = _training(FAMILIES[family])
    step = TrainingStep(mll, opts, compile=False)
    assert step.fallback_reason is None
    torch.manual_seed(0)
    draws = step.lean.draws()
    e_step_lr = None if step._e_step is None else torch.tensor(0.5, dtype=torch.float64)
    rates = torch.full((sum(len(o.param_groups) for o in step._gradient_optimizers),), 0.1, dtype=torch.float64)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        explanation = torch._dynamo.explain(step._lean_step)(x, y, draws, e_step_lr, rates)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_step_equals_eager_general_step(family):
    model, likelihood, mll, opts, x, y = _training(FAMILIES[family])
    eager_model, eager_likelihood, eager_mll, eager_opts, _, _ = _training(FAMILIES[family])
    compiled = compile_training_step(mll, opts, backend="aot_eager")
    eager = TrainingStep(eager_mll, eager_opts, lean=False)
    for index in range(3):
        batch = slice(8 * index, 8 * index + 24)
        for e_step in (opt for opt in [*opts, *eager_opts] if isinstance(opt, DualEStep)):
            e_step.param_groups[0]["lr"] = max(1 / (index + 1), 0.3)  # t-SVGP's schedule: no recompilation
        torch.manual_seed(index)  # the same sampled KL rows
        loss = compiled(x[batch], y[batch])
        torch.manual_seed(index)
        expected = eager(x[batch], y[batch])
        torch.testing.assert_close(loss, expected, rtol=1e-11, atol=0)
    for value, expected in zip(_state(model, likelihood), _state(eager_model, eager_likelihood), strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    # the optimizers' state is theirs: an eager step can follow a compiled one
    for optimizer in opts:
        if isinstance(optimizer, DualEStep):
            optimizer.step(x, y)
        else:
            optimizer.step()


@pytest.mark.parametrize("family", ["svgp-natural", "orthnat-mean-basis-adam", "decoupled"])
def test_learning_rate_schedulers_do_not_recompile(family, recwarn):
    # every group's rate is data of the graph: a scheduler that changes every optimizer's rate at every step (more
    # steps than Dynamo's recompile limit) compiles nothing after the first step, does not warn that it stepped before
    # the optimizer, and the steps equal eager steps under the same schedule
    model, likelihood, mll, opts, x, y = _training(FAMILIES[family])
    eager_model, eager_likelihood, eager_mll, eager_opts, _, _ = _training(FAMILIES[family])
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compile_training_step(mll, opts, backend=counter)
    eager = TrainingStep(eager_mll, eager_opts, lean=False)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))
        for optimizer in [*opts, *eager_opts]
    ]
    compiled_frames = None
    for index in range(torch._dynamo.config.recompile_limit + 2):
        batch = slice(4 * (index % 5), 4 * (index % 5) + 24)
        torch.manual_seed(index)  # the same random draws of MeanBasisAdam's function scale
        loss = compiled(x[batch], y[batch])
        compiled_frames = compiled_frames or counter.frame_count
        torch.manual_seed(index)
        expected = eager(x[batch], y[batch])
        torch.testing.assert_close(loss, expected, rtol=1e-11, atol=0)
        for schedule in schedules:
            schedule.step()
    assert opts[0].param_groups[0]["lr"] < 0.5 * opts[0].defaults["lr"]  # the rates did change
    assert counter.frame_count == compiled_frames
    assert not [warning for warning in recwarn if "lr_scheduler.step()" in str(warning.message)]
    for value, expected in zip(_state(model, likelihood), _state(eager_model, eager_likelihood), strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["orthnat", "tsvgp", "decoupled", "decoupled-sampled-kl"])
def test_one_compilation_serves_every_batch_size(family):
    # a loader's smaller last batch (drop_last=False) takes the graph of the first compilation: the batch size is a
    # dynamic dimension from the start
    model, likelihood, mll, opts, x, y = _training(FAMILIES[family])
    eager_model, eager_likelihood, eager_mll, eager_opts, _, _ = _training(FAMILIES[family])
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compile_training_step(mll, opts, backend=counter)
    eager = TrainingStep(eager_mll, eager_opts, lean=False)
    compiled_frames = None
    for index, size in enumerate([24, 24, 17, 24, 9]):
        batch = slice(index, index + size)
        torch.manual_seed(index)
        loss = compiled(x[batch], y[batch])
        compiled_frames = compiled_frames or counter.frame_count
        torch.manual_seed(index)
        torch.testing.assert_close(loss, eager(x[batch], y[batch]), rtol=1e-11, atol=0)
    assert counter.frame_count == compiled_frames
    for value, expected in zip(_state(model, likelihood), _state(eager_model, eager_likelihood), strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "options, dynamic",
    [({}, True), ({"dynamic": None}, True), ({"dynamic": False}, False), ({"mode": "reduce-overhead"}, False)],
)
def test_batch_size_is_dynamic_unless_told_or_with_cuda_graphs(options, dynamic):
    model, likelihood, mll, opts, x, y = _training(FAMILIES["svgp-natural"])
    assert TrainingStep(mll, opts, **options)._dynamic_batch is dynamic
    assert TrainingStep(mll, opts, compile=False)._dynamic_batch is False


def test_optimizer_load_state_dict_reaches_the_compiled_step():
    # load_state_dict replaces the optimizer's groups and state: the step reads the new ones (one recompilation)
    model, likelihood, mll, opts, x, y = _training(FAMILIES["svgp-natural"])
    eager_model, eager_likelihood, eager_mll, eager_opts, _, _ = _training(FAMILIES["svgp-natural"])
    compiled = compile_training_step(mll, opts, backend="aot_eager")
    eager = TrainingStep(eager_mll, eager_opts, lean=False)
    for step in (compiled, eager):
        step(x, y)
    for adam in (opts[1], eager_opts[1]):
        saved = copy.deepcopy(adam.state_dict())
        saved["param_groups"][0]["lr"] = 0.2  # a checkpoint with another rate and the Adam moments of one step
        adam.load_state_dict(saved)
    for _ in range(2):
        torch.testing.assert_close(compiled(x, y), eager(x, y), rtol=1e-11, atol=0)
    for value, expected in zip(_state(model, likelihood), _state(eager_model, eager_likelihood), strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    assert opts[1].state[opts[1].param_groups[0]["params"][0]]["step"] == 3


def _state(model, likelihood):
    """Every parameter and buffer (t-SVGP's sites are buffers)."""
    tensors = [*model.parameters(), *model.buffers(), *likelihood.parameters()]
    return [tensor.detach().clone() for tensor in tensors if tensor.is_floating_point()]


def test_tsvgp_e_step_failure_keeps_the_sites_and_raises():
    model, likelihood, mll, opts, x, y = _training(FAMILIES["tsvgp"])
    step = compile_training_step(mll, opts, backend="aot_eager")
    sites = [site.clone() for site in model.variational_strategy._variational_distribution()]
    opts[0].min_curvature = float("nan")  # non-finite targets: the eager E-step raises before changing anything
    with pytest.raises(RuntimeError, match="sites were not changed"):
        step(x, y)
    for site, before in zip(model.variational_strategy._variational_distribution(), sites, strict=True):
        assert torch.equal(site, before)


def test_decoupled_step_that_is_not_finite_changes_nothing_of_the_strategy_and_raises():
    # The compiled step cannot raise inside its graph: MeanBasisAdam's curvature step keeps the strategy's parameters
    # and its own state where its values are not finite, and the step raises after the graph (as eagerly, where
    # MeanBasisAdam.step raises before changing anything).
    model, likelihood, mll, opts, x, y = _training(FAMILIES["decoupled"])
    step = compile_training_step(mll, opts, backend="aot_eager")
    step(x[:24], y[:24])
    distribution = model.variational_strategy._variational_distribution
    kept = [distribution.mean_coefficients, distribution.precision_factor]
    kept += list(opts[0].state[distribution.mean_coefficients].values())
    before = [tensor.clone() for tensor in kept]
    opts[0].param_groups[0]["damping"] = float("nan")
    with pytest.raises(RuntimeError, match="decoupled strategy's step is not finite"):
        step(x[:24], y[:24])
    for tensor, expected in zip(kept[:1] + kept[2:], before[:1] + before[2:], strict=True):
        assert torch.equal(tensor, expected)
    # L_B is Adam's parameter too: it took Adam's step (the other updates were applied), not the curvature step's
    assert not torch.equal(kept[1], before[1]) and torch.isfinite(kept[1]).all()


@pytest.mark.parametrize("compile", [False, True], ids=["lean", "compiled"])
def test_a_step_built_before_the_bases_grew_refuses_to_train_the_old_tensors(compile):
    # grow_bases (as OnlineBasisGrowth does) replaces the mean basis's points and coefficients and L_B: the step, which
    # holds the old tensors through its optimizers, would compute no gradient for the new ones and train nothing.
    model, likelihood, mll, opts, x, y = _training(FAMILIES["decoupled"])
    options = {"backend": "aot_eager"} if compile else {"compile": False}
    step = compile_training_step(mll, opts, **options) if compile else TrainingStep(mll, opts, compile=False)
    step(x[:24], y[:24])
    model.variational_strategy.grow_bases(mean_points=x[:3] + 0.01, inducing_points=x[3:5] + 0.01)
    before = _state(model, likelihood)
    with pytest.raises(RuntimeError, match="parameters were replaced"):
        step(x[:24], y[:24])
    for value, expected in zip(_state(model, likelihood), before, strict=True):
        assert torch.equal(value, expected)


def test_mean_basis_adam_of_another_model_falls_back():
    model, likelihood, mll, opts, x, y = _training(FAMILIES["decoupled"])
    other_model, _, _, other_opts, _, _ = _training(FAMILIES["decoupled"], seed=1)
    with pytest.warns(UserWarning, match="decoupled strategy other than"):
        step = compile_training_step(mll, [other_opts[0], opts[1]])
    assert "MeanBasisAdam" in step.fallback_reason


def test_mean_basis_adam_after_a_kernel_optimizer_falls_back():
    # its rate reads the kernel, which an earlier Adam step would have moved: the compiled step cannot reproduce that
    model, likelihood, mll, opts, x, y = _training(FAMILIES["orthnat-mean-basis-adam"])
    with pytest.warns(UserWarning, match="MeanBasisAdam after"):
        step = compile_training_step(mll, [opts[0], opts[2], opts[1]])
    assert "MeanBasisAdam" in step.fallback_reason


def test_tsvgp_without_its_e_step_falls_back():
    model, likelihood, mll, opts, x, y = _training(FAMILIES["tsvgp"])
    with pytest.warns(UserWarning, match="without its DualEStep"):
        step = compile_training_step(mll, opts[1:])
    assert "DualEStep" in step.fallback_reason


def test_unsupported_model_falls_back_to_eager_with_a_warning():
    model, likelihood, mll, opts, x, y = _training(FAMILIES["svgp-natural"])
    eager_model, eager_likelihood, eager_mll, eager_opts, _, _ = _training(FAMILIES["svgp-natural"])
    for target in (model, eager_model):
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel()).double()
        target.covar_module = kernel
    opts[1] = torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.05)
    eager_opts[1] = torch.optim.Adam([*eager_model.hyperparameters(), *eager_likelihood.parameters()], lr=0.05)
    with pytest.warns(UserWarning, match="covar_module ScaleKernel"):
        step = compile_training_step(mll, opts)
    assert "covar_module" in step.fallback_reason
    reference = TrainingStep(eager_mll, eager_opts, lean=False)
    torch.testing.assert_close(step(x, y), reference(x, y), rtol=0, atol=0)


def test_torch_older_than_2_11_falls_back_to_eager_with_a_warning(monkeypatch):
    # torch 2.5 lacks Dynamo's trace_autograd_ops and breaks the lean step's graphs: eager steps there (tested by hand
    # on torch 2.5.1, where the rest of the suite passes), for every kind of compiled step.
    from torch.torch_version import TorchVersion

    from tests.recursive_problems import make_model, problem

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.10.1"))
    model, likelihood, mll, opts, x, y = _training(FAMILIES["orthnat"])
    eager_model, eager_likelihood, eager_mll, eager_opts, _, _ = _training(FAMILIES["orthnat"])
    with pytest.warns(UserWarning, match=r"torch 2\.10\.1 \(the lean and compiled steps need torch >= 2\.11\)"):
        step = compile_training_step(mll, opts)
    reference = TrainingStep(eager_mll, eager_opts, lean=False)
    torch.testing.assert_close(step(x, y), reference(x, y), rtol=0, atol=0)
    recursive_model, recursive_likelihood = make_model(problem(dims=2)[2])
    adam = torch.optim.Adam([*recursive_model.parameters(), *recursive_likelihood.parameters()], lr=0.05)
    srgp = RecursiveGradientPropagation(recursive_model, recursive_likelihood, adam)
    for compiled in (srgp, srgp.strategy):
        with pytest.warns(UserWarning, match="need torch >= 2.11"):
            assert "torch 2.10.1" in compile_training_step(compiled).fallback_reason


@pytest.mark.parametrize(
    "options",
    [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}, {"maximize": True}],
    ids=["plain", "momentum", "nesterov-weight-decay", "maximize"],
)
def test_sgd_step_equals_eager(options):
    # SGD's momentum buffers start as zeros, which its first step (a copy of the gradient) gives without dampening
    steps = []
    for _ in range(2):
        model, likelihood, mll, _, x, y = _training(FAMILIES["svgp-cholesky"])
        sgd = torch.optim.SGD([*model.parameters(), *likelihood.parameters()], lr=0.01, **options)
        steps.append((model, likelihood, sgd, mll))
    (model, likelihood, sgd, mll), (eager_model, eager_likelihood, eager_sgd, eager_mll) = steps
    compiled = compile_training_step(mll, [sgd], backend="aot_eager")
    eager = TrainingStep(eager_mll, [eager_sgd], lean=False)
    assert compiled.fallback_reason is None
    for index in range(3):
        batch = slice(8 * index, 8 * index + 24)
        torch.testing.assert_close(compiled(x[batch], y[batch]), eager(x[batch], y[batch]), rtol=1e-11, atol=0)
    # the momentum buffers are SGD's own: its eager step follows the compiled ones
    eager_training_step(mll, [sgd], x[:24], y[:24])
    eager(x[:24], y[:24])
    for value, expected in zip(_state(model, likelihood), _state(eager_model, eager_likelihood), strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)


def test_unsupported_optimizer_falls_back():
    model, likelihood, mll, opts, x, y = _training(FAMILIES["svgp-cholesky"])
    rmsprop = torch.optim.RMSprop([*model.parameters(), *likelihood.parameters()], lr=0.01)
    with pytest.warns(UserWarning, match="RMSprop"):
        step = compile_training_step(mll, [rmsprop])
    assert step(x, y).isfinite()
    dampened = torch.optim.SGD([*model.parameters(), *likelihood.parameters()], lr=0.01, momentum=0.9, dampening=0.1)
    with pytest.warns(UserWarning, match="dampening"):
        compile_training_step(mll, [dampened])


def test_parameter_in_two_optimizers_is_refused():
    model, likelihood, mll, opts, x, y = _training(FAMILIES["svgp-natural"])
    with pytest.raises(ValueError, match="more than one optimizer"):
        TrainingStep(mll, [*opts, torch.optim.Adam(model.hyperparameters())], compile=False)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda x, y: (x[:, :1], y), "x has 1 columns"),
        (lambda x, y: (x[0], y), "x must have shape"),
        (lambda x, y: (x, y[:-1]), "y must have shape"),
        (lambda x, y: (x.float(), y), "x is torch.float32"),
        (lambda x, y: (x, torch.where(y > 0, float("nan"), y)), "NaN or inf"),
        (lambda x, y: (x.index_fill(0, torch.tensor([3]), float("inf")), y), "NaN or inf"),
        (lambda x, y: (x, y.float()), "y is torch.float32"),
        (lambda x, y: (x.tolist(), y), "x must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize("after_a_step", [False, True], ids=["first-batch", "after-a-step"])
def test_bad_input_is_refused_before_any_change(bad, message, after_a_step):
    # After a step, a batch of the same shapes, dtypes and devices is checked by its finiteness alone (one reduction
    # per tensor): the errors must be the same.
    model, likelihood, mll, opts, x, y = _training(FAMILIES["orthnat"])
    step = TrainingStep(mll, opts, compile=False)
    if after_a_step:
        step(x, y)
    before = _state(model, likelihood)
    adam_state = copy.deepcopy(opts[1].state_dict())
    with pytest.raises((TypeError, ValueError), match=message):
        step(*bad(x, y))
    for value, expected in zip(_state(model, likelihood), before, strict=True):
        assert torch.equal(value, expected)
    assert str(opts[1].state_dict()) == str(adam_state)


def test_targets_of_label_likelihoods_are_always_checked_in_full():
    # The repeated-batch check reads only the finiteness of targets whose likelihood takes any real value.
    likelihoods = gpytorch.likelihoods
    assert not checks_target_values(likelihoods.GaussianLikelihood())
    for likelihood in (likelihoods.BernoulliLikelihood(), likelihoods.SoftmaxLikelihood(num_classes=3, num_features=2)):
        assert checks_target_values(likelihood)
    assert checks_target_values(likelihoods.BetaLikelihood())


def test_non_finite_loss_raises():
    model, likelihood, mll, opts, x, y = _training(FAMILIES["svgp-natural"])
    step = compile_training_step(mll, opts, backend="aot_eager")
    with torch.no_grad():
        model.covar_module.raw_outputscale.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="not finite"):
        step(x, y)
