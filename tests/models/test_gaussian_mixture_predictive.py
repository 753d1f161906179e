"""The BMA predictive of VBKS: spec C.5 identity V7 and the mixture quantiles."""

import torch

from gpytorch_decoupled.models.gaussian_mixture_predictive import GaussianMixturePredictive


def _mixture():
    generator = torch.Generator().manual_seed(0)
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    means = torch.randn(3, 4, generator=generator, dtype=torch.float64) * 2
    variances = torch.rand(3, 4, generator=generator, dtype=torch.float64) + 0.1
    return GaussianMixturePredictive(weights, means, variances), weights, means, variances


def test_v7_moments_match_the_formula_and_sampling():
    mixture, weights, means, variances = _mixture()
    mean = (weights[:, None] * means).sum(0)
    variance = (weights[:, None] * (variances + means.square())).sum(0) - mean.square()
    assert torch.allclose(mixture.mean, mean, rtol=1e-14)
    assert torch.allclose(mixture.variance, variance, rtol=1e-12)
    torch.manual_seed(1)
    samples = mixture.sample((400_000,))
    standard_error = (variance / samples.size(0)).sqrt()
    assert ((samples.mean(0) - mean).abs() < 5 * standard_error).all()
    assert torch.allclose(samples.var(0), variance, rtol=0.02)


def test_v7_one_weight_gives_that_component():
    _, _, means, variances = _mixture()
    single = GaussianMixturePredictive(torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), means, variances)
    assert torch.allclose(single.mean, means[1], rtol=1e-14)
    assert torch.allclose(single.variance, variances[1], rtol=1e-12)
    lower, upper = single.confidence_region(0.95)
    half_width = 1.959963984540054 * variances[1].sqrt()
    assert torch.allclose(lower, means[1] - half_width, atol=1e-9)
    assert torch.allclose(upper, means[1] + half_width, atol=1e-9)


def test_quantiles_invert_the_mixture_cdf():
    mixture, *_ = _mixture()
    for probability in (0.01, 0.2, 0.5, 0.9, 0.999):
        quantile = mixture.icdf(torch.tensor(probability, dtype=torch.float64))
        assert torch.allclose(mixture.cdf(quantile), torch.full((4,), probability, dtype=torch.float64), atol=1e-12)


def test_log_prob_is_the_mixture_density():
    mixture, weights, means, variances = _mixture()
    y = torch.tensor([0.1, -0.4, 2.0, 0.0], dtype=torch.float64)
    density = (
        weights[:, None] * torch.exp(-0.5 * (y - means).square() / variances) / (2 * torch.pi * variances).sqrt()
    ).sum(0)
    assert torch.allclose(mixture.log_prob(y), density.log(), rtol=1e-12)


def test_bad_shapes_raise():
    import pytest

    with pytest.raises(ValueError, match="weights"):
        GaussianMixturePredictive(torch.ones(2), torch.zeros(3, 4), torch.ones(3, 4))
    with pytest.raises(ValueError, match="non-negative"):
        GaussianMixturePredictive(torch.tensor([1.0, -1.0]), torch.zeros(2, 1), torch.ones(2, 1))
