"""Spec A.5 identities T1-T13 for t-SVGP (DualVariationalStrategy, DualEStep, DualVariationalELBO), against dense
float64 oracles (``tests/oracles/dual.py``, ``sparse_gp.py``) and GPyTorch's SGPR, exact GP and natural-gradient SVGP.

Default setup (spec A.5): n = 60 noisy 2-D points, M = 10 inducing inputs on a perturbed grid, the fixed SE kernel of
``tests/float64_problems.py``, float64 and jitter 1e-10 on K_uu, passed to the strategy (``jitter_val``) and given to
the oracles as the same jittered K_uu. GPyTorch's automatic jitter cannot interfere: every Cholesky that had to add
jitter warns with a NumericalWarning (GPyTorch's ``psd_safe_cholesky`` and the package's ``jittered_cholesky``
alike), and this module turns those warnings into errors. Bernoulli-probit uses a 40-point Gauss-Hermite rule with
float64 nodes on both sides. "Converged E-step" means one step with r = 1 (Gaussian) or 300 steps with r = 0.5
(Bernoulli). Tolerances are 1e-8 relative unless the spec says otherwise; the observed errors are far below.

GPyTorch's ``VariationalELBO`` (and so ``DualVariationalELBO``) returns ELBO / n: it is multiplied by n before every
comparison.
"""

from __future__ import annotations

import itertools

import gpytorch
import pytest
import torch

from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep
from tests.dual_problems import (
    DualGP,
    M,
    N,
    NaturalSVGP,
    binary_labels,
    dual_distribution,
    oracle_blocks,
    prior_mean,
    problem,
    q_of,
    random_sites,
    set_sites,
    site_values,
)
from tests.float64_problems import (
    F64,
    LENGTHSCALE,
    NOISE,
    OUTPUTSCALE,
    bernoulli_likelihood,
    fix_hyperparameters,
    gaussian_likelihood,
    generator,
    randn,
    relative_error,
)
from tests.oracles import (
    collapsed_bound,
    exact_log_marginal_likelihood,
    expected_gaussian_loglik,
    gaussian_kl,
    rbf,
    titsias_optimal_qu,
    unwhiten_qu,
    whiten_qu,
)
from tests.oracles.dual import (
    bernoulli_expected_loglik,
    datum_sites_to_summaries,
    dual_kl,
    dual_log_normalizer,
    dual_predictive,
    dual_qu_from_sites,
    dual_qu_from_summaries,
    expected_log_site,
    normalized_expected_log_site,
    normalized_log_normalizer,
    sites_to_summaries,
    summaries_to_sites,
    variational_elbo,
)

GH_POINTS = 40
CONSTANT_MEAN = 0.3

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("error::gpytorch.utils.warnings.NumericalWarning"),
]


# --------------------------------------------------------------------------------------------------------- models
class ExactModel(gpytorch.models.ExactGP):
    """GPyTorch's exact GP, or with ``inducing_points`` its SGPR (``InducingPointKernel``), with the SE kernel."""

    def __init__(self, X, y, likelihood, inducing_points=None, lengthscale=LENGTHSCALE, outputscale=OUTPUTSCALE):
        super().__init__(X, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        if inducing_points is not None:
            self.covar_module = gpytorch.kernels.InducingPointKernel(self.covar_module, inducing_points, likelihood)
        fix_hyperparameters(self, lengthscale=lengthscale, outputscale=outputscale)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


# --------------------------------------------------------------------------------------------------------- helpers
def _expected_loglik(likelihood, y: torch.Tensor):
    """The oracle's VE_i(mean, var) for ``likelihood`` (Gaussian closed form, Bernoulli by the same GH rule)."""
    if isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood):
        return lambda mean, var: expected_gaussian_loglik(y, mean, var, likelihood.noise)
    return lambda mean, var: bernoulli_expected_loglik(y, mean, var, GH_POINTS)


def _objective(model, likelihood, X, y) -> torch.Tensor:
    """n times DualVariationalELBO on the full batch, in training mode (spec: the M-step objective)."""
    model.train()
    likelihood.train()
    return X.size(-2) * DualVariationalELBO(likelihood, model, num_data=X.size(-2))(model(X), y)


def _gradients(value: torch.Tensor, modules) -> dict[str, torch.Tensor]:
    named = [(name, p) for module in modules for name, p in module.named_parameters()]
    grads = torch.autograd.grad(value, [p for _, p in named])
    return {name: g for (name, _), g in zip(named, grads, strict=True)}


def _converged(model, likelihood, X, y) -> DualEStep:
    """A converged E-step at the current hyperparameters (spec A.5: one r=1 step for Gaussian, 300 r=0.5 steps)."""
    gaussian = isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood)
    e_step = DualEStep(model, likelihood, num_data=X.size(0), lr=1.0 if gaussian else 0.5)
    indices = torch.arange(X.size(0)) if dual_distribution(model).per_datum else None
    for _ in range(1 if gaussian else 300):
        e_step.step(X, y, indices)
    return e_step


def _perturb(model, likelihood, seed: int, noise: bool = True) -> None:
    """Moves log-lengthscale, log-outputscale (and log-noise) by 0.3 N(0, 1) and Z by 0.2 N(0, 1)."""
    gen = generator(seed)
    kernel = model.covar_module
    with torch.no_grad():
        kernel.base_kernel.lengthscale = kernel.base_kernel.lengthscale * (0.3 * randn(1, gen=gen)).exp()
        kernel.outputscale = kernel.outputscale * (0.3 * randn(1, gen=gen)).exp().squeeze()
        Z = model.variational_strategy.inducing_points
        Z.add_(0.2 * randn(*Z.shape, gen=gen))
        if noise:
            likelihood.noise = likelihood.noise * (0.3 * randn(1, gen=gen)).exp()
    model.variational_strategy._clear_cache()


def _c(elbo: torch.Tensor, K_uu, m, S, expected_log_t: torch.Tensor) -> torch.Tensor:
    """c = sum_i E_q[log p(y_i | f_i)] - E_q[log t] = ELBO + KL(q || p) - E_q[log t] (spec eq. 40), from the oracle's
    ELBO of q and the expected log-site of the normalization of t at hand."""
    return elbo + gaussian_kl(m, S, torch.zeros_like(m), K_uu) - expected_log_t


def _assert_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    error = relative_error(actual.detach(), expected.detach())
    assert error < rtol, f"{name}: relative error {error:.2e} >= {rtol:.0e}"


# ----------------------------------------------------------------------------- q(u), log Z, KL, predictive (T6, T7)
@pytest.mark.parametrize("per_datum", [False, True])
@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([2])])
def test_variational_distribution_matches_the_oracle(batch_shape: torch.Size, per_datum: bool) -> None:
    Z, X, _ = problem()
    model = DualGP(Z, batch_shape=batch_shape, datum_inputs=X if per_datum else None)
    site_mean, site_precision = random_sites(model, 1)
    if batch_shape:  # different sites per latent
        site_precision = site_precision * torch.tensor([1.0, 3.0], dtype=F64).view(2, *[1] * (2 - per_datum))
        set_sites(model, site_mean, site_precision)
    K_uu, K_uf, _ = (block.detach() for block in oracle_blocks(model, X))
    m, S = q_of(model)
    assert m.shape == torch.Size([*batch_shape, M])
    for b in range(batch_shape.numel()):
        index = (b,) if batch_shape else ()
        if per_datum:  # variant C: summaries from the per-datum sites at the current theta
            summaries = datum_sites_to_summaries(K_uf, site_mean[index], site_precision[index])
            m_ref, S_ref = dual_qu_from_summaries(K_uu, *summaries)
        else:
            summaries = sites_to_summaries(K_uu, site_mean[index], site_precision[index])
            m_ref, S_ref = dual_qu_from_sites(K_uu, site_mean[index], site_precision[index])
        for actual, expected in zip(model.variational_strategy.site_summaries(), summaries):
            _assert_rel(actual[index], expected, 1e-10, "summaries (eq. 44)")
        _assert_rel(m[index], m_ref, 1e-10, "m")
        _assert_rel(S[index], S_ref, 1e-10, "S")
    prior = model.variational_strategy.prior_distribution
    _assert_rel(prior.covariance_matrix, K_uu, 1e-14, "prior covariance: K_uu + jitter")
    assert torch.equal(prior.mean, torch.zeros(M, dtype=F64))


@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([2])])
def test_t6_kl_is_eq51_and_the_generic_gaussian_kl(batch_shape: torch.Size) -> None:
    Z, X, _ = problem()
    model = DualGP(Z, batch_shape=batch_shape)
    ell1, L2 = random_sites(model, 2)
    K_uu = oracle_blocks(model, X)[0].detach()
    with torch.no_grad():
        kl = model.variational_strategy.kl_divergence()
    assert kl.shape == batch_shape
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    generic = gaussian_kl(m, S, torch.zeros_like(m), K_uu)
    _assert_rel(kl, generic, 1e-10, "KL vs generic")
    _assert_rel(kl, dual_kl(K_uu, *sites_to_summaries(K_uu, ell1, L2)), 1e-10, "KL vs eq. 51")
    assert (kl > 0.1).all()


def test_site_log_normalizer_matches_the_oracle() -> None:
    Z, X, y = problem()
    model = DualGP(Z, batch_shape=torch.Size([2]))
    ell1, L2 = random_sites(model, 3)
    K_uu = oracle_blocks(model, X)[0].detach()
    with torch.no_grad():
        log_z = model.variational_strategy.site_log_normalizer()
        objective = DualVariationalELBO(gaussian_likelihood(), model, num_data=N)
        _assert_rel(log_z, dual_log_normalizer(K_uu, *sites_to_summaries(K_uu, ell1, L2)), 1e-10, "log Z")
        _assert_rel(objective.site_log_normalizer(), log_z.sum() / N, 1e-14, "mll log Z")
    set_sites(model, torch.zeros_like(ell1), torch.zeros_like(L2))  # the prior: Z = 1
    assert model.variational_strategy.site_log_normalizer().abs().max() < 1e-14


def test_t7_predictive_is_eq49_and_the_generic_predictive() -> None:
    Z, X, _ = problem()
    model = DualGP(Z, constant_mean=CONSTANT_MEAN)
    ell1, L2 = random_sites(model, 4)
    X_test = X[:25]
    K_uu, K_us, _ = (block.detach() for block in oracle_blocks(model, X_test))
    with torch.no_grad():
        K_ss = model.covar_module(X_test).to_dense()
    prior_mean = torch.full((25,), CONSTANT_MEAN, dtype=F64)
    lam1bar, Lam2bar = sites_to_summaries(K_uu, ell1, L2)
    mean49, cov49 = dual_predictive(K_uu, K_us, K_ss, lam1bar, Lam2bar, prior_mean_s=prior_mean)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    V = torch.linalg.solve(K_uu, K_us)
    generic_mean, generic_cov = prior_mean + V.mT @ m, K_ss - V.mT @ (K_uu - S) @ V  # spec §0
    model.eval()
    with torch.no_grad():
        output = model(X_test)
    for reference in ((mean49, cov49), (generic_mean, generic_cov)):
        _assert_rel(output.mean, reference[0], 1e-10, "mean")
        _assert_rel(output.covariance_matrix, reference[1], 1e-10, "covariance")
    model.train()
    with torch.no_grad():
        output = model(X_test)
    _assert_rel(output.mean, mean49, 1e-10, "train mean")
    _assert_rel(output.variance, cov49.diagonal(), 1e-10, "train variance")


# ------------------------------------------------------------------------------------------------- T1-T4 E-step
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
    _assert_rel(lam1bar, K_uf @ centred_y / NOISE, 1e-10, "lam1bar")
    _assert_rel(Lam2bar, K_uf @ K_uf.mT / NOISE, 1e-10, "Lam2bar")
    # ... and q(u) is Titsias' q*.
    m_star, S_star = titsias_optimal_qu(K_uu, K_uf, y, NOISE, prior_mean_f=prior_mean(model, N))
    m, S = q_of(model)
    _assert_rel(m, m_star, 1e-10, "m")
    _assert_rel(S, S_star, 1e-10, "S")


def test_t2_elbo_at_titsias_q_is_vfe_bound_and_gpytorch_sgpr() -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z), gaussian_likelihood()
    random_sites(model, 6)
    DualEStep(model, likelihood, num_data=N, lr=1.0).step(X, y)
    elbo = _objective(model, likelihood, X, y)
    K_uu, K_uf, k_ff = (block.detach() for block in oracle_blocks(model, X))
    vfe = collapsed_bound(K_uu, K_uf, k_ff, y, NOISE)
    _assert_rel(elbo, vfe, 1e-8, "ELBO vs L_VFE")

    sgpr_likelihood = gaussian_likelihood()
    sgpr = ExactModel(X, y, sgpr_likelihood, inducing_points=Z)
    sgpr.train()
    sgpr_value = N * gpytorch.mlls.ExactMarginalLogLikelihood(sgpr_likelihood, sgpr)(sgpr(X), y)
    _assert_rel(sgpr_value, vfe, 1e-8, "GPyTorch SGPR n*mll vs L_VFE")
    # The sign of the trace term: in the installed GPyTorch it lowers the bound (L_VFE < log N(y | 0, Q + s2 I)).
    trace_term = sgpr.covar_module.added_loss_terms()
    assert sum(term.loss().item() for term in trace_term) < -1.0


@pytest.mark.parametrize("likelihood_name", ["gaussian", "bernoulli"])
@pytest.mark.parametrize("per_datum", [False, True])
def test_t3_converged_sites_are_a_fixed_point(likelihood_name: str, per_datum: bool) -> None:
    Z, X, y = problem()
    if likelihood_name == "gaussian":
        likelihood = gaussian_likelihood()
    else:
        likelihood, y = bernoulli_likelihood(GH_POINTS), binary_labels(y)
    model = DualGP(Z, datum_inputs=X if per_datum else None)
    e_step = _converged(model, likelihood, X, y)
    converged = site_values(model)
    for lr in (0.37, 1.0):
        e_step.param_groups[0]["lr"] = lr
        e_step.step(X, y, torch.arange(N) if per_datum else None)
        for after, before, name in zip(site_values(model), converged, ("site mean", "site precision"), strict=True):
            _assert_rel(after, before, 1e-10, f"{name} after r={lr}")


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
    _assert_rel(m, m_star, 1e-10, "m")
    _assert_rel(S, S_star, 1e-10, "S")


# --------------------------------------------------------------------------------------------- T5 E-step = NGD
@pytest.mark.parametrize("likelihood_name", ["gaussian", "bernoulli"])
def test_t5_e_step_is_one_gpytorch_ngd_step(likelihood_name: str) -> None:
    Z, X, y = problem()
    if likelihood_name == "gaussian":
        likelihood = gaussian_likelihood()
    else:
        likelihood, y = bernoulli_likelihood(GH_POINTS), binary_labels(y)
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
    _assert_rel(m, m_ngd, 1e-8, "m")
    _assert_rel(S, S_ngd, 1e-8, "S")


# ---------------------------------------------------------------------------------------------- T8 log Z + c
def test_t8_log_normalizer_plus_c_is_the_elbo_variant_a() -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z), gaussian_likelihood()
    ell1, L2 = random_sites(model, 11)  # arbitrary, non-converged sites
    DualEStep(model, likelihood, num_data=N, lr=0.6).step(X, y)
    ell1, L2 = site_values(model)
    _perturb(model, likelihood, 12)  # an arbitrary theta, not the E-step's
    elbo = _objective(model, likelihood, X, y).detach()
    with torch.no_grad():
        log_z = model.variational_strategy.site_log_normalizer()
        K_uu, K_uf, k_ff = oracle_blocks(model, X)
        m, S = dual_qu_from_sites(K_uu, ell1, L2)  # variant A: u-space sites held fixed
        expected = variational_elbo(K_uu, K_uf, k_ff, m, S, _expected_loglik(likelihood, y))
        c = _c(expected, K_uu, m, S, expected_log_site(ell1, L2, m, S))
    _assert_rel(log_z, dual_log_normalizer(K_uu, *sites_to_summaries(K_uu, ell1, L2)), 1e-10, "log Z")
    _assert_rel(log_z + c, elbo, 1e-10, "log Z + c vs package ELBO")
    _assert_rel(elbo, expected, 1e-10, "package ELBO vs oracle ELBO of q_theta")


def test_t8_log_normalizer_plus_c_is_the_elbo_variant_c() -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z, datum_inputs=X), gaussian_likelihood()
    lam1, lam2 = random_sites(model, 13)  # arbitrary per-datum sites, lambda_2 >= 0
    _perturb(model, likelihood, 14)
    elbo = _objective(model, likelihood, X, y).detach()
    with torch.no_grad():
        log_z = model.variational_strategy.site_log_normalizer()
        K_uu, K_uf, k_ff = oracle_blocks(model, X)
        lam1bar, Lam2bar = datum_sites_to_summaries(K_uf, lam1, lam2)  # variant C: recomputed at this theta
        m, S = dual_qu_from_summaries(K_uu, lam1bar, Lam2bar)
        ell1, L2 = summaries_to_sites(K_uu, lam1bar, Lam2bar)
        expected = variational_elbo(K_uu, K_uf, k_ff, m, S, _expected_loglik(likelihood, y))
        c = _c(expected, K_uu, m, S, expected_log_site(ell1, L2, m, S))
    _assert_rel(log_z, dual_log_normalizer(K_uu, lam1bar, Lam2bar), 1e-10, "log Z")
    _assert_rel(log_z + c, elbo, 1e-10, "log Z + c vs package ELBO")
    _assert_rel(elbo, expected, 1e-10, "package ELBO vs oracle ELBO of q_theta")


def test_t8_normalized_eq41_form_with_fixed_summaries_variant_b() -> None:
    # Variant B exists only as an oracle: summaries from an E-step at theta_0, then theta moves. The package gives the
    # ELBO of q_B once its u-space sites are set from the fixed summaries at the new theta.
    Z, X, y = problem()
    model, likelihood = DualGP(Z), gaussian_likelihood()
    random_sites(model, 15)
    DualEStep(model, likelihood, num_data=N, lr=0.8).step(X, y)
    with torch.no_grad():
        lam1bar, Lam2bar = sites_to_summaries(oracle_blocks(model, X)[0], *site_values(model))
    assert torch.linalg.eigvalsh(Lam2bar).min() > 1e-6  # eq. 41 needs an invertible Lam2bar (n > M)
    _perturb(model, likelihood, 16)
    with torch.no_grad():
        K_uu, K_uf, k_ff = oracle_blocks(model, X)
        m, S = dual_qu_from_summaries(K_uu, lam1bar, Lam2bar)
        expected = variational_elbo(K_uu, K_uf, k_ff, m, S, _expected_loglik(likelihood, y))
        c = _c(expected, K_uu, m, S, normalized_expected_log_site(K_uu, lam1bar, Lam2bar, m, S))
        eq41 = normalized_log_normalizer(K_uu, lam1bar, Lam2bar) + c
    set_sites(model, *summaries_to_sites(K_uu, lam1bar, Lam2bar))
    elbo = _objective(model, likelihood, X, y).detach()
    _assert_rel(eq41, expected, 1e-10, "eq. 41 log Z + c vs oracle ELBO")
    _assert_rel(elbo, eq41, 1e-9, "package ELBO of q_B vs eq. 41")


# ------------------------------------------------------------------------------------------- T9 matched E-step
@pytest.mark.parametrize("likelihood_name", ["gaussian", "bernoulli"])
@pytest.mark.parametrize("per_datum", [False, True])
def test_t9_matched_e_step_value_and_gradients(likelihood_name: str, per_datum: bool) -> None:
    Z, X, y = problem()
    if likelihood_name == "gaussian":
        likelihood = gaussian_likelihood()
    else:
        likelihood, y = bernoulli_likelihood(GH_POINTS), binary_labels(y)
    model = DualGP(Z, datum_inputs=X if per_datum else None, constant_mean=CONSTANT_MEAN)
    _converged(model, likelihood, X, y)
    m0, S0 = q_of(model)

    value = _objective(model, likelihood, X, y)
    gradients = _gradients(value, (model, likelihood))
    K_uu, K_uf, k_ff = oracle_blocks(model, X)
    q_fixed = variational_elbo(K_uu, K_uf, k_ff, m0, S0, _expected_loglik(likelihood, y), prior_mean(model, N))
    q_fixed_gradients = _gradients(q_fixed, (model, likelihood))

    _assert_rel(value, q_fixed, 1e-10, "value")
    assert set(gradients) == set(q_fixed_gradients)
    expected_names = {"variational_strategy.inducing_points", "mean_module.raw_constant"}
    assert expected_names | {"covar_module.raw_outputscale", "covar_module.base_kernel.raw_lengthscale"} <= set(
        gradients
    )
    for name, gradient in gradients.items():
        assert q_fixed_gradients[name].abs().max() > 1e-3, name  # a non-trivial gradient
        _assert_rel(gradient, q_fixed_gradients[name], 1e-8, name)


# ------------------------------------------------------------------------------------ T10, T11 envelopes
def test_t10_variant_c_is_the_vfe_bound_and_an_upper_envelope() -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z, datum_inputs=X), gaussian_likelihood()
    _converged(model, likelihood, X, y)
    lam1, lam2 = site_values(model)
    torch.testing.assert_close(lam1, y / NOISE, rtol=1e-12, atol=0)
    torch.testing.assert_close(lam2, torch.full_like(y, 1.0 / NOISE), rtol=1e-12, atol=0)
    m0, S0 = q_of(model)
    for seed in range(17, 21):  # kernel parameters and Z move; the noise stays sigma_0^2
        _perturb(model, likelihood, seed, noise=False)
        value = _objective(model, likelihood, X, y).detach()
        with torch.no_grad():
            K_uu, K_uf, k_ff = oracle_blocks(model, X)
            vfe = collapsed_bound(K_uu, K_uf, k_ff, y, NOISE)
            q_fixed = variational_elbo(K_uu, K_uf, k_ff, m0, S0, _expected_loglik(likelihood, y))
        _assert_rel(value, vfe, 1e-8, f"L_C vs L_VFE (seed {seed})")
        assert value >= q_fixed - 1e-9 * q_fixed.abs(), (seed, value, q_fixed)


def _hessian(value: torch.Tensor, parameters: list[torch.Tensor]) -> torch.Tensor:
    """The dense Hessian of ``value`` in the flattened ``parameters``, by double backward."""
    gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, parameters, create_graph=True)])
    rows = [torch.autograd.grad(g, parameters, retain_graph=True) for g in gradient]
    return torch.stack([torch.cat([h.reshape(-1) for h in row]) for row in rows])


def test_t10_variant_c_hessian_dominates_the_q_fixed_hessian() -> None:
    # On the kernel + Z block at theta_0 (noise fixed): Hess L_C = Hess L_VFE, and Hess L_C - Hess L_q-fixed >= 0.
    Z, X, y = problem()
    model, likelihood = DualGP(Z, datum_inputs=X), gaussian_likelihood()
    _converged(model, likelihood, X, y)
    m0, S0 = q_of(model)
    kernel = model.covar_module
    parameters = [
        kernel.base_kernel.raw_lengthscale,
        kernel.raw_outputscale,
        model.variational_strategy.inducing_points,
    ]
    hessian_c = _hessian(_objective(model, likelihood, X, y), parameters)
    hessian_vfe = _hessian(collapsed_bound(*oracle_blocks(model, X), y, NOISE), parameters)
    K_uu, K_uf, k_ff = oracle_blocks(model, X)
    hessian_q = _hessian(variational_elbo(K_uu, K_uf, k_ff, m0, S0, _expected_loglik(likelihood, y)), parameters)
    _assert_rel(hessian_c, hessian_vfe, 1e-8, "Hessian of L_C vs L_VFE")
    difference = hessian_c - hessian_q
    eigenvalues = torch.linalg.eigvalsh(0.5 * (difference + difference.mT))
    assert eigenvalues.min() > -1e-8 * eigenvalues.abs().max(), eigenvalues  # observed min +1.8e-3, max 1.5e2


def test_t11_inducing_inputs_at_the_data_give_the_exact_marginal_likelihood() -> None:
    gen = generator(21)
    grid = torch.cartesian_prod(*(2 * [torch.linspace(-2.0, 2.0, 5, dtype=F64)]))
    X = grid + 0.05 * randn(25, 2, gen=gen)
    y = torch.sin(1.5 * X[:, 0]) + 0.5 * torch.cos(2.0 * X[:, 1]) + 0.3 * randn(25, gen=gen)
    model, likelihood = DualGP(X.clone()), gaussian_likelihood()
    _converged(model, likelihood, X, y)
    for seed in range(22, 26):  # kernel parameters move; Z = X and the noise stay
        _perturb(model, likelihood, seed, noise=False)
        with torch.no_grad():
            model.variational_strategy.inducing_points.copy_(X)
            K_ff = oracle_blocks(model, X)[1]
        value = _objective(model, likelihood, X, y).detach()
        exact = exact_log_marginal_likelihood(K_ff, y, NOISE)
        _assert_rel(value, exact, 1e-7, f"L_A vs exact LML (seed {seed})")  # spec: ~1e-7 from the jitter


# ------------------------------------------------------------------------------------------- T12 unbiasedness
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
        _assert_rel(mean, full, 1e-10, name)
    _assert_rel(mean_objective, full_objective, 1e-10, "objective")


# ---------------------------------------------------------------------------------------- T13 reference suite
def test_t13_reference_suite_elbo_is_the_gpr_marginal_likelihood() -> None:
    # 8 points, SE kernel (lengthscale 2, variance 2.25), noise 0.3, Z = X: one r = 1 E-step, then ELBO = GPR LML.
    gen = generator(27)
    X = torch.linspace(-3.0, 3.0, 8, dtype=F64).unsqueeze(-1) + 0.1 * randn(8, 1, gen=gen)
    y = torch.sin(X[:, 0]) + 0.3 * randn(8, gen=gen)
    likelihood = gaussian_likelihood(0.3)
    model = DualGP(X.clone())
    fix_hyperparameters(model, lengthscale=2.0, outputscale=2.25)
    DualEStep(model, likelihood, num_data=8, lr=1.0).step(X, y)
    elbo = _objective(model, likelihood, X, y).item()
    gpr_likelihood = gaussian_likelihood(0.3)
    gpr = ExactModel(X, y, gpr_likelihood, lengthscale=2.0, outputscale=2.25)
    gpr.train()
    gpr_lml = 8 * gpytorch.mlls.ExactMarginalLogLikelihood(gpr_likelihood, gpr)(gpr(X), y).item()
    K_ff = rbf(X, X, 2.0, 2.25)
    assert gpr_lml == pytest.approx(exact_log_marginal_likelihood(K_ff, y, 0.3).item(), abs=1e-10)
    assert abs(elbo - gpr_lml) < 5e-5, (elbo, gpr_lml)  # 4 decimals (observed |difference| ~1e-9)


# ------------------------------------------------------------------------------------- no gradients into sites
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


def test_m_step_gradients_do_not_flow_into_the_sites() -> None:
    Z, X, y = problem()
    model, likelihood = DualGP(Z), gaussian_likelihood()
    DualEStep(model, likelihood, num_data=N, lr=1.0).step(X, y)
    sites = site_values(model)
    names = {name for name, _ in model.named_parameters()}
    assert not any("site" in name for name in names)
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        (-_objective(model, likelihood, X, y)).backward()
        optimizer.step()
    for site, before in zip(dual_distribution(model)(), sites, strict=True):
        assert site.grad is None and not site.requires_grad
        assert torch.equal(site, before)
    assert model.covar_module.raw_outputscale.grad is not None
