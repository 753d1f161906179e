from __future__ import annotations

import math

import torch
from gpytorch.likelihoods import BernoulliLikelihood, GaussianLikelihood, Likelihood
from gpytorch.settings import min_variance
from torch import Tensor

from ..linalg import log_normal_cdf


class LeanLikelihood:
    r"""
    :math:`\mathbb E_{q(f_n)}[\log p(y_n \mid f_n)]` of a GPyTorch likelihood of a supported type as plain tensor
    operations, for the lean training path: the same values and gradients as the likelihood's ``expected_log_prob``
    at :math:`q(f_n) = \mathcal N(\mu_n, \sigma_n^2)`, read from the likelihood's parameters at every call.

    Supported: :class:`~gpytorch.likelihoods.GaussianLikelihood` (homoskedastic; with a batch shape where asked for,
    a noise per batch member broadcast over the last dimension), in closed form,

    .. math::

        -\tfrac12\big[(y_n - \mu_n)^2 + \sigma_n^2\big]/\sigma_\epsilon^2 - \tfrac12\log(2\pi\sigma_\epsilon^2),

    and :class:`~gpytorch.likelihoods.BernoulliLikelihood` (probit, labels in :math:`\{0, 1\}`, or GPyTorch's
    deprecated :math:`\{-1, 1\}`, which it reads as given when any label is :math:`-1`, without its
    ``DeprecationWarning`` here) by GPyTorch's Gauss-Hermite quadrature at its own locations and weights,

    .. math::

        \frac1{\sqrt\pi}\sum_q w_q \log\Phi\big((2y_n - 1)(\mu_n + \sqrt{2}\,\sigma_n t_q)\big),

    with :math:`\log\Phi` by :func:`~gpytorch_decoupled.linalg.log_normal_cdf` (GPyTorch's approximations, without
    their data-dependent branches).

    GPyTorch raises the predictive variances to a floor (``gpytorch.settings.min_variance``) and warns when one falls
    below it; here the floor is applied without the data-dependent check (same values, no warning).

    :param likelihood: The likelihood.

    Example:
        >>> import gpytorch, torch
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> mean, variance, y = torch.randn(5), torch.rand(5), torch.randn(5)
        >>> q_f = gpytorch.distributions.MultivariateNormal(mean, torch.diag(variance))
        >>> torch.allclose(LeanLikelihood.of(likelihood)(y, mean, variance), likelihood.expected_log_prob(y, q_f))
        True
    """

    def __init__(self, likelihood: Likelihood):
        self.likelihood = likelihood

    @classmethod
    def of(cls, likelihood: Likelihood, batch_shape: torch.Size = torch.Size()) -> LeanLikelihood | None:
        """The lean form of ``likelihood`` with batch shape ``batch_shape``, or None where it is not of a supported
        type or shape."""
        if type(likelihood) is BernoulliLikelihood:  # no parameters: any batch of latents broadcasts
            return cls(likelihood)
        if type(likelihood) is not GaussianLikelihood or likelihood.noise_covar.noise.shape != (*batch_shape, 1):
            return None
        return cls(likelihood)

    @property
    def is_gaussian(self) -> bool:
        """Whether the likelihood is Gaussian (the closed forms of t-SVGP's E-step and the Kalman updates)."""
        return type(self.likelihood) is GaussianLikelihood

    def derivatives(self, y: Tensor, mean: Tensor, variance: Tensor) -> tuple[Tensor, Tensor]:
        r"""
        The derivatives of each target's expected log-likelihood with respect to :math:`\mu_n` and
        :math:`\sigma_n^2`, as t-SVGP's E-step takes them
        (:meth:`~gpytorch_decoupled.variational.DualVariationalStrategy.site_targets`): for a Gaussian likelihood in
        closed form, :math:`(y_n - \mu_n)/\sigma_\epsilon^2` and :math:`-\tfrac12/\sigma_\epsilon^2`; for a
        Bernoulli one by :func:`torch.autograd.grad` of this expected log-likelihood (inside a compiled graph too),
        as the E-step differentiates GPyTorch's.
        """
        if self.is_gaussian:
            noise = self.likelihood.noise
            mean_gradient = (y - mean) / noise
            return mean_gradient, (-0.5 / noise).expand(mean_gradient.shape)
        mean = mean.detach().requires_grad_(True)
        variance = variance.detach().requires_grad_(True)
        with torch.enable_grad():
            mean_gradient, variance_gradient = torch.autograd.grad(self(y, mean, variance).sum(), [mean, variance])
        return mean_gradient, variance_gradient

    def __call__(self, y: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
        """The expected log-likelihood of each target, ``(N,)``."""
        variance = variance.clamp_min(min_variance.value(variance.dtype))
        if not self.is_gaussian:
            return self._bernoulli(y, mean, variance)
        noise = self.likelihood.noise
        return -0.5 * (((y - mean).square() + variance) / noise + noise.log() + math.log(2.0 * math.pi))

    def _bernoulli(self, y: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
        signs = torch.where((y == -1).any(), y, y * 2 - 1)  # GPyTorch reads {-1, 1} labels as given
        quadrature = self.likelihood.quadrature
        locations = quadrature.locations.view(-1, *[1] * mean.dim())
        shifted = torch.sqrt(2.0 * variance) * locations + mean
        log_probabilities = log_normal_cdf(shifted * signs)
        weights = quadrature.weights.view(-1, *[1] * mean.dim())
        return ((1 / math.sqrt(math.pi)) * (log_probabilities * weights)).sum(0)
