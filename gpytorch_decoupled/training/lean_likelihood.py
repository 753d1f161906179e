from __future__ import annotations

import math

import torch
from gpytorch.likelihoods import GaussianLikelihood, Likelihood
from gpytorch.settings import min_variance
from torch import Tensor


class LeanLikelihood:
    r"""
    :math:`\mathbb E_{q(f_n)}[\log p(y_n \mid f_n)]` of a GPyTorch likelihood of a supported type as plain tensor
    operations, for the lean training path: the same values and gradients as the likelihood's ``expected_log_prob``
    at :math:`q(f_n) = \mathcal N(\mu_n, \sigma_n^2)`, read from the likelihood's parameters at every call.

    Supported: :class:`~gpytorch.likelihoods.GaussianLikelihood` (homoskedastic; with a batch shape where asked for,
    a noise per batch member broadcast over the last dimension), in closed form,

    .. math::

        -\tfrac12\big[(y_n - \mu_n)^2 + \sigma_n^2\big]/\sigma_\epsilon^2 - \tfrac12\log(2\pi\sigma_\epsilon^2).

    Not (yet) supported: :class:`~gpytorch.likelihoods.BernoulliLikelihood`, whose ``log_normal_cdf`` branches on the
    data (a graph break per branch) and uses approximations the lean path would have to reproduce term by term to
    return the same values; it keeps the general, eager path.

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
        if type(likelihood) is not GaussianLikelihood or likelihood.noise_covar.noise.shape != (*batch_shape, 1):
            return None
        return cls(likelihood)

    def derivatives(self, y: Tensor, mean: Tensor, variance: Tensor) -> tuple[Tensor, Tensor]:
        r"""
        The derivatives of each target's expected log-likelihood with respect to :math:`\mu_n` and
        :math:`\sigma_n^2`, :math:`(y_n - \mu_n)/\sigma_\epsilon^2` and :math:`-\tfrac12/\sigma_\epsilon^2`, in closed
        form, as t-SVGP's E-step takes them for a Gaussian likelihood
        (:meth:`~gpytorch_decoupled.variational.DualVariationalStrategy.site_targets`).
        """
        noise = self.likelihood.noise
        mean_gradient = (y - mean) / noise
        return mean_gradient, (-0.5 / noise).expand(mean_gradient.shape)

    def __call__(self, y: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
        """The expected log-likelihood of each target, ``(N,)``."""
        variance = variance.clamp_min(min_variance.value(variance.dtype))
        noise = self.likelihood.noise
        return -0.5 * (((y - mean).square() + variance) / noise + noise.log() + math.log(2.0 * math.pi))
