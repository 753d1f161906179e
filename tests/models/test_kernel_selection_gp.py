"""KernelSelectionGP (VBKS): spec C.5 identities V1, V4, V5, V6, V8 against GPyTorch SVGP and dense float64 oracles,
bad input, state_dict, plugged strategies, and kernel recovery on synthetic data."""

import math

import gpytorch
import pytest
import torch
from gpytorch.mlls import VariationalELBO

from gpytorch_decoupled.models.kernel_selection_gp import KernelSelectionGP

N, M = 40, 8


@pytest.fixture(autouse=True)
def _pinned_jitter():
    with (
        gpytorch.settings.cholesky_jitter(float_value=1e-6, double_value=1e-10),
        gpytorch.settings.max_cholesky_size(10_000),
    ):
        yield


def _data(seed=0, n=N):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=generator, dtype=torch.float64) * 4
    y = torch.sin(3 * x.squeeze(-1)) + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64)
    return x, y


def _model(kernels, seed=0, **kwargs):
    torch.manual_seed(seed)
    x, _ = _data()
    model = KernelSelectionGP(kernels, inducing_points=x[:M].clone(), **kwargs).double()
    with torch.no_grad():  # a generic point: random q(u_c), non-default hyperparameters
        distribution = model.candidates.variational_strategy._variational_distribution
        distribution.variational_mean.normal_()
        chol = distribution.chol_variational_covar
        chol.copy_(torch.eye(M, dtype=torch.float64) * 0.5 + 0.05 * torch.randn_like(chol).tril())
        for name, parameter in model.named_parameters():
            if name.startswith("candidates.covar_module") or name.startswith("likelihood"):
                parameter.add_(0.3 * torch.randn_like(parameter))
        model.candidates.variational_strategy.variational_params_initialized.fill_(1)
    return model


class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, inducing_points, kernel, jitter):
        distribution = gpytorch.variational.CholeskyVariationalDistribution(inducing_points.size(0))
        strategy = gpytorch.variational.VariationalStrategy(self, inducing_points, distribution, jitter_val=jitter)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = kernel

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _gpytorch_svgp_like(model, c):
    """A GPyTorch SVGP (and likelihood) holding candidate c's parameters."""
    strategy = model.candidates.variational_strategy
    svgp = _SVGP(strategy.inducing_points.detach().clone(), model.kernel.candidate(c), strategy.jitter_val).double()
    distribution = strategy._variational_distribution
    with torch.no_grad():
        svgp.variational_strategy._variational_distribution.variational_mean.copy_(distribution.variational_mean[c])
        svgp.variational_strategy._variational_distribution.chol_variational_covar.copy_(
            distribution.chol_variational_covar[c]
        )
        svgp.mean_module.constant.copy_(model.candidates.mean_module.constant[c])
        svgp.variational_strategy.variational_params_initialized.fill_(1)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = model.likelihood.noise[c].detach()
    return svgp, likelihood


def test_v1_single_kernel_is_gpytorch_svgp():
    x, y = _data()
    model = _model(["SE"])
    svgp, likelihood = _gpytorch_svgp_like(model, 0)
    ours = model.local_elbos(x, y, num_data=N)
    reference = VariationalELBO(likelihood, svgp, num_data=N)(svgp(x), y) * N
    assert torch.allclose(ours, reference.reshape(1), rtol=1e-10)
    ours.sum().backward()
    reference.backward()
    ours_mean = model.candidates.variational_strategy._variational_distribution.variational_mean.grad[0]
    reference_mean = svgp.variational_strategy._variational_distribution.variational_mean.grad
    assert torch.allclose(ours_mean, reference_mean, rtol=1e-9, atol=1e-12)
    assert torch.allclose(
        model.likelihood.noise_covar.raw_noise.grad.reshape(1),
        likelihood.noise_covar.raw_noise.grad.reshape(1),
        rtol=1e-9,
    )
    assert torch.allclose(
        model.candidates.mean_module.constant.grad, svgp.mean_module.constant.grad.reshape(1), rtol=1e-9
    )

    posterior = model.fit_kernel_belief(model.estimate_local_elbos(x, y))
    assert posterior[0] == ("SE", 1.0)
    x_test = torch.linspace(-1, 5, 7, dtype=torch.float64).unsqueeze(-1)
    bma = model.predict(x_test, top=None)
    svgp.eval(), likelihood.eval()
    with torch.no_grad():
        expected = likelihood(svgp(x_test))
    assert torch.allclose(bma.mean, expected.mean, rtol=1e-10)
    assert torch.allclose(bma.variance, expected.variance, rtol=1e-10)


def test_full_data_estimate_is_exact():
    x, y = _data()
    model = _model(["SE", "PER", "SE + LIN"])
    exact = model.local_elbos(x, y, num_data=N).detach()
    assert torch.allclose(model.estimate_local_elbos(x, y, batch_size=7), exact, rtol=1e-12)


def test_v5_minibatch_estimator_is_unbiased_over_a_partition():
    x, y = _data()
    model = _model(["SE", "PER×LIN", "RQ + PER"])
    full = model.local_elbos(x, y, num_data=N)
    batches = [model.local_elbos(x[i : i + 8], y[i : i + 8], num_data=N) for i in range(0, N, 8)]
    assert torch.allclose(torch.stack(batches).mean(0), full, rtol=1e-12)


def test_v5_conditional_expectation_averaged_over_u_is_the_analytic_ell():
    """MC over u ~ q(u) of sum_i E_{p(f_i|u)} log N(y_i | f_i, s^2) equals the analytic expected log-likelihood."""
    x, y = _data()
    model = _model(["SE + PER"])
    strategy = model.candidates.variational_strategy
    kernel = model.kernel.candidate(0)
    with torch.no_grad():
        ell, _ = model.local_elbo_terms(x, y, num_data=N)
        z = strategy.inducing_points
        k_uu = kernel(z).to_dense() + strategy.jitter_val * torch.eye(M, dtype=torch.float64)
        k_ux, k_xx = kernel(z, x).to_dense(), kernel(x, diag=True)
        chol = torch.linalg.cholesky(k_uu)
        distribution = strategy._variational_distribution
        projection = torch.cholesky_solve(k_ux, chol).mT  # a_i^T rows
        conditional_variance = k_xx - (projection * k_ux.mT).sum(-1)
        mean_constant, noise = model.candidates.mean_module.constant[0], model.likelihood.noise[0]
        torch.manual_seed(3)
        whitened = (
            distribution.variational_mean[0]
            + torch.randn(50_000, M, dtype=torch.float64) @ distribution.chol_variational_covar[0].mT
        )
        u = whitened @ chol.mT  # u = L u_w (prior mean of u is the constant, as for f)
        f_mean = mean_constant + u @ projection.mT
        per_sample = (
            -0.5 * torch.log(2 * math.pi * noise) - ((y - f_mean).square() + conditional_variance) / (2 * noise)
        ).sum(-1)
    standard_error = per_sample.std() / math.sqrt(per_sample.numel())
    assert abs(per_sample.mean() - ell[0]) < 5 * standard_error


def test_v4_eq8_bounds_the_factorized_family_elbo():
    x, y = _data()
    model = _model(["SE", "PER", "LIN", "SE×PER"])
    model.fit_kernel_belief(model.estimate_local_elbos(x, y), elbo_scale=1 / N)
    with torch.no_grad():
        eq8 = model.elbo(x, y, num_data=N)
        ell, kl = model.local_elbo_terms(x, y, num_data=N)
        weights = model.kernel_belief.softmax_samples()
        exact_family = (weights * ell).sum(-1).mean() - kl.sum() - model.kernel_belief.kl_divergence()
        q_bar = weights.mean(0)
    assert eq8 >= exact_family
    assert torch.allclose(eq8 - exact_family, ((1 - q_bar) * kl).sum(), rtol=1e-10)


def test_v8_gradients_separate():
    x, y = _data()
    model = _model(["SE", "PER", "SE + PER"])
    model.fit_kernel_belief(model.estimate_local_elbos(x, y), elbo_scale=1 / N)
    variational_mean = model.candidates.variational_strategy._variational_distribution.variational_mean
    model.elbo(x, y, num_data=N).backward()
    full = variational_mean.grad.clone()
    q_bar = model.kernel_belief.probabilities().detach()
    for c in range(3):
        variational_mean.grad = None
        model.local_elbos(x, y, num_data=N)[c].backward()
        local = variational_mean.grad.clone()
        others = [j for j in range(3) if j != c]
        assert local[others].abs().max() == 0  # L_c does not depend on Phi_j
        assert torch.allclose(full[c], q_bar[c] * local[c], rtol=1e-10, atol=1e-14)


def test_v6_hyperparameter_posterior_kl_pieces_collapse_to_the_gaussian_kl():
    x, y = _data()
    model = _model(["SE", "PER"], hyperparameter_posterior=True)
    posterior = model.hyperparameter_posterior
    with torch.no_grad():
        posterior.raw_scale_tril.diagonal(dim1=-2, dim2=-1).fill_(math.log(1e-12))
        ell, kl = model.local_elbo_terms(x, y, num_data=N)
        kl_u = kl - posterior.kl_divergence(model._hyperparameters())
        strategy = model.candidates.variational_strategy
        distribution = strategy._variational_distribution
        for c in range(2):
            kernel = model.kernel.candidate(c)
            k_uu = kernel(strategy.inducing_points).to_dense() + strategy.jitter_val * torch.eye(M, dtype=torch.float64)
            m, chol_s = distribution.variational_mean[c], distribution.chol_variational_covar[c]
            s = chol_s @ chol_s.mT
            entropy = 0.5 * torch.logdet(2 * math.pi * math.e * s)
            expected_log_prior = -0.5 * (
                M * math.log(2 * math.pi)
                + torch.logdet(k_uu)
                + torch.trace(torch.linalg.solve(k_uu, s))
                + m @ torch.linalg.solve(k_uu, m)
            )
            assert kl_u[c] == pytest.approx((-entropy - expected_log_prior).item(), rel=1e-8)
        point_ell, point_kl = model(x, y, N)
    assert torch.allclose(ell, point_ell, rtol=1e-7)


def test_hyperparameter_posterior_trains_and_predicts():
    x, y = _data()
    model = _model(["SE", "PER"], hyperparameter_posterior=True, num_hyperparameter_samples=2)
    scale_before = model.hyperparameter_posterior.scale_tril.detach().clone()
    model.fit(x, y, num_iterations=5, batch_size=20, lr=0.01, progress=False)
    assert not torch.equal(model.hyperparameter_posterior.scale_tril, scale_before)
    predictive = model.predict(torch.linspace(0, 4, 5, dtype=torch.float64).unsqueeze(-1), top=None)
    assert predictive.mean.shape == (5,) and (predictive.variance > 0).all()


def test_bad_input_raises_and_changes_nothing():
    x, y = _data()
    model = _model(["SE", "PER"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad_y = y.clone()
    bad_y[3] = float("nan")
    for args, match in [
        ((x, bad_y), "y contains NaN or inf"),
        ((x, y[:-1]), r"y must have shape \(40,\)"),
        ((x.float(), y.float()), "x is torch.float32"),
        ((torch.cat([x, x], -1), y), "x has 2 columns"),
        ((x[:0], y[:0]), "x is empty"),  # issue 20: an obscure error before
        ((x, y.unsqueeze(-1)), r"y must have shape \(40,\) to match x, got \(40, 1\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            model.fit(*args, num_iterations=2, progress=False)
    for settings, error, match in [
        ({"batch_size": 0}, ValueError, "batch_size must be at least 1"),
        ({"batch_size": 2.5}, TypeError, "batch_size must be an integer"),
        ({"num_iterations": -1}, ValueError, "num_iterations must be at least 0"),
        ({"lr": float("nan")}, ValueError, "lr must be finite and positive"),
        ({"elbo_scale": 0.0}, ValueError, "elbo_scale must be finite and positive"),
    ]:
        with pytest.raises(error, match=match):
            model.fit(x, y, **{"num_iterations": 2, "progress": False, **settings})
    with pytest.raises(RuntimeError, match="no local ELBOs"):
        model.predict(x)
    assert all(
        torch.equal(
            before[k],
            v,
        )
        or (before[k].isnan().all() and v.isnan().all())
        for k, v in model.state_dict().items()
    )


def test_state_dict_round_trip_predicts_the_same():
    x, y = _data()
    model = _model(["SE", "PER", "SE + PER"])
    model.fit(x, y, num_iterations=3, batch_size=20, progress=False)
    clone = _model(["SE", "PER", "SE + PER"], seed=5)
    clone.load_state_dict(model.state_dict())
    x_test = torch.linspace(0, 4, 6, dtype=torch.float64).unsqueeze(-1)
    assert clone.kernel_posterior().names == model.kernel_posterior().names
    first, second = model.predict(x_test, top=2), clone.predict(x_test, top=2)
    assert torch.allclose(first.mean, second.mean, rtol=1e-12)
    assert torch.allclose(first.variance, second.variance, rtol=1e-12)


def test_a_strategy_of_this_package_plugs_in():
    from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy

    def orthogonally_decoupled(model, inducing_points, num_candidates):
        distribution = gpytorch.variational.CholeskyVariationalDistribution(
            inducing_points.size(0), batch_shape=torch.Size([num_candidates])
        )
        gamma = torch.linspace(0, 4, 12, dtype=inducing_points.dtype).unsqueeze(-1)
        return OrthogonallyDecoupledVariationalStrategy(model, inducing_points, distribution, gamma)

    x, y = _data()
    torch.manual_seed(0)
    model = KernelSelectionGP(["SE", "PER"], x[:M].clone(), variational_strategy=orthogonally_decoupled).double()
    start = model.local_elbos(x, y, num_data=N).detach()
    model.fit(x, y, num_iterations=60, batch_size=N, lr=0.05, progress=False)
    assert (model.local_elbo_estimates > start).all()


def test_data_from_a_composite_kernel_put_most_posterior_mass_on_it():
    from gpytorch_decoupled.kernels import KernelExpression

    torch.manual_seed(1)
    n = 300
    x = torch.rand(n, 1, dtype=torch.float64) * 20 - 10
    truth = KernelExpression.parse("SE + PER").build().double()
    with torch.no_grad():
        truth.kernels[0].base_kernel.lengthscale = 3.0
        truth.kernels[1].base_kernel.period_length = 2.0
        covariance = truth(x).to_dense() + 1e-8 * torch.eye(n, dtype=torch.float64)
        y = torch.linalg.cholesky(covariance) @ torch.randn(n, dtype=torch.float64) + 0.1 * torch.randn(
            n, dtype=torch.float64
        )
    candidates = ["SE", "PER", "LIN", "SE + PER", "PER + LIN", "SE×PER", "PER×LIN", "SE + LIN"]
    inducing_points = torch.linspace(-10, 10, 30, dtype=torch.float64).unsqueeze(-1)
    model = KernelSelectionGP(candidates, inducing_points).double()
    model.kernel.set_base_hyperparameters("PER", period_length=2.0)
    model.fit(x, y, num_iterations=300, batch_size=n, lr=0.1, elbo_scale=1.0, progress=False)
    posterior = model.kernel_posterior()
    assert posterior.names[0] == "SE + PER"
    assert posterior.probabilities[0] > 0.9


def test_predict_chosen_candidates():
    x, y = _data()
    model = _model(["SE", "PER", "SE + PER"])
    model.estimate_local_elbos(x, y)
    model.fit_kernel_belief(elbo_scale=1 / N)
    x_test = torch.linspace(0, 4, 5, dtype=torch.float64).unsqueeze(-1)
    single = model.predict(x_test, candidates=["PER"])
    with torch.no_grad():
        expected = model.likelihood(model.candidates(x_test))
    assert torch.allclose(single.mean, expected.mean[1], rtol=1e-12)
    assert torch.allclose(single.variance, expected.variance[1], rtol=1e-12)
    pair = model.predict(x_test, candidates=[0, "SE + PER"])
    assert pair.weights.shape == (2,) and torch.allclose(pair.weights.sum(), torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match="distinct"):
        model.predict(x_test, candidates=[0, "SE"])
