r"""Decoupled variational GP (SVDGP, Cheng & Boots 2017), inversely parametrised, from dense kernel matrices.

Notation (spec ``decoupled_orthogonal.md`` §0, §3): mean basis :math:`\alpha` (:math:`M_\alpha` points) with
coefficients :math:`\mathbf a`, covariance basis :math:`\beta` (:math:`M_\beta` points) with
:math:`\mathbf B=\mathbf L_B\mathbf L_B^\top\succeq0` (``L_B`` square, usually lower-triangular; :math:`\mathbf B`
may be singular). In RKHS form :math:`\mu=\Psi_\alpha\mathbf a`,
:math:`\Sigma=(I+\Psi_\beta\mathbf B\Psi_\beta^\top)^{-1}`, so the process has (spec eq. 3.1)

.. math::
    m(x)=\mu_0(x)+\mathbf k_{x\alpha}\mathbf a,\qquad
    s(x,x')=k_{xx'}-\mathbf k_{x\beta}\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top\mathbf k_{\beta x'},\qquad
    \mathbf H=\mathbf I+\mathbf L_B^\top\mathbf K_\beta\mathbf L_B,

using :math:`(\mathbf B^{-1}+\mathbf K_\beta)^{-1}=\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top`, which stays defined for
a singular :math:`\mathbf B`. It is the S-form (spec eq. 0.1) with
:math:`\mathbf S=(\mathbf K_\beta^{-1}+\mathbf B)^{-1}\preceq\mathbf K_\beta`, and its KL (spec eq. 3.2) is

.. math::
    \mathrm{KL}=\tfrac12\mathbf a^\top\mathbf K_\alpha\mathbf a+\tfrac12\log\lvert\mathbf H\rvert
    -\tfrac12\operatorname{tr}\big(\mathbf K_\beta\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top\big).

The bases are arbitrary (:math:`\alpha` need not contain :math:`\beta`); the spec compares with ODVGP at
:math:`\alpha=[\gamma;\beta]`. As in the other oracles nothing adds jitter and only one latent is supported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import centred, check_noise, cholesky, logdet_from_cholesky, require_float64, tril_solve
from .gaussian import expected_gaussian_loglik
from .orthogonal import _solve_spd

__all__ = [
    "decoupled_predictive",
    "decoupled_kl",
    "decoupled_elbo",
    "decoupled_covariance_to_s",
    "s_to_decoupled_precision",
    "decoupled_optimum",
    "decoupled_kl_gradients",
]


def _check_factor(K_bb: Tensor, L_B: Tensor) -> None:
    if K_bb.dim() != 2 or L_B.shape != K_bb.shape:
        raise ValueError(f"expected K_bb and L_B of shape (M_beta, M_beta), got {K_bb.shape}, {L_B.shape}")


def _inverse_factor(K_bb: Tensor, L_B: Tensor) -> tuple[Tensor, Tensor]:
    r"""``(C, R)`` with :math:`\mathbf R=\operatorname{chol}(\mathbf H)` and :math:`\mathbf C=\mathbf R^{-1}
    \mathbf L_B^\top`, so that :math:`\mathbf C^\top\mathbf C=\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top
    =(\mathbf B^{-1}+\mathbf K_\beta)^{-1}`.

    :math:`\mathbf H\succeq\mathbf I`, so the factorisation cannot fail for any ``L_B``.
    """
    _check_factor(K_bb, L_B)
    eye = torch.eye(L_B.shape[-1], dtype=L_B.dtype, device=L_B.device)
    H = eye + L_B.mT @ K_bb @ L_B
    R = cholesky(0.5 * (H + H.mT), "H = I + L_B^T K_bb L_B")
    return tril_solve(R, L_B.mT), R


def decoupled_predictive(
    K_bb: Tensor,
    K_as: Tensor,
    K_bs: Tensor,
    K_ss: Tensor,
    a: Tensor,
    L_B: Tensor,
    prior_mean_s: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Mean and full covariance of the Decoupled process at test inputs :math:`X_*` (spec eq. 3.1).

    .. math::
        \boldsymbol\mu_*=\mu_0(X_*)+\mathbf K_{*\alpha}\mathbf a,\qquad
        \boldsymbol\Sigma_*=\mathbf K_{**}-\mathbf V^\top\mathbf V,\qquad
        \mathbf V=\mathbf R^{-1}\mathbf L_B^\top\mathbf K_{\beta *},\quad\mathbf R\mathbf R^\top=\mathbf H.

    :param K_bb: ``(M_beta, M_beta)`` :math:`\mathbf K_\beta`.
    :param K_as: ``(M_alpha, S)`` :math:`\mathbf K_{\alpha *}`.
    :param K_bs: ``(M_beta, S)`` :math:`\mathbf K_{\beta *}`.
    :param K_ss: ``(S, S)`` :math:`\mathbf K_{**}`.
    :param a: ``(M_alpha,)`` mean coefficients.
    :param L_B: ``(M_beta, M_beta)`` factor of :math:`\mathbf B=\mathbf L_B\mathbf L_B^\top`.
    :param prior_mean_s: :math:`\mu_0(X_*)` (default zero).
    :return: ``(mean (S,), covariance (S, S))``.
    """
    require_float64(K_bb=K_bb, K_as=K_as, K_bs=K_bs, K_ss=K_ss, a=a, L_B=L_B, prior_mean_s=prior_mean_s)
    C, _ = _inverse_factor(K_bb, L_B)
    V = C @ K_bs
    mean = K_as.mT @ a
    if prior_mean_s is not None:
        mean = mean + prior_mean_s
    cov = K_ss - V.mT @ V
    return mean, 0.5 * (cov + cov.mT)


def decoupled_kl(K_aa: Tensor, K_bb: Tensor, a: Tensor, L_B: Tensor) -> Tensor:
    r"""The Decoupled KL (spec eq. 3.2, [CB] Theorem 1), through :math:`\mathbf L_B` and :math:`\mathbf H`.

    .. math::
        \mathrm{KL}=\tfrac12\mathbf a^\top\mathbf K_\alpha\mathbf a+\tfrac12\log\lvert\mathbf H\rvert
        -\tfrac12\operatorname{tr}\big(\mathbf K_\beta\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top\big),
        \qquad\mathbf H=\mathbf I+\mathbf L_B^\top\mathbf K_\beta\mathbf L_B.

    :math:`\log\lvert\mathbf H\rvert=\log\lvert\mathbf I+\mathbf K_\beta\mathbf B\rvert` (Sylvester). Differentiable
    in ``a`` and ``L_B`` (identity G1).
    """
    require_float64(K_aa=K_aa, K_bb=K_bb, a=a, L_B=L_B)
    C, R = _inverse_factor(K_bb, L_B)
    trace = (C * (C @ K_bb)).sum((-2, -1))  # tr(C K C^T) = tr(K C^T C)
    return 0.5 * (a @ K_aa @ a) + 0.5 * logdet_from_cholesky(R) - 0.5 * trace


def decoupled_elbo(
    K_aa: Tensor,
    K_bb: Tensor,
    K_aX: Tensor,
    K_bX: Tensor,
    k_XX_diag: Tensor,
    y: Tensor,
    noise: float | Tensor,
    a: Tensor,
    L_B: Tensor,
    prior_mean_f: Tensor | None = None,
) -> Tensor:
    r"""Gaussian-likelihood ELBO of the Decoupled model, summed over the data (spec eq. 0.3 with eqs. 3.1, 3.2).

    .. math::
        \mathrm{ELBO}=\sum_{n=1}^{N}\Big[-\tfrac12\log(2\pi\sigma^2)-\frac{(y_n-m(x_n))^2+s(x_n)}{2\sigma^2}\Big]
        -\mathrm{KL},\qquad s(x_n)=k_{nn}-\lVert\mathbf V_{:n}\rVert^2

    with :math:`\mathbf V` as in :func:`decoupled_predictive` (the spec's batch-variance form).
    """
    require_float64(K_aX=K_aX, K_bX=K_bX, k_XX_diag=k_XX_diag, y=y, prior_mean_f=prior_mean_f)
    check_noise(noise)
    C, _ = _inverse_factor(K_bb, L_B)
    mean = K_aX.mT @ a
    if prior_mean_f is not None:
        mean = mean + prior_mean_f
    var = k_XX_diag - (C @ K_bX).square().sum(-2)
    expected = expected_gaussian_loglik(y, mean, var, noise).sum(-1)
    return expected - decoupled_kl(K_aa, K_bb, a, L_B)


def decoupled_covariance_to_s(K_bb: Tensor, L_B: Tensor) -> Tensor:
    r"""The S-form covariance of :math:`q(f(\beta))` of a Decoupled process (spec §3.2).

    .. math::
        \mathbf S=(\mathbf K_\beta^{-1}+\mathbf B)^{-1}
        =\mathbf K_\beta-\mathbf K_\beta\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top\mathbf K_\beta,

    computed in the second form: it needs no inverse of :math:`\mathbf B` (which may be singular) or of
    :math:`\mathbf K_\beta`. Always :math:`\mathbf S\preceq\mathbf K_\beta`.
    """
    require_float64(K_bb=K_bb, L_B=L_B)
    C, _ = _inverse_factor(K_bb, L_B)
    W = C @ K_bb
    S = K_bb - W.mT @ W
    return 0.5 * (S + S.mT)


def s_to_decoupled_precision(K_bb: Tensor, S: Tensor) -> Tensor:
    r"""Inverse of :func:`decoupled_covariance_to_s`: :math:`\mathbf B=\mathbf S^{-1}-\mathbf K_\beta^{-1}`.

    :math:`\mathbf B\succeq0` iff :math:`\mathbf S\preceq\mathbf K_\beta`; that is not checked here (the result is
    returned as is), so tests can see what a too-large :math:`\mathbf S` maps to. Both matrices must be positive
    definite.
    """
    require_float64(K_bb=K_bb, S=S)
    eye = torch.eye(K_bb.shape[-1], dtype=K_bb.dtype, device=K_bb.device)
    B = _solve_spd(S, eye, "S") - _solve_spd(K_bb, eye, "K_bb")
    return 0.5 * (B + B.mT)


def decoupled_optimum(
    K_aa: Tensor,
    K_bb: Tensor,
    K_aX: Tensor,
    K_bX: Tensor,
    y: Tensor,
    noise: float | Tensor,
    prior_mean_f: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Closed-form Decoupled optimum for a Gaussian likelihood (spec eq. 3.3, with erratum E1's :math:`1/\sigma^2`).

    .. math::
        \mathbf a^\star=\Big(\tfrac1{\sigma^2}\mathbf K_{\alpha X}\mathbf K_{X\alpha}+\mathbf K_\alpha\Big)^{-1}
        \tfrac1{\sigma^2}\mathbf K_{\alpha X}(\mathbf y-\mu_0(X)),\qquad
        \mathbf B^\star=\tfrac1{\sigma^2}\mathbf A\mathbf A^\top,\quad\mathbf A=\mathbf K_\beta^{-1}\mathbf K_{\beta X}.

    Written as printed in (3.3), not in the :math:`\sigma^2`-multiplied form of
    :func:`tests.oracles.orthogonal.odvgp_optimum`, so that the two check each other. The factor
    :math:`\mathbf L_B^\star` comes from a QR decomposition :math:`\mathbf A^\top/\sigma=\mathbf Q\mathbf R`
    (:math:`\mathbf L_B^\star=\mathbf R^\top`, padded with zero columns when :math:`N<M_\beta`, where
    :math:`\mathbf B^\star` is singular); it is lower-triangular with :math:`\mathbf L_B^\star\mathbf L_B^{\star\top}
    =\mathbf B^\star`, though its diagonal may have either sign. The optimal ELBO is the ODVGP value (spec eq. 5.13)
    with :math:`\mathbf Q^{(\alpha)}`.

    :return: ``(a* (M_alpha,), B* (M_beta, M_beta), L_B* (M_beta, M_beta))``.
    """
    require_float64(K_aa=K_aa, K_bb=K_bb, K_aX=K_aX, K_bX=K_bX, y=y, prior_mean_f=prior_mean_f)
    check_noise(noise)
    precision = K_aX @ K_aX.mT / noise + K_aa
    rhs = (K_aX @ centred(y, prior_mean_f) / noise).unsqueeze(-1)
    a_star = _solve_spd(0.5 * (precision + precision.mT), rhs, "K_aX K_Xa / noise + K_aa").squeeze(-1)
    A = _solve_spd(K_bb, K_bX, "K_bb")
    B_star = A @ A.mT / noise
    R = torch.linalg.qr(A.mT / torch.as_tensor(noise, dtype=A.dtype, device=A.device).sqrt(), mode="r")[1]
    L_B = torch.zeros_like(K_bb)
    L_B[:, : R.shape[-2]] = R.mT
    return a_star, 0.5 * (B_star + B_star.mT), L_B


def decoupled_kl_gradients(K_aa: Tensor, K_bb: Tensor, a: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    r"""Gradients of the Decoupled KL in :math:`\mathbf a` and symmetric :math:`\mathbf B` ([CB] Prop. 2, spec §3.3).

    .. math::
        \nabla_{\mathbf a}\mathrm{KL}=\mathbf K_\alpha\mathbf a,\qquad
        \nabla_{\mathbf B}\mathrm{KL}=\tfrac12(\mathbf I+\mathbf K_\beta\mathbf B)^{-1}\mathbf K_\beta\mathbf B
        \mathbf K_\beta(\mathbf I+\mathbf B\mathbf K_\beta)^{-1}.

    For the factor, :math:`\nabla_{\mathbf L_B}\mathrm{KL}=2\,\nabla_{\mathbf B}\mathrm{KL}\,\mathbf L_B`. The two
    non-symmetric systems are solved as written (general LU solves); ``B`` may be singular.

    :return: ``(grad_a (M_alpha,), grad_B (M_beta, M_beta))``.
    """
    require_float64(K_aa=K_aa, K_bb=K_bb, a=a, B=B)
    if B.shape != K_bb.shape:
        raise ValueError(f"expected K_bb and B of shape (M_beta, M_beta), got {K_bb.shape}, {B.shape}")
    eye = torch.eye(K_bb.shape[-1], dtype=K_bb.dtype, device=K_bb.device)
    left = torch.linalg.solve(eye + K_bb @ B, K_bb @ B @ K_bb)  # (I + K B)^{-1} K B K
    # right factor: X (I + B K)^{-1} = [(I + K B)^{-1} X^T]^T, since (I + B K)^T = I + K B
    grad_B = 0.5 * torch.linalg.solve(eye + K_bb @ B, left.mT).mT
    return K_aa @ a, grad_B
