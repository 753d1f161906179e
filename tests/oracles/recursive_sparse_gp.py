r"""The sparse GP models of the PEP family (VFE, DTC, FITC, PITC, PEP(alpha)) from dense kernel matrices: batch
bounds, batch posterior of the inducing values and batch predictive (spec ``dual_recursive_vbks.md`` B.1), and the
covariance-form Kalman filter of spec B.3 (eq. 16) as a second, recursive route to all three.

Notation: :math:`\mathbf Q_{ab}=\mathbf K_{au}\mathbf K_{uu}^{-1}\mathbf K_{ub}`,
:math:`\boldsymbol\Delta=\mathbf K_{ff}-\mathbf Q_{ff}`, :math:`\boldsymbol\delta=\operatorname{diag}\boldsymbol\Delta`.
Each model adds a noise :math:`\bar{\mathbf V}` to :math:`\mathbf Q_{ff}` and subtracts a regularizer from
:math:`\log\mathcal N(\mathbf y\mid\mathbf 0,\mathbf Q_{ff}+\bar{\mathbf V}+\sigma^2\mathbf I)`:

* vfe: :math:`\bar{\mathbf V}=\mathbf 0`, regularizer :math:`\operatorname{tr}\boldsymbol\Delta/2\sigma^2`;
* dtc: :math:`\bar{\mathbf V}=\mathbf 0`, no regularizer;
* fitc: :math:`\bar{\mathbf V}=\operatorname{Diag}\boldsymbol\delta`, no regularizer;
* pitc: :math:`\bar{\mathbf V}=\operatorname{blkdiag}_k\boldsymbol\Delta_k` over the given blocks, no regularizer;
* pep: :math:`\bar{\mathbf V}=\alpha\operatorname{Diag}\boldsymbol\delta`, regularizer
  :math:`\frac{1-\alpha}{2\alpha}\sum_i\log(1+\alpha\delta_i/\sigma^2)`.

Everything is formed densely (:math:`N\times N`), without Woodbury, and differentiable, so that autograd through
these functions is the reference gradient of the batch bounds. No jitter is added: pass the jittered
:math:`\mathbf K_{uu}` of the implementation under test. The prior mean is zero (pass centred targets).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import check_noise, cholesky, require_float64, tril_solve
from .gaussian import gaussian_logpdf

__all__ = [
    "sparse_model_noise",
    "recursive_sparse_bound",
    "recursive_sparse_posterior",
    "recursive_sparse_predictive",
    "kalman_filter",
]

MODELS = ("vfe", "dtc", "fitc", "pitc", "pep")


def _nystrom(K_uu: Tensor, K_ua: Tensor, K_ub: Tensor) -> Tensor:
    L = cholesky(K_uu, "K_uu")
    return tril_solve(L, K_ua).mT @ tril_solve(L, K_ub)


def _check_model(model: str, alpha: float | None, blocks: list[Tensor] | None) -> None:
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if model == "pep" and (alpha is None or not 0 < alpha <= 1):
        raise ValueError("pep needs 0 < alpha <= 1")
    if model == "pitc" and blocks is None:
        raise ValueError("pitc needs the blocks (a partition of the data indices)")


def sparse_model_noise(
    K_uu: Tensor,
    K_uf: Tensor,
    K_ff: Tensor,
    noise: float | Tensor,
    model: str,
    alpha: float | None = None,
    blocks: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(Q_ff, V, regularizer)`` of a model, with the whole data noise :math:`\mathbf V=\bar{\mathbf V}+
    \sigma^2\mathbf I` (see the module table); ``blocks`` partition the data for PITC."""
    require_float64(K_uu=K_uu, K_uf=K_uf, K_ff=K_ff)
    check_noise(noise)
    _check_model(model, alpha, blocks)
    Q_ff = _nystrom(K_uu, K_uf, K_uf)
    Delta = K_ff - Q_ff
    delta = torch.diagonal(Delta)
    white = noise * torch.eye(K_ff.shape[-1], dtype=K_ff.dtype)
    zero = torch.zeros((), dtype=K_ff.dtype)
    if model == "vfe":
        return Q_ff, white, delta.sum() / (2 * noise)
    if model == "dtc":
        return Q_ff, white, zero
    if model == "fitc":
        return Q_ff, torch.diag(delta) + white, zero
    if model == "pep":
        regularizer = (1 - alpha) / (2 * alpha) * torch.log1p(alpha * delta / noise).sum()
        return Q_ff, alpha * torch.diag(delta) + white, regularizer
    mask = torch.zeros_like(K_ff)
    for block in blocks:
        mask[block.unsqueeze(-1), block] = 1.0
    return Q_ff, mask * Delta + white, zero


def recursive_sparse_bound(
    K_uu: Tensor,
    K_uf: Tensor,
    K_ff: Tensor,
    y: Tensor,
    noise: float | Tensor,
    model: str,
    alpha: float | None = None,
    blocks: list[Tensor] | None = None,
) -> Tensor:
    r"""The batch bound :math:`\mathcal L_{\rm model} = \log\mathcal N(\mathbf y\mid\mathbf 0,\mathbf Q_{ff}+
    \bar{\mathbf V}+\sigma^2\mathbf I) - \text{regularizer}` (summed over data, not divided by :math:`N`)."""
    require_float64(y=y)
    Q_ff, V, regularizer = sparse_model_noise(K_uu, K_uf, K_ff, noise, model, alpha, blocks)
    return gaussian_logpdf(y, torch.zeros_like(y), Q_ff + V) - regularizer


def recursive_sparse_posterior(
    K_uu: Tensor,
    K_uf: Tensor,
    K_ff: Tensor,
    y: Tensor,
    noise: float | Tensor,
    model: str,
    alpha: float | None = None,
    blocks: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    r"""The batch posterior of the inducing values (spec eq. 14), with
    :math:`\mathbf H=\mathbf K_{fu}\mathbf K_{uu}^{-1}` and :math:`\mathbf V=\bar{\mathbf V}+\sigma^2\mathbf I`:

    .. math::
        \mathbf S=(\mathbf K_{uu}^{-1}+\mathbf H^\top\mathbf V^{-1}\mathbf H)^{-1},\qquad
        \mathbf m=\mathbf S\mathbf H^\top\mathbf V^{-1}\mathbf y.

    :return: ``(m (M,), S (M, M))``.
    """
    require_float64(y=y)
    _, V, _ = sparse_model_noise(K_uu, K_uf, K_ff, noise, model, alpha, blocks)
    H = torch.linalg.solve(K_uu, K_uf).mT
    precision = torch.linalg.inv(K_uu) + H.mT @ torch.linalg.solve(V, H)
    S = torch.linalg.inv(precision)
    S = 0.5 * (S + S.mT)
    return S @ H.mT @ torch.linalg.solve(V, y), S


def recursive_sparse_predictive(
    K_uu: Tensor,
    K_uf: Tensor,
    K_ff: Tensor,
    K_us: Tensor,
    K_ss: Tensor,
    y: Tensor,
    noise: float | Tensor,
    model: str,
    alpha: float | None = None,
    blocks: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    r"""The batch predictive of the latent :math:`\mathbf f_*` (spec eq. 3), :math:`\bar{\mathbf K}=\mathbf Q_{ff}+
    \bar{\mathbf V}`:

    .. math::
        \boldsymbol\mu_*=\mathbf Q_{*f}(\bar{\mathbf K}+\sigma^2\mathbf I)^{-1}\mathbf y,\qquad
        \boldsymbol\Sigma_*=\mathbf K_{**}-\mathbf Q_{*f}(\bar{\mathbf K}+\sigma^2\mathbf I)^{-1}\mathbf Q_{f*}.

    :return: ``(mean (S,), covariance (S, S))``.
    """
    require_float64(K_us=K_us, K_ss=K_ss, y=y)
    Q_ff, V, _ = sparse_model_noise(K_uu, K_uf, K_ff, noise, model, alpha, blocks)
    C = Q_ff + V
    Q_sf = _nystrom(K_uu, K_us, K_uf)
    mean = Q_sf @ torch.linalg.solve(C, y)
    cov = K_ss - Q_sf @ torch.linalg.solve(C, Q_sf.mT)
    return mean, 0.5 * (cov + cov.mT)


def kalman_filter(
    K_uu: Tensor,
    K_uf: Tensor,
    K_ff: Tensor,
    y: Tensor,
    noise: float | Tensor,
    model: str,
    blocks: list[Tensor],
    alpha: float | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    r"""The covariance-form Kalman filter over the mini-batches ``blocks`` in the given order (spec B.3, eq. 16),
    starting from :math:`\mathbf m_0=\mathbf 0`, :math:`\mathbf S_0=\mathbf K_{uu}`:

    .. math::
        \mathbf e_k=\mathbf y_k-\mathbf H_k\mathbf m_{k-1},\quad
        \boldsymbol\Omega_k=\mathbf H_k\mathbf S_{k-1}\mathbf H_k^\top+\mathbf V_k,\quad
        \mathbf G_k=\mathbf S_{k-1}\mathbf H_k^\top\boldsymbol\Omega_k^{-1},\quad
        \mathbf m_k=\mathbf m_{k-1}+\mathbf G_k\mathbf e_k,\quad
        \mathbf S_k=\mathbf S_{k-1}-\mathbf G_k\boldsymbol\Omega_k\mathbf G_k^\top,

    with the bound terms :math:`\psi_k=\log\mathcal N(\mathbf e_k\mid\mathbf 0,\boldsymbol\Omega_k)-\rho_k`.

    :return: ``(psi, means, covariances)``: the bound term, :math:`\mathbf m_k` and :math:`\mathbf S_k` after each
        mini-batch.
    """
    require_float64(K_uu=K_uu, K_uf=K_uf, K_ff=K_ff, y=y)
    check_noise(noise)
    _check_model(model, alpha, blocks)
    M = K_uu.shape[-1]
    m, S = torch.zeros(M, dtype=y.dtype), K_uu.clone()
    psis, means, covariances = [], [], []
    for block in blocks:
        K_ub, K_bb = K_uf[:, block], K_ff[block][:, block]
        H = torch.linalg.solve(K_uu, K_ub).mT
        _, V, regularizer = sparse_model_noise(K_uu, K_ub, K_bb, noise, model, alpha, [torch.arange(len(block))])
        e = y[block] - H @ m
        Omega = H @ S @ H.mT + V
        G = torch.linalg.solve(Omega, H @ S).mT
        psis.append(gaussian_logpdf(e, torch.zeros_like(e), Omega) - regularizer)
        m = m + G @ e
        S = S - G @ Omega @ G.mT
        S = 0.5 * (S + S.mT)
        means.append(m)
        covariances.append(S)
    return psis, means, covariances
