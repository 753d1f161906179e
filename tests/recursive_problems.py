"""Small float64 problems for the Kalman-recursive sparse GP (spec B.5: n = 60, M = 10, mini-batches of 12 or 7).

One model class at module level (so that it pickles), a 1-D and a 2-D regression problem, the dense kernel blocks a
dense oracle needs (with the strategy's jitter on K_uu), and the batch bound of a model as a differentiable function
of its parameters, through the oracle.
"""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_decoupled.variational import KalmanVariationalStrategy
from tests.oracles import recursive_sparse_bound

F64 = torch.float64
NOISE, JITTER = 0.04, 1e-8
MODELS = [("vfe", None), ("dtc", None), ("fitc", None), ("pitc", None), ("pep", 0.5)]


class RecursiveGP(gpytorch.models.ApproximateGP):
    """An ApproximateGP with a KalmanVariationalStrategy, a constant (or zero) mean and a scaled RBF kernel."""

    def __init__(self, inducing_points, likelihood, approximation="vfe", alpha=None, constant_mean=False, **kwargs):
        strategy = KalmanVariationalStrategy(
            self, inducing_points, likelihood=likelihood, approximation=approximation, alpha=alpha, **kwargs
        )
        super().__init__(strategy)
        batch_shape = inducing_points.shape[:-2]
        dims = inducing_points.size(-1)
        self.mean_module = (
            gpytorch.means.ConstantMean(batch_shape=batch_shape) if constant_mean else gpytorch.means.ZeroMean()
        )
        kernel = gpytorch.kernels.RBFKernel(ard_num_dims=dims, batch_shape=batch_shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(kernel, batch_shape=batch_shape)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def problem(seed: int = 2, n: int = 60, num_inducing: int = 10, dims: int = 1):
    """``(X, y, Z)``: inputs uniform on [-3, 3]^d, a smooth function plus noise, inducing inputs spread over the
    domain (a perturbed grid in 1-D)."""
    gen = torch.Generator().manual_seed(seed)
    X = 6.0 * torch.rand(n, dims, generator=gen, dtype=F64) - 3.0
    y = torch.sin(2.0 * X[:, 0]) + 0.3 * torch.cos(5.0 * X[:, -1]) + 0.2 * torch.randn(n, generator=gen, dtype=F64)
    if dims == 1:
        Z = torch.linspace(-2.5, 2.5, num_inducing, dtype=F64).unsqueeze(-1)
        Z = Z + 0.01 * torch.randn(num_inducing, 1, generator=gen, dtype=F64)
    else:
        Z = 5.0 * torch.rand(num_inducing, dims, generator=gen, dtype=F64) - 2.5
    return X, y, Z


def make_model(Z, approximation="vfe", alpha=None, constant_mean=False, jitter_val=JITTER, **kwargs):
    """A float64 model with fixed hyperparameters (length-scales 0.6 / 0.9, amplitude 1.3, noise 0.04) and its
    likelihood; a constant mean is set to 0.2."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = torch.tensor(NOISE, dtype=F64)
    model = RecursiveGP(Z, likelihood, approximation, alpha, constant_mean, jitter_val=jitter_val, **kwargs).double()
    dims = Z.size(-1)
    lengthscale = torch.tensor([0.6, 0.9, 1.2][:dims] if dims <= 3 else [0.8] * dims, dtype=F64)
    model.covar_module.base_kernel.lengthscale = lengthscale.expand(*Z.shape[:-2], 1, dims)
    model.covar_module.outputscale = torch.full(Z.shape[:-2], 1.3, dtype=F64)
    if constant_mean:
        model.mean_module.constant = torch.full(Z.shape[:-2], 0.2, dtype=F64)
    return model, likelihood


def blocks_of(n: int, size: int, order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """A partition of ``range(n)``, taken in ``order``, into mini-batches of ``size`` (the last may be smaller)."""
    order = torch.arange(n) if order is None else order
    return list(order.split(size))


def stream(model, X, y, blocks) -> list[torch.Tensor]:
    """Absorbs the mini-batches in turn; the bound terms."""
    return [model.variational_strategy.update(X[..., block, :], y[..., block]) for block in blocks]


def dense_blocks(model, X: torch.Tensor, X_star: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The model's dense kernel matrices (K_uu with the strategy's jitter) and prior means, differentiable in its
    parameters: keys ``K_uu, K_uf, K_ff, mean_f`` and, with ``X_star``, ``K_us, K_ss, mean_s``."""
    strategy = model.variational_strategy
    Z = strategy.inducing_points
    num = Z.size(-2)
    inputs = [Z, X] if X_star is None else [Z, X, X_star]
    points = torch.cat([points.expand(*Z.shape[:-2], *points.shape[-2:]) for points in inputs], dim=-2)
    K = model.covar_module(points).to_dense()
    mean = model.mean_module(points)
    eye = torch.eye(num, dtype=K.dtype)
    end = num + X.size(-2)
    blocks = {
        "K_uu": K[..., :num, :num] + strategy.jitter_val * eye,
        "K_uf": K[..., :num, num:end],
        "K_ff": K[..., num:end, num:end],
        "mean_f": mean[..., num:end],
    }
    if X_star is not None:
        blocks.update(K_us=K[..., :num, end:], K_ss=K[..., end:, end:], mean_s=mean[..., end:])
    return blocks


def oracle_bound(model, likelihood, X, y, blocks=None) -> torch.Tensor:
    """The model's batch bound through the dense oracle, differentiable in every parameter (PITC: ``blocks``),
    summed over a batch of latents."""
    strategy = model.variational_strategy
    dense = dense_blocks(model, X)
    residual = (y - dense["mean_f"]).reshape(-1, X.size(-2))
    matrices = [dense[name].reshape(-1, *dense[name].shape[-2:]) for name in ("K_uu", "K_uf", "K_ff")]
    bounds = [
        recursive_sparse_bound(
            *(matrix[i] for matrix in matrices),
            residual[i],
            likelihood.noise[0],
            strategy.approximation,
            strategy.alpha,
            blocks,
        )
        for i in range(residual.size(0))
    ]
    return torch.stack(bounds).sum()
