r"""Orthogonally decoupled variational GP (ODVGP, Salimbeni et al. 2018) from dense kernel matrices.

Notation (spec ``decoupled_orthogonal.md`` §0, §5): covariance basis :math:`\beta` (:math:`M_\beta` points), mean
basis :math:`\gamma` (:math:`M_\gamma` points, possibly none), :math:`q(f(\beta))=\mathcal N(\mathbf m_\beta,\mathbf S)`
(**unwhitened**) and mean coefficients :math:`\mathbf a_\gamma` acting on the residual features

.. math::
    \tilde{\mathbf k}_{x\gamma}=\mathbf k_{x\gamma}-\mathbf k_{x\beta}\mathbf K_\beta^{-1}\mathbf K_{\beta\gamma}.

The process has (spec eqs. 5.1 and 0.1)

.. math::
    m(x)=\mu_0(x)+\tilde{\mathbf k}_{x\gamma}\mathbf a_\gamma+\mathbf k_{x\beta}\mathbf K_\beta^{-1}\mathbf m_\beta,
    \qquad
    s(x,x')=k_{xx'}-\mathbf k_{x\beta}\mathbf K_\beta^{-1}\mathbf k_{\beta x'}
    +\mathbf k_{x\beta}\mathbf K_\beta^{-1}\mathbf S\mathbf K_\beta^{-1}\mathbf k_{\beta x'},

and KL (spec eq. 5.3)
:math:`\tfrac12\mathbf a_\gamma^\top\mathbf K_{\gamma\perp\beta}\mathbf a_\gamma
+\mathrm{KL}(\mathcal N(\mathbf m_\beta,\mathbf S)\Vert\mathcal N(\mathbf 0,\mathbf K_\beta))` with the Schur
complement :math:`\mathbf K_{\gamma\perp\beta}=\mathbf K_\gamma
-\mathbf K_{\gamma\beta}\mathbf K_\beta^{-1}\mathbf K_{\beta\gamma}`.

Every function takes the dense kernel blocks it needs. As in the other oracles nothing adds jitter: pass the
:math:`\mathbf K_\beta` (with its jitter) that the implementation under test factors. Only the unbatched case
(one latent) is supported; an empty mean basis (``K_bg`` of shape ``(M_beta, 0)``) is allowed everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import centred, check_noise, cholesky, require_float64, tril_solve
from .gaussian import expected_gaussian_loglik, gaussian_kl, gaussian_logpdf

__all__ = [
    "odvgp_predictive",
    "odvgp_kl",
    "odvgp_elbo",
    "odvgp_residual_features",
    "odvgp_optimum",
    "odvgp_conditional_optimum",
    "odvgp_optimal_elbo",
]


def _solve_spd(K: Tensor, B: Tensor, name: str) -> Tensor:
    r""":math:`\mathbf K^{-1}\mathbf B` through the Cholesky factor of :math:`\mathbf K` (no jitter)."""
    L = cholesky(K, name)
    return torch.linalg.solve_triangular(L.mT, tril_solve(L, B), upper=True)


def _check_blocks(K_bb: Tensor, K_bg: Tensor) -> None:
    if K_bb.dim() != 2 or K_bg.dim() != 2 or K_bg.shape[0] != K_bb.shape[0]:
        raise ValueError(f"expected K_bb (M_beta, M_beta) and K_bg (M_beta, M_gamma), got {K_bb.shape}, {K_bg.shape}")


def odvgp_residual_features(K_bb: Tensor, K_bs: Tensor, K_gs: Tensor, K_bg: Tensor) -> Tensor:
    r"""Residual features :math:`\tilde{\mathbf K}_{\gamma *}=\mathbf K_{\gamma *}-\mathbf K_{\gamma\beta}
    \mathbf K_\beta^{-1}\mathbf K_{\beta *}` at the columns of ``K_bs`` / ``K_gs``, shape ``(M_gamma, S)``.

    Its transpose at the training inputs is the spec's :math:`\boldsymbol\Phi` (§5.6.1).
    """
    require_float64(K_bb=K_bb, K_bs=K_bs, K_gs=K_gs, K_bg=K_bg)
    _check_blocks(K_bb, K_bg)
    return K_gs - K_bg.mT @ _solve_spd(K_bb, K_bs, "K_bb")


def odvgp_predictive(
    K_bb: Tensor,
    K_bg: Tensor,
    K_bs: Tensor,
    K_gs: Tensor,
    K_ss: Tensor,
    a_gamma: Tensor,
    m_beta: Tensor,
    S: Tensor,
    prior_mean_s: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Mean and full covariance of the ODVGP process at test inputs :math:`X_*` (spec eqs. 5.1, 0.1).

    .. math::
        \boldsymbol\mu_*=\mu_0(X_*)+\tilde{\mathbf K}_{*\gamma}\mathbf a_\gamma+\mathbf A^\top\mathbf m_\beta,\qquad
        \boldsymbol\Sigma_*=\mathbf K_{**}-\mathbf K_{*\beta}\mathbf A+\mathbf A^\top\mathbf S\mathbf A,
        \qquad\mathbf A=\mathbf K_\beta^{-1}\mathbf K_{\beta *}.

    :param K_bb: ``(M_beta, M_beta)`` :math:`\mathbf K_\beta`.
    :param K_bg: ``(M_beta, M_gamma)`` :math:`\mathbf K_{\beta\gamma}`.
    :param K_bs: ``(M_beta, S)`` :math:`\mathbf K_{\beta *}`.
    :param K_gs: ``(M_gamma, S)`` :math:`\mathbf K_{\gamma *}`.
    :param K_ss: ``(S, S)`` :math:`\mathbf K_{**}`.
    :param a_gamma: ``(M_gamma,)`` mean coefficients.
    :param m_beta: ``(M_beta,)`` mean of :math:`q(f(\beta))`.
    :param S: ``(M_beta, M_beta)`` covariance of :math:`q(f(\beta))`.
    :param prior_mean_s: :math:`\mu_0(X_*)` (default zero).
    :return: ``(mean (S,), covariance (S, S))``.
    """
    require_float64(
        K_bb=K_bb, K_bg=K_bg, K_bs=K_bs, K_gs=K_gs, K_ss=K_ss, a_gamma=a_gamma, m_beta=m_beta, S=S,
        prior_mean_s=prior_mean_s,
    )  # fmt: skip
    _check_blocks(K_bb, K_bg)
    A = _solve_spd(K_bb, K_bs, "K_bb")
    residual = K_gs - K_bg.mT @ A
    mean = residual.mT @ a_gamma + A.mT @ m_beta
    if prior_mean_s is not None:
        mean = mean + prior_mean_s
    cov = K_ss - K_bs.mT @ A + A.mT @ S @ A
    return mean, 0.5 * (cov + cov.mT)


def odvgp_kl(K_bb: Tensor, K_bg: Tensor, K_gg: Tensor, a_gamma: Tensor, m_beta: Tensor, S: Tensor) -> Tensor:
    r"""The ODVGP KL (spec eq. 5.3, [ODVGP] Prop. A.1).

    .. math::
        \mathrm{KL}=\tfrac12\mathbf a_\gamma^\top\big(\mathbf K_\gamma-\mathbf K_{\gamma\beta}\mathbf K_\beta^{-1}
        \mathbf K_{\beta\gamma}\big)\mathbf a_\gamma
        +\mathrm{KL}\big(\mathcal N(\mathbf m_\beta,\mathbf S)\Vert\mathcal N(\mathbf 0,\mathbf K_\beta)\big)

    The Schur complement is formed as a dense matrix (not through the norm identity the implementation uses).
    """
    require_float64(K_bb=K_bb, K_bg=K_bg, K_gg=K_gg, a_gamma=a_gamma, m_beta=m_beta, S=S)
    _check_blocks(K_bb, K_bg)
    schur = K_gg - K_bg.mT @ _solve_spd(K_bb, K_bg, "K_bb")
    return 0.5 * a_gamma @ schur @ a_gamma + gaussian_kl(m_beta, S, torch.zeros_like(m_beta), K_bb)


def odvgp_elbo(
    K_bb: Tensor,
    K_bg: Tensor,
    K_gg: Tensor,
    K_bX: Tensor,
    K_gX: Tensor,
    k_XX_diag: Tensor,
    y: Tensor,
    noise: float | Tensor,
    a_gamma: Tensor,
    m_beta: Tensor,
    S: Tensor,
    prior_mean_f: Tensor | None = None,
) -> Tensor:
    r"""Gaussian-likelihood ELBO of the ODVGP, summed over the data (spec eq. 0.3 with eq. 5.3).

    .. math::
        \mathrm{ELBO}=\sum_{n=1}^{N}\Big[-\tfrac12\log(2\pi\sigma^2)-\frac{(y_n-m(x_n))^2+s(x_n)}{2\sigma^2}\Big]
        -\mathrm{KL}

    GPyTorch's ``VariationalELBO`` returns this divided by :math:`N`.
    """
    require_float64(K_bX=K_bX, K_gX=K_gX, k_XX_diag=k_XX_diag, y=y, prior_mean_f=prior_mean_f)
    check_noise(noise)
    A = _solve_spd(K_bb, K_bX, "K_bb")
    mean = (K_gX - K_bg.mT @ A).mT @ a_gamma + A.mT @ m_beta
    if prior_mean_f is not None:
        mean = mean + prior_mean_f
    var = k_XX_diag - (K_bX * A).sum(-2) + (A * (S @ A)).sum(-2)
    expected = expected_gaussian_loglik(y, mean, var, noise).sum(-1)
    return expected - odvgp_kl(K_bb, K_bg, K_gg, a_gamma, m_beta, S)


def _stack_alpha(K_gg: Tensor, K_gb: Tensor, K_bb: Tensor, K_gX: Tensor, K_bX: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`\mathbf K_\alpha` and :math:`\mathbf K_{\alpha X}` for :math:`\alpha=[\gamma;\beta]`."""
    K_aa = torch.cat([torch.cat([K_gg, K_gb], -1), torch.cat([K_gb.mT, K_bb], -1)], -2)
    return K_aa, torch.cat([K_gX, K_bX], -2)


def odvgp_optimum(
    K_gg: Tensor,
    K_gb: Tensor,
    K_bb: Tensor,
    K_gX: Tensor,
    K_bX: Tensor,
    y: Tensor,
    noise: float | Tensor,
    prior_mean_f: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Closed-form ODVGP optimum for a Gaussian likelihood (spec eqs. 5.10-5.12, [ODVGP] App. E corrected).

    .. math::
        \tilde{\mathbf a}=\big(\mathbf K_{\alpha X}\mathbf K_{X\alpha}+\sigma^2\mathbf K_\alpha\big)^{-1}
        \mathbf K_{\alpha X}\mathbf y,\qquad
        \mathbf a_\gamma^\star=\tilde{\mathbf a}_\gamma,\qquad
        \mathbf m_\beta^\star=\mathbf K_{\beta\alpha}\tilde{\mathbf a},\qquad
        \mathbf S^\star=\mathbf K_\beta\big(\tfrac1{\sigma^2}\mathbf K_{\beta X}\mathbf K_{X\beta}
        +\mathbf K_\beta\big)^{-1}\mathbf K_\beta,

    with :math:`\alpha=[\gamma;\beta]` (the first form of 5.10 multiplied through by :math:`\sigma^2`).

    :return: ``(a_gamma* (M_gamma,), m_beta* (M_beta,), S* (M_beta, M_beta))``.
    """
    require_float64(K_gg=K_gg, K_gb=K_gb, K_bb=K_bb, K_gX=K_gX, K_bX=K_bX, y=y, prior_mean_f=prior_mean_f)
    check_noise(noise)
    K_aa, K_aX = _stack_alpha(K_gg, K_gb, K_bb, K_gX, K_bX)
    system = K_aX @ K_aX.mT + noise * K_aa
    a_tilde = _solve_spd(system, (K_aX @ centred(y, prior_mean_f)).unsqueeze(-1), "K_aX K_Xa + noise K_aa")
    a_tilde = a_tilde.squeeze(-1)
    m_gamma = K_gg.shape[-1]
    m_beta = torch.cat([K_gb.mT, K_bb], -1) @ a_tilde
    S = K_bb @ _solve_spd(K_bX @ K_bX.mT / noise + K_bb, K_bb, "K_bX K_Xb / noise + K_bb")
    return a_tilde[:m_gamma], m_beta, 0.5 * (S + S.mT)


def odvgp_conditional_optimum(
    K_bb: Tensor,
    K_bg: Tensor,
    K_bX: Tensor,
    K_gX: Tensor,
    y: Tensor,
    noise: float | Tensor,
    a_gamma: Tensor,
    prior_mean_f: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Optimal :math:`q(f(\beta))` for a *fixed* :math:`\mathbf a_\gamma` (spec §5.6.1, identity N1).

    .. math::
        \mathbf S^\star=\big(\mathbf K_\beta^{-1}+\tfrac1{\sigma^2}\mathbf K_\beta^{-1}\mathbf K_{\beta X}
        \mathbf K_{X\beta}\mathbf K_\beta^{-1}\big)^{-1},\qquad
        \mathbf m_\beta=\mathbf S^\star\mathbf K_\beta^{-1}\mathbf K_{\beta X}
        (\mathbf y-\boldsymbol\Phi\mathbf a_\gamma)/\sigma^2,\qquad
        \boldsymbol\Phi=\mathbf K_{X\gamma}-\mathbf K_{X\beta}\mathbf K_\beta^{-1}\mathbf K_{\beta\gamma}.

    :math:`\mathbf S^\star` is formed from the precision :math:`\mathbf S^{\star-1}` (the first form of eq. 5.12),
    unlike :func:`odvgp_optimum`, so that the two check each other.

    :return: ``(m_beta (M_beta,), S* (M_beta, M_beta))``.
    """
    require_float64(K_bb=K_bb, K_bg=K_bg, K_bX=K_bX, K_gX=K_gX, y=y, a_gamma=a_gamma, prior_mean_f=prior_mean_f)
    check_noise(noise)
    _check_blocks(K_bb, K_bg)
    A = _solve_spd(K_bb, K_bX, "K_bb")  # K_b^-1 K_bX
    phi = (K_gX - K_bg.mT @ A).mT
    eye = torch.eye(K_bb.shape[-1], dtype=K_bb.dtype, device=K_bb.device)
    precision = _solve_spd(K_bb, eye, "K_bb") + A @ A.mT / noise
    S = _solve_spd(0.5 * (precision + precision.mT), eye, "S*^-1")
    residual = centred(y, prior_mean_f) - phi @ a_gamma
    m_beta = S @ (A @ residual) / noise
    return m_beta, 0.5 * (S + S.mT)


def odvgp_optimal_elbo(
    K_gg: Tensor,
    K_gb: Tensor,
    K_bb: Tensor,
    K_gX: Tensor,
    K_bX: Tensor,
    k_XX_diag: Tensor,
    y: Tensor,
    noise: float | Tensor,
    prior_mean_f: Tensor | None = None,
) -> Tensor:
    r"""The optimal ODVGP ELBO for a Gaussian likelihood (spec eq. 5.13), summed over the data.

    .. math::
        \mathrm{ELBO}^\star=-\tfrac N2\log2\pi-\tfrac12\log\lvert\mathbf Q^{(\beta)}_{XX}+\sigma^2\mathbf I\rvert
        -\tfrac12\mathbf y^\top\big(\mathbf Q^{(\alpha)}_{XX}+\sigma^2\mathbf I\big)^{-1}\mathbf y
        -\tfrac1{2\sigma^2}\operatorname{tr}\big(\mathbf K_{XX}-\mathbf Q^{(\beta)}_{XX}\big),

    :math:`\mathbf Q^{(A)}_{XX}=\mathbf K_{XA}\mathbf K_A^{-1}\mathbf K_{AX}`, formed densely (:math:`N\times N`).
    The covariance basis enters the log-determinant and trace, the mean basis :math:`\alpha=[\gamma;\beta]` only the
    data fit.
    """
    require_float64(K_gg=K_gg, K_gb=K_gb, K_bb=K_bb, K_gX=K_gX, K_bX=K_bX, k_XX_diag=k_XX_diag, y=y)
    require_float64(prior_mean_f=prior_mean_f)
    check_noise(noise)
    K_aa, K_aX = _stack_alpha(K_gg, K_gb, K_bb, K_gX, K_bX)
    V_b = tril_solve(cholesky(K_bb, "K_bb"), K_bX)
    V_a = tril_solve(cholesky(K_aa, "K_alpha"), K_aX)
    Q_b, Q_a = V_b.mT @ V_b, V_a.mT @ V_a
    eye = torch.eye(y.shape[-1], dtype=y.dtype, device=y.device)
    r = centred(y, prior_mean_f)
    zeros = torch.zeros_like(r)
    # log N(r | 0, Q_b + s I) carries the log-determinant; swap its quadratic term for the alpha one.
    log_det_part = gaussian_logpdf(zeros, zeros, Q_b + noise * eye)
    data_fit = r @ _solve_spd(Q_a + noise * eye, r.unsqueeze(-1), "Q_alpha + noise I").squeeze(-1)
    trace = k_XX_diag.sum(-1) - V_b.square().sum((-2, -1))
    return log_det_part - 0.5 * data_fit - trace / (2.0 * noise)
