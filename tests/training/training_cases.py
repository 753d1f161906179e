"""Small models for the training-step tests: every supported strategy, kernel, mean and likelihood, with parameters
moved away from their initial values (so that no gradient is trivially zero)."""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep, MeanBasisAdam
from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    DualVariationalDistribution,
    DualVariationalStrategy,
    FastNaturalVariationalDistribution,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)

STRATEGIES = ("svgp", "odvgp", "hybrid")
DISTRIBUTIONS = ("fast_natural", "cholesky")
KERNELS = ("rbf_ard", "matern12", "matern32", "matern52", "rbf_unscaled")


class CaseModel(gpytorch.models.ApproximateGP):
    def __init__(
        self,
        z,
        strategy="svgp",
        distribution="fast_natural",
        kernel="rbf_ard",
        mean="constant",
        gamma=None,
        jacobi=False,
        sampled_kl=False,
        kl_data_landmarks=True,
    ):
        q = (
            FastNaturalVariationalDistribution(z.size(0))
            if distribution == "fast_natural"
            else gpytorch.variational.CholeskyVariationalDistribution(z.size(0))
        )
        # mean bases of 20 points: with sampled_kl, their training KL is estimated from 5 rows per step
        exact_kl_size = 10 if sampled_kl else 4096
        if strategy == "dual":  # t-SVGP: its own sites
            variational_strategy = DualVariationalStrategy(self, z, DualVariationalDistribution(z.size(0)))
        elif strategy == "decoupled":  # its own parameters (a, L_B): the mean basis is gamma
            q = DecoupledVariationalDistribution(gamma.size(0), z.size(0))
            variational_strategy = DecoupledVariationalStrategy(
                self, z, q, gamma, num_kl_columns=5, jacobi_preconditioning=jacobi, exact_kl_size=exact_kl_size
            )
        elif strategy == "svgp":
            variational_strategy = gpytorch.variational.VariationalStrategy(self, z, q)
        else:
            cls = OrthogonallyDecoupledVariationalStrategy if strategy == "odvgp" else HybridVariationalStrategy
            variational_strategy = cls(
                self, z, q, gamma, num_kl_columns=5, exact_kl_size=exact_kl_size, kl_data_landmarks=kl_data_landmarks
            )
        super().__init__(variational_strategy)
        self.mean_module = gpytorch.means.ConstantMean() if mean == "constant" else gpytorch.means.ZeroMean()
        dims = z.size(-1)
        base = {
            "rbf_ard": lambda: gpytorch.kernels.RBFKernel(ard_num_dims=dims),
            "rbf_unscaled": lambda: gpytorch.kernels.RBFKernel(),
            "matern12": lambda: gpytorch.kernels.MaternKernel(nu=0.5, ard_num_dims=dims),
            "matern32": lambda: gpytorch.kernels.MaternKernel(nu=1.5),
            "matern52": lambda: gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=dims),
        }[kernel]()
        self.covar_module = base if kernel == "rbf_unscaled" else gpytorch.kernels.ScaleKernel(base)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def make_case(seed=0, dtype=torch.float64, likelihood="gaussian", num_data=40, num_inducing=8, dims=2, **options):
    """A model, likelihood, objective and data, with q(u) initialized and every parameter perturbed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_data, dims, generator=generator, dtype=dtype) * 4 - 2
    f = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1:].sum(-1)
    if likelihood == "gaussian":
        y = f + 0.1 * torch.randn(num_data, generator=generator, dtype=dtype)
        lik = gpytorch.likelihoods.GaussianLikelihood()
    else:
        y = (f > 0).to(dtype)
        lik = gpytorch.likelihoods.BernoulliLikelihood()
    gamma = torch.rand(20, dims, generator=generator, dtype=dtype) * 4 - 2
    torch.manual_seed(seed)
    model = CaseModel(x[:num_inducing].clone() + 0.05, gamma=gamma, **options).to(dtype)
    lik = lik.to(dtype)
    dual = options.get("strategy") == "dual"
    mll = (DualVariationalELBO if dual else gpytorch.mlls.VariationalELBO)(lik, model, num_data=num_data)
    model.train()
    lik.train()
    with torch.no_grad():
        model(x[:2])  # initializes q(u) as GPyTorch does on the first call
        for name, parameter in [*model.named_parameters(), *lik.named_parameters()]:
            if "natural" not in name:  # natural parameters must stay a valid Gaussian: moved by NGD below
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator, dtype=dtype))
        if dual:  # sites away from the prior, as an E-step sets them (then a perturbation that keeps them PSD)
            DualEStep(model, lik, num_data=num_data, lr=0.7).step(x, y)
            q = model.variational_strategy._variational_distribution
            shift = 0.1 * torch.randn(num_inducing, num_inducing, generator=generator, dtype=dtype)
            q.site_precision.add_(0.05 * (shift @ shift.mT))
            q.site_mean.add_(0.3 * torch.randn(num_inducing, generator=generator, dtype=dtype))
        elif options.get("distribution", "fast_natural") == "fast_natural":
            q = model.variational_strategy._variational_distribution
            shift = 0.1 * torch.randn(num_inducing, num_inducing, generator=generator, dtype=dtype)
            q.natural_mat.sub_(0.05 * (shift @ shift.mT))
            q.natural_vec.add_(0.3 * torch.randn(num_inducing, generator=generator, dtype=dtype))
    return model, lik, mll, x, y


def optimizers(model, likelihood, num_data, distribution="fast_natural", mean_rule=None):
    """NGD on q(u) (Adam with a Cholesky distribution) and Adam on the rest, as the benchmarks train; for t-SVGP
    (``distribution="dual"``) its E-step and an Adam M-step."""
    if distribution == "dual":
        e_step = DualEStep(model, likelihood, num_data=num_data, lr=0.5)
        return [e_step, torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.05)]
    if distribution == "decoupled":  # MeanBasisAdam's curvature step on (a, L_B), Adam on the rest (L_B too)
        mean_step = MeanBasisAdam(model, num_samples=4)
        coefficients = model.variational_strategy.mean_basis.coefficients
        rest = [p for p in [*model.parameters(), *likelihood.parameters()] if p is not coefficients]
        return [mean_step, torch.optim.Adam(rest, lr=0.05)]
    if mean_rule == "mean-basis-adam":  # a decoupled strategy's mean coefficients by MeanBasisAdam (the default)
        ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=0.1)
        mean_step = MeanBasisAdam(model, lr=0.3, num_samples=4)
        coefficients = {id(group["params"][0]) for group in mean_step.param_groups}
        rest = [p for p in [*model.hyperparameters(), *likelihood.parameters()] if id(p) not in coefficients]
        return [ngd, mean_step, torch.optim.Adam(rest, lr=0.05)]
    if distribution == "fast_natural":
        ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=0.1)
        adam = torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.05)
        return [ngd, adam]
    return [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)]
