"""The recursive sparse GP oracle (``tests/oracles/recursive_sparse_gp.py``) checked against independent routes.

Each model's batch bound, posterior and predictive is compared with something computed another way: the exact GP
when the inducing inputs are the data (every model is then exact), Titsias' bound and optimum of
``tests/oracles/sparse_gp.py``, GPyTorch's own SGPR (``ExactGP`` with an ``InducingPointKernel``), the limits that
relate the models to each other (PEP at alpha = 1 is FITC, alpha -> 0 is VFE, PITC with singleton blocks is FITC and
with one block the exact GP), and the covariance-form Kalman filter (spec eq. 16), which never forms the batch matrices.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

from tests.oracles import (
    collapsed_bound,
    exact_log_marginal_likelihood,
    exact_posterior,
    kalman_filter,
    rbf,
    recursive_sparse_bound,
    recursive_sparse_posterior,
    recursive_sparse_predictive,
    svgp_predictive,
    titsias_optimal_qu,
)
from tests.recursive_problems import MODELS, blocks_of

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
LENGTHSCALE, OUTPUTSCALE, NOISE = 0.7, 1.3, 0.05


def _k(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return rbf(A, B, LENGTHSCALE, OUTPUTSCALE)


def _problem(n: int = 40, num_inducing: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    X = 6.0 * torch.rand(n, 1, generator=gen, dtype=F64) - 3.0
    y = torch.sin(2.0 * X[:, 0]) + 0.2 * torch.randn(n, generator=gen, dtype=F64)
    Z = torch.linspace(-2.8, 2.8, num_inducing, dtype=F64).unsqueeze(-1)
    X_star = torch.linspace(-3.5, 3.5, 7, dtype=F64).unsqueeze(-1)
    return X, y, Z, X_star


def _blocks(X, Z, X_star=None):
    blocks = {"K_uu": _k(Z, Z), "K_uf": _k(Z, X), "K_ff": _k(X, X)}
    if X_star is not None:
        blocks.update(K_us=_k(Z, X_star), K_ss=_k(X_star, X_star))
    return blocks


def _grid_data(n: int = 12):
    """Inputs near a regular grid (K_XX well conditioned, so that Z = X can be factored without jitter)."""
    gen = torch.Generator().manual_seed(5)
    X = (torch.linspace(-3.0, 3.0, n, dtype=F64) + 0.05 * torch.randn(n, generator=gen, dtype=F64)).unsqueeze(-1)
    y = torch.sin(2.0 * X[:, 0]) + 0.3 * torch.randn(n, generator=gen, dtype=F64)
    return X, y


@pytest.mark.parametrize("model,alpha", MODELS)
def test_inducing_points_at_the_data_give_the_exact_gp(model: str, alpha: float | None) -> None:
    # Q_ff = K_ff and Delta = 0: every model, and its posterior of u = f(X), is the exact GP.
    X, y = _grid_data()
    X_star = torch.linspace(-3.5, 3.5, 5, dtype=F64).unsqueeze(-1)
    K, K_xs, K_ss = _k(X, X), _k(X, X_star), _k(X_star, X_star)
    blocks = blocks_of(12, 5)
    bound = recursive_sparse_bound(K, K, K, y, NOISE, model, alpha, blocks)
    torch.testing.assert_close(bound, exact_log_marginal_likelihood(K, y, NOISE), rtol=1e-9, atol=0.0)

    m, S = recursive_sparse_posterior(K, K, K, y, NOISE, model, alpha, blocks)
    exact_mean, exact_cov = exact_posterior(K, K, K, y, NOISE)
    torch.testing.assert_close(m, exact_mean, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(S, exact_cov, rtol=1e-8, atol=1e-9)

    mean, cov = recursive_sparse_predictive(K, K, K, K_xs, K_ss, y, NOISE, model, alpha, blocks)
    exact_mean_s, exact_cov_s = exact_posterior(K, K_xs, K_ss, y, NOISE)
    torch.testing.assert_close(mean, exact_mean_s, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(cov, exact_cov_s, rtol=1e-8, atol=1e-9)


def test_vfe_is_titsias() -> None:
    X, y, Z, _ = _problem()
    b = _blocks(X, Z)
    bound = recursive_sparse_bound(b["K_uu"], b["K_uf"], b["K_ff"], y, NOISE, "vfe")
    expected = collapsed_bound(b["K_uu"], b["K_uf"], torch.diagonal(b["K_ff"]), y, NOISE)
    torch.testing.assert_close(bound, expected, rtol=1e-12, atol=0.0)
    m, S = recursive_sparse_posterior(b["K_uu"], b["K_uf"], b["K_ff"], y, NOISE, "vfe")
    m_opt, S_opt = titsias_optimal_qu(b["K_uu"], b["K_uf"], y, NOISE)
    torch.testing.assert_close(m, m_opt, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(S, S_opt, rtol=1e-10, atol=1e-11)
    # VFE and DTC share the posterior; the bounds differ by exactly tr(K_ff - Q_ff) / (2 noise) > 0.
    dtc = recursive_sparse_bound(b["K_uu"], b["K_uf"], b["K_ff"], y, NOISE, "dtc")
    m_dtc, S_dtc = recursive_sparse_posterior(*b.values(), y, NOISE, "dtc")
    torch.testing.assert_close(m_dtc, m, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(S_dtc, S, rtol=1e-13, atol=1e-14)
    trace = torch.diagonal(b["K_ff"]).sum() - torch.trace(b["K_uf"].mT @ torch.linalg.solve(b["K_uu"], b["K_uf"]))
    torch.testing.assert_close(dtc - bound, trace / (2 * NOISE), rtol=1e-10, atol=0.0)
    assert float(trace) > 0.1


class _SGPR(gpytorch.models.ExactGP):
    def __init__(self, X, y, Z, likelihood):
        super().__init__(X, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        base.base_kernel.lengthscale = torch.tensor(LENGTHSCALE, dtype=F64)
        base.outputscale = torch.tensor(OUTPUTSCALE, dtype=F64)
        self.covar_module = gpytorch.kernels.InducingPointKernel(base, Z, likelihood)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def test_vfe_is_gpytorch_sgpr_times_n() -> None:
    # spec S10: GPyTorch's ExactMarginalLogLikelihood with an InducingPointKernel returns L_VFE / n; its added loss
    # term carries the minus sign of -tr(K_ff - Q_ff) / (2 noise) in the installed version (1.15).
    X, y, Z, X_star = _problem()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = torch.tensor(NOISE, dtype=F64)
    sgpr = _SGPR(X, y, Z.clone(), likelihood).double()
    sgpr.covar_module.base_kernel.base_kernel.lengthscale = torch.tensor(LENGTHSCALE, dtype=F64)
    sgpr.covar_module.base_kernel.outputscale = torch.tensor(OUTPUTSCALE, dtype=F64)
    sgpr.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, sgpr)
    with gpytorch.settings.max_cholesky_size(10_000):
        value = X.size(0) * mll(sgpr(X), y)
    b = _blocks(X, Z, X_star)
    bound = recursive_sparse_bound(b["K_uu"], b["K_uf"], b["K_ff"], y, NOISE, "vfe")
    torch.testing.assert_close(value.detach(), bound, rtol=1e-9, atol=0.0)
    # The trace term matters: the DTC bound (no trace) is far from GPyTorch's value.
    dtc = recursive_sparse_bound(b["K_uu"], b["K_uf"], b["K_ff"], y, NOISE, "dtc")
    assert float(dtc - value.detach()) > 1.0

    # Its predictive, without the diagonal correction of the training covariance, is the projected-process one:
    # the VFE mean and, for the latent, the VFE covariance minus K_** - Q_** (spec eq. 17 with V_* = 0).
    sgpr.eval()
    with (
        torch.no_grad(),
        gpytorch.settings.max_cholesky_size(10_000),
        gpytorch.settings.sgpr_diagonal_correction(False),
    ):
        predictive = sgpr(X_star)
    mean, cov = recursive_sparse_predictive(*b.values(), y, NOISE, "vfe")
    residual = b["K_ss"] - b["K_us"].mT @ torch.linalg.solve(b["K_uu"], b["K_us"])
    torch.testing.assert_close(predictive.mean, mean, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(predictive.covariance_matrix, cov - residual, rtol=1e-7, atol=1e-9)


def test_pep_limits() -> None:
    X, y, Z, _ = _problem()
    b = _blocks(X, Z)
    fitc = recursive_sparse_bound(*b.values(), y, NOISE, "fitc")
    vfe = recursive_sparse_bound(*b.values(), y, NOISE, "vfe")
    torch.testing.assert_close(
        recursive_sparse_bound(*b.values(), y, NOISE, "pep", alpha=1.0), fitc, rtol=1e-14, atol=0
    )
    # alpha -> 0 converges to VFE at rate O(alpha) (spec S5).
    gaps = [float((recursive_sparse_bound(*b.values(), y, NOISE, "pep", alpha=a) - vfe).abs()) for a in (1e-2, 1e-3)]
    assert 7.0 < gaps[0] / gaps[1] < 13.0
    assert abs(float(recursive_sparse_bound(*b.values(), y, NOISE, "pep", alpha=1e-7) - vfe)) < 1e-4
    assert abs(float(fitc - vfe)) > 1.0


def test_pitc_block_limits() -> None:
    X, y, Z, _ = _problem(n=20)
    b = _blocks(X, Z)
    singletons = blocks_of(20, 1)
    fitc = recursive_sparse_bound(*b.values(), y, NOISE, "fitc")
    torch.testing.assert_close(
        recursive_sparse_bound(*b.values(), y, NOISE, "pitc", blocks=singletons), fitc, rtol=1e-13, atol=0
    )
    one_block = recursive_sparse_bound(*b.values(), y, NOISE, "pitc", blocks=blocks_of(20, 20))
    torch.testing.assert_close(one_block, exact_log_marginal_likelihood(b["K_ff"], y, NOISE), rtol=1e-10, atol=0)


@pytest.mark.parametrize("model,alpha", MODELS)
def test_kalman_filter_equals_the_batch_forms(model: str, alpha: float | None) -> None:
    # spec S1 and S3 at oracle level: the covariance-form recursion against the dense batch formulas, in a shuffled
    # order with uneven mini-batches (PITC: the blocks are those mini-batches).
    X, y, Z, _ = _problem()
    b = _blocks(X, Z)
    blocks = blocks_of(40, 7, torch.randperm(40, generator=torch.Generator().manual_seed(3)))
    psi, means, covariances = kalman_filter(*b.values(), y, NOISE, model, blocks, alpha)
    bound = recursive_sparse_bound(*b.values(), y, NOISE, model, alpha, blocks)
    torch.testing.assert_close(sum(psi), bound, rtol=1e-11, atol=0.0)
    m, S = recursive_sparse_posterior(*b.values(), y, NOISE, model, alpha, blocks)
    torch.testing.assert_close(means[-1], m, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(covariances[-1], S, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("model,alpha", MODELS)
def test_predictive_from_the_posterior_is_the_batch_predictive(model: str, alpha: float | None) -> None:
    # spec S6 at oracle level: N(H_* m, H_* S H_*^T + K_** - Q_**) (eq. 17, the SVGP predictive) equals eq. 3.
    X, y, Z, X_star = _problem()
    b = _blocks(X, Z, X_star)
    blocks = blocks_of(40, 8)
    m, S = recursive_sparse_posterior(b["K_uu"], b["K_uf"], b["K_ff"], y, NOISE, model, alpha, blocks)
    mean, cov = svgp_predictive(b["K_uu"], b["K_us"], b["K_ss"], m, S)
    expected_mean, expected_cov = recursive_sparse_predictive(*b.values(), y, NOISE, model, alpha, blocks)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(cov, expected_cov, rtol=1e-9, atol=1e-10)


def test_argument_checks() -> None:
    X, y, Z, _ = _problem(n=10)
    b = _blocks(X, Z)
    with pytest.raises(ValueError, match="blocks"):
        recursive_sparse_bound(*b.values(), y, NOISE, "pitc")
    with pytest.raises(ValueError, match="alpha"):
        recursive_sparse_bound(*b.values(), y, NOISE, "pep", alpha=0.0)
    with pytest.raises(ValueError, match="model"):
        recursive_sparse_bound(*b.values(), y, NOISE, "sor")
    with pytest.raises(TypeError, match="float64"):
        recursive_sparse_bound(*(value.float() for value in b.values()), y.float(), NOISE, "vfe")
