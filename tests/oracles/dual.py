r"""t-SVGP (the dual parameterization of SVGP, Adam et al. 2021) references from dense kernel matrices.

Spec ``dual_recursive_vbks.md`` Part A. The approximate posterior is the prior times Gaussian sites,
:math:`q(\mathbf u)\propto\mathcal N(\mathbf u\mid\mathbf 0,\mathbf K_{uu})
\exp(\boldsymbol\ell_1^\top\mathbf u-\tfrac12\mathbf u^\top\mathbf L_2\mathbf u)`, held in one of three forms:

* u-space sites :math:`(\boldsymbol\ell_1,\mathbf L_2)`: :math:`\mathbf S^{-1}=\mathbf K_{uu}^{-1}+\mathbf L_2`,
  :math:`\mathbf S^{-1}\mathbf m=\boldsymbol\ell_1` (variant A);
* summaries :math:`\bar{\boldsymbol\lambda}_1=\mathbf K_{uu}\boldsymbol\ell_1`,
  :math:`\bar{\boldsymbol\Lambda}_2=\mathbf K_{uu}\mathbf L_2\mathbf K_{uu}` with :math:`\mathbf R=\mathbf K_{uu}+
  \bar{\boldsymbol\Lambda}_2`, :math:`\mathbf S=\mathbf K_{uu}\mathbf R^{-1}\mathbf K_{uu}`,
  :math:`\mathbf m=\mathbf K_{uu}\mathbf R^{-1}\bar{\boldsymbol\lambda}_1` (eqs. 47-48; variant B);
* per-datum sites :math:`(\lambda_{1,i},\lambda_{2,i})` with :math:`\bar{\boldsymbol\lambda}_1=\mathbf K_{uf}
  \boldsymbol\lambda_1`, :math:`\bar{\boldsymbol\Lambda}_2=\mathbf K_{uf}\operatorname{diag}(\boldsymbol\lambda_2)
  \mathbf K_{fu}` (variant C).

The two routes to :math:`q` (natural parameters vs. eqs. 47-48) are written separately so that tests can check one
against the other. Expected log-likelihoods are callables ``(mean, var) -> (n,)`` of the marginals of :math:`q(f_i)`
(uncentred: the prior mean is included), e.g. ``lambda mu, v: expected_gaussian_loglik(y, mu, v, noise)`` or
:func:`bernoulli_expected_loglik`. No jitter is added: pass the jittered :math:`\mathbf K_{uu}` of the implementation.
Titsias' :math:`q^*` and :math:`\mathcal L_{\rm VFE}` are :func:`~tests.oracles.sparse_gp.titsias_optimal_qu` and
:func:`~tests.oracles.sparse_gp.collapsed_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ._linalg import LOG_2PI, cholesky, logdet_from_cholesky, require_float64, tril_solve
from .gaussian import gaussian_logpdf
from .sparse_gp import svgp_kl, svgp_marginals

__all__ = [
    "sites_to_summaries",
    "summaries_to_sites",
    "datum_sites_to_summaries",
    "dual_qu_from_sites",
    "dual_qu_from_summaries",
    "dual_predictive",
    "dual_kl",
    "dual_log_normalizer",
    "expected_log_site",
    "normalized_log_normalizer",
    "normalized_expected_log_site",
    "bernoulli_expected_loglik",
    "variational_elbo",
    "dual_site_targets",
    "dual_e_step",
]

ExpectedLogLik = Callable[[Tensor, Tensor], Tensor]


def _matvec(A: Tensor, v: Tensor) -> Tensor:
    """:math:`\\mathbf A\\mathbf v` with batch dimensions broadcast."""
    return (A @ v.unsqueeze(-1)).squeeze(-1)


def _solve(K: Tensor, B: Tensor) -> Tensor:
    """:math:`\\mathbf K^{-1}\\mathbf B` by a Cholesky factor of the SPD :math:`\\mathbf K`."""
    return torch.cholesky_solve(B, cholesky(K, "matrix to solve with"))


def _inverse(K: Tensor) -> Tensor:
    inverse = torch.cholesky_inverse(cholesky(K, "matrix to invert"))
    return 0.5 * (inverse + inverse.mT)


def sites_to_summaries(K_uu: Tensor, ell1: Tensor, L2: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`(\bar{\boldsymbol\lambda}_1,\bar{\boldsymbol\Lambda}_2)=(\mathbf K_{uu}\boldsymbol\ell_1,
    \mathbf K_{uu}\mathbf L_2\mathbf K_{uu})`."""
    require_float64(K_uu=K_uu, ell1=ell1, L2=L2)
    return _matvec(K_uu, ell1), K_uu @ L2 @ K_uu


def summaries_to_sites(K_uu: Tensor, lam1bar: Tensor, Lam2bar: Tensor) -> tuple[Tensor, Tensor]:
    r"""Inverse of :func:`sites_to_summaries`: :math:`(\mathbf K_{uu}^{-1}\bar{\boldsymbol\lambda}_1,
    \mathbf K_{uu}^{-1}\bar{\boldsymbol\Lambda}_2\mathbf K_{uu}^{-1})`."""
    require_float64(K_uu=K_uu, lam1bar=lam1bar, Lam2bar=Lam2bar)
    ell1 = _solve(K_uu, lam1bar.unsqueeze(-1)).squeeze(-1)
    L2 = _solve(K_uu, _solve(K_uu, Lam2bar).mT)
    return ell1, 0.5 * (L2 + L2.mT)


def datum_sites_to_summaries(K_uf: Tensor, lam1: Tensor, lam2: Tensor) -> tuple[Tensor, Tensor]:
    r"""Per-datum sites to summaries (eq. 44): :math:`(\mathbf K_{uf}\boldsymbol\lambda_1,
    \mathbf K_{uf}\operatorname{diag}(\boldsymbol\lambda_2)\mathbf K_{fu})`."""
    require_float64(K_uf=K_uf, lam1=lam1, lam2=lam2)
    return _matvec(K_uf, lam1), (K_uf * lam2.unsqueeze(-2)) @ K_uf.mT


def dual_qu_from_sites(K_uu: Tensor, ell1: Tensor, L2: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`q(\mathbf u)` from its natural parameters: :math:`\mathbf S=(\mathbf K_{uu}^{-1}+\mathbf L_2)^{-1}`,
    :math:`\mathbf m=\mathbf S\boldsymbol\ell_1` (explicit inverses; the route independent of eqs. 47-48).

    :return: ``(m (M,), S (M, M))``.
    """
    require_float64(K_uu=K_uu, ell1=ell1, L2=L2)
    S = _inverse(_inverse(K_uu) + L2)
    return _matvec(S, ell1), S


def dual_qu_from_summaries(K_uu: Tensor, lam1bar: Tensor, Lam2bar: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`q(\mathbf u)` by eqs. 47-48: :math:`\mathbf S=\mathbf K_{uu}\mathbf R^{-1}\mathbf K_{uu}`,
    :math:`\mathbf m=\mathbf K_{uu}\mathbf R^{-1}\bar{\boldsymbol\lambda}_1`, :math:`\mathbf R=\mathbf K_{uu}+
    \bar{\boldsymbol\Lambda}_2`.

    :return: ``(m (M,), S (M, M))``.
    """
    require_float64(K_uu=K_uu, lam1bar=lam1bar, Lam2bar=Lam2bar)
    L_R = cholesky(K_uu + Lam2bar, "R = K_uu + Lam2bar")
    B = tril_solve(L_R, K_uu)
    c = tril_solve(L_R, lam1bar.unsqueeze(-1)).squeeze(-1)
    return _matvec(B.mT, c), B.mT @ B


def dual_predictive(
    K_uu: Tensor,
    K_us: Tensor,
    K_ss: Tensor,
    lam1bar: Tensor,
    Lam2bar: Tensor,
    prior_mean_s: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Predictive of the latent process, eq. 49 (reconstructed):

    .. math::
        \mathbb E[f_*]=\mu_0(X_*)+\mathbf K_{*u}\mathbf R^{-1}\bar{\boldsymbol\lambda}_1,\qquad
        \operatorname{Cov}[f_*]=\mathbf K_{**}-\mathbf K_{*u}\mathbf K_{uu}^{-1}\mathbf K_{u*}
        +\mathbf K_{*u}\mathbf R^{-1}\mathbf K_{u*}.

    :return: ``(mean (S,), covariance (S, S))``.
    """
    require_float64(K_uu=K_uu, K_us=K_us, K_ss=K_ss, lam1bar=lam1bar, Lam2bar=Lam2bar, prior_mean_s=prior_mean_s)
    V = tril_solve(cholesky(K_uu, "K_uu"), K_us)
    L_R = cholesky(K_uu + Lam2bar, "R = K_uu + Lam2bar")
    W = tril_solve(L_R, K_us)
    mean = _matvec(W.mT, tril_solve(L_R, lam1bar.unsqueeze(-1)).squeeze(-1))
    if prior_mean_s is not None:
        mean = mean + prior_mean_s
    cov = K_ss - V.mT @ V + W.mT @ W
    return mean, 0.5 * (cov + cov.mT)


def dual_kl(K_uu: Tensor, lam1bar: Tensor, Lam2bar: Tensor) -> Tensor:
    r"""KL eq. 51 (reconstructed):

    .. math::
        \mathrm{KL}(q\Vert p)=\tfrac12\big[\operatorname{tr}(\mathbf R^{-1}\mathbf K_{uu})-M
        +\bar{\boldsymbol\lambda}_1^\top\mathbf R^{-1}\mathbf K_{uu}\mathbf R^{-1}\bar{\boldsymbol\lambda}_1
        +\log\lvert\mathbf R\rvert-\log\lvert\mathbf K_{uu}\rvert\big].
    """
    require_float64(K_uu=K_uu, lam1bar=lam1bar, Lam2bar=Lam2bar)
    R = K_uu + Lam2bar
    L_R = cholesky(R, "R = K_uu + Lam2bar")
    R_inv_lam = _solve(R, lam1bar.unsqueeze(-1)).squeeze(-1)
    trace = torch.diagonal(_solve(R, K_uu), dim1=-2, dim2=-1).sum(-1)
    quadratic = (R_inv_lam * _matvec(K_uu, R_inv_lam)).sum(-1)
    logdet_K = logdet_from_cholesky(cholesky(K_uu, "K_uu"))
    return 0.5 * (trace - K_uu.shape[-1] + quadratic + logdet_from_cholesky(L_R) - logdet_K)


def dual_log_normalizer(K_uu: Tensor, lam1bar: Tensor, Lam2bar: Tensor) -> Tensor:
    r""":math:`\log\mathcal Z=\log\int\mathcal N(\mathbf u\mid\mathbf 0,\mathbf K_{uu})\,t(\mathbf u)\,d\mathbf u` for
    the unnormalized sites :math:`t(\mathbf u)=\exp(\boldsymbol\ell_1^\top\mathbf u-\tfrac12\mathbf u^\top\mathbf L_2
    \mathbf u)` (spec A.2.2):

    .. math::
        \log\mathcal Z=-\tfrac12\big(\log\lvert\mathbf R\rvert-\log\lvert\mathbf K_{uu}\rvert\big)
        +\tfrac12\bar{\boldsymbol\lambda}_1^\top\mathbf R^{-1}\bar{\boldsymbol\lambda}_1.
    """
    require_float64(K_uu=K_uu, lam1bar=lam1bar, Lam2bar=Lam2bar)
    L_R = cholesky(K_uu + Lam2bar, "R = K_uu + Lam2bar")
    c = tril_solve(L_R, lam1bar.unsqueeze(-1)).squeeze(-1)
    logdet_K = logdet_from_cholesky(cholesky(K_uu, "K_uu"))
    return -0.5 * (logdet_from_cholesky(L_R) - logdet_K) + 0.5 * c.square().sum(-1)


def expected_log_site(ell1: Tensor, L2: Tensor, m: Tensor, S: Tensor) -> Tensor:
    r""":math:`\mathbb E_{q}[\log t(\mathbf u)]=\boldsymbol\ell_1^\top\mathbf m
    -\tfrac12\operatorname{tr}\big(\mathbf L_2(\mathbf S+\mathbf m\mathbf m^\top)\big)` for the unnormalized sites."""
    require_float64(ell1=ell1, L2=L2, m=m, S=S)
    second_moment = S + m.unsqueeze(-1) * m.unsqueeze(-2)
    return (ell1 * m).sum(-1) - 0.5 * (L2 * second_moment).sum((-2, -1))


def _normalized_site(K_uu: Tensor, lam1bar: Tensor, Lam2bar: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`(\tilde{\mathbf y},\tilde{\boldsymbol\Sigma})=(\mathbf K_{uu}\bar{\boldsymbol\Lambda}_2^{-1}
    \bar{\boldsymbol\lambda}_1,\mathbf K_{uu}\bar{\boldsymbol\Lambda}_2^{-1}\mathbf K_{uu})`."""
    y_tilde = _matvec(K_uu, _solve(Lam2bar, lam1bar.unsqueeze(-1)).squeeze(-1))
    Sigma_tilde = K_uu @ _solve(Lam2bar, K_uu)
    return y_tilde, 0.5 * (Sigma_tilde + Sigma_tilde.mT)


def normalized_log_normalizer(K_uu: Tensor, lam1bar: Tensor, Lam2bar: Tensor) -> Tensor:
    r"""Paper eq. 41: :math:`\log\mathcal Z=\log\mathcal N(\tilde{\mathbf y}\mid\mathbf 0,\tilde{\boldsymbol\Sigma}
    +\mathbf K_{uu})` for the normalized sites :math:`t(\mathbf u)=\mathcal N(\tilde{\mathbf y}\mid\mathbf u,
    \tilde{\boldsymbol\Sigma})`. Needs an invertible :math:`\bar{\boldsymbol\Lambda}_2` (variant B: summaries fixed).
    """
    require_float64(K_uu=K_uu, lam1bar=lam1bar, Lam2bar=Lam2bar)
    y_tilde, Sigma_tilde = _normalized_site(K_uu, lam1bar, Lam2bar)
    return gaussian_logpdf(y_tilde, torch.zeros_like(y_tilde), Sigma_tilde + K_uu)


def normalized_expected_log_site(K_uu: Tensor, lam1bar: Tensor, Lam2bar: Tensor, m: Tensor, S: Tensor) -> Tensor:
    r""":math:`\mathbb E_q[\log\mathcal N(\tilde{\mathbf y}\mid\mathbf u,\tilde{\boldsymbol\Sigma})]
    =-\tfrac12\big[M\log2\pi+\log\lvert\tilde{\boldsymbol\Sigma}\rvert+\operatorname{tr}(\tilde{\boldsymbol\Sigma}^{-1}
    \mathbf S)+(\tilde{\mathbf y}-\mathbf m)^\top\tilde{\boldsymbol\Sigma}^{-1}(\tilde{\mathbf y}-\mathbf m)\big]`,
    the companion of :func:`normalized_log_normalizer`."""
    require_float64(K_uu=K_uu, lam1bar=lam1bar, Lam2bar=Lam2bar, m=m, S=S)
    y_tilde, Sigma_tilde = _normalized_site(K_uu, lam1bar, Lam2bar)
    L = cholesky(Sigma_tilde, "Sigma_tilde")
    trace = tril_solve(L, cholesky(S, "S")).square().sum((-2, -1))
    maha = tril_solve(L, (y_tilde - m).unsqueeze(-1)).squeeze(-1).square().sum(-1)
    return -0.5 * (K_uu.shape[-1] * LOG_2PI + logdet_from_cholesky(L) + trace + maha)


def bernoulli_expected_loglik(y: Tensor, mean: Tensor, var: Tensor, num_points: int = 100) -> Tensor:
    r""":math:`\mathbb E_{\mathcal N(f\mid\mu,v)}[\log\Phi((2y-1)f)]` (Bernoulli-probit, labels in {0, 1}) by
    ``num_points``-point Gauss-Hermite quadrature with float64 nodes and weights.

    :return: elementwise, the broadcast shape of the inputs (not summed).
    """
    require_float64(y=y, mean=mean, var=var)
    nodes, weights = np.polynomial.hermite_e.hermegauss(num_points)
    nodes = torch.as_tensor(nodes, dtype=mean.dtype, device=mean.device)
    weights = torch.as_tensor(weights / math.sqrt(2.0 * math.pi), dtype=mean.dtype, device=mean.device)
    f = mean.unsqueeze(-1) + var.sqrt().unsqueeze(-1) * nodes
    return (torch.special.log_ndtr((2.0 * y - 1.0).unsqueeze(-1) * f) * weights).sum(-1)


def variational_elbo(
    K_uu: Tensor,
    K_uf: Tensor,
    k_ff_diag: Tensor,
    m: Tensor,
    S: Tensor,
    expected_loglik: ExpectedLogLik,
    prior_mean_f: Tensor | None = None,
) -> Tensor:
    r"""The uncollapsed ELBO of any :math:`q(\mathbf u)=\mathcal N(\mathbf m,\mathbf S)` and likelihood, summed over
    data: :math:`\sum_i\mathrm{VE}_i(\mu_i,v_i)-\mathrm{KL}(q\Vert p)` with the marginals of
    :func:`~tests.oracles.sparse_gp.svgp_marginals`. Differentiable in every argument (for gradient identities)."""
    mean, var = svgp_marginals(K_uu, K_uf, k_ff_diag, m, S, prior_mean_f)
    return expected_loglik(mean, var).sum(-1) - svgp_kl(K_uu, m, S)


def dual_site_targets(
    K_uu: Tensor,
    K_ub: Tensor,
    k_bb_diag: Tensor,
    m: Tensor,
    S: Tensor,
    expected_loglik: ExpectedLogLik,
    prior_mean_b: Tensor | None = None,
    min_curvature: float = 0.0,
) -> tuple[Tensor, Tensor]:
    r"""Natural-gradient targets of the E-step (spec A.3 steps 1-3) at the columns of :math:`\mathbf K_{ub}`:
    :math:`\alpha_i=\partial\mathrm{VE}_i/\partial\mu_i`, :math:`\beta_i=\max(-2\,\partial\mathrm{VE}_i/\partial v_i,
    \beta_{\min})` (by autograd of ``expected_loglik``), :math:`g_{1,i}=\beta_i(\mu_i-\mu_0(x_i))+\alpha_i`,
    :math:`g_{2,i}=\beta_i`.

    :return: ``(g1 (B,), g2 (B,))``.
    """
    mean, var = svgp_marginals(K_uu, K_ub, k_bb_diag, m, S, prior_mean_b)
    mean, var = mean.detach().requires_grad_(True), var.detach().requires_grad_(True)
    with torch.enable_grad():
        alpha, dvar = torch.autograd.grad(expected_loglik(mean, var).sum(), [mean, var])
    beta = (-2.0 * dvar).clamp_min(min_curvature)
    centred_mean = mean.detach() if prior_mean_b is None else mean.detach() - prior_mean_b
    return beta * centred_mean + alpha, beta


def dual_e_step(
    K_uu: Tensor,
    K_ub: Tensor,
    k_bb_diag: Tensor,
    ell1: Tensor,
    L2: Tensor,
    expected_loglik: ExpectedLogLik,
    lr: float,
    scale: float = 1.0,
    prior_mean_b: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""One dense E-step on the u-space sites (spec A.3 step 4) at a batch of :math:`B` points with
    :math:`s=` ``scale`` :math:`=n/B`:

    .. math::
        \boldsymbol\ell_1\leftarrow(1-r)\boldsymbol\ell_1+rs\sum_i\mathbf a_ig_{1,i},\qquad
        \mathbf L_2\leftarrow(1-r)\mathbf L_2+rs\sum_ig_{2,i}\mathbf a_i\mathbf a_i^\top,\qquad
        \mathbf a_i=\mathbf K_{uu}^{-1}\mathbf k_{ui},

    with :math:`q` from :func:`dual_qu_from_sites` and targets from :func:`dual_site_targets`.

    :return: the new ``(ell1, L2)``.
    """
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    g1, g2 = dual_site_targets(K_uu, K_ub, k_bb_diag, m, S, expected_loglik, prior_mean_b)
    A = _solve(K_uu, K_ub)
    new_L2 = (1.0 - lr) * L2 + lr * scale * (A * g2.unsqueeze(-2)) @ A.mT
    return (1.0 - lr) * ell1 + lr * scale * _matvec(A, g1), 0.5 * (new_L2 + new_L2.mT)
