r"""Exact GP regression with Gaussian noise, from dense kernel matrices.

Model: :math:`f\sim\mathcal{GP}(\mu_0,k)`, :math:`y_i=f(x_i)+\varepsilon_i`,
:math:`\varepsilon_i\sim\mathcal N(0,\sigma^2)`. With :math:`\mathbf C=\mathbf K_{XX}+\sigma^2\mathbf I`,

.. math::
    \mathbb E[f_*\mid\mathbf y]=\mu_0(X_*)+\mathbf K_{*X}\mathbf C^{-1}(\mathbf y-\mu_0(X)),\qquad
    \operatorname{Cov}[f_*\mid\mathbf y]=\mathbf K_{**}-\mathbf K_{*X}\mathbf C^{-1}\mathbf K_{X*},

.. math::
    \log p(\mathbf y)=\log\mathcal N(\mathbf y\mid\mu_0(X),\mathbf K_{XX}+\sigma^2\mathbf I).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import centred, check_noise, cholesky, require_float64, tril_solve
from .gaussian import gaussian_logpdf

__all__ = ["exact_posterior", "exact_log_marginal_likelihood"]


def _noisy(K: Tensor, noise: float | Tensor) -> Tensor:
    return K + noise * torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)


def exact_posterior(
    K_xx: Tensor,
    K_xs: Tensor,
    K_ss: Tensor,
    y: Tensor,
    noise: float | Tensor,
    prior_mean_x: Tensor | None = None,
    prior_mean_s: Tensor | None = None,
    include_noise: bool = False,
) -> tuple[Tensor, Tensor]:
    r"""Exact posterior mean and full covariance at test inputs :math:`X_*`.

    :param K_xx: ``(N, N)`` training covariance :math:`\mathbf K_{XX}` (without noise).
    :param K_xs: ``(N, S)`` cross covariance :math:`\mathbf K_{X*}`.
    :param K_ss: ``(S, S)`` test covariance :math:`\mathbf K_{**}`.
    :param y: ``(N,)`` targets.
    :param noise: :math:`\sigma^2>0`.
    :param prior_mean_x: :math:`\mu_0(X)` (default zero).
    :param prior_mean_s: :math:`\mu_0(X_*)` (default zero).
    :param include_noise: if true, return the predictive of :math:`y_*` (covariance :math:`+\sigma^2\mathbf I`)
        instead of the latent :math:`f_*`.
    :return: ``(mean (S,), covariance (S, S))``.
    """
    require_float64(K_xx=K_xx, K_xs=K_xs, K_ss=K_ss, y=y, prior_mean_x=prior_mean_x, prior_mean_s=prior_mean_s)
    check_noise(noise)
    L = cholesky(_noisy(K_xx, noise), "K_xx + noise I")
    A = tril_solve(L, K_xs)
    resid = centred(y, prior_mean_x)
    r = tril_solve(L, resid.unsqueeze(-1)).squeeze(-1)
    mean = A.mT @ r
    if prior_mean_s is not None:
        mean = mean + prior_mean_s
    cov = K_ss - A.mT @ A
    if include_noise:
        cov = _noisy(cov, noise)
    return mean, cov


def exact_log_marginal_likelihood(
    K_xx: Tensor, y: Tensor, noise: float | Tensor, prior_mean: Tensor | None = None
) -> Tensor:
    r""":math:`\log\mathcal N(\mathbf y\mid\mu_0(X),\mathbf K_{XX}+\sigma^2\mathbf I)` (not divided by :math:`N`)."""
    require_float64(K_xx=K_xx, y=y, prior_mean=prior_mean)
    check_noise(noise)
    mean = torch.zeros_like(y) if prior_mean is None else prior_mean
    return gaussian_logpdf(y, mean, _noisy(K_xx, noise))
