"""Small float64 problems for t-SVGP (spec A.5: n = 60 noisy 2-D points, M = 10 inducing inputs, SE kernel, jitter
1e-10 on K_uu), shared by the dual identity, contract and likelihood tests.

One model class at module level (so that it pickles), helpers that read and set the sites, the dense kernel blocks
at a model's current hyperparameters through the oracle kernel, differentiable in the model's raw parameters, and the
objective, E-step and comparison helpers that the strategy, E-step and objective identity tests share.
"""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep
from gpytorch_decoupled.variational import (
    DualVariationalDistribution,
    DualVariationalStrategy,
    IndependentMultitaskVariationalStrategy,
    LMCVariationalStrategy,
)
from tests.float64_problems import (
    F64,
    JITTER,
    LENGTHSCALE,
    OUTPUTSCALE,
    bernoulli_likelihood,
    eye,
    fix_hyperparameters,
    gaussian_likelihood,
    generator,
    randn,
    random_spd,
    regression_problem,
    relative_error,
)
from tests.oracles import expected_gaussian_loglik, gaussian_kl, rbf
from tests.oracles.dual import bernoulli_expected_loglik

N, M = 60, 10


class DualGP(gpytorch.models.ApproximateGP):
    """A float64 t-SVGP with the fixed SE kernel; ``datum_inputs`` gives per-datum sites (variant C)."""

    def __init__(self, Z, batch_shape=torch.Size([]), datum_inputs=None, constant_mean=None, jitter_val=JITTER):
        q = DualVariationalDistribution(Z.size(-2), batch_shape=batch_shape, datum_inputs=datum_inputs)
        super().__init__(DualVariationalStrategy(self, Z, q, jitter_val=jitter_val))
        self.mean_module = gpytorch.means.ZeroMean() if constant_mean is None else gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        fix_hyperparameters(self, constant_mean)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class NaturalSVGP(gpytorch.models.ApproximateGP):
    """GPyTorch's whitened SVGP with a NaturalVariationalDistribution (for NGD), same kernel and jitter."""

    def __init__(self, Z):
        q = gpytorch.variational.NaturalVariationalDistribution(Z.size(-2))
        super().__init__(gpytorch.variational.VariationalStrategy(self, Z, q, jitter_val=JITTER))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        fix_hyperparameters(self)
        self.variational_strategy.variational_params_initialized.fill_(1)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def problem(seed: int = 0):
    """``(Z, X, y)``: M = 10 inducing inputs on a perturbed grid and n = 60 noisy 2-D points."""
    Z, _, X, y = regression_problem(seed, n=N, m_beta=M, m_gamma=0)
    return Z, X, y


def binary_labels(y: torch.Tensor) -> torch.Tensor:
    return (y > 0).to(F64)


def dual_distribution(model: DualGP) -> DualVariationalDistribution:
    return model.variational_strategy._variational_distribution


def site_values(model: DualGP) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(site.clone() for site in dual_distribution(model)())


def set_sites(model: DualGP, site_mean: torch.Tensor, site_precision: torch.Tensor) -> None:
    with torch.no_grad():
        for site, value in zip(dual_distribution(model)(), (site_mean, site_precision), strict=True):
            site.copy_(value)
    model.variational_strategy._clear_cache()


def random_sites(model: DualGP, seed: int, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary sites: a random ell_1 and a random PSD L_2 (or random per-datum sites with lambda_2 >= 0)."""
    gen = generator(seed)
    site_mean, site_precision = dual_distribution(model)()
    if dual_distribution(model).per_datum:
        values = randn(*site_mean.shape, gen=gen), scale * torch.rand(site_precision.shape, generator=gen, dtype=F64)
    else:
        values = randn(*site_mean.shape, gen=gen), scale * random_spd(site_mean.size(-1), gen)
    set_sites(model, *values)
    return values


def q_of(model: DualGP) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        q = model.variational_strategy.variational_distribution
        return q.mean.clone(), q.covariance_matrix.clone()


def oracle_blocks(model: DualGP, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(K_uu + jitter I, K_uf, k_ff)`` by the dense oracle kernel at the model's current hyperparameters and inducing
    inputs: differentiable in the model's raw parameters, so gradients of oracle objectives can be compared."""
    kernel = model.covar_module
    lengthscale, outputscale = kernel.base_kernel.lengthscale.reshape(-1), kernel.outputscale
    strategy = model.variational_strategy
    Z = getattr(strategy, "base_variational_strategy", strategy).inducing_points  # also inside a multitask wrapper
    K_uu = rbf(Z, Z, lengthscale, outputscale) + JITTER * eye(Z.size(-2))
    return K_uu, rbf(Z, X, lengthscale, outputscale), outputscale.expand(X.size(-2))


def prior_mean(model: DualGP, n: int) -> torch.Tensor | None:
    if isinstance(model.mean_module, gpytorch.means.ZeroMean):
        return None
    return model.mean_module.constant.expand(n)


# ---------------------------------------------------------- shared by the strategy, E-step and objective identities
GH_POINTS = 40
CONSTANT_MEAN = 0.3


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


def likelihood_and_targets(name: str, y: torch.Tensor) -> tuple[gpytorch.likelihoods.Likelihood, torch.Tensor]:
    """The float64 ``"gaussian"`` likelihood and ``y``, or the ``"bernoulli"`` (probit, GH_POINTS-point rule) one and
    the labels ``y > 0``."""
    if name == "gaussian":
        return gaussian_likelihood(), y
    return bernoulli_likelihood(GH_POINTS), binary_labels(y)


def expected_loglik(likelihood, y: torch.Tensor):
    """The oracle's VE_i(mean, var) for ``likelihood`` (Gaussian closed form, Bernoulli by the same GH rule)."""
    if isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood):
        return lambda mean, var: expected_gaussian_loglik(y, mean, var, likelihood.noise)
    return lambda mean, var: bernoulli_expected_loglik(y, mean, var, GH_POINTS)


def full_batch_objective(model, likelihood, X, y) -> torch.Tensor:
    """n times DualVariationalELBO on the full batch, in training mode (spec: the M-step objective)."""
    model.train()
    likelihood.train()
    return X.size(-2) * DualVariationalELBO(likelihood, model, num_data=X.size(-2))(model(X), y)


def named_gradients(value: torch.Tensor, modules) -> dict[str, torch.Tensor]:
    named = [(name, p) for module in modules for name, p in module.named_parameters()]
    grads = torch.autograd.grad(value, [p for _, p in named])
    return {name: g for (name, _), g in zip(named, grads, strict=True)}


def converged_e_step(model, likelihood, X, y) -> DualEStep:
    """A converged E-step at the current hyperparameters (spec A.5: one r=1 step for Gaussian, 300 r=0.5 steps)."""
    gaussian = isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood)
    e_step = DualEStep(model, likelihood, num_data=X.size(0), lr=1.0 if gaussian else 0.5)
    indices = torch.arange(X.size(0)) if dual_distribution(model).per_datum else None
    for _ in range(1 if gaussian else 300):
        e_step.step(X, y, indices)
    return e_step


def perturb(model, likelihood, seed: int, noise: bool = True) -> None:
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


def c_term(elbo: torch.Tensor, K_uu, m, S, expected_log_t: torch.Tensor) -> torch.Tensor:
    """c = sum_i E_q[log p(y_i | f_i)] - E_q[log t] = ELBO + KL(q || p) - E_q[log t] (spec eq. 40), from the oracle's
    ELBO of q and the expected log-site of the normalization of t at hand."""
    return elbo + gaussian_kl(m, S, torch.zeros_like(m), K_uu) - expected_log_t


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    error = relative_error(actual.detach(), expected.detach())
    assert error < rtol, f"{name}: relative error {error:.2e} >= {rtol:.0e}"


class NaNLikelihood(gpytorch.likelihoods.GaussianLikelihood):
    """A likelihood whose expected log-likelihood is NaN (as a broken custom likelihood would give)."""

    def expected_log_prob(self, target, input, *params, **kwargs):
        return super().expected_log_prob(target, input, *params, **kwargs) * float("nan")


def em_model(per_datum: bool = False, batch_shape: torch.Size = torch.Size([])):
    """A float64 model after two E-steps (r = 0.7) and two Adam M-steps, and its data."""
    Z, X, y = problem()
    model, likelihood = DualGP(Z, batch_shape=batch_shape, datum_inputs=X if per_datum else None), gaussian_likelihood()
    e_step = DualEStep(model, likelihood, num_data=X.size(0), lr=0.7)
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    objective = DualVariationalELBO(likelihood, model, num_data=X.size(0))
    indices = torch.arange(X.size(0)) if per_datum else None
    for _ in range(2):
        e_step.step(X, y, indices)
        model.train()
        optimizer.zero_grad()
        (-objective(model(X), y).sum()).backward()
        optimizer.step()
    return model, likelihood, X, y


def state_snapshot(module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def assert_same_state(module, state: dict[str, torch.Tensor]) -> None:
    now = module.state_dict()
    assert now.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(now[name], value), name


class MultitaskDualGP(gpytorch.models.ApproximateGP):
    """One t-SVGP latent per task (batch [T]) in the IndependentMultitask wrapper, or T latents mixed by LMC."""

    def __init__(self, Z, num_tasks: int, wrapper: str = "imt"):
        q = DualVariationalDistribution(Z.size(-2), batch_shape=torch.Size([num_tasks]))
        base = DualVariationalStrategy(self, Z, q, jitter_val=JITTER)
        if wrapper == "imt":
            strategy = IndependentMultitaskVariationalStrategy(base, num_tasks=num_tasks)
        else:
            strategy = LMCVariationalStrategy(base, num_tasks=num_tasks, num_latents=num_tasks)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.double()
        self.covar_module.base_kernel.lengthscale = torch.tensor(0.7, dtype=F64)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
