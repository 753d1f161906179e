"""Finite-dimensional Gaussian identities: KL, log density, expected Gaussian log-likelihood.

All functions are batch-capable: vectors are ``(..., n)``, matrices ``(..., n, n)``, and batch dimensions broadcast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import LOG_2PI, check_noise, cholesky, logdet_from_cholesky, require_float64, tril_solve

__all__ = ["gaussian_kl", "gaussian_logpdf", "expected_gaussian_loglik"]


def gaussian_kl(m_q: Tensor, S_q: Tensor, m_p: Tensor, S_p: Tensor) -> Tensor:
    r"""KL divergence between two multivariate normals.

    .. math::
        \mathrm{KL}\big(\mathcal N(\mathbf m_q,\mathbf S_q)\,\Vert\,\mathcal N(\mathbf m_p,\mathbf S_p)\big)
        =\tfrac12\Big[\operatorname{tr}(\mathbf S_p^{-1}\mathbf S_q)
        +(\mathbf m_p-\mathbf m_q)^\top\mathbf S_p^{-1}(\mathbf m_p-\mathbf m_q)-n
        +\log\lvert\mathbf S_p\rvert-\log\lvert\mathbf S_q\rvert\Big]

    The trace is :math:`\lVert\mathbf L_p^{-1}\mathbf L_q\rVert_F^2`, so no inverse is formed and the term stays
    non-negative. Both covariances must be positive definite (no jitter is added); for nearly singular covariances
    on a grid use :func:`tests.oracles.process_kl.process_kl`.

    :return: KL with the broadcast batch shape of the inputs.
    """
    require_float64(m_q=m_q, S_q=S_q, m_p=m_p, S_p=S_p)
    L_p = cholesky(S_p, "S_p")
    L_q = cholesky(S_q, "S_q")
    n = m_q.shape[-1]
    trace = tril_solve(L_p, L_q).square().sum((-2, -1))
    maha = tril_solve(L_p, (m_p - m_q).unsqueeze(-1)).squeeze(-1).square().sum(-1)
    return 0.5 * (trace + maha - n + logdet_from_cholesky(L_p) - logdet_from_cholesky(L_q))


def gaussian_logpdf(y: Tensor, m: Tensor, S: Tensor) -> Tensor:
    r"""Log density of a multivariate normal.

    .. math::
        \log\mathcal N(\mathbf y\mid\mathbf m,\mathbf S)
        =-\tfrac12\Big[n\log2\pi+\log\lvert\mathbf S\rvert
        +(\mathbf y-\mathbf m)^\top\mathbf S^{-1}(\mathbf y-\mathbf m)\Big]
    """
    require_float64(y=y, m=m, S=S)
    L = cholesky(S, "S")
    r = tril_solve(L, (y - m).unsqueeze(-1)).squeeze(-1)
    return -0.5 * (y.shape[-1] * LOG_2PI + logdet_from_cholesky(L) + r.square().sum(-1))


def expected_gaussian_loglik(y: Tensor, mean: Tensor, var: Tensor, noise: float | Tensor) -> Tensor:
    r"""Elementwise expected Gaussian log-likelihood under a Gaussian marginal :math:`q(f)=\mathcal N(\mu,v)`.

    .. math::
        \mathbb E_{\mathcal N(f\mid\mu,v)}\big[\log\mathcal N(y\mid f,\sigma^2)\big]
        =-\tfrac12\log(2\pi\sigma^2)-\frac{(y-\mu)^2+v}{2\sigma^2}

    :return: a tensor of the broadcast shape of ``y``, ``mean`` and ``var`` (not summed).
    """
    require_float64(y=y, mean=mean, var=var)
    check_noise(noise)
    log_noise = torch.log(torch.as_tensor(noise, dtype=y.dtype, device=y.device))
    return -0.5 * (LOG_2PI + log_noise) - ((y - mean).square() + var) / (2.0 * noise)
