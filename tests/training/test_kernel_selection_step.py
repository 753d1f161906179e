"""The kernel-selection (VBKS) training step: the lean candidate bank and local ELBOs against the bank's and the
model's general path (float64, values and every gradient), one graph with no break, the compiled step equal to the
eager general step, fallbacks, input validation and ``KernelSelectionGP.fit(compile=True)``."""

from __future__ import annotations

import copy
import math

import gpytorch
import pytest
import torch

from gpytorch_decoupled.kernels import CandidateKernelBank
from gpytorch_decoupled.models import KernelSelectionGP
from gpytorch_decoupled.training import KernelSelectionStep, LeanCandidateBank, compile_training_step

pytestmark = pytest.mark.usefixtures("single_thread")

SPACE = ["SE", "RQ", "PER", "LIN", "SE + PER×LIN", "(PER + RQ)×LIN", "SE×RQ×PER", "LIN×LIN"]
# With a hyperparameter posterior the sub-models are unwhitened, and GPyTorch clamps each datum's variance
# k(x, x) - k_xz K_zz^-1 k_zx at zero: for LIN and LIN×LIN (rank at most 3 < M) it is zero up to rounding, so which
# side of the clamp it falls on, and the gradient through it, is rounding (both paths are right); these tests leave
# them out.
FULL_RANK_SPACE = [name for name in SPACE if name not in ("LIN", "LIN×LIN")]
N, M, D = 60, 10, 2


def _data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=generator, dtype=torch.float64)
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(N, generator=generator, dtype=torch.float64)
    return x, y


def _model(seed=0, space=SPACE, **kwargs) -> KernelSelectionGP:
    """A generic point: random q(u_c), hyperparameters away from their defaults, ARD."""
    torch.manual_seed(seed)
    x, _ = _data()
    model = KernelSelectionGP(space, inducing_points=x[:M].clone(), ard_num_dims=D, **kwargs).double()
    model.kernel.set_base_hyperparameters("PER", period_length=1.3)
    with torch.no_grad():
        distribution = model.candidates.variational_strategy._variational_distribution
        distribution.variational_mean.normal_()
        if hasattr(distribution, "chol_variational_covar"):
            chol = distribution.chol_variational_covar
            chol.copy_(torch.eye(M, dtype=torch.float64) * 0.5 + 0.05 * torch.randn_like(chol).tril())
        for name, parameter in model.named_parameters():
            if not name.startswith(("kernel_belief", "candidates.variational_strategy")):
                parameter.add_(0.3 * torch.randn_like(parameter))
        model.candidates.variational_strategy.variational_params_initialized.fill_(1)
    return model


def _adam(model, **options):
    parameters = [p for name, p in model.named_parameters() if not name.startswith("kernel_belief.")]
    return torch.optim.Adam(parameters, lr=0.01, **options)


def _trained(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if not name.startswith("kernel_belief.")]


def assert_steps_equal(step, eager, x, y, batches, rtol=1e-11, parameter_rtol=1e-10):
    """Steps both on the same batches (and the same draws of a hyperparameter posterior), then compares the returned
    local ELBOs and every trained parameter. LIN's K_uu has rank D < M (only the jitter makes it definite): rounding
    differences grow to ~1e-11 in q(u), hence the parameters' absolute tolerance."""
    for index, batch in enumerate(batches):
        torch.manual_seed(index)
        value = step(x[batch], y[batch])
        torch.manual_seed(index)
        torch.testing.assert_close(value, eager(x[batch], y[batch]), rtol=rtol, atol=rtol / 100)
    for (name, value), (_, expected) in zip(_trained(step.model), _trained(eager.model), strict=True):
        torch.testing.assert_close(value, expected, rtol=parameter_rtol, atol=1e-10, msg=name)


@pytest.mark.parametrize("ard", [None, D], ids=["shared-lengthscale", "ard"])
def test_lean_bank_equals_the_bank_values_and_gradients(ard):
    torch.manual_seed(1)
    bank = CandidateKernelBank(SPACE, ard_num_dims=ard).double()
    with torch.no_grad():
        for parameter in bank.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    lean = LeanCandidateBank.of(bank)
    x1, x2 = torch.randn(7, D, dtype=torch.float64), torch.randn(5, D, dtype=torch.float64)
    blocks = [(lambda f: f(x1, x2)), (lambda f: f(x1, x1)), None]
    for block in blocks:
        if block is None:
            value, expected = lean.diagonal(x1), bank(x1, diag=True)
        else:
            value, expected = block(lean), block(lambda a, b: bank(a, b).to_dense())
        assert value.shape == expected.shape
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-14)
        weights = torch.randn_like(value)
        gradients = torch.autograd.grad((value * weights).sum(), list(bank.parameters()), materialize_grads=True)
        expected_gradients = torch.autograd.grad(
            (expected * weights).sum(), list(bank.parameters()), materialize_grads=True
        )
        for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
            torch.testing.assert_close(gradient, expected_gradient, rtol=1e-10, atol=1e-12)


def test_lean_local_elbo_terms_equal_the_models_values_and_gradients():
    x, y = _data()
    model = _model()
    step = KernelSelectionStep(model, _adam(model), N, compile=False)
    assert step.fallback_reason is None
    model.train()
    terms = step.lean(x[:24], y[:24], N)
    expected = model.local_elbo_terms(x[:24], y[:24], N)
    names, parameters = zip(*_trained(model))
    for value, reference in zip(terms, expected, strict=True):
        assert value.shape == (len(SPACE),)
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    weights = torch.randn(len(SPACE), dtype=torch.float64)
    gradients = torch.autograd.grad(((terms[0] - terms[1]) * weights).sum(), parameters)
    expected_gradients = torch.autograd.grad(((expected[0] - expected[1]) * weights).sum(), parameters)
    for name, gradient, expected_gradient in zip(names, gradients, expected_gradients, strict=True):
        scale = expected_gradient.abs().max()
        assert (gradient - expected_gradient).abs().max() <= 1e-10 * scale, name


def test_bernoulli_likelihood_terms_equal_the_models():
    # VBKS for classification: every candidate's quadrature of GPyTorch's log Phi, labels in {0, 1}
    x, y = _data()
    labels = (y > 0).to(y.dtype)
    model = _model(likelihood=gpytorch.likelihoods.BernoulliLikelihood())
    step = KernelSelectionStep(model, _adam(model), N, compile=False)
    assert step.fallback_reason is None
    model.train()
    terms = step.lean(x[:24], labels[:24], N)
    expected = model.local_elbo_terms(x[:24], labels[:24], N)
    for value, reference in zip(terms, expected, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    names, parameters = zip(*_trained(model))
    gradients = torch.autograd.grad((terms[0] - terms[1]).sum(), parameters)
    expected_gradients = torch.autograd.grad((expected[0] - expected[1]).sum(), parameters)
    for name, gradient, expected_gradient in zip(names, gradients, expected_gradients, strict=True):
        assert (gradient - expected_gradient).abs().max() <= 1e-10 * expected_gradient.abs().max(), name


def test_whole_step_is_one_graph():
    x, y = _data()
    model = _model(learn_inducing_locations=True)
    step = KernelSelectionStep(model, _adam(model), N, compile=False)
    rates = torch.full((1,), 0.01, dtype=torch.float64)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        explanation = torch._dynamo.explain(step._lean_step)(x[:24], y[:24], None, rates)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("learn_inducing_locations", [False, True], ids=["fixed-z", "learned-z"])
def test_compiled_step_equals_eager_general_step(learn_inducing_locations):
    x, y = _data()
    model, eager_model = (_model(learn_inducing_locations=learn_inducing_locations) for _ in range(2))
    compiled = KernelSelectionStep(model, _adam(model), N, backend="aot_eager")
    eager = KernelSelectionStep(eager_model, _adam(eager_model), N, lean=False)
    # the batch size changes: one compilation serves all
    assert_steps_equal(compiled, eager, x, y, [slice(8 * i, 8 * i + 24 - 4 * i) for i in range(3)])
    assert model.candidates.variational_strategy.inducing_points.requires_grad == learn_inducing_locations


def test_first_step_initializes_q_u_as_the_general_path():
    x, y = _data()
    model = KernelSelectionGP(["SE", "PER"], inducing_points=x[:M].clone()).double()
    eager_model = copy.deepcopy(model)
    compiled = KernelSelectionStep(model, _adam(model), N, backend="aot_eager")
    eager = KernelSelectionStep(eager_model, _adam(eager_model), N, lean=False)
    torch.manual_seed(3)
    value = compiled(x, y)
    torch.manual_seed(3)
    torch.testing.assert_close(value, eager(x, y), rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda model: {"optimizer": torch.optim.RMSprop(model.parameters(), lr=0.1)}, "RMSprop"),
        (lambda model: {"optimizer": _adam(model, amsgrad=True)}, "amsgrad"),
        (lambda model: {"optimizer": torch.optim.Adam(model.parameters())}, "other than the candidates'"),
        (lambda model: {"lean": False}, "lean=False"),
    ],
    ids=["rmsprop", "amsgrad", "kernel-belief", "lean-false"],
)
def test_unsupported_steps_fall_back_to_eager(change, reason, recwarn):
    x, y = _data()
    model = _model()
    options = {"optimizer": _adam(model), **change(model)}
    step = KernelSelectionStep(model, options.pop("optimizer"), N, **options)
    assert reason in step.fallback_reason
    assert len(recwarn.list) == (0 if reason == "lean=False" else 1)
    before = model.kernel.base_kernels["SE"].raw_outputscale.detach().clone()
    assert step(x, y).shape == (len(SPACE),)
    assert not torch.equal(model.kernel.base_kernels["SE"].raw_outputscale, before)


def test_hyperparameter_posterior_terms_equal_the_models_values_and_gradients():
    # The unwhitened sub-models at each draw of the hyperparameters (the same generator call as the model's own pass),
    # averaged, plus KL[q(theta) || p(theta)]: the model's local ELBO terms and every gradient, the posterior's too.
    x, y = _data()
    model = _model(space=FULL_RANK_SPACE, hyperparameter_posterior=True, num_hyperparameter_samples=3)
    with torch.no_grad():
        model.hyperparameter_posterior.raw_scale_tril.add_(
            0.1 * torch.randn_like(model.hyperparameter_posterior.raw_scale_tril)
        )
    step = KernelSelectionStep(model, _adam(model), N, compile=False)
    assert step.fallback_reason is None
    model.train()
    torch.manual_seed(5)
    terms = step.lean(x[:24], y[:24], N, step.lean.draws())
    torch.manual_seed(5)
    expected = model.local_elbo_terms(x[:24], y[:24], N)
    names, parameters = zip(*_trained(model))
    assert any(name.startswith("hyperparameter_posterior") for name in names)
    for value, reference in zip(terms, expected, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    weights = torch.randn(len(FULL_RANK_SPACE), dtype=torch.float64)
    gradients = torch.autograd.grad(((terms[0] - terms[1]) * weights).sum(), parameters)
    expected_gradients = torch.autograd.grad(((expected[0] - expected[1]) * weights).sum(), parameters)
    for name, gradient, expected_gradient in zip(names, gradients, expected_gradients, strict=True):
        assert (gradient - expected_gradient).abs().max() <= 1e-10 * expected_gradient.abs().max(), name


def test_hyperparameter_posterior_step_is_one_graph_and_equals_eager():
    x, y = _data()
    options = {"space": FULL_RANK_SPACE, "hyperparameter_posterior": True, "num_hyperparameter_samples": 2}
    explained, model, eager_model = (_model(**options) for _ in range(3))
    step = KernelSelectionStep(explained, _adam(explained), N, compile=False)
    rates = torch.full((1,), 0.01, dtype=torch.float64)
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # explain runs the step: on a model of its own
        explanation = torch._dynamo.explain(step._lean_step)(x[:24], y[:24], step.lean.draws(), rates)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = KernelSelectionStep(model, _adam(model), N, backend="aot_eager")
    eager = KernelSelectionStep(eager_model, _adam(eager_model), N, lean=False)
    assert_steps_equal(compiled, eager, x, y, [slice(8 * i, 8 * i + 24) for i in range(3)])
    # a batch equal to the inducing points: GPyTorch's unwhitened strategy returns q(u) itself, the step takes it
    z = model.candidates.variational_strategy.inducing_points.detach().clone()
    torch.manual_seed(7)
    value = compiled(z, y[:M])
    torch.manual_seed(7)
    torch.testing.assert_close(value, eager(z, y[:M]), rtol=1e-11, atol=1e-13)


def test_other_sub_models_fall_back_and_fit_does_not_warn(recwarn):
    x, y = _data()

    def strategy(model, inducing_points, num_candidates):
        distribution = gpytorch.variational.MeanFieldVariationalDistribution(
            inducing_points.size(-2), batch_shape=torch.Size([num_candidates])
        )
        return gpytorch.variational.VariationalStrategy(model, inducing_points, distribution)

    model = _model(variational_strategy=strategy)
    with pytest.warns(UserWarning, match="MeanFieldVariationalDistribution"):
        KernelSelectionStep(model, _adam(model), N)
    recwarn.clear()
    model.fit(x, y, num_iterations=2, batch_size=20, progress=False)
    assert not [w for w in recwarn.list if "lean kernel-selection step" in str(w.message)]


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda x, y: (x, torch.where(y > 0, float("nan"), y)), "NaN or inf"),
        (lambda x, y: (x.index_fill(0, torch.tensor([3]), float("inf")), y), "NaN or inf"),
        (lambda x, y: (x, y[:-1]), "y must have shape"),
        (lambda x, y: (x.float(), y), "x is torch.float32"),
        (lambda x, y: (x[:, :1], y), "x has 1 columns"),
    ],
)
@pytest.mark.parametrize("after_a_step", [False, True], ids=["first-batch", "after-a-step"])
def test_bad_input_is_refused_before_any_change(bad, message, after_a_step):
    x, y = _data()
    model = _model()
    optimizer = _adam(model)
    step = KernelSelectionStep(model, optimizer, N, compile=False)
    if after_a_step:
        step(x, y)
    before = copy.deepcopy(model.state_dict())
    adam_state = str(optimizer.state_dict())
    with pytest.raises(ValueError, match=message):
        step(*bad(x, y))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]) or (value.isnan().all() and before[key].isnan().all()), key
    assert str(optimizer.state_dict()) == adam_state


def test_labels_are_checked_in_full_after_a_step():
    # a Bernoulli likelihood reads the targets' values: a repeated batch shape is not enough to skip the label check
    x, y = _data()
    labels = (y > 0).to(y.dtype)
    model = _model(likelihood=gpytorch.likelihoods.BernoulliLikelihood())
    step = KernelSelectionStep(model, _adam(model), N, compile=False)
    step(x, labels)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="BernoulliLikelihood takes labels"):
        step(x, torch.full_like(labels, 0.5))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]) or (value.isnan().all() and before[key].isnan().all()), key


def test_num_data_below_the_batch_size_is_refused():
    x, y = _data()
    model = _model()
    step = KernelSelectionStep(model, _adam(model), 10, compile=False)
    with pytest.raises(ValueError, match="num_data"):
        step(x, y)
    with pytest.raises(TypeError, match="KernelSelectionGP"):
        KernelSelectionStep(model.candidates, _adam(model), N)


def test_non_finite_local_elbos_raise():
    x, y = _data()
    model = _model()
    step = KernelSelectionStep(model, _adam(model), N, backend="aot_eager")
    with torch.no_grad():
        model.likelihood.raw_noise.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="not finite"):
        step(x, y)


def test_fit_compiled_equals_fit_eager():
    x, y = _data()
    model, eager_model = _model(), _model()
    trace = model.fit(
        x,
        y,
        num_iterations=4,
        batch_size=16,
        generator=torch.Generator().manual_seed(0),
        progress=False,
        compile=True,
        backend="aot_eager",
    )
    expected = eager_model.fit(
        x, y, num_iterations=4, batch_size=16, generator=torch.Generator().manual_seed(0), progress=False
    )
    torch.testing.assert_close(trace, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.kernel_posterior().probabilities, eager_model.kernel_posterior().probabilities)
    with pytest.raises(TypeError, match="compile=False"):
        model.fit(x, y, num_iterations=1, progress=False, backend="aot_eager")
    assert math.isfinite(float(model.local_elbo_estimates.sum()))


def test_sgd_step_equals_eager():
    x, y = _data()
    model, eager_model = _model(), _model()
    options = {"lr": 1e-3, "momentum": 0.9, "nesterov": True}
    parameters = [[p for _, p in _trained(m)] for m in (model, eager_model)]
    step = KernelSelectionStep(model, torch.optim.SGD(parameters[0], **options), N, backend="aot_eager")
    assert step.fallback_reason is None
    eager = KernelSelectionStep(eager_model, torch.optim.SGD(parameters[1], **options), N, lean=False)
    assert_steps_equal(step, eager, x, y, [slice(8 * i, 8 * i + 24) for i in range(3)])


def test_compile_training_step_builds_the_kernel_selection_step():
    model = _model()
    adam = _adam(model)
    step = compile_training_step(model, adam, num_data=N, backend="aot_eager")
    assert isinstance(step, KernelSelectionStep) and step.compiled and step.fallback_reason is None
    assert isinstance(compile_training_step(model, [adam], num_data=N, backend="aot_eager"), KernelSelectionStep)
    with pytest.raises(TypeError, match="num_data=n"):
        compile_training_step(model, adam)
    with pytest.raises(TypeError, match="num_data is for a KernelSelectionGP"):
        compile_training_step(gpytorch.mlls.VariationalELBO(model.likelihood, model.candidates, N), [adam], num_data=N)
