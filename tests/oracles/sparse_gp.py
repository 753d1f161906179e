r"""Sparse variational GP (SVGP / SGPR) references from dense kernel matrices.

Notation (spec ``dual_recursive_vbks.md`` §0): inducing variables :math:`\mathbf u=f(Z)` with prior
:math:`p(\mathbf u)=\mathcal N(\mathbf 0,\mathbf K_{uu})`, :math:`q(\mathbf u)=\mathcal N(\mathbf m,\mathbf S)`
(**unwhitened**), :math:`\mathbf Q_{ab}=\mathbf K_{au}\mathbf K_{uu}^{-1}\mathbf K_{ub}`. The sparse process is
:math:`q(f)=\int p(f\mid\mathbf u)q(\mathbf u)\,d\mathbf u`, whose finite-dimensional marginals are

.. math::
    q(\mathbf f_*)=\mathcal N\big(\mu_0(X_*)+\mathbf K_{*u}\mathbf K_{uu}^{-1}\mathbf m,\;
    \mathbf K_{**}-\mathbf K_{*u}\mathbf K_{uu}^{-1}(\mathbf K_{uu}-\mathbf S)\mathbf K_{uu}^{-1}\mathbf K_{u*}\big).

No jitter is added anywhere: pass the :math:`\mathbf K_{uu}` (including its jitter) that the implementation under test
factors. A prior mean :math:`\mu_0` shifts every predictive mean and, in the objectives, is subtracted from
:math:`\mathbf y`; the KL does not depend on it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import centred, check_noise, cholesky, require_float64, tril_solve
from .gaussian import expected_gaussian_loglik, gaussian_kl, gaussian_logpdf

__all__ = [
    "titsias_optimal_qu",
    "collapsed_bound",
    "svgp_marginals",
    "svgp_predictive",
    "svgp_kl",
    "svgp_elbo",
    "whiten_qu",
    "unwhiten_qu",
]


def titsias_optimal_qu(
    K_uu: Tensor, K_uf: Tensor, y: Tensor, noise: float | Tensor, prior_mean_f: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Optimal :math:`q^*(\mathbf u)` for a Gaussian likelihood (Titsias 2009).

    .. math::
        \boldsymbol\Sigma=(\mathbf K_{uu}+\sigma^{-2}\mathbf K_{uf}\mathbf K_{fu})^{-1},\qquad
        \mathbf m^*=\sigma^{-2}\mathbf K_{uu}\boldsymbol\Sigma\mathbf K_{uf}(\mathbf y-\mu_0(X)),\qquad
        \mathbf S^*=\mathbf K_{uu}\boldsymbol\Sigma\mathbf K_{uu}.

    With :math:`\mathbf L_A\mathbf L_A^\top=\boldsymbol\Sigma^{-1}` and
    :math:`\mathbf B=\mathbf L_A^{-1}\mathbf K_{uu}`, :math:`\mathbf S^*=\mathbf B^\top\mathbf B`, which is symmetric
    PSD by construction.

    :return: ``(m* (M,), S* (M, M))``.
    """
    require_float64(K_uu=K_uu, K_uf=K_uf, y=y, prior_mean_f=prior_mean_f)
    check_noise(noise)
    L_A = cholesky(K_uu + K_uf @ K_uf.mT / noise, "K_uu + K_uf K_fu / noise")
    B = tril_solve(L_A, K_uu)
    c = tril_solve(L_A, (K_uf @ centred(y, prior_mean_f)).unsqueeze(-1)).squeeze(-1)
    return B.mT @ c / noise, B.mT @ B


def collapsed_bound(
    K_uu: Tensor,
    K_uf: Tensor,
    k_ff_diag: Tensor,
    y: Tensor,
    noise: float | Tensor,
    prior_mean_f: Tensor | None = None,
) -> Tensor:
    r"""Titsias' collapsed (SGPR / VFE) bound, summed over data (not divided by :math:`N`).

    .. math::
        \mathcal L_{\rm VFE}=\log\mathcal N(\mathbf y\mid\mu_0(X),\mathbf Q_{ff}+\sigma^2\mathbf I)
        -\frac{\operatorname{tr}(\mathbf K_{ff}-\mathbf Q_{ff})}{2\sigma^2}

    :math:`\mathbf Q_{ff}=\mathbf V^\top\mathbf V` with :math:`\mathbf V=\mathbf L_{uu}^{-1}\mathbf K_{uf}` is formed
    densely (:math:`N\times N`): an oracle favours the plain formula over the Woodbury identity it is meant to check.
    """
    require_float64(K_uu=K_uu, K_uf=K_uf, k_ff_diag=k_ff_diag, y=y, prior_mean_f=prior_mean_f)
    check_noise(noise)
    V = tril_solve(cholesky(K_uu, "K_uu"), K_uf)
    Q_ff = V.mT @ V
    n = y.shape[-1]
    cov = Q_ff + noise * torch.eye(n, dtype=y.dtype, device=y.device)
    mean = torch.zeros_like(y) if prior_mean_f is None else prior_mean_f
    trace = k_ff_diag.sum(-1) - V.square().sum((-2, -1))
    return gaussian_logpdf(y, mean, cov) - trace / (2.0 * noise)


def _projection(K_uu: Tensor, K_ux: Tensor) -> tuple[Tensor, Tensor]:
    """``V = L_uu^{-1} K_ux`` and ``A = K_uu^{-1} K_ux``, the two forms every sparse prediction needs."""
    L = cholesky(K_uu, "K_uu")
    V = tril_solve(L, K_ux)
    return V, torch.linalg.solve_triangular(L.mT, V, upper=True)


def svgp_marginals(
    K_uu: Tensor, K_uf: Tensor, k_ff_diag: Tensor, m: Tensor, S: Tensor, prior_mean_f: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Marginals :math:`q(f_i)=\mathcal N(\mu_i,v_i)` of the sparse process at the columns of :math:`\mathbf K_{uf}`.

    .. math::
        \mu_i=\mu_0(x_i)+\mathbf a_i^\top\mathbf m,\qquad
        v_i=k_{ii}-\mathbf a_i^\top\mathbf K_{uu}\mathbf a_i+\mathbf a_i^\top\mathbf S\mathbf a_i,
        \qquad\mathbf a_i=\mathbf K_{uu}^{-1}\mathbf k_{ui}.

    ``S`` need not be PSD here (the formula is linear in it), which lets tests probe arbitrary symmetric ``S``.

    :return: ``(mean (N,), var (N,))``.
    """
    require_float64(K_uu=K_uu, K_uf=K_uf, k_ff_diag=k_ff_diag, m=m, S=S, prior_mean_f=prior_mean_f)
    V, A = _projection(K_uu, K_uf)
    mean = A.mT @ m
    if prior_mean_f is not None:
        mean = mean + prior_mean_f
    var = k_ff_diag - V.square().sum(-2) + (A * (S @ A)).sum(-2)
    return mean, var


def svgp_predictive(
    K_uu: Tensor, K_us: Tensor, K_ss: Tensor, m: Tensor, S: Tensor, prior_mean_s: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Full predictive of the latent sparse process at test inputs (see the module docstring).

    .. math::
        \boldsymbol\mu_*=\mu_0(X_*)+\mathbf A^\top\mathbf m,\qquad
        \boldsymbol\Sigma_*=\mathbf K_{**}-\mathbf A^\top\mathbf K_{uu}\mathbf A+\mathbf A^\top\mathbf S\mathbf A,
        \qquad\mathbf A=\mathbf K_{uu}^{-1}\mathbf K_{u*}.

    Add :math:`\sigma^2\mathbf I` for the predictive of :math:`\mathbf y_*` under a Gaussian likelihood.

    :return: ``(mean (S,), covariance (S, S))``.
    """
    require_float64(K_uu=K_uu, K_us=K_us, K_ss=K_ss, m=m, S=S, prior_mean_s=prior_mean_s)
    V, A = _projection(K_uu, K_us)
    mean = A.mT @ m
    if prior_mean_s is not None:
        mean = mean + prior_mean_s
    cov = K_ss - V.mT @ V + A.mT @ S @ A
    return mean, 0.5 * (cov + cov.mT)


def svgp_kl(K_uu: Tensor, m: Tensor, S: Tensor) -> Tensor:
    r"""The (unwhitened) SVGP KL term.

    .. math::
        \mathrm{KL}\big(\mathcal N(\mathbf m,\mathbf S)\Vert\mathcal N(\mathbf 0,\mathbf K_{uu})\big)

    For whitened parameters this equals ``gaussian_kl(m_w, S_w, 0, I)`` (spec identity R4).
    """
    return gaussian_kl(m, S, torch.zeros_like(m), K_uu)


def svgp_elbo(
    K_uu: Tensor,
    K_uf: Tensor,
    k_ff_diag: Tensor,
    y: Tensor,
    noise: float | Tensor,
    m: Tensor,
    S: Tensor,
    prior_mean_f: Tensor | None = None,
) -> Tensor:
    r"""Uncollapsed SVGP ELBO (Hensman et al. 2013) for any :math:`q(\mathbf u)=\mathcal N(\mathbf m,\mathbf S)`.

    .. math::
        \mathcal L(\mathbf m,\mathbf S)
        =\sum_{i=1}^N\Big[-\tfrac12\log(2\pi\sigma^2)-\frac{(y_i-\mu_i)^2+v_i}{2\sigma^2}\Big]
        -\mathrm{KL}\big(\mathcal N(\mathbf m,\mathbf S)\Vert\mathcal N(\mathbf 0,\mathbf K_{uu})\big)

    with :math:`(\mu_i,v_i)` from :func:`svgp_marginals`. Summed over data: GPyTorch's ``VariationalELBO`` returns
    this divided by :math:`N`. At :math:`q^*` of :func:`titsias_optimal_qu` it equals :func:`collapsed_bound`.
    """
    check_noise(noise)
    mean, var = svgp_marginals(K_uu, K_uf, k_ff_diag, m, S, prior_mean_f)
    return expected_gaussian_loglik(y, mean, var, noise).sum(-1) - svgp_kl(K_uu, m, S)


def whiten_qu(K_uu: Tensor, m: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    r"""Unwhitened :math:`q(\mathbf u)` to whitened :math:`q(\mathbf v)`, :math:`\mathbf u=\mathbf L_{uu}\mathbf v`.

    .. math::
        \mathbf m_w=\mathbf L_{uu}^{-1}\mathbf m,\qquad\mathbf S_w=\mathbf L_{uu}^{-1}\mathbf S\mathbf L_{uu}^{-\top},
        \qquad\mathbf L_{uu}\mathbf L_{uu}^\top=\mathbf K_{uu}

    (GPyTorch's ``VariationalStrategy`` convention, with :math:`\mathbf L_{uu}` the lower Cholesky factor).
    """
    require_float64(K_uu=K_uu, m=m, S=S)
    L = cholesky(K_uu, "K_uu")
    m_w = tril_solve(L, m.unsqueeze(-1)).squeeze(-1)
    S_w = tril_solve(L, tril_solve(L, S).mT)
    return m_w, 0.5 * (S_w + S_w.mT)


def unwhiten_qu(K_uu: Tensor, m_w: Tensor, S_w: Tensor) -> tuple[Tensor, Tensor]:
    r"""Inverse of :func:`whiten_qu`: :math:`\mathbf m=\mathbf L_{uu}\mathbf m_w`,
    :math:`\mathbf S=\mathbf L_{uu}\mathbf S_w\mathbf L_{uu}^\top`."""
    require_float64(K_uu=K_uu, m_w=m_w, S_w=S_w)
    L = cholesky(K_uu, "K_uu")
    S = L @ S_w @ L.mT
    return L @ m_w, 0.5 * (S + S.mT)
