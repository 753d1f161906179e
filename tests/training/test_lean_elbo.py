"""The lean training path returns the general path's loss and every gradient (float64, 1e-12), for every supported
strategy, distribution, kernel, mean and likelihood; unsupported parts are named."""

from __future__ import annotations

import contextlib

import gpytorch
import pytest
import torch

from gpytorch_decoupled.optim import DualEStep
from gpytorch_decoupled.training import LeanELBO, LeanEStep, LeanKernel, LeanLikelihood
from tests.training.training_cases import DISTRIBUTIONS, KERNELS, STRATEGIES, make_case

pytestmark = pytest.mark.usefixtures("single_thread")


def _loss_and_gradients(loss_fn, parameters):
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad(loss, parameters, allow_unused=True)


def _assert_same(lean_fn, general_fn, parameters, rtol=1e-12):
    lean_loss, lean_grads = _loss_and_gradients(lean_fn, parameters)
    general_loss, general_grads = _loss_and_gradients(general_fn, parameters)
    torch.testing.assert_close(lean_loss, general_loss, rtol=rtol, atol=0)
    for lean_grad, general_grad in zip(lean_grads, general_grads, strict=True):
        assert (lean_grad is None) == (general_grad is None)
        if general_grad is not None:
            assert general_grad.abs().max() > 0
            # relative to each gradient's size: entries that cancel to ~0 carry the rounding of the larger ones
            torch.testing.assert_close(lean_grad, general_grad, rtol=0, atol=rtol * general_grad.abs().max())


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_strategies_match_general_path(strategy, distribution):
    model, likelihood, mll, x, y = make_case(strategy=strategy, distribution=distribution)
    lean = LeanELBO.of(mll)
    assert lean is not None, LeanELBO.unsupported(mll)
    parameters = [*model.parameters(), *likelihood.parameters()]

    def lean_loss():
        torch.manual_seed(3)  # the same sampled KL rows on both paths
        return lean(x, y, lean.draws())

    def general_loss():
        torch.manual_seed(3)
        return -mll(model(x), y)

    _assert_same(lean_loss, general_loss, parameters)


@pytest.mark.parametrize(
    "strategy, distribution",
    [("svgp", "fast_natural"), ("svgp", "cholesky"), ("odvgp", "fast_natural"), ("hybrid", "cholesky")]
    + [("decoupled", "decoupled")],
)
@pytest.mark.parametrize("labels", ["zero-one", "minus-one-one"])
def test_bernoulli_likelihood_matches_general_path(strategy, distribution, labels):
    # GPyTorch's quadrature of its log_normal_cdf (three approximations by the size of the argument), labels in
    # {0, 1} or its deprecated {-1, 1}; the latent means are spread so that every approximation is taken.
    model, likelihood, mll, x, y = make_case(strategy=strategy, distribution=distribution, likelihood="bernoulli")
    with torch.no_grad():
        model.mean_module.constant.fill_(-0.5)
        model.covar_module.outputscale = 6.0
    if labels == "minus-one-one":
        y = 2 * y - 1
    lean = LeanELBO.of(mll)
    assert lean is not None, LeanELBO.unsupported(mll)
    parameters = [*model.parameters(), *likelihood.parameters()]
    latent = model(x)
    arguments = (2 * y - 1 if labels == "zero-one" else y) * latent.mean
    assert (arguments.pow(2) < 0.04).any() and (arguments < -1).any() and (arguments > 0.2).any()
    with pytest.warns(DeprecationWarning) if labels == "minus-one-one" else contextlib.nullcontext():
        _assert_same(lambda: lean(x, y, None), lambda: -mll(model(x), y), parameters)


@pytest.mark.parametrize("kernel", ["rbf_ard", "matern32", "matern52", "rbf_unscaled"])
@pytest.mark.parametrize("jacobi", [False, True], ids=["plain", "jacobi"])
def test_decoupled_matches_general_path(kernel, jacobi):
    # DecoupledVariationalStrategy with its exact KL (20 mean-basis points), with and without Jacobi scaling: the loss,
    # every gradient and the terms whose derivatives MeanBasisAdam's curvature step reads.
    options = {"strategy": "decoupled", "distribution": "decoupled", "kernel": kernel, "jacobi": jacobi}
    model, likelihood, mll, x, y = make_case(**options)
    lean = LeanELBO.of(mll)
    assert lean is not None, LeanELBO.unsupported(mll)
    parameters = [*model.parameters(), *likelihood.parameters()]
    _assert_same(lambda: lean(x, y, None), lambda: -mll(model(x), y), parameters)
    _, terms = lean.loss_and_statistics(x, y, None)
    general = model(x)
    torch.testing.assert_close(terms.mean, general.mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.variance, general.variance, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.kl, model.variational_strategy.kl_divergence(), rtol=1e-12, atol=0)
    assert terms.inputs is x


@pytest.mark.parametrize("strategy", ["odvgp", "hybrid"])
@pytest.mark.parametrize("control_variate", ["landmarks", "beta-landmarks", "uniform"])
def test_orthogonal_and_hybrid_with_a_sampled_kl_match_general_path(strategy, control_variate):
    # A mean basis above exact_kl_size: the KL from 5 rows of 20 drawn by |a_gamma| with beta and the batch as
    # landmarks (the default) or beta alone (kl_data_landmarks=False), or drawn uniformly; with the same draws (the
    # basis's own generator), the same loss and gradients.
    model, likelihood, mll, x, y = make_case(strategy=strategy, sampled_kl=True)
    basis = model.variational_strategy.mean_basis
    basis.importance_sampling = control_variate != "uniform"
    model.variational_strategy.kl_data_landmarks = control_variate == "landmarks"
    lean = LeanELBO.of(mll)
    assert lean is not None, LeanELBO.unsupported(mll)

    def seeded(loss):
        def call():
            basis.generator = torch.Generator().manual_seed(7)
            return loss()

        return call

    parameters = [*model.parameters(), *likelihood.parameters()]
    _assert_same(seeded(lambda: lean(x, y, lean.draws())), seeded(lambda: -mll(model(x), y)), parameters)


@pytest.mark.parametrize("strategy", ["odvgp", "hybrid"])
def test_a_mean_basis_above_the_kernel_keep_size_stays_on_the_lean_path(strategy):
    # The lean path's products are swept in tiles (kept for the backward pass up to kernel_keep_size, evaluated again
    # beyond it), as the general path's: a basis whose blocks exceed the keep size (here 100 entries) is not a reason
    # to fall back, and the loss and gradients are the general path's.
    from gpytorch_decoupled.linalg import kernel_keep_size

    model, likelihood, mll, x, y = make_case(strategy=strategy)
    with kernel_keep_size(100):
        assert LeanELBO.unsupported(mll) is None
        lean = LeanELBO.of(mll)
        _assert_same(
            lambda: lean(x, y, None), lambda: -mll(model(x), y), [*model.parameters(), *likelihood.parameters()]
        )


@pytest.mark.parametrize("kernel", ["rbf_ard", "matern12"])
def test_decoupled_with_a_sampled_kl_matches_general_path(kernel):
    # A mean basis above exact_kl_size (and Matern 1/2, which has no fused sweep, at any size): the KL's quadratic form
    # is estimated from 5 drawn rows of 20; with the same draws (the basis's own generator), the same loss, gradients
    # and terms, and the drawn rows are the terms' (for MeanBasisAdam's curvature step).
    options = {"strategy": "decoupled", "distribution": "decoupled", "kernel": kernel, "sampled_kl": True}
    model, likelihood, mll, x, y = make_case(**options)
    lean = LeanELBO.of(mll)
    assert lean is not None, LeanELBO.unsupported(mll)
    basis = model.variational_strategy.mean_basis
    parameters = [*model.parameters(), *likelihood.parameters()]

    def seeded(loss):
        def call():
            basis.generator = torch.Generator().manual_seed(7)
            return loss()

        return call

    _assert_same(seeded(lambda: lean(x, y, lean.draws())), seeded(lambda: -mll(model(x), y)), parameters)
    basis.generator = torch.Generator().manual_seed(7)
    _, terms = lean.loss_and_statistics(x, y, lean.draws())
    basis.generator = torch.Generator().manual_seed(7)
    model(x)
    assert torch.equal(terms.kl_rows, basis.sampled_indices) and terms.kl_rows.numel() == 5


@pytest.mark.parametrize("kernel", ["rbf_ard", "matern52"])
def test_tsvgp_matches_general_path(kernel):
    # DualVariationalELBO at sites away from the prior: the loss and every M-step gradient.
    model, likelihood, mll, x, y = make_case(strategy="dual", kernel=kernel)
    lean = LeanELBO.of(mll)
    assert lean is not None, LeanELBO.unsupported(mll)
    parameters = [*model.parameters(), *likelihood.parameters()]
    _assert_same(lambda: lean(x, y, None), lambda: -mll(model(x), y), parameters)


@pytest.mark.parametrize("likelihood", ["gaussian", "bernoulli"])
def test_tsvgp_e_step_matches_dual_e_step(likelihood):
    # The compiled iteration's E-step at the forward pass's statistics against DualEStep.step at the same batch: a
    # Gaussian likelihood's derivatives in closed form, a Bernoulli one's by autograd through the lean quadrature.
    model, likelihood, mll, x, y = make_case(strategy="dual", distribution="dual", likelihood=likelihood)
    lean = LeanELBO.of(mll)
    e_step = DualEStep(model, likelihood, num_data=x.size(0), lr=0.4)
    _, statistics = lean.loss_and_statistics(x[:24], y[:24], None)
    sites = model.variational_strategy._variational_distribution()
    before = [site.clone() for site in sites]
    with torch.no_grad():
        done, *lean_sites = LeanEStep(e_step, lean.likelihood)(
            y[:24], statistics, torch.tensor(0.4, dtype=torch.float64)
        )
    assert done
    for site, old, new in zip(sites, before, lean_sites, strict=True):
        assert torch.equal(site, old) and not torch.equal(site, new)  # stored by the caller (LeanEStep.keep)
    e_step.step(x[:24], y[:24])
    for value, expected in zip(lean_sites, sites, strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mean", ["constant", "zero"])
def test_kernels_and_means_match_general_path(kernel, mean):
    model, likelihood, mll, x, y = make_case(kernel=kernel, mean=mean)
    lean = LeanELBO.of(mll)
    parameters = [*model.parameters(), *likelihood.parameters()]
    _assert_same(lambda: lean(x, y, None), lambda: -mll(model(x), y), parameters)


def test_kernel_matches_dense_oracle():
    from tests.oracles import rbf

    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = 0.7
    kernel.outputscale = 1.3
    x1, x2 = torch.randn(6, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    lean = LeanKernel.of(kernel)
    lengthscale, outputscale = kernel.base_kernel.lengthscale.item(), kernel.outputscale.item()
    torch.testing.assert_close(lean(x1, x2), rbf(x1, x2, lengthscale, outputscale), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(lean.diagonal(x1), torch.full((6,), outputscale, dtype=torch.float64))


@pytest.mark.parametrize("base", ["rbf", "matern52", "matern12"])
def test_kernel_matvec_matches_the_dense_product(base):
    # Eagerly the fused tiled product of the general path (dense for Matern 1/2): values and gradients of the inputs,
    # coefficients and hyperparameters as the dense block's, in float64, with tiles smaller than the block.
    from gpytorch_decoupled.linalg.settings import kernel_tile_size

    inner = (
        gpytorch.kernels.RBFKernel(ard_num_dims=2)
        if base == "rbf"
        else gpytorch.kernels.MaternKernel(nu={"matern52": 2.5, "matern12": 0.5}[base], ard_num_dims=2)
    )
    kernel = gpytorch.kernels.ScaleKernel(inner).double()
    kernel.base_kernel.lengthscale = torch.tensor([0.7, 1.4])
    kernel.outputscale = 1.3
    generator = torch.Generator().manual_seed(3)
    x1 = torch.randn(37, 2, dtype=torch.float64, generator=generator).requires_grad_(True)
    x2 = torch.randn(53, 2, dtype=torch.float64, generator=generator).requires_grad_(True)
    a = torch.randn(53, dtype=torch.float64, generator=generator).requires_grad_(True)
    weights = torch.randn(37, dtype=torch.float64, generator=generator)
    lean = LeanKernel.of(kernel)
    parameters = [x1, x2, a, *kernel.parameters()]
    with kernel_tile_size(200):
        fused = _loss_and_gradients(lambda: (weights * lean.matvec(x1, x2, a)).sum(), parameters)
    dense = _loss_and_gradients(lambda: (weights * (lean(x1, x2) @ a)).sum(), parameters)
    torch.testing.assert_close(fused[0], dense[0], rtol=1e-12, atol=0)
    for fused_grad, dense_grad in zip(fused[1], dense[1], strict=True):
        torch.testing.assert_close(fused_grad, dense_grad, rtol=0, atol=1e-11 * dense_grad.abs().max())


def test_unsupported_parts_are_named():
    model, likelihood, mll, x, y = make_case()
    assert LeanELBO.unsupported(mll) is None
    model.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.LinearKernel()).double()
    assert "covar_module" in LeanELBO.unsupported(mll) and LeanELBO.of(mll) is None
    model, likelihood, mll, x, y = make_case()
    predictive = gpytorch.mlls.PredictiveLogLikelihood(likelihood, model, num_data=40)
    assert "PredictiveLogLikelihood" in LeanELBO.unsupported(predictive)
    model.covar_module.register_prior("outputscale_prior", gpytorch.priors.GammaPrior(2.0, 1.0), "outputscale")
    assert "prior" in LeanELBO.unsupported(mll)
    assert LeanLikelihood.of(gpytorch.likelihoods.StudentTLikelihood()) is None
    assert LeanLikelihood.of(gpytorch.likelihoods.GaussianLikelihood(), torch.Size([3])) is None


def test_model_forward_is_checked():
    model, likelihood, mll, x, y = make_case()

    def warped_forward(inputs):  # a model whose forward is not the prior of its mean and kernel modules
        inputs = inputs.pow(2)
        return gpytorch.distributions.MultivariateNormal(model.mean_module(inputs), model.covar_module(inputs))

    model.forward = warped_forward
    assert "model.forward" in LeanELBO.unsupported(mll)
