"""BoTorch's conditioning and fantasies through gpytorch_decoupled.botorch.SingleTaskVariationalGP for the strategies
that condition in closed form (Kalman, Dual): ``condition_on_observations`` equals the model's posterior of all the
data at the fitted hyperparameters (float64, 1e-9), ``fantasize`` gives BoTorch's batch shapes, acquisition values are
differentiable through the fantasies, and two lookahead acquisition functions (qKnowledgeGradient,
qNegIntegratedPosteriorVariance) optimize on a small problem. The other families say which strategies condition."""

from __future__ import annotations

import copy

import pytest
import torch

botorch = pytest.importorskip("botorch", reason="BoTorch is the optional botorch extra (pip install '.[botorch]')")

from botorch.acquisition import qKnowledgeGradient, qLogExpectedImprovement  # noqa: E402
from botorch.acquisition.active_learning import qNegIntegratedPosteriorVariance  # noqa: E402
from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement  # noqa: E402
from botorch.acquisition.objective import GenericMCObjective  # noqa: E402
from botorch.fit import fit_gpytorch_mll  # noqa: E402
from botorch.models.transforms import Normalize, Standardize  # noqa: E402
from botorch.optim import optimize_acqf  # noqa: E402
from botorch.sampling import SobolQMCNormalSampler  # noqa: E402
from gpytorch.mlls import VariationalELBO  # noqa: E402

from gpytorch_decoupled.botorch import SingleTaskVariationalGP  # noqa: E402
from gpytorch_decoupled.optim import DualEStep  # noqa: E402
from gpytorch_decoupled.variational import (  # noqa: E402
    DualVariationalStrategy,
    HybridVariationalStrategy,
    KalmanVariationalStrategy,
)
from tests.oracles import svgp_predictive, titsias_optimal_qu  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
CONDITIONING = {"dual": DualVariationalStrategy, "kalman": KalmanVariationalStrategy}
BOUNDS = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=F64)
FIT_KWARGS = {"optimizer_kwargs": {"options": {"maxiter": 50}}, "num_rounds": 2}


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=gen, dtype=F64)
    return x, (6 * x).sin().sum(-1, keepdim=True) + 0.05 * torch.randn(n, 1, generator=gen, dtype=F64)


def _fitted(strategy_cls, x, y, transforms: bool = False):
    torch.manual_seed(0)
    transforms = {"input_transform": Normalize(2), "outcome_transform": Standardize(1)} if transforms else {}
    model = SingleTaskVariationalGP(x, y, variational_strategy=strategy_cls, inducing_points=10, **transforms)
    fit_gpytorch_mll(VariationalELBO(model.likelihood, model.model, num_data=x.size(-2)), **FIT_KWARGS)
    return model


def _posterior_of_all_the_data(model, x, y):
    """The model at its hyperparameters with its state recomputed from all the (transformed) data (Kalman: absorbed
    again; Dual: a full-batch E-step with r = 1, Titsias' posterior for a Gaussian likelihood)."""
    reference = copy.deepcopy(model).eval()
    x = reference.transform_inputs(x)
    if hasattr(reference, "outcome_transform"):
        y, _ = reference.outcome_transform(y, X=x)
    strategy = reference.model.variational_strategy
    if isinstance(strategy, KalmanVariationalStrategy):
        strategy.reset()
        strategy.update(x, y.squeeze(-1))
    else:
        DualEStep(reference.model, reference.likelihood, num_data=x.size(0)).step(x, y.squeeze(-1))
    return reference


@pytest.mark.parametrize("transforms", [False, True], ids=["plain", "normalize-standardize"])
@pytest.mark.parametrize("family", list(CONDITIONING))
def test_condition_on_observations_is_the_posterior_of_all_the_data(family, transforms):
    x, y = _data(30, seed=0)
    model = _fitted(CONDITIONING[family], x, y, transforms)
    x_new, y_new = _data(4, seed=1)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    conditioned = model.condition_on_observations(x_new, y_new)
    assert isinstance(conditioned, SingleTaskVariationalGP) and conditioned.likelihood is model.likelihood
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())
    reference = _posterior_of_all_the_data(model, torch.cat([x, x_new]), torch.cat([y, y_new]))
    x_test, _ = _data(7, seed=2)
    actual, expected = conditioned.posterior(x_test), reference.posterior(x_test)
    assert (actual.mean - expected.mean).abs().max() <= 1e-9
    assert (actual.variance - expected.variance).abs().max() <= 1e-9


@pytest.mark.parametrize("family", list(CONDITIONING))
def test_fantasize_has_botorchs_batch_shapes_and_is_differentiable(family):
    x, y = _data(30, seed=0)
    model = _fitted(CONDITIONING[family], x, y)
    candidates = torch.rand(5, 2, 2, dtype=F64, requires_grad=True)  # 5 candidate sets of q = 2 points
    fantasy = model.fantasize(candidates, SobolQMCNormalSampler(torch.Size([4])))
    assert fantasy.batch_shape == torch.Size([4, 5])
    posterior = fantasy.posterior(torch.rand(3, 2, dtype=F64))
    assert posterior.mean.shape == torch.Size([4, 5, 3, 1])
    # Gradients reach the candidates through both the fantasy inputs and the sampled targets.
    (gradient,) = torch.autograd.grad(posterior.variance.sum() + posterior.mean.sum(), candidates)
    assert torch.isfinite(gradient).all() and gradient.abs().sum() > 0


@pytest.mark.parametrize("family", list(CONDITIONING))
def test_lookahead_acquisition_functions_optimize(family):
    x, y = _data(30, seed=0)
    model = _fitted(CONDITIONING[family], x, y)
    torch.manual_seed(0)
    knowledge_gradient = qKnowledgeGradient(model, num_fantasies=4)
    candidate, value = optimize_acqf(
        knowledge_gradient, BOUNDS, q=1, num_restarts=2, raw_samples=16, options={"maxiter": 5}
    )
    assert candidate.shape == (1, 2) and torch.isfinite(value) and value > 0
    sampler = SobolQMCNormalSampler(torch.Size([1]))
    variance = qNegIntegratedPosteriorVariance(model, mc_points=torch.rand(16, 2, dtype=F64), sampler=sampler)
    candidates, value = optimize_acqf(variance, BOUNDS, q=2, num_restarts=2, raw_samples=16, options={"maxiter": 5})
    # Two new points reduce the integrated variance below the model's own.
    assert candidates.shape == (2, 2) and -value < model.posterior(variance.mc_points).variance.mean()


def test_families_without_conditioning_say_which_have_it():
    x, y = _data(30, seed=0)
    model = SingleTaskVariationalGP(x, y, variational_strategy=HybridVariationalStrategy, inducing_points=10)
    with pytest.raises(NotImplementedError, match="KalmanVariationalStrategy and DualVariationalStrategy"):
        model.condition_on_observations(*_data(2, seed=1))


def test_several_outputs_of_the_dual_strategy_condition_on_observations():
    """m = 2 outputs (BoTorch's batch of latents inside an independent multitask wrapper): the conditioned posterior is
    that of all the data; fantasies have BoTorch's shapes."""
    x, y = _data(30, seed=0)
    y = torch.cat([y, (3 * x).cos().sum(-1, keepdim=True)], -1)
    torch.manual_seed(0)
    model = SingleTaskVariationalGP(x, y, variational_strategy=DualVariationalStrategy, inducing_points=10)
    fit_gpytorch_mll(VariationalELBO(model.likelihood, model.model, num_data=x.size(-2)), **FIT_KWARGS)
    # (the fit's sites of several outputs are not quite the converged E-step at its last hyperparameters: one more
    # makes the state the posterior of the data, which conditioning then extends)
    DualEStep(model.model, model.likelihood, num_data=x.size(0)).step(x, y)
    x_new, _ = _data(4, seed=1)
    y_new = torch.randn(4, 2, generator=torch.Generator().manual_seed(3), dtype=F64)
    conditioned = model.condition_on_observations(x_new, y_new)
    reference = copy.deepcopy(model).eval()
    all_x, all_y = torch.cat([x, x_new]), torch.cat([y, y_new])
    DualEStep(reference.model, reference.likelihood, num_data=all_x.size(0)).step(all_x, all_y)
    x_test, _ = _data(7, seed=2)
    actual, expected = conditioned.posterior(x_test), reference.posterior(x_test)
    assert actual.mean.shape == (7, 2)
    assert (actual.mean - expected.mean).abs().max() <= 1e-9
    assert (actual.variance - expected.variance).abs().max() <= 1e-9
    fantasy = model.fantasize(torch.rand(5, 1, 2, dtype=F64), SobolQMCNormalSampler(torch.Size([3])))
    assert fantasy.batch_shape == torch.Size([3, 5])
    assert fantasy.posterior(torch.rand(4, 2, dtype=F64)).mean.shape == torch.Size([3, 5, 4, 2])


def _two_outputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data(n, seed)
    gen = torch.Generator().manual_seed(seed + 10)
    second = (3 * x).cos().sum(-1, keepdim=True) + 0.05 * torch.randn(n, 1, generator=gen, dtype=F64)
    return x, torch.cat([y, second], -1)


def _titsias_posterior(model, x, y, x_test):
    """Dense float64 oracle: each output's Titsias posterior (Kalman-VFE's batch posterior) of the data (x, y) at the
    model's fitted hyperparameters, its inducing points and its task's noise, at ``x_test``: means and variances
    ``(n_test, m)``."""
    gp, likelihood = model.model, model.likelihood
    strategy = gp.variational_strategy.base_variational_strategy
    noise = (likelihood.task_noises + likelihood.noise).detach()
    means, variances = [], []
    with torch.no_grad():
        Z, K = strategy.inducing_points, gp.covar_module
        K_uu = K(Z).to_dense() + strategy.jitter_val * torch.eye(Z.size(-2), dtype=F64)
        K_uf, K_us, K_ss = K(Z, x).to_dense(), K(Z, x_test).to_dense(), K(x_test).to_dense()
        mean_f, mean_s = gp.mean_module(x), gp.mean_module(x_test)
        for t in range(y.size(-1)):
            m, S = titsias_optimal_qu(K_uu[t], K_uf[t], y[:, t], noise[t], mean_f[t])
            mean, covariance = svgp_predictive(K_uu[t], K_us[t], K_ss[t], m, S, mean_s[t])
            means.append(mean)
            variances.append(covariance.diagonal())
    return torch.stack(means, -1), torch.stack(variances, -1)


def test_several_outputs_of_the_kalman_strategy_fit_condition_and_acquire():
    """m = 2 outputs of a Kalman strategy (BoTorch's batch of latents inside an independent multitask wrapper, noise
    per task from a MultitaskGaussianLikelihood): fit_gpytorch_mll fits the hyperparameters and absorbs the data, the
    posterior is each output's Titsias posterior of the data (dense float64 oracle), condition_on_observations gives
    that of all the data, fantasies have BoTorch's shapes, and qLogEI (scalarized outputs) and qLogNEHVI optimize."""
    x, y = _two_outputs(30, seed=0)
    torch.manual_seed(0)
    model = SingleTaskVariationalGP(x, y, variational_strategy=KalmanVariationalStrategy, inducing_points=10)
    lengthscales = model.model.covar_module.lengthscale.detach().clone()
    fit_gpytorch_mll(VariationalELBO(model.likelihood, model.model, num_data=x.size(-2)), **FIT_KWARGS)
    assert model.model.variational_strategy.base_variational_strategy.num_observed == 30
    assert not torch.allclose(model.model.covar_module.lengthscale, lengthscales)  # the hyperparameters were fitted
    x_test, _ = _two_outputs(7, seed=2)
    posterior = model.posterior(x_test)
    mean, variance = _titsias_posterior(model, x, y, x_test)
    assert posterior.mean.shape == (7, 2)
    assert (posterior.mean - mean).abs().max() <= 1e-9 and (posterior.variance - variance).abs().max() <= 1e-9
    assert (model.posterior(x).mean - y).pow(2).mean().sqrt() < 0.1  # and the fit is a good one

    x_new, y_new = _two_outputs(4, seed=1)
    conditioned = model.condition_on_observations(x_new, y_new)
    actual = conditioned.posterior(x_test)
    mean, variance = _titsias_posterior(model, torch.cat([x, x_new]), torch.cat([y, y_new]), x_test)
    assert (actual.mean - mean).abs().max() <= 1e-9 and (actual.variance - variance).abs().max() <= 1e-9
    assert model.model.variational_strategy.base_variational_strategy.num_observed == 30  # the model is unchanged
    fantasy = model.fantasize(torch.rand(5, 1, 2, dtype=F64), SobolQMCNormalSampler(torch.Size([3])))
    assert fantasy.batch_shape == torch.Size([3, 5])
    assert fantasy.posterior(torch.rand(4, 2, dtype=F64)).mean.shape == torch.Size([3, 5, 4, 2])

    torch.manual_seed(0)
    objective = GenericMCObjective(lambda samples, X=None: samples[..., 0] + samples[..., 1])
    log_ei = qLogExpectedImprovement(model, best_f=(y[:, 0] + y[:, 1]).max(), objective=objective)
    candidates, value = optimize_acqf(log_ei, BOUNDS, q=2, num_restarts=2, raw_samples=16, options={"maxiter": 5})
    assert candidates.shape == (2, 2) and torch.isfinite(value)
    # cache_root=False: BoTorch's cached root decomposition expects a block-diagonal covariance of the outputs, which
    # GPyTorch's independent multitask wrapper gives interleaved (BoTorch's own SingleTaskVariationalGP fails alike).
    hypervolume = qLogNoisyExpectedHypervolumeImprovement(
        model, ref_point=[-2.0, -2.0], X_baseline=x, prune_baseline=False, cache_root=False
    )
    candidates, value = optimize_acqf(hypervolume, BOUNDS, q=1, num_restarts=2, raw_samples=16, options={"maxiter": 5})
    assert candidates.shape == (1, 2) and torch.isfinite(value)
