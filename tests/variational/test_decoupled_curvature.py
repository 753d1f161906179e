"""What :class:`DecoupledVariationalStrategy` records of the loss while ``record_curvature`` is set (its
:class:`DecoupledCurvature`, which :class:`~gpytorch_decoupled.optim.MeanBasisAdam` steps it with): recording
changes no value and no gradient, and the records are the objective's derivatives, against closed forms for a
Gaussian likelihood (float64)."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpytorch_decoupled.variational import LMCVariationalStrategy
from tests.float64_problems import (
    NOISE,
    full_batch_elbo,
    gaussian_likelihood,
    generator,
    randn,
    random_factor,
    regression_problem,
)
from tests.variational.mean_basis_cases import MeanBasisGP, mean_basis_strategy, set_decoupled_state

pytestmark = pytest.mark.usefixtures("single_thread")


def _model(record: bool, seed: int = 3):
    beta, gamma, X, y = regression_problem(seed)
    model = MeanBasisGP("decoupled", beta, torch.cat([gamma, beta[:2]]), constant_mean=0.4)
    gen = generator(seed + 1)
    set_decoupled_state(model, randn(12, gen=gen), random_factor(6, gen, scale=0.7))
    model.variational_strategy.record_curvature = record
    return model, X, y


def _values_and_gradients(model, X, y):
    elbo = full_batch_elbo(model, gaussian_likelihood(), X, y)
    parameters = [p for p in model.parameters() if p.requires_grad]
    return elbo.detach(), torch.autograd.grad(elbo, parameters)


def test_recording_changes_no_value_and_no_gradient() -> None:
    plain, X, y = _model(record=False)
    recording, _, _ = _model(record=True)
    elbo, gradients = _values_and_gradients(plain, X, y)
    recorded_elbo, recorded_gradients = _values_and_gradients(recording, X, y)
    assert recording.variational_strategy.curvature is not None
    assert plain.variational_strategy.curvature is None
    torch.testing.assert_close(recorded_elbo, elbo, rtol=0, atol=0)
    for recorded, expected in zip(recorded_gradients, gradients, strict=True):
        torch.testing.assert_close(recorded, expected, rtol=0, atol=0)
    for model in (plain, recording):  # the full-covariance path of a training call
        with torch.no_grad():
            output = model(X[:7], diag=False)
        assert output.covariance_matrix.shape == (7, 7)
    torch.testing.assert_close(
        recording(X[:7], diag=False).covariance_matrix, plain(X[:7], diag=False).covariance_matrix, rtol=0, atol=0
    )


def test_the_records_are_the_derivatives_of_the_elbo() -> None:
    # For GPyTorch's ELBO with a Gaussian likelihood, L = -(1/N) sum_n E[log N(y_n | f_n, s^2)] + KL / N:
    # dL/ds_n = 1 / (2 s^2 N), dL/dm_n = (m_n - y_n) / (s^2 N) and dL/dKL = 1 / N.
    model, X, y = _model(record=True)
    N = X.size(0)
    (-full_batch_elbo(model, gaussian_likelihood(), X, y) / N).backward()
    curvature = model.variational_strategy.curvature
    model.eval()
    with torch.no_grad():
        mean = model(X).mean
    torch.testing.assert_close(curvature.inputs, X, rtol=0, atol=0)
    torch.testing.assert_close(curvature.kl_weight, torch.tensor(1.0 / N, dtype=X.dtype), rtol=1e-14, atol=0)
    torch.testing.assert_close(curvature.variance_weights, torch.full_like(y, 1 / (NOISE * N)), rtol=1e-12, atol=0)
    expected_mean_weights = N * ((mean - y) / (NOISE * N)).pow(2)
    assert expected_mean_weights.max() > 1e-2
    torch.testing.assert_close(curvature.mean_weights, expected_mean_weights, rtol=1e-10, atol=1e-16)


def test_records_accumulate_over_backward_passes_until_reset() -> None:
    # Like .grad: two mini-batches' passes are concatenated (their KL weights added); reset_curvature forgets them.
    model, X, y = _model(record=True)
    strategy = model.variational_strategy
    likelihood = gaussian_likelihood()
    for rows in (slice(0, 20), slice(20, 45)):
        (-full_batch_elbo(model, likelihood, X[rows], y[rows])).backward()
    first = strategy.curvature
    torch.testing.assert_close(first.inputs, X[:45], rtol=0, atol=0)
    torch.testing.assert_close(first.kl_weight, torch.tensor(2.0, dtype=X.dtype), rtol=1e-14, atol=0)
    torch.testing.assert_close(first.variance_weights, torch.full((45,), 1 / NOISE, dtype=X.dtype), rtol=1e-12, atol=0)
    strategy.reset_curvature()
    assert strategy.curvature is None
    with torch.no_grad():  # no gradients, nothing recorded
        full_batch_elbo(model, likelihood, X, y)
    assert strategy.curvature is None


def test_batched_latents_under_an_lmc_wrapper_record_per_latent() -> None:
    # The LMC wrapper asks its base for full covariances: the records have the latents' batch shape.
    beta, gamma, X, y = regression_problem(5)

    class LMCModel(gpytorch.models.ApproximateGP):
        def __init__(self):
            batch = torch.Size([2])
            base = mean_basis_strategy("decoupled", self, beta, gamma, batch_shape=batch, num_kl_columns=None)
            super().__init__(LMCVariationalStrategy(base, num_tasks=3, num_latents=2, latent_dim=-1))
            self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch)
            kernel = gpytorch.kernels.RBFKernel(batch_shape=batch)
            self.covar_module = gpytorch.kernels.ScaleKernel(kernel, batch_shape=batch)

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model = LMCModel().double()
    strategy = model.variational_strategy.base_variational_strategy
    strategy.record_curvature = True
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3).double()
    targets = torch.stack([y, -y, 0.5 * y], dim=-1)
    model.train()
    likelihood.train()
    (-gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(0))(model(X), targets)).backward()
    curvature = strategy.curvature
    torch.testing.assert_close(curvature.inputs, X, rtol=0, atol=0)  # the latents share the basis and the data
    assert curvature.variance_weights.shape == curvature.mean_weights.shape == (2, X.size(0))
    assert curvature.kl_weight.shape == (2,)
    # sum_t c_qt^2 / noise_t per latent q, over N: the latent curvature of the mixed Gaussian likelihood
    noise = likelihood.task_noises.detach() + likelihood.noise.detach()
    expected = (model.variational_strategy.lmc_coefficients.detach().pow(2) / noise).sum(-1) / X.size(0)
    torch.testing.assert_close(
        curvature.variance_weights, expected.unsqueeze(-1).expand(2, X.size(0)), rtol=1e-10, atol=0
    )
