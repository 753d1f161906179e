"""Small float64 problems for t-SVGP (spec A.5: n = 60 noisy 2-D points, M = 10 inducing inputs, SE kernel, jitter
1e-10 on K_uu), shared by the dual identity, contract and likelihood tests.

One model class at module level (so that it pickles), helpers that read and set the sites, and the dense kernel blocks
at a model's current hyperparameters through the oracle kernel, differentiable in the model's raw parameters.
"""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy
from tests.float64_problems import (
    F64,
    JITTER,
    eye,
    fix_hyperparameters,
    generator,
    randn,
    random_spd,
    regression_problem,
)
from tests.oracles import rbf

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
