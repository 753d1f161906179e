"""MeanBasisAdam: its first step moves the mean function by the same amount whatever the basis size (plain Adam's
step grows with it), and with the default rate it converges, without oscillating, to the optimal mean coefficients
for a Gaussian and a Bernoulli likelihood at a small and a 16 times larger mean basis (float64; the optimum from
L-BFGS on the same objective). On the decoupled strategy, its curvature step reaches the closed-form optimum of a
Gaussian likelihood (spec 3.3 and 5.13)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from gpytorch_decoupled.optim import MeanBasisAdam, OnlineBasisGrowth
from gpytorch_decoupled.optim import _decoupled_natural_step as decoupled_natural_step_module
from tests.float64_problems import (
    F64,
    NOISE,
    bernoulli_likelihood,
    decoupled_blocks,
    fix_hyperparameters,
    full_batch_elbo,
    gaussian_likelihood,
    generator,
    odvgp_blocks,
    prior_variances,
    randn,
    random_factor,
    regression_problem,
)
from tests.oracles import decoupled_optimum, odvgp_optimal_elbo
from tests.variational.mean_basis_cases import MeanBasisGP, set_decoupled_state

SIZES = (40, 640)


def _line(likelihood: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(X, y, beta)``: 120 data on [-3, 3] (regression targets or their signs) and 5 covariance points."""
    X = torch.linspace(-3, 3, 120, dtype=F64).unsqueeze(-1)
    f = torch.sin(2 * X[:, 0]) + 0.5 * X[:, 0]
    y = f if likelihood == "gaussian" else (f > 0).to(F64)
    return X, y, torch.linspace(-3, 3, 5, dtype=F64).unsqueeze(-1)


def _line_points(size: int) -> torch.Tensor:
    return torch.linspace(-3.1, 3.1, size, dtype=F64).unsqueeze(-1)


def _problem(kind: str, size: int, likelihood: str):
    """A 1-D problem on [-3, 3] with 5 covariance points and ``size`` mean points, coefficients 0."""
    X, y, beta = _line(likelihood)
    gamma = _line_points(size)
    model = MeanBasisGP(kind, beta, gamma, learn_inducing_locations=False)
    with torch.no_grad():
        model.variational_strategy.mean_coefficients.zero_()
    return model, gaussian_likelihood() if likelihood == "gaussian" else bernoulli_likelihood(), X, y


def _mean(model, X: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(X).mean


def _train(model, likelihood, X, y, optimizer, steps: int) -> list[float]:
    """Full-batch steps of ``optimizer`` on the ELBO; the ELBO before each step."""
    values = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = -full_batch_elbo(model, likelihood, X, y)
        loss.backward()
        optimizer.step()
        values.append(-loss.item())
    return values


@pytest.mark.parametrize("kind", ["orthogonal", "hybrid"])
def test_the_first_step_moves_the_mean_alike_for_any_basis_size(kind: str) -> None:
    moves = {}
    for rule in ("function scale", "plain"):
        for size in SIZES:
            model, likelihood, X, y = _problem(kind, size, "gaussian")
            before = _mean(model, X)
            a = model.variational_strategy.mean_coefficients
            optimizer = MeanBasisAdam(model, lr=0.05) if rule == "function scale" else torch.optim.Adam([a], lr=0.05)
            _train(model, likelihood, X, y, optimizer, 1)
            moves[rule, size] = (_mean(model, X) - before).abs().max().item()
    small, large = SIZES
    assert 0.5 < moves["function scale", large] / moves["function scale", small] < 2.0, moves
    assert moves["plain", large] / moves["plain", small] > 8.0, moves  # what the function scale takes out


@pytest.mark.parametrize("likelihood", ["gaussian", "bernoulli"])
@pytest.mark.parametrize("size", SIZES)
def test_the_default_rate_converges_at_any_basis_size(likelihood: str, size: int) -> None:
    model, lik, X, y = _problem("orthogonal", size, likelihood)
    reference, _, _, _ = _problem("orthogonal", size, likelihood)
    coefficients = reference.variational_strategy.mean_coefficients
    lbfgs = torch.optim.LBFGS(
        [coefficients], max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-13, line_search_fn="strong_wolfe"
    )

    def closure():
        lbfgs.zero_grad()
        loss = -full_batch_elbo(reference, lik, X, y)
        loss.backward()
        return loss

    lbfgs.step(closure)
    best = -closure().item()
    values = _train(model, lik, X, y, MeanBasisAdam(model), 400)
    gap = best - values[0]
    assert best - values[-1] < 0.02 * gap, (best, values[0], values[-1])
    assert max(values[-50:]) - min(values[-50:]) < 0.005 * gap  # no oscillation


def test_bad_arguments_are_refused_before_anything_changes() -> None:
    with pytest.raises(TypeError, match="decoupled strategy"):
        MeanBasisAdam(torch.nn.Linear(2, 1))
    model, _, _, _ = _problem("orthogonal", 40, "gaussian")
    for name, value in (("lr", 0.0), ("num_samples", 0), ("smoothing", 1.0), ("refresh_every", 0)):
        with pytest.raises(ValueError, match=name):
            MeanBasisAdam(model, **{name: value})


def test_the_scale_is_estimated_every_refresh_every_steps_and_resumes() -> None:
    model, likelihood, X, y = _problem("orthogonal", 200, "gaussian")
    optimizer = MeanBasisAdam(model, refresh_every=4, generator=torch.Generator().manual_seed(0))
    estimated = []
    original = optimizer.function_scale
    optimizer.function_scale = lambda strategy: estimated.append(len(estimated)) or original(strategy)
    scales = []
    for step in range(9):
        _train(model, likelihood, X, y, optimizer, 1)
        scales.append(optimizer.state[model.variational_strategy.mean_coefficients]["function_scale"])
        if step == 4:  # a checkpoint mid-way between two estimates resumes the schedule
            resumed = MeanBasisAdam(model, refresh_every=4)
            resumed.load_state_dict(optimizer.state_dict())
    assert len(estimated) == 3  # steps 1, 5 and 9
    assert scales[0] is scales[3] and scales[4] is not scales[3] and scales[4] is scales[7]
    state = resumed.state[model.variational_strategy.mean_coefficients]
    assert state["function_scale_age"] == 0 and torch.equal(state["function_scale"], scales[4])
    # Every step, as before: one estimate per step.
    every, _, _, _ = _problem("orthogonal", 200, "gaussian")
    optimizer = MeanBasisAdam(every, refresh_every=1)
    calls = []
    original = optimizer.function_scale
    optimizer.function_scale = lambda strategy: calls.append(1) or original(strategy)
    _train(every, likelihood, X, y, optimizer, 3)
    assert len(calls) == 3


# ------------------------------------------------------------------ the decoupled strategy's curvature step
def _decoupled_problem(**options):
    """Spec B3's problem (alpha = [gamma; beta], fixed hyperparameters), the coefficients near the prior; ``options``
    go to the strategy."""
    beta, gamma, X, y = regression_problem(8)
    alpha = torch.cat([gamma, beta])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MeanBasisGP("decoupled", beta, alpha, **options)
    return model, gaussian_likelihood(), alpha, beta, X, y


def _elbo_steps(model, likelihood, X, y, optimizer, steps: int) -> list[float]:
    """Full-batch steps on GPyTorch's ELBO (the loss averages over the data, as MeanBasisAdam assumes); ELBO * N
    before each step."""
    values = []
    for _ in range(steps):
        optimizer.zero_grad()
        elbo = full_batch_elbo(model, likelihood, X, y)
        (-elbo / X.size(0)).backward()
        optimizer.step()
        values.append(elbo.item())
    return values


def _optimal_elbo(alpha, beta, X, y) -> float:
    gamma = alpha[: alpha.size(0) - beta.size(0)]
    blocks = odvgp_blocks(gamma, beta, X)
    return odvgp_optimal_elbo(**blocks, k_XX_diag=prior_variances(X.size(0)), y=y, noise=NOISE).item()


def _process(model) -> tuple[torch.Tensor, torch.Tensor]:
    strategy = model.variational_strategy
    factor = strategy.precision_factor.detach()
    return strategy.mean_coefficients.detach().clone(), factor @ factor.mT


def test_decoupled_covariance_step_sets_the_closed_form_optimum() -> None:
    # Gaussian likelihood, full data: the natural-gradient target of B is B* of spec (3.3) whatever a and L_B are, so
    # covariance_lr=1 reaches it in one step (float64 roundoff of the pseudo-inverse of K_beta).
    model, likelihood, alpha, beta, X, y = _decoupled_problem()
    gen = generator(11)
    set_decoupled_state(model, randn(16, gen=gen), random_factor(6, gen, scale=0.7))
    _elbo_steps(model, likelihood, X, y, MeanBasisAdam(model, covariance_lr=1.0), 1)
    _, B_star, _ = decoupled_optimum(**decoupled_blocks(alpha, beta, X), y=y, noise=NOISE)
    B = _process(model)[1]
    assert (B - B_star).norm() < 1e-9 * B_star.norm(), ((B - B_star).norm(), B_star.norm())


def test_decoupled_full_steps_converge_monotonically_to_the_optimum() -> None:
    # lr=1 and covariance_lr=1: B is at B* from the first step and a takes damped Newton steps (its curvature through
    # beta, exact on the diagonal): the ELBO rises to ELBO* (spec 5.13) without overshooting.
    model, likelihood, alpha, beta, X, y = _decoupled_problem()
    best = _optimal_elbo(alpha, beta, X, y)
    values = _elbo_steps(model, likelihood, X, y, MeanBasisAdam(model, lr=1.0, covariance_lr=1.0), 150)
    assert best - values[0] > 100.0  # it did start far away
    assert max(values) <= best + 1e-9 * abs(best)
    assert all(later >= earlier - 1e-9 * abs(best) for earlier, later in zip(values[1:], values[2:]))
    assert best - values[-1] < 1e-8 * abs(best), (best, values[-1])


def test_decoupled_default_rates_approach_the_optimum() -> None:
    model, likelihood, alpha, beta, X, y = _decoupled_problem()
    best = _optimal_elbo(alpha, beta, X, y)
    values = _elbo_steps(model, likelihood, X, y, MeanBasisAdam(model), 200)
    assert max(values) <= best + 1e-9 * abs(best)
    assert best - values[-1] < 1e-3 * (best - values[0]), (best, values[0], values[-1])


def test_decoupled_default_rates_converge_monotonically_on_a_dense_mean_basis() -> None:
    # 405 mean points on a line of 120 data: the data's curvature couples each coefficient to hundreds of neighbours,
    # far more than the step's diagonal outside beta's span sees, so without the step-size bound the default rate
    # overshoots (the ELBO fell 86 times, by up to 29 nats, and stalled 66 nats short). With it the ELBO rises at
    # every step and passes the optimum of a 15-point sub-basis (a lower bound of this basis's optimum).
    X, y, beta = _line("gaussian")
    dense, sparse = (torch.cat([_line_points(size), beta]) for size in (400, 10))
    bound = _optimal_elbo(sparse, beta, X, y)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MeanBasisGP("decoupled", beta, dense)
    optimizer = MeanBasisAdam(model)
    values = _elbo_steps(model, gaussian_likelihood(), X, y, optimizer, 200)
    assert all(later >= earlier - 1e-9 * abs(bound) for earlier, later in zip(values[1:], values[2:]))
    assert bound - values[-1] < 0.01 * (bound - values[0]), (bound, values[0], values[-1])
    step_sizes = optimizer.state[model.variational_strategy.mean_basis.coefficients]["step_size"]
    assert 0 < step_sizes.item() < 0.1  # the bound is active


def test_decoupled_step_stops_short_of_the_minimum_along_its_direction() -> None:
    # Full batch, Gaussian likelihood, fixed hyperparameters, exact KL: the ELBO is a parabola along the step's
    # direction d. A rate far above 1 is cut to d^T g / d^T H_m d, the minimum along d of the step's quadratic model
    # (H_m = c K~ + K_ax Lambda_m K_xa, whose data part bounds the ELBO's from above), which the step must not pass:
    # the ELBO's vertex along d lies at or beyond the step's end, checked on the dense ELBO.
    model, likelihood, alpha, beta, X, y = _decoupled_problem()
    optimizer = MeanBasisAdam(model, lr=50.0)
    strategy = model.variational_strategy
    before = strategy.mean_coefficients.detach().clone()
    _elbo_steps(model, likelihood, X, y, optimizer, 1)
    step = strategy.mean_coefficients.detach() - before
    assert optimizer.state[strategy.mean_basis.coefficients]["step_size"].item() < 1.0

    def elbo_at(fraction: float) -> float:
        with torch.no_grad():
            strategy.mean_coefficients.copy_(before + fraction * step)
            return full_batch_elbo(model, likelihood, X, y).item()

    left, middle, right = (elbo_at(fraction) for fraction in (0.5, 1.0, 1.5))
    vertex = 1.0 + 0.25 * (left - right) / (left - 2 * middle + right)  # of the parabola through the three
    assert left - 2 * middle + right < 0 and vertex >= 1.0, vertex


def test_sampled_kl_gradient_and_its_residual_part() -> None:
    # For every draw of 3 of 7 rows: the step's sampled gradient of 1/2 a^T K a is autograd's of the column-sampled
    # estimate, and the residual's estimate, for K - K~ with K~ = W^T W + diag(K - W^T W), averages over the 35
    # draws to (K - K~) a exactly (unbiased).
    gen = generator(21)
    projection, a = randn(4, 7, gen=gen), randn(7, gen=gen)
    dense = projection.mT @ projection + 0.3 * torch.exp(-torch.cdist(randn(7, 1, gen=gen), randn(7, 1, gen=gen)))
    dense = 0.5 * (dense + dense.mT) + 2.0 * torch.eye(7, dtype=F64)
    residual_variances = dense.diagonal() - projection.pow(2).sum(0)
    residual = dense - projection.mT @ projection - torch.diag(residual_variances)
    estimates = []
    for draw in itertools.combinations(range(7), 3):
        rows = torch.tensor(draw)
        coefficients = a.clone().requires_grad_(True)
        estimate = (7 / 3) * (coefficients[rows] * (dense[rows] @ coefficients)).sum()
        (expected,) = torch.autograd.grad(0.5 * estimate, coefficients)
        sampled, sampled_residual = decoupled_natural_step_module._sampled_residual_gradient(
            dense[rows], projection, residual_variances, a, rows
        )
        torch.testing.assert_close(sampled, expected, rtol=1e-13, atol=1e-13)
        estimates.append(sampled_residual)
    torch.testing.assert_close(torch.stack(estimates).mean(0), residual @ a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("likelihood", ["gaussian", "bernoulli"])
def test_decoupled_sampled_kl_trains_as_the_exact_one(likelihood: str) -> None:
    # 8 sampled rows of 405: the column-sampled KL's gradient puts 405/8 times the prior's pull on the drawn
    # coefficients. With its part through beta exact, the rest averaged over steps and the damping times 405/8, 300
    # full-batch steps at the defaults end within 1 nat of the exact KL's run (the former step: 77 nats below with the
    # Gaussian likelihood, 990 with the Bernoulli one; with the damping grown only beyond a sampling ratio of 16, the
    # Bernoulli run fell to -510 and ended 53 nats below). The rows are drawn from a seeded generator: over 8 seeds
    # the Gaussian run ended 0.52-0.55 nats below, the Bernoulli one 0.2-1.6 (one of 8 above 1). The curvature
    # records each sampled KL's rows and weight, and an exact KL none.
    X, y, beta = _line(likelihood)
    dense = torch.cat([_line_points(400), beta])
    final = {}
    for num_kl_columns in (None, 8):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = MeanBasisGP("decoupled", beta, dense, num_kl_columns=num_kl_columns, exact_kl_size=0)
        strategy = model.variational_strategy
        strategy.mean_basis.generator = torch.Generator().manual_seed(0)  # the draws, whatever ran before
        lik = gaussian_likelihood() if likelihood == "gaussian" else bernoulli_likelihood()
        optimizer = MeanBasisAdam(model)
        for _ in range(300):
            optimizer.zero_grad()
            (-full_batch_elbo(model, lik, X, y) / X.size(0)).backward()
            samples = strategy.curvature.kl_samples
            if num_kl_columns is None:
                assert samples == ()
            else:
                ((rows, weight),) = samples
                assert torch.equal(rows, strategy.mean_basis.sampled_indices) and rows.numel() == 8
                torch.testing.assert_close(weight, strategy.curvature.kl_weight, rtol=0, atol=0)
            optimizer.step()
        strategy.num_kl_columns = None
        with torch.no_grad():
            final[num_kl_columns] = full_batch_elbo(model, lik, X, y).item()
    assert abs(final[8] - final[None]) < 1.0, final


def test_decoupled_jacobi_preconditioned_strategy_takes_the_same_step() -> None:
    # The step is taken in the strategy's a and L_B: with the raw parameters mapped (a_0 = diag(K_alpha) a,
    # L_0 = diag(K_beta) L_B) the process after three steps is the plain model's. Prior variances differ from 1.
    models = []
    for jacobi in (False, True):
        beta, gamma, X, y = regression_problem(8)
        model = MeanBasisGP("decoupled", beta, torch.cat([gamma, beta]), jacobi_preconditioning=jacobi)
        fix_hyperparameters(model, outputscale=2.3)
        gen = generator(12)
        a, L_B = randn(16, gen=gen), random_factor(6, gen, scale=0.7)
        scale = 2.3 if jacobi else 1.0  # diag(K) of the scaled SE kernel
        set_decoupled_state(model, scale * a, scale * L_B)
        _elbo_steps(model, gaussian_likelihood(), X, y, MeanBasisAdam(model), 3)
        models.append(_process(model))
    for jacobi, plain in zip(models[1], models[0], strict=True):
        torch.testing.assert_close(jacobi, plain, rtol=1e-10, atol=1e-12)


def test_decoupled_state_dict_resumes_the_same_steps() -> None:
    # The running averages of the data's curvature are optimizer state: a run resumed from a checkpoint after two
    # steps takes the same third step as the uninterrupted run.
    runs = []
    for resume in (False, True):
        model, likelihood, alpha, beta, X, y = _decoupled_problem()
        optimizer = MeanBasisAdam(model)
        _elbo_steps(model, likelihood, X, y, optimizer, 2)
        if resume:
            checkpoint = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
            model, likelihood, alpha, beta, X, y = _decoupled_problem()
            optimizer = MeanBasisAdam(model)
            model.load_state_dict(checkpoint[0])
            optimizer.load_state_dict(checkpoint[1])
            kept = set(optimizer.state[model.variational_strategy.mean_basis.coefficients])
            assert kept == {"step", "mean_precision", "residual_curvature", "step_size"}
        _elbo_steps(model, likelihood, X, y, optimizer, 1)
        runs.append(_process(model))
    for resumed, uninterrupted in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=0)


@pytest.mark.parametrize("max_beta", [6, 8])
def test_decoupled_step_follows_grown_bases(max_beta: int) -> None:
    # Grown bases (zero coefficients, zero rows of L_B) change neither the process nor the step's running averages
    # of the old points: the step after growth is finite and keeps the averages' leading entries, also when only the
    # mean basis grows (max_beta=6: the covariance basis is full).
    model, likelihood, alpha, beta, X, y = _decoupled_problem()
    optimizer = MeanBasisAdam(model)
    _elbo_steps(model, likelihood, X, y, optimizer, 2)
    strategy = model.variational_strategy
    before = optimizer.state[strategy.mean_basis.coefficients]["residual_curvature"].clone()
    growth = OnlineBasisGrowth(
        model, 20, max_beta, 2, optimizers=[optimizer], generator=torch.Generator().manual_seed(0)
    )
    growth.step(X[:10], y[:10])
    assert strategy.mean_inducing_points.size(0) == 18 and strategy.inducing_points.size(0) == max_beta
    state = optimizer.state[strategy.mean_basis.coefficients]
    torch.testing.assert_close(state["residual_curvature"][:16], before, rtol=0, atol=0)
    _elbo_steps(model, likelihood, X, y, optimizer, 1)
    new_state = optimizer.state[strategy.mean_basis.coefficients]
    assert new_state["mean_precision"].shape == (max_beta, max_beta) and new_state["residual_curvature"].shape == (18,)
    assert all(torch.isfinite(value).all() for value in _process(model))


def test_decoupled_step_without_recorded_curvature_changes_nothing() -> None:
    model, likelihood, alpha, beta, X, y = _decoupled_problem()
    optimizer = MeanBasisAdam(model)
    strategy = model.variational_strategy
    strategy.record_curvature = False  # e.g. a forward pass before the optimizer existed
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="recorded no curvature"):
        _elbo_steps(model, likelihood, X, y, optimizer, 1)
    for parameter, value in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(parameter.detach(), value, rtol=0, atol=0)


def test_decoupled_arguments_are_refused() -> None:
    model = _decoupled_problem()[0]
    for name, value in (("covariance_lr", 0.0), ("covariance_lr", 1.5), ("damping", 0.0), ("lr", -1.0)):
        with pytest.raises(ValueError, match=name):
            MeanBasisAdam(model, **{name: value})
    optimizer = MeanBasisAdam(model)
    assert optimizer.param_groups[0]["lr"] == 0.1 and model.variational_strategy.record_curvature


def test_decoupled_step_is_the_same_through_either_whitener(monkeypatch) -> None:
    # Every use of the root X of K_beta^+ is invariant to its rotation: the step with the Cholesky whitener (the
    # certificate holds for this problem) equals the step with the eigendecomposition's.
    eigenvalue_root = decoupled_natural_step_module.pseudo_inverse_root

    def without_cholesky(matrix, eps):
        with monkeypatch.context() as patch:
            patch.setattr(torch.linalg, "cholesky_ex", lambda A: (A, torch.ones((), dtype=torch.int32)))
            return eigenvalue_root(matrix, eps)

    runs = []
    for root in (eigenvalue_root, without_cholesky):
        monkeypatch.setattr(decoupled_natural_step_module, "pseudo_inverse_root", root)
        model, likelihood, alpha, beta, X, y = _decoupled_problem()
        _elbo_steps(model, likelihood, X, y, MeanBasisAdam(model), 3)
        runs.append(_process(model))
    for eigen, cholesky in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(eigen, cholesky, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("num_kl_columns", [None, 4])
def test_a_float32_models_step_follows_the_float64_step_to_its_rounding(num_kl_columns: int | None) -> None:
    # A float32 model's step keeps the M_beta x M_alpha blocks and their products in float32 (their reductions and
    # everything else in float64): three steps from the same state, with the exact KL or 4 sampled rows of 16 (the
    # same draws), agree with the float64 model's to float32's rounding (products in bfloat16, about 3 significant
    # digits, miss the tolerance).
    runs = {}
    for dtype in (torch.float32, F64):
        model, likelihood, alpha, beta, X, y = _decoupled_problem(num_kl_columns=num_kl_columns, exact_kl_size=0)
        model.variational_strategy.mean_basis.generator = torch.Generator().manual_seed(0)
        gen = generator(11)
        set_decoupled_state(model, randn(16, gen=gen), random_factor(6, gen, scale=0.7))
        model, likelihood = model.to(dtype), likelihood.to(dtype)
        _elbo_steps(model, likelihood, X.to(dtype), y.to(dtype), MeanBasisAdam(model), 3)
        runs[dtype] = _process(model)
    for single, double in zip(runs[torch.float32], runs[F64], strict=True):
        assert single.dtype == torch.float32
        torch.testing.assert_close(single.double(), double, rtol=1e-5, atol=1e-6)


def test_a_nan_average_of_the_sampled_kl_gradient_reads_as_none_yet() -> None:
    # The lean training step creates the running average of the sampled KL's gradient before its first step, as NaN:
    # eager steps read it as no average (the first estimate taken whole), so both paths step alike from either state.
    runs = []
    for prefilled in (False, True):
        model, likelihood, alpha, beta, X, y = _decoupled_problem(num_kl_columns=4, exact_kl_size=0)
        model.variational_strategy.mean_basis.generator = torch.Generator().manual_seed(0)
        optimizer = MeanBasisAdam(model)
        coefficients = model.variational_strategy.mean_basis.coefficients
        if prefilled:
            optimizer.state[coefficients]["kl_residual_gradient"] = torch.full_like(coefficients, float("nan"))
        _elbo_steps(model, likelihood, X, y, optimizer, 3)
        assert torch.isfinite(optimizer.state[coefficients]["kl_residual_gradient"]).all()
        runs.append(_process(model))
    for value, expected in zip(*runs, strict=True):
        assert torch.equal(value, expected)
