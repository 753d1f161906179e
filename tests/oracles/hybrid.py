r"""Hybrid decoupled variational GP (Cheng & Boots 2017, App. A.3) from dense kernel matrices.

Notation (spec ``decoupled_orthogonal.md`` §0, §4): covariance basis :math:`\beta`, extra mean basis :math:`\gamma`,
:math:`q(f(\beta))`-style parameters :math:`(\mathbf m_\beta,\mathbf S)` (**unwhitened**) and plain kernel features
on :math:`\gamma` with coefficients :math:`\mathbf a_\gamma`. The process has (spec eqs. 4.1 and 0.1)

.. math::
    m(x)=\mu_0(x)+\mathbf k_{x\gamma}\mathbf a_\gamma+\mathbf k_{x\beta}\mathbf K_\beta^{-1}\mathbf m_\beta,
    \qquad
    s(x,x')=k_{xx'}-\mathbf k_{x\beta}\mathbf K_\beta^{-1}\mathbf k_{\beta x'}
    +\mathbf k_{x\beta}\mathbf K_\beta^{-1}\mathbf S\mathbf K_\beta^{-1}\mathbf k_{\beta x'},

i.e. the SVGP process on :math:`\beta` plus the mean shift :math:`\mathbf k_{x\gamma}\mathbf a_\gamma`. Unlike ODVGP,
:math:`q(f(\beta))` has mean :math:`\mathbf m_\beta+\mathbf K_{\beta\gamma}\mathbf a_\gamma`, not
:math:`\mathbf m_\beta`: under :math:`\mathbf m_\beta^{\rm ODVGP}=\mathbf m_\beta^{\rm Hyb}+\mathbf K_{\beta\gamma}
\mathbf a_\gamma` (same :math:`\mathbf a_\gamma` and :math:`\mathbf S`) the two families are the same process
(spec §4.7). The function signatures mirror :mod:`.orthogonal`; nothing adds jitter; one latent only.
"""

from __future__ import annotations

from torch import Tensor

from ._linalg import check_noise, require_float64
from .decoupled import decoupled_covariance_to_s, decoupled_optimum
from .gaussian import expected_gaussian_loglik, gaussian_kl
from .orthogonal import _check_blocks, _solve_spd, _stack_alpha
from .sparse_gp import svgp_marginals, svgp_predictive

__all__ = [
    "hybrid_predictive",
    "hybrid_kl",
    "hybrid_elbo",
    "hybrid_to_odvgp",
    "odvgp_to_hybrid",
    "hybrid_optimum",
]


def hybrid_predictive(
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
    r"""Mean and full covariance of the Hybrid process at test inputs :math:`X_*` (spec eqs. 4.1, 0.1).

    .. math::
        \boldsymbol\mu_*=\mu_0(X_*)+\mathbf K_{*\gamma}\mathbf a_\gamma+\mathbf A^\top\mathbf m_\beta,\qquad
        \boldsymbol\Sigma_*=\mathbf K_{**}-\mathbf K_{*\beta}\mathbf A+\mathbf A^\top\mathbf S\mathbf A,
        \qquad\mathbf A=\mathbf K_\beta^{-1}\mathbf K_{\beta *}:

    :func:`tests.oracles.sparse_gp.svgp_predictive` of :math:`\mathcal N(\mathbf m_\beta,\mathbf S)` plus
    :math:`\mathbf K_{*\gamma}\mathbf a_\gamma`. Arguments as in :func:`tests.oracles.orthogonal.odvgp_predictive`
    (``K_bg`` only fixes the shapes here).

    :return: ``(mean (S,), covariance (S, S))``.
    """
    require_float64(K_bg=K_bg, K_gs=K_gs, a_gamma=a_gamma)
    _check_blocks(K_bb, K_bg)
    mean, cov = svgp_predictive(K_bb, K_bs, K_ss, m_beta, S, prior_mean_s)
    return mean + K_gs.mT @ a_gamma, cov


def hybrid_kl(K_bb: Tensor, K_bg: Tensor, K_gg: Tensor, a_gamma: Tensor, m_beta: Tensor, S: Tensor) -> Tensor:
    r"""The Hybrid KL (spec eq. 4.2: [CB] eq. 14 with the :math:`\tfrac12` on the log-determinant, erratum E6).

    .. math::
        \mathrm{KL}=\tfrac12\mathbf m_\beta^\top\mathbf K_\beta^{-1}\mathbf m_\beta
        +\mathbf m_\beta^\top\mathbf K_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma
        +\tfrac12\mathbf a_\gamma^\top\mathbf K_\gamma\mathbf a_\gamma
        -\tfrac12\log\lvert\mathbf K_\beta^{-1}\mathbf S\rvert+\tfrac12\operatorname{tr}(\mathbf S\mathbf K_\beta^{-1})
        -\tfrac12M_\beta.

    The last three terms are :math:`\mathrm{KL}(\mathcal N(\mathbf 0,\mathbf S)\Vert\mathcal N(\mathbf 0,
    \mathbf K_\beta))` (spec eq. 0.2).
    """
    require_float64(K_bb=K_bb, K_bg=K_bg, K_gg=K_gg, a_gamma=a_gamma, m_beta=m_beta, S=S)
    _check_blocks(K_bb, K_bg)
    w = _solve_spd(K_bb, m_beta.unsqueeze(-1), "K_bb").squeeze(-1)  # K_b^-1 m_beta
    quadratic = 0.5 * (m_beta @ w) + w @ (K_bg @ a_gamma) + 0.5 * (a_gamma @ K_gg @ a_gamma)
    zeros = m_beta.new_zeros(m_beta.shape)
    return quadratic + gaussian_kl(zeros, S, zeros, K_bb)


def hybrid_elbo(
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
    r"""Gaussian-likelihood ELBO of the Hybrid model, summed over the data (spec eq. 0.3 with eq. 4.2).

    The marginals are :func:`tests.oracles.sparse_gp.svgp_marginals` shifted by
    :math:`\mathbf K_{X\gamma}\mathbf a_\gamma`. Arguments as in :func:`tests.oracles.orthogonal.odvgp_elbo`.
    """
    require_float64(K_gX=K_gX)
    check_noise(noise)
    mean, var = svgp_marginals(K_bb, K_bX, k_XX_diag, m_beta, S, prior_mean_f)
    expected = expected_gaussian_loglik(y, mean + K_gX.mT @ a_gamma, var, noise).sum(-1)
    return expected - hybrid_kl(K_bb, K_bg, K_gg, a_gamma, m_beta, S)


def hybrid_to_odvgp(K_bg: Tensor, a_gamma: Tensor, m_beta: Tensor) -> tuple[Tensor, Tensor]:
    r"""Hybrid parameters to the ODVGP parameters of the same process (spec §4.7; :math:`\mathbf S` is unchanged).

    .. math::
        \mathbf a_\gamma^{\rm ODVGP}=\mathbf a_\gamma,\qquad
        \mathbf m_\beta^{\rm ODVGP}=\mathbf m_\beta^{\rm Hyb}+\mathbf K_{\beta\gamma}\mathbf a_\gamma

    (:math:`\mathbf m_\beta^{\rm ODVGP}=\mathbf K_\beta\mathbf a_\beta^{\rm ODVGP}` is the mean of :math:`q(f(\beta))`,
    the parameter :func:`tests.oracles.orthogonal.odvgp_predictive` takes).

    :return: ``(a_gamma (M_gamma,), m_beta_odvgp (M_beta,))``.
    """
    require_float64(K_bg=K_bg, a_gamma=a_gamma, m_beta=m_beta)
    return a_gamma, m_beta + K_bg @ a_gamma


def odvgp_to_hybrid(K_bg: Tensor, a_gamma: Tensor, m_beta: Tensor) -> tuple[Tensor, Tensor]:
    r"""Inverse of :func:`hybrid_to_odvgp`: :math:`\mathbf m_\beta^{\rm Hyb}=\mathbf m_\beta^{\rm ODVGP}
    -\mathbf K_{\beta\gamma}\mathbf a_\gamma`.

    :return: ``(a_gamma (M_gamma,), m_beta_hybrid (M_beta,))``.
    """
    require_float64(K_bg=K_bg, a_gamma=a_gamma, m_beta=m_beta)
    return a_gamma, m_beta - K_bg @ a_gamma


def hybrid_optimum(
    K_gg: Tensor,
    K_gb: Tensor,
    K_bb: Tensor,
    K_gX: Tensor,
    K_bX: Tensor,
    y: Tensor,
    noise: float | Tensor,
    prior_mean_f: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Closed-form Hybrid optimum for a Gaussian likelihood (spec §4.6).

    With :math:`\tilde{\mathbf a}=[\tilde{\mathbf a}_\gamma;\tilde{\mathbf a}_\beta]=\mathbf a^\star` of the Decoupled
    optimum (spec eq. 3.3) at :math:`\alpha=[\gamma;\beta]`,

    .. math::
        \mathbf a_\gamma^\star=\tilde{\mathbf a}_\gamma,\qquad
        \mathbf m_\beta^\star=\mathbf K_\beta\tilde{\mathbf a}_\beta,\qquad
        \mathbf S^\star=(\mathbf K_\beta^{-1}+\mathbf B^\star)^{-1}\ \text{(spec eq. 5.12)}.

    Built from :func:`tests.oracles.decoupled.decoupled_optimum` (not from
    :func:`tests.oracles.orthogonal.odvgp_optimum`), so comparing the two optima is a real check. Arguments as in
    ``odvgp_optimum``.

    :return: ``(a_gamma* (M_gamma,), m_beta* (M_beta,), S* (M_beta, M_beta))``.
    """
    require_float64(K_gg=K_gg, K_gb=K_gb, K_bb=K_bb, K_gX=K_gX, K_bX=K_bX)
    K_aa, K_aX = _stack_alpha(K_gg, K_gb, K_bb, K_gX, K_bX)
    a_tilde, _, L_B = decoupled_optimum(K_aa, K_bb, K_aX, K_bX, y, noise, prior_mean_f)
    m_gamma = K_gg.shape[-1]
    return a_tilde[:m_gamma], K_bb @ a_tilde[m_gamma:], decoupled_covariance_to_s(K_bb, L_B)
