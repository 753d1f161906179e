"""Spec A.5 identities T1, T3-T5 and T12 for the t-SVGP E-step (DualEStep), against dense float64 oracles
(``tests/oracles/dual.py``, ``sparse_gp.py``) and GPyTorch's natural-gradient SVGP. The set-up is that of
``tests/dual_problems.py`` (spec A.5: n = 60, M = 10, jitter 1e-10 on K_uu); every Cholesky that had to add jitter
warns, and this module turns those warnings into errors. "Converged E-step" means one step with r = 1 (Gaussian) or
300 steps with r = 0.5 (Bernoulli, a 40-point float64 Gauss-Hermite rule on both sides).

Then the E-step's contract: settings and wrappers it refuses, bad input (and a likelihood that produces NaN) raising
before any site changes, the per-datum mode's index checks, and the factors reused between consecutive steps.
"""

from __future__ import annotations

import copy
import itertools
import unittest
import unittest.mock

import gpytorch
import pytest
import torch

from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep
from gpytorch_decoupled.variational import DualVariationalStrategy
from tests.dual_problems import (
    CONSTANT_MEAN,
    GH_POINTS,
    DualGP,
    MultitaskDualGP,
    N,
    NaNLikelihood,
    NaturalSVGP,
    assert_relative,
    assert_same_state,
    binary_labels,
    converged_e_step,
    dual_distribution,
    em_model,
    likelihood_and_targets,
    oracle_blocks,
    prior_mean,
    problem,
    q_of,
    random_sites,
    set_sites,
    site_values,
    state_snapshot,
)
from tests.float64_problems import (
    F64,
    NOISE,
    assert_close,
    bernoulli_likelihood,
    gaussian_likelihood,
    generator,
    relative_error,
)
from tests.oracles import (
    titsias_optimal_qu,
    unwhiten_qu,
    whiten_qu,
)
from tests.oracles.dual import (
    dual_qu_from_sites,
    sites_to_summaries,
)

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("error::gpytorch.utils.warnings.NumericalWarning"),
]


@pytest.mark.parametrize("constant_mean", [None, CONSTANT_MEAN])
def test_t1_one_full_batch_e_step_gives_titsias_q(constant_mean: float | None) -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z, constant_mean=constant_mean), gaussian_likelihood()
    random_sites(model, 5, scale=1.0)
    DualEStep(model, likelihood, num_data=N, lr=1.0).step(X, y)
    K_uu, K_uf, _ = (block.detach() for block in oracle_blocks(model, X))
    centred_y = y if constant_mean is None else y - constant_mean
    ell1, L2 = site_values(model)
    # The summaries are K_uf y / sigma^2 and K_uf K_fu / sigma^2 ...
    lam1bar, Lam2bar = sites_to_summaries(K_uu, ell1, L2)
    assert_relative(lam1bar, K_uf @ centred_y / NOISE, 1e-10, "lam1bar")
    assert_relative(Lam2bar, K_uf @ K_uf.mT / NOISE, 1e-10, "Lam2bar")
    # ... and q(u) is Titsias' q*.
    m_star, S_star = titsias_optimal_qu(K_uu, K_uf, y, NOISE, prior_mean_f=prior_mean(model, N))
    m, S = q_of(model)
    assert_relative(m, m_star, 1e-10, "m")
    assert_relative(S, S_star, 1e-10, "S")


@pytest.mark.parametrize("likelihood_name", ["gaussian", "bernoulli"])
@pytest.mark.parametrize("per_datum", [False, True])
def test_t3_converged_sites_are_a_fixed_point(likelihood_name: str, per_datum: bool) -> None:
    Z, X, y = problem()
    likelihood, y = likelihood_and_targets(likelihood_name, y)
    model = DualGP(Z, datum_inputs=X if per_datum else None)
    e_step = converged_e_step(model, likelihood, X, y)
    converged = site_values(model)
    for lr in (0.37, 1.0):
        e_step.param_groups[0]["lr"] = lr
        e_step.step(X, y, torch.arange(N) if per_datum else None)
        for after, before, name in zip(site_values(model), converged, ("site mean", "site precision"), strict=True):
            assert_relative(after, before, 1e-10, f"{name} after r={lr}")


def test_t4_one_epoch_with_decreasing_steps_gives_titsias_q() -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z), gaussian_likelihood()
    random_sites(model, 7, scale=1.0)
    e_step = DualEStep(model, likelihood, num_data=N, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(e_step, lambda t: 1.0 / (t + 1))  # r_t = 1/t, t = 1, 2, ...
    permutation = torch.randperm(N, generator=generator(8))
    for batch in permutation.split(12):  # a partition into 5 batches, s = 5
        e_step.step(X[batch], y[batch])
        schedule.step()
    assert e_step.param_groups[0]["lr"] == pytest.approx(1.0 / 6)
    K_uu, K_uf, _ = (block.detach() for block in oracle_blocks(model, X))
    m_star, S_star = titsias_optimal_qu(K_uu, K_uf, y, NOISE)
    m, S = q_of(model)
    assert_relative(m, m_star, 1e-10, "m")
    assert_relative(S, S_star, 1e-10, "S")


@pytest.mark.parametrize("likelihood_name", ["gaussian", "bernoulli"])
def test_t5_e_step_is_one_gpytorch_ngd_step(likelihood_name: str) -> None:
    Z, X, y = problem()
    likelihood, y = likelihood_and_targets(likelihood_name, y)
    lr, batch = 0.3, torch.randperm(N, generator=generator(9))[:15]  # s = 4
    model = DualGP(Z)
    ell1, L2 = random_sites(model, 10)
    K_uu = oracle_blocks(model, X)[0].detach()
    m0, S0 = dual_qu_from_sites(K_uu, ell1, L2)

    # The same q(u) in GPyTorch's whitened natural parameters (theta1 = S_v^-1 m_v, theta2 = -S_v^-1 / 2).
    svgp = NaturalSVGP(Z)
    m_v, S_v = whiten_qu(K_uu, m0, S0)
    precision_v = torch.linalg.inv(S_v)
    q_v = svgp.variational_strategy._variational_distribution
    with torch.no_grad():
        q_v.natural_vec.copy_(precision_v @ m_v)
        q_v.natural_mat.copy_(-0.5 * precision_v)
    ngd = gpytorch.optim.NGD(svgp.variational_parameters(), num_data=N, lr=lr)
    svgp.train()
    likelihood.train()
    ngd.zero_grad()
    (-gpytorch.mlls.VariationalELBO(likelihood, svgp, num_data=N)(svgp(X[batch]), y[batch])).backward()
    ngd.step()
    svgp.variational_strategy._clear_cache()  # GPyTorch caches q(v) in training mode
    with torch.no_grad():
        q_after = svgp.variational_strategy.variational_distribution
        m_ngd, S_ngd = unwhiten_qu(K_uu, q_after.mean, q_after.covariance_matrix)

    DualEStep(model, likelihood, num_data=N, lr=lr).step(X[batch], y[batch])
    m, S = q_of(model)
    assert relative_error(m, m0) > 0.05 and relative_error(S, S0) > 0.05  # the step moved q
    assert_relative(m, m_ngd, 1e-8, "m")
    assert_relative(S, S_ngd, 1e-8, "S")


def test_t12_mini_batch_sites_and_elbo_are_unbiased() -> None:
    # Every subset of size B of n = 9 points, from the same arbitrary sites: the average of the mini-batch E-steps
    # (s = n / B) is the full-batch E-step, and the average mini-batch objective is the full objective.
    n, B, lr = 9, 3, 0.6
    Z, X, y = problem()
    Z, X, y = Z[:4], X[:n], binary_labels(y[:n])
    likelihood = bernoulli_likelihood(GH_POINTS)
    model = DualGP(Z)
    start = random_sites(model, 26)
    e_step = DualEStep(model, likelihood, num_data=n, lr=lr)
    objective = DualVariationalELBO(likelihood, model, num_data=n)
    e_step.step(X, y)
    full_sites = site_values(model)
    set_sites(model, *start)
    full_objective = objective(model(X), y).detach()
    subsets = list(itertools.combinations(range(n), B))
    mean_sites = [torch.zeros_like(site) for site in start]
    mean_objective = torch.zeros((), dtype=F64)
    for subset in subsets:
        batch = torch.tensor(subset)
        set_sites(model, *start)
        mean_objective += objective(model(X[batch]), y[batch]).detach() / len(subsets)
        e_step.step(X[batch], y[batch])
        for total, site in zip(mean_sites, site_values(model), strict=True):
            total += site / len(subsets)
    for mean, full, name in zip(mean_sites, full_sites, ("site mean", "site precision"), strict=True):
        assert_relative(mean, full, 1e-10, name)
    assert_relative(mean_objective, full_objective, 1e-10, "objective")


def test_e_step_leaves_no_autograd_graph_and_no_gradients() -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z), bernoulli_likelihood(GH_POINTS)
    model.train()
    DualEStep(model, likelihood, num_data=N, lr=0.5).step(X, binary_labels(y))
    for name, site in dual_distribution(model).named_buffers():
        assert site.grad_fn is None and not site.requires_grad, name
    for name, parameter in [*model.named_parameters(), *likelihood.named_parameters()]:
        assert parameter.grad is None, name
    # q(u) computed afterwards depends on the hyperparameters only, not on a graph kept from the E-step.
    assert model.variational_strategy.variational_distribution.mean.grad_fn is not None


# ------------------------------------------------------------------------------------------- contract
def test_lmc_wrapper_is_refused_by_the_e_step_and_the_objective() -> None:
    # Mixed latents have no per-latent marginal expected log-likelihood: the closed-form E-step is undefined.
    Z, _, _ = problem()
    model = MultitaskDualGP(Z, num_tasks=2, wrapper="lmc")
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2).double()
    with pytest.raises(TypeError, match="DualEStep needs a model whose variational strategy is a Dual"):
        DualEStep(model, likelihood, num_data=60)
    with pytest.raises(TypeError, match="DualVariationalELBO needs"):
        DualVariationalELBO(likelihood, model, num_data=60)


def test_other_strategies_are_refused() -> None:
    Z, _, _ = problem()
    svgp = DualGP(Z)
    svgp.variational_strategy = gpytorch.variational.VariationalStrategy(
        svgp, Z, gpytorch.variational.CholeskyVariationalDistribution(Z.size(0))
    )
    with pytest.raises(TypeError, match="DualEStep needs"):
        DualEStep(svgp, gaussian_likelihood(), num_data=60)


@pytest.mark.parametrize("kwargs", [{"lr": 0.0}, {"lr": 1.5}, {"num_data": 0}, {"min_curvature": 0.0}])
def test_bad_e_step_settings_are_refused(kwargs) -> None:
    Z, _, _ = problem()
    settings = {"num_data": 60, "lr": 1.0, **kwargs}
    with pytest.raises(ValueError, match="need 0 < lr <= 1"):
        DualEStep(DualGP(Z), gaussian_likelihood(), **settings)


# -------------------------------------------------------------------------------------------------- bad input
def _bad_inputs(X: torch.Tensor, y: torch.Tensor) -> dict[str, tuple]:
    nan_x, nan_y = X.clone(), y.clone()
    nan_x[3, 1] = float("nan")
    nan_y[5] = float("nan")
    return {
        "x width": (X[:, :1], y, ValueError, "x has 1 columns"),
        "x dtype": (X.float(), y, ValueError, "float32"),
        "x device": (torch.empty_like(X, device="meta"), y, ValueError, "meta"),
        "x NaN": (nan_x, y, ValueError, "NaN"),
        "y NaN": (X, nan_y, ValueError, "NaN"),
        "y length": (X, y[:-1], ValueError, r"y must have shape \(60,\) to match x"),
        "x not a matrix": (X.unsqueeze(0), y, ValueError, "shape"),
        # R1 of issue 20: (B, 1) targets broadcast against the (B,) marginals (site precision 11,026 instead of 55)
        "y column": (X, y.unsqueeze(-1), ValueError, r"y must have shape \(60,\) to match x, got \(60, 1\)"),
        # R8 of issue 20: an empty batch raised ZeroDivisionError
        "empty": (X[:0], y[:0], ValueError, "x is empty"),
        "y int": (X, y.long(), ValueError, "y must be real-valued"),
        "y not a tensor": (X, y.tolist(), TypeError, "y must be a torch.Tensor"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs(torch.zeros(8, 2), torch.zeros(8))))
@pytest.mark.parametrize("per_datum", [False, True])
def test_bad_input_raises_and_leaves_the_sites_unchanged(case: str, per_datum: bool) -> None:
    model, likelihood, X, y = em_model(per_datum)
    x_bad, y_bad, error, message = _bad_inputs(X, y)[case]
    state = state_snapshot(model)
    e_step = DualEStep(model, likelihood, num_data=X.size(0), lr=0.5)
    indices = torch.arange(X.size(0)) if per_datum else None
    with pytest.raises(error, match=message):
        e_step.step(x_bad, y_bad, indices)
    assert_same_state(model, state)
    e_step.step(X, y, indices)  # and the E-step still works afterwards
    assert not torch.equal(site_values(model)[0], state[_site_mean_name(per_datum)])


@pytest.mark.parametrize("labels", [[0.0, 2.0], [0.5, 1.0], [-1.0, 0.0, 1.0], [float("nan"), 1.0]])
def test_labels_the_bernoulli_likelihood_does_not_take_are_refused(labels: list[float]) -> None:
    """R2 of issue 20: labels {0, 2} or 0.5 were silently accepted (GPyTorch 1.15 reads {0, 1}, and {-1, 1} with a
    DeprecationWarning; a mixture of the two conventions means neither)."""
    Z, X, y = problem()
    model, likelihood = DualGP(Z), bernoulli_likelihood()
    e_step = DualEStep(model, likelihood, num_data=X.size(0), lr=0.5)
    objective = DualVariationalELBO(likelihood, model, num_data=X.size(0))
    bad = torch.tensor(labels, dtype=F64).repeat(X.size(0))[: X.size(0)]
    e_step.step(X, binary_labels(y))  # sites away from the prior: a training forward pass at the prior raises
    output = model(X)  # the first call records itself
    state = state_snapshot(model)
    with pytest.raises(ValueError, match="y has values .* BernoulliLikelihood takes labels in|y contains NaN"):
        e_step.step(X, bad)
    with pytest.raises(
        ValueError, match="target has values .* BernoulliLikelihood takes labels in|target contains NaN"
    ):
        objective(output, bad)
    assert_same_state(model, state)
    e_step.step(X, binary_labels(y))  # {0, 1} works, in any numeric dtype
    e_step.step(X, binary_labels(y).long())


def _site_mean_name(per_datum: bool) -> str:
    return "variational_strategy._variational_distribution." + ("datum_site_mean" if per_datum else "site_mean")


@pytest.mark.parametrize("per_datum", [False, True])
def test_a_likelihood_producing_nan_raises_and_leaves_the_sites_unchanged(per_datum: bool) -> None:
    model, _, X, y = em_model(per_datum)
    state = state_snapshot(model)
    likelihood = NaNLikelihood().double()
    e_step = DualEStep(model, likelihood, num_data=X.size(0), lr=0.5)
    with pytest.raises(RuntimeError, match="non-finite"):
        e_step.step(X, y, torch.arange(X.size(0)) if per_datum else None)
    assert_same_state(model, state)


def test_per_datum_mode_needs_the_batch_indices() -> None:
    model, likelihood, X, y = em_model(per_datum=True)
    state = state_snapshot(model)
    e_step = DualEStep(model, likelihood, num_data=X.size(0), lr=0.5)
    batch = torch.tensor([4, 9, 11, 30])
    for indices in (None, batch[:3], batch.unsqueeze(0)):
        with pytest.raises(ValueError, match="indices"):
            e_step.step(X[batch], y[batch], indices)
    with pytest.raises(ValueError, match=r"x is not datum_inputs\[indices\]"):
        e_step.step(X[batch], y[batch], batch + 1)
    assert_same_state(model, state)
    # With the right indices only those sites move (no n / B scale: sites are per datum).
    lam1_before = site_values(model)[0]
    e_step.step(X[batch], y[batch], batch)
    lam1 = site_values(model)[0]
    changed = (lam1 != lam1_before).nonzero().squeeze(-1)
    assert torch.equal(changed, batch)
    target = y[batch] / likelihood.noise.detach()  # Gaussian: g_1 = y / sigma^2 whatever q is
    torch.testing.assert_close(lam1[batch], 0.5 * lam1_before[batch] + 0.5 * target, rtol=1e-12, atol=0)


def test_u_space_mode_ignores_indices() -> None:
    model, likelihood, X, y = em_model()
    other = copy.deepcopy(model)
    DualEStep(model, likelihood, num_data=X.size(0), lr=0.5).step(X[:12], y[:12], torch.arange(12) + 5)
    DualEStep(other, likelihood, num_data=X.size(0), lr=0.5).step(X[:12], y[:12])
    for a, b in zip(site_values(model), site_values(other), strict=True):
        assert torch.equal(a, b)


def test_consecutive_e_steps_reuse_the_factors_exactly_and_any_model_change_invalidates_them() -> None:
    """Steps at fixed hyperparameters reuse the factors the previous step computed (no refactorization of K_uu and
    H); the result equals fresh computations, and a changed hyperparameter or site forces a fresh computation."""
    Z, X, y = problem()
    # Bernoulli, so that the targets depend on q and a wrong reused factor would show in the sites.
    likelihood, y = bernoulli_likelihood(), (y > 0).to(y)

    def run(reuse: bool, change_between: bool) -> DualGP:
        model = DualGP(Z)
        e_step = DualEStep(model, likelihood, num_data=N, lr=0.5)
        factorizations = unittest.mock.patch.object(
            DualVariationalStrategy,
            "posterior_factors",
            autospec=True,
            side_effect=DualVariationalStrategy.posterior_factors,
        )
        with factorizations as posterior_factors:
            steps = run_steps(model, e_step, reuse, change_between)
        # Without reuse every step factorizes; with it only the first step and the one after the change do.
        expected = steps if not reuse else 1 + change_between
        assert posterior_factors.call_count == expected
        if change_between:
            with torch.no_grad():
                model.variational_strategy._variational_distribution.site_mean.add_(1.0)
            assert e_step._reusable_factors() is None
        return model

    def run_steps(model: DualGP, e_step: DualEStep, reuse: bool, change_between: bool) -> int:
        batches = torch.arange(N).split(15)
        for step, batch in enumerate(batches):
            if not reuse:
                e_step._last_factors = None
            if change_between and step == 2:
                with torch.no_grad():
                    model.covar_module.base_kernel.raw_lengthscale.add_(0.1)
            e_step.step(X[batch], y[batch])
        return len(batches)

    for change_between in (False, True):
        reused, fresh = run(True, change_between), run(False, change_between)
        for first, second in zip(site_values(reused), site_values(fresh)):
            assert_close(first, second, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("likelihood_name", ["gaussian", "bernoulli"])
def test_e_step_after_the_m_step_backward_reuses_its_marginals_exactly(likelihood_name: str) -> None:
    # The default mini-batch schedule: the M-step's forward and backward, then the E-step at the same batch, then the
    # M-step's optimizer step. The E-step takes the forward pass's detached marginals (no kernel evaluation, no
    # factorization) and moves the sites exactly as an E-step that recomputes them; a change of the model between the
    # forward pass and the E-step (here an assignment through .data, which autograd's version counters miss) makes it
    # recompute.
    Z, X, y = problem()
    likelihood, targets = likelihood_and_targets(likelihood_name, y)

    def one_pass(change: bool) -> tuple[tuple[torch.Tensor, ...], int]:
        model = DualGP(Z.clone())
        set_sites(model, *random_sites(model, seed=3))
        e_step = DualEStep(model, likelihood, num_data=N, lr=0.3)
        objective = DualVariationalELBO(likelihood, model, num_data=N)
        batch = torch.arange(20)
        loss = -objective(model(X[batch]), targets[batch])
        loss.backward()
        if change:
            model.covar_module.base_kernel.raw_lengthscale.data.add_(0.1)
        evaluations = unittest.mock.patch.object(
            DualVariationalStrategy, "_marginals", autospec=True, side_effect=DualVariationalStrategy._marginals
        )
        with evaluations as marginals:
            e_step.step(X[batch], targets[batch])
        return site_values(model), marginals.call_count

    def fresh(change: bool) -> tuple[torch.Tensor, ...]:
        model = DualGP(Z.clone())
        set_sites(model, *random_sites(model, seed=3))
        if change:
            model.covar_module.base_kernel.raw_lengthscale.data.add_(0.1)
        DualEStep(model, likelihood, num_data=N, lr=0.3).step(X[:20], targets[:20])
        return site_values(model)

    for change in (False, True):
        sites, calls = one_pass(change)
        assert calls == (1 if change else 0)
        for actual, expected in zip(sites, fresh(change), strict=True):
            assert torch.equal(actual, expected)
