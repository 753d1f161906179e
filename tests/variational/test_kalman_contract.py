"""The API contract of KalmanVariationalStrategy: no trainable variational parameters, clear errors that leave the
state exactly as it was, a stream checkpointed mid-way with ``state_dict`` (or pickled / deep-copied) and resumed
with identical results, ``reset``, float64 state through ``.float()`` and back, eval caches invalidated by every
update, reset and load, and ``prior=True``."""

from __future__ import annotations

import copy
import functools
import pickle
import unittest.mock

import gpytorch
import pytest
import torch
from linear_operator.operators import DiagLinearOperator
from linear_operator.utils.errors import NotPSDError

from gpytorch_decoupled.variational import KalmanVariationalStrategy, _kalman_terms
from gpytorch_decoupled.variational import kalman_variational_strategy as kalman_module
from tests.recursive_problems import F64, RecursiveGP, blocks_of, make_model, problem, stream

pytestmark = pytest.mark.usefixtures("single_thread")

X_STAR = torch.linspace(-3.5, 3.5, 9, dtype=F64).unsqueeze(-1)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _assert_same_state(model, snapshot) -> None:
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    for name, value in snapshot.items():
        assert torch.equal(state[name], value), name


def _predict(model, x=X_STAR):
    model.eval()
    with torch.no_grad():
        output = model(x)
    return output.mean, output.covariance_matrix


def _half_streamed(approximation="fitc", alpha=None):
    X, y, Z = problem()
    model, likelihood = make_model(Z, approximation, alpha, constant_mean=True)
    blocks = blocks_of(60, 12)
    stream(model, X, y, blocks[:3])
    return model, likelihood, X, y, blocks


def test_state_is_buffers_and_nothing_variational_is_trainable():
    model, _, _, _, _ = _half_streamed()
    assert list(model.variational_parameters()) == []
    names = {name for name, _ in model.named_parameters()}
    assert names == {
        "variational_strategy.inducing_points",
        "mean_module.raw_constant",
        "covar_module.raw_outputscale",
        "covar_module.base_kernel.raw_lengthscale",
    }
    state = model.state_dict()
    prefix = "variational_strategy._variational_distribution."
    assert state[prefix + "information_vector"].dtype == F64
    assert state[prefix + "information_matrix"].shape == (10, 10)
    assert int(state[prefix + "num_observed"]) == 36
    assert model.variational_strategy.jitter_val == 1e-8
    # GPyTorch's variational jitter for the dtype of the kernel matrices
    default = KalmanVariationalStrategy(model, torch.zeros(3, 1), likelihood=gpytorch.likelihoods.GaussianLikelihood())
    assert default.jitter_val == 1e-4 and default.double().jitter_val == 1e-6


@pytest.mark.parametrize(
    "likelihood",
    [
        gpytorch.likelihoods.BernoulliLikelihood(),
        gpytorch.likelihoods.FixedNoiseGaussianLikelihood(torch.ones(5)),
        gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2),
    ],
)
def test_non_gaussian_likelihoods_are_refused(likelihood):
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        RecursiveGP(torch.zeros(4, 1), likelihood)
    strategy = RecursiveGP(torch.zeros(4, 1), None).variational_strategy
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        strategy.likelihood = likelihood
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        strategy.update(torch.zeros(3, 1), torch.zeros(3), likelihood)
    assert strategy.likelihood is None


def test_the_likelihood_may_come_later_and_is_attached_once():
    X, y, Z = problem()
    reference, likelihood = make_model(Z)
    stream(reference, X, y, blocks_of(60, 12))
    model, _ = make_model(Z)
    strategy = model.variational_strategy
    strategy.likelihood = None  # built without one, as BoTorch builds it
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=r"update\(x, y, likelihood=likelihood\)"):
        strategy.update(X[:12], y[:12])
    _assert_same_state(model, snapshot)
    for block in blocks_of(60, 12):
        strategy.update(X[block], y[block], likelihood if block[0] == 0 else None)
    assert strategy.likelihood is likelihood
    _assert_same_state(model, _snapshot(reference))
    with pytest.raises(ValueError, match="must be the one"):
        strategy.update(X[:12], y[:12], gpytorch.likelihoods.GaussianLikelihood().double())
    # The model's own likelihood attribute is used when none is attached (as GPyTorch's fantasy models read it).
    model.likelihood = likelihood
    strategy.likelihood = None
    assert strategy.likelihood is likelihood


def test_the_old_argument_order_still_works_with_a_deprecation_warning():
    X, y, Z = problem()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    new = RecursiveGP(Z, likelihood, "pep", 0.5, jitter_val=1e-8).double()
    for old_arguments in [(likelihood, "pep", 0.5), (likelihood,)]:
        model = RecursiveGP(Z, None).double()
        with pytest.warns(DeprecationWarning, match="GPyTorch's order"):
            strategy = KalmanVariationalStrategy(model, Z, *old_arguments, jitter_val=1e-8)
        assert strategy.likelihood is likelihood and strategy.jitter_val == 1e-8
        expected = ("pep", 0.5) if len(old_arguments) > 1 else ("vfe", None)
        assert (strategy.approximation, strategy.alpha) == expected
    model.variational_strategy = strategy
    new.load_state_dict(model.state_dict())
    assert set(model.state_dict()) == set(new.state_dict())


@pytest.mark.parametrize(
    "approximation,alpha,match",
    [
        ("sor", None, "approximation"),
        ("pep", None, "alpha"),
        ("pep", 0.0, "alpha"),
        ("pep", 1.5, "alpha"),
        ("vfe", 0.5, "alpha"),
    ],
)
def test_bad_approximations_are_refused(approximation, alpha, match):
    with pytest.raises(ValueError, match=match):
        RecursiveGP(torch.zeros(4, 1), gpytorch.likelihoods.GaussianLikelihood(), approximation, alpha)
    assert RecursiveGP(torch.zeros(4, 1), gpytorch.likelihoods.GaussianLikelihood(), "PEP", 0.3)


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda x, y: (x, y.clone().index_fill_(0, torch.tensor([3]), float("nan"))), "NaN"),
        (lambda x, y: (x.clone().index_fill_(0, torch.tensor([1]), float("inf")), y), "NaN or inf"),
        (lambda x, y: (x, y[:-1]), "shape"),
        (lambda x, y: (x, y[0]), "shape"),
        (lambda x, y: (torch.cat([x, x], dim=-1), y), "x has 2 columns"),
        (lambda x, y: (x, y.float()), "float32"),
        (lambda x, y: (x.float(), y.float()), "float32"),
        (lambda x, y: (x[:0], y[:0]), "empty"),
        (lambda x, y: (x.expand(3, *x.shape), y), "batch shape"),
    ],
)
def test_bad_mini_batches_raise_and_leave_the_state_unchanged(corrupt, match):
    model, _, X, y, blocks = _half_streamed()
    snapshot = _snapshot(model)
    x_bad, y_bad = corrupt(X[blocks[3]], y[blocks[3]])
    with pytest.raises(ValueError, match=match):
        model.variational_strategy.update(x_bad, y_bad)
    _assert_same_state(model, snapshot)


def test_numerical_failures_leave_the_state_unchanged():
    model, _, X, y, blocks = _half_streamed()
    strategy = model.variational_strategy
    snapshot = _snapshot(model)
    # The factorization of the updated precision fails even with the maximum jitter.
    real = _kalman_terms.jittered_cholesky

    def failing(matrix, **kwargs):
        if kwargs.get("name", "").startswith("Kalman"):
            raise NotPSDError("not positive definite even with jitter")
        return real(matrix, **kwargs)

    with unittest.mock.patch.object(_kalman_terms, "jittered_cholesky", failing):
        with pytest.raises(NotPSDError):
            strategy.update(X[blocks[3]], y[blocks[3]])
    _assert_same_state(model, snapshot)
    # A NaN bound term (here: injected) is refused before anything is added.
    with unittest.mock.patch.object(kalman_module, "bound_term", lambda *args: torch.tensor(float("nan"))):
        with pytest.raises(RuntimeError, match="NaN or inf"):
            strategy.update(X[blocks[3]], y[blocks[3]])
    _assert_same_state(model, snapshot)
    # A NaN hyperparameter.
    with torch.no_grad():
        model.covar_module.raw_outputscale.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        strategy.update(X[blocks[3]], y[blocks[3]])
    with torch.no_grad():
        model.covar_module.raw_outputscale.copy_(snapshot["covar_module.raw_outputscale"])
    _assert_same_state(model, snapshot)


def test_kernel_batch_shape_must_match_the_inducing_points():
    X, y, Z = problem()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = RecursiveGP(Z, likelihood).double()
    model.covar_module = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).double()
    with pytest.raises(ValueError, match="batch shape"):
        model.variational_strategy.update(X[:5], y[:5])
    assert model.variational_strategy.num_observed == 0


def test_checkpoint_mid_stream_and_resume():
    model, likelihood, X, y, blocks = _half_streamed("pitc")
    checkpoint = copy.deepcopy((model.state_dict(), likelihood.state_dict()))

    resumed, resumed_likelihood = make_model(torch.zeros(10, 1, dtype=F64), "pitc", constant_mean=True)
    resumed.load_state_dict(checkpoint[0])
    resumed_likelihood.load_state_dict(checkpoint[1])
    clones = [resumed, pickle.loads(pickle.dumps(model)), copy.deepcopy(model)]
    reference = stream(model, X, y, blocks[3:])
    for clone in clones:
        assert torch.equal(torch.stack(stream(clone, X, y, blocks[3:])), torch.stack(reference))
        assert clone.variational_strategy.num_observed == 60
        _assert_same_state(clone, model.state_dict())
        for actual, expected in zip(_predict(clone), _predict(model), strict=True):
            assert torch.equal(actual, expected)


def test_reset_returns_to_the_prior():
    model, _, X, _, _ = _half_streamed()
    strategy = model.variational_strategy
    assert float(strategy.kl_divergence().detach()) > 1.0
    _predict(model)  # warm eval caches
    strategy.reset()
    assert strategy.num_observed == 0 and float(strategy.recursive_bound) == 0.0
    mean, covariance = _predict(model)
    with torch.no_grad():
        prior = model(X_STAR, prior=True)
    torch.testing.assert_close(mean, prior.mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(covariance, prior.covariance_matrix, rtol=0, atol=1e-10)
    torch.testing.assert_close(strategy.kl_divergence(), torch.zeros((), dtype=F64), rtol=0, atol=1e-10)


def test_float32_and_back_keeps_the_float64_state():
    model, likelihood, X, y, blocks = _half_streamed()
    twin = copy.deepcopy(model)
    snapshot = _snapshot(model)
    expected = _predict(model)

    model.float()
    state = model.variational_strategy._variational_distribution
    assert state.information_matrix.dtype == F64 and model.variational_strategy.inducing_points.dtype == torch.float32
    assert torch.equal(
        state.information_vector, snapshot["variational_strategy._variational_distribution.information_vector"]
    )
    mean, covariance = _predict(model, X_STAR.float())
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean, expected[0].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(covariance, expected[1].float(), rtol=1e-3, atol=1e-4)

    psi = model.variational_strategy.update(X[blocks[3]].float(), y[blocks[3]].float())
    twin_psi = twin.variational_strategy.update(X[blocks[3]], y[blocks[3]])
    assert psi.dtype == torch.float32
    torch.testing.assert_close(psi.double(), twin_psi, rtol=1e-5, atol=1e-5)

    model.double()
    assert state.information_matrix.dtype == F64
    torch.testing.assert_close(
        state.information_matrix,
        twin.variational_strategy._variational_distribution.information_matrix,
        rtol=1e-5,
        atol=1e-6,
    )
    for actual, reference in zip(_predict(model), _predict(twin), strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-6)


def test_eval_caches_follow_updates_resets_and_loads():
    model, _, X, y, blocks = _half_streamed()
    strategy = model.variational_strategy
    first = _predict(model)
    assert strategy._kept_posterior_factors is not None
    with unittest.mock.patch.object(kalman_module, "jittered_cholesky", wraps=kalman_module.jittered_cholesky) as chol:
        assert all(torch.equal(a, b) for a, b in zip(_predict(model), first, strict=True))
        assert chol.call_count == 0  # the cached factors were reused

    strategy.update(X[blocks[3]], y[blocks[3]])  # still in eval mode
    after_update = _predict(model)
    fresh = _predict(copy.deepcopy(model))  # copies carry no caches
    assert all(torch.equal(a, b) for a, b in zip(after_update, fresh, strict=True))
    assert not torch.allclose(after_update[0], first[0])

    other, _ = make_model(strategy.inducing_points.detach().clone(), "fitc", constant_mean=True)
    stream(other, X, y, blocks[:1])
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_predict(model), _predict(other), strict=True))


def test_prior_call_and_one_dimensional_inputs():
    model, _, X, y, _ = _half_streamed()
    for mode in (True, False):
        model.train(mode)
        with torch.no_grad():
            prior = model(X_STAR, prior=True)
            expected = model.forward(X_STAR)
        torch.testing.assert_close(prior.mean, expected.mean)
        torch.testing.assert_close(prior.covariance_matrix, expected.covariance_matrix)
    psi = model.variational_strategy.update(X[40:45, 0], y[40:45])
    assert psi.shape == () and model.variational_strategy.num_observed == 41


def test_predictions_broadcast_over_batches_of_inputs():
    model, _, _, _, _ = _half_streamed()
    single = _predict(model)
    batched = _predict(model, torch.stack([X_STAR, X_STAR + 0.5, X_STAR - 0.5]))
    assert batched[0].shape == (3, 9)
    for actual, expected in zip(batched, single, strict=True):
        torch.testing.assert_close(actual[0], expected, rtol=1e-12, atol=1e-13)
    again = _predict(model)  # the expanded eval caches are not reused for unbatched inputs
    assert all(torch.equal(a, b) for a, b in zip(again, single, strict=True))


def test_training_mode_returns_marginals_with_gradients():
    model, likelihood, X, y, _ = _half_streamed("vfe")
    model.train()
    output = model(X[:7])
    assert isinstance(output.lazy_covariance_matrix, DiagLinearOperator)
    full = model(X[:7], diag=False)
    model.eval()
    with torch.no_grad():
        reference = model(X[:7])
    torch.testing.assert_close(output.variance.detach(), reference.variance, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(full.covariance_matrix.detach(), reference.covariance_matrix, rtol=1e-12, atol=1e-14)
    output.mean.sum().backward()
    assert model.covar_module.raw_outputscale.grad is not None


@pytest.mark.cuda
def test_cuda_matches_cpu():
    from gpytorch_decoupled.mlls import StreamingCollapsedBound
    from gpytorch_decoupled.optim import RecursiveGradientPropagation

    X, y, Z = problem()
    blocks = blocks_of(60, 12)
    results = {}
    for device in ("cpu", "cuda"):
        model, likelihood = make_model(Z, "fitc", constant_mean=True)
        model.to(device)
        likelihood.to(device)
        Xd, yd = X.to(device), y.to(device)
        psi = torch.stack(stream(model, Xd, yd, blocks[:2]))
        mean, covariance = _predict(model, X_STAR.to(device))
        model.train()
        loss = StreamingCollapsedBound(model, likelihood).value_and_backward([(Xd, yd)])
        optimizer = torch.optim.SGD([*model.parameters(), *likelihood.parameters()], lr=0.0)
        srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
        step_psi = torch.tensor([srgp.step(Xd[block], yd[block]) for block in blocks], dtype=F64)
        gradient = model.variational_strategy.inducing_points.grad
        results[device] = [value.cpu() for value in (psi, mean, covariance, loss, step_psi, gradient)]
    for cpu, cuda in zip(results["cpu"], results["cuda"], strict=True):
        torch.testing.assert_close(cuda, cpu, rtol=1e-9, atol=1e-10)


def test_the_public_update_protocol_composes_to_update():
    # update() is checked_data, observation_terms, bound_term, increments and absorb in turn: the protocol the
    # optimizers, the streaming bound and the distributed update use.
    model, likelihood, X, y, blocks = _half_streamed("pep", 0.5)
    twin = copy.deepcopy(model)
    strategy, twin_strategy = model.variational_strategy, twin.variational_strategy
    batch = blocks[3]
    psi = strategy.update(X[batch], y[batch])
    x, y_batch = twin_strategy.checked_data(X[batch], y[batch])
    terms, inducing_covariance = twin_strategy.observation_terms(x, y_batch)
    with torch.no_grad():
        twin_psi = twin_strategy.bound_term(terms, inducing_covariance, *twin_strategy.statistics)
    increments = twin_strategy.increments(terms, twin_psi)
    torch.testing.assert_close(increments.information_matrix, increments.information_matrix.mT, rtol=0, atol=0)
    twin_strategy.absorb(increments, x.size(-2))
    assert torch.equal(twin_psi, psi)
    _assert_same_state(twin, _snapshot(model))
    assert twin_strategy.num_observed == strategy.num_observed == 48


def test_of_model_finds_the_strategy_and_checks_the_likelihood():
    model, likelihood, *_ = _half_streamed()
    assert KalmanVariationalStrategy.of_model(model, likelihood, "Caller") is model.variational_strategy
    with pytest.raises(ValueError, match="Caller: the likelihood must be the one"):
        KalmanVariationalStrategy.of_model(model, gpytorch.likelihoods.GaussianLikelihood(), "Caller")
    with pytest.raises(TypeError, match="Caller needs a model whose variational_strategy is a KalmanVariational"):
        KalmanVariationalStrategy.of_model(torch.nn.Module(), likelihood, "Caller")


def test_a_training_step_at_the_prior_names_the_update_call():
    # GPyTorch's loop with only the strategy swapped in: the first step fails instead of fitting to the prior.
    X, y, Z = problem()
    model, likelihood = make_model(Z)
    model.train()
    with pytest.raises(RuntimeError, match=r"update\(x_batch, y_batch, likelihood\).*reset\(\)"):
        model(X)
    with torch.no_grad():  # predictions from the prior without gradients (and prior=True) stay possible
        model(X)
    model(X, prior=True)
    model.variational_strategy.update(X[:12], y[:12])
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=60)
    (-mll(model(X[:12]), y[:12])).backward()
    assert model.variational_strategy.inducing_points.grad.abs().sum() > 0


class _TwoOutputGP(gpytorch.models.ApproximateGP):
    """Two outputs as BoTorch builds them: a batch of two latents under an independent multitask wrapper (or LMC)."""

    def __init__(self, Z, wrapper):
        base = KalmanVariationalStrategy(self, Z.expand(2, *Z.shape).clone())
        super().__init__(wrapper(base))
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=torch.Size([2]))
        kernel = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2]))
        self.covar_module = gpytorch.kernels.ScaleKernel(kernel, batch_shape=torch.Size([2]))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def test_several_outputs_take_each_tasks_noise_of_a_multitask_likelihood():
    """Under an independent multitask wrapper, a MultitaskGaussianLikelihood (rank 0) gives each latent its task's
    noise (task noise + global noise): the same state and predictions as a batched GaussianLikelihood of those noises;
    under LMC (no latent has a noise of its own) the update says so, before anything changes."""
    X, y, Z = problem()
    targets = torch.stack([y, (2 * X[:, 0]).cos()])  # the base's latents: (2, n)
    wrap = functools.partial(gpytorch.variational.IndependentMultitaskVariationalStrategy, num_tasks=2)
    torch.manual_seed(0)
    model = _TwoOutputGP(Z, wrap).double()
    multitask = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2).double()
    multitask.task_noises = torch.tensor([0.01, 0.2], dtype=F64)
    multitask.noise = torch.tensor([0.05], dtype=F64)
    reference = copy.deepcopy(model)
    batched = gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([2])).double()
    batched.noise = (multitask.task_noises + multitask.noise).detach().unsqueeze(-1)
    model.variational_strategy.base_variational_strategy.update(X, targets, multitask)
    reference.variational_strategy.base_variational_strategy.update(X, targets, batched)
    (mean, covariance), (expected_mean, expected_covariance) = _predict(model), _predict(reference)
    assert mean.shape == (9, 2)
    torch.testing.assert_close(mean, expected_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(covariance, expected_covariance, rtol=0, atol=1e-12)
    lmc = functools.partial(gpytorch.variational.LMCVariationalStrategy, num_tasks=2, num_latents=2)
    mixed = _TwoOutputGP(Z, lmc).double()
    with pytest.raises(NotImplementedError, match="IndependentMultitaskVariationalStrategy"):
        mixed.variational_strategy.base_variational_strategy.update(X, targets, multitask)
    assert mixed.variational_strategy.base_variational_strategy.num_observed == 0
