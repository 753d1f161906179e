r"""KL between two Gaussian processes restricted to a finite input domain (the spec's "dense" / "process" KL).

On a finite domain :math:`D=\{x_1,\dots,x_n\}` a GP is just the Gaussian vector
:math:`f_D\sim\mathcal N(\mathbf m_D,\mathbf S_D)`, so :math:`\mathrm{KL}[q\Vert p]` restricted to :math:`D` is an
ordinary :math:`n`-dimensional KL (spec ``decoupled_orthogonal.md`` §7).

**Why it equals the sparse KL when** :math:`Z\subseteq D`. A sparse variational process has the form
:math:`q(f)=q(\mathbf u)\,p(f_{\neg u}\mid\mathbf u)` with :math:`\mathbf u=f(Z)` for a finite set :math:`Z`: it moves
only the inducing variables and keeps the prior conditional elsewhere (for SVGP, :math:`Z` is the inducing inputs;
for the decoupled models, the union of the mean and covariance bases, spec §7). Split
:math:`f_D=(\mathbf u,\mathbf r)`. The chain rule of KL gives

.. math::
    \mathrm{KL}[q(f_D)\Vert p(f_D)]=\mathrm{KL}[q(\mathbf u)\Vert p(\mathbf u)]
    +\mathbb E_{q(\mathbf u)}\mathrm{KL}[p(\mathbf r\mid\mathbf u)\Vert p(\mathbf r\mid\mathbf u)]
    =\mathrm{KL}[q(\mathbf u)\Vert p(\mathbf u)],

since both conditionals are the same prior conditional. The same argument on any larger domain shows that the value
does not depend on which extra points :math:`D` holds; it is the KL between the processes (Matthews et al. 2016). If
:math:`Z\not\subseteq D`, the data-processing inequality gives only
:math:`\mathrm{KL}[q(f_D)\Vert p(f_D)]\le\mathrm{KL}[q(\mathbf u)\Vert p(\mathbf u)]`, so a test grid must contain every
inducing point.

**Numerics: Cholesky whitening by p, then an eigendecomposition.** With
:math:`\mathbf L_p\mathbf L_p^\top=\mathbf S_p+\epsilon\mathbf I` and the eigenvalues :math:`\lambda_i` of
:math:`\mathbf A=\mathbf L_p^{-1}(\mathbf S_q+\epsilon\mathbf I)\mathbf L_p^{-\top}`,

.. math::
    \mathrm{KL}=\tfrac12\Big[\sum_{i=1}^n(\lambda_i-1-\log\lambda_i)
    +\lVert\mathbf L_p^{-1}(\mathbf m_q-\mathbf m_p)\rVert^2\Big].

Every summand is non-negative, so the large terms :math:`\operatorname{tr}`, :math:`\log\det` and :math:`n` never
cancel against each other. On a grid where :math:`q` is the prior conditional almost everywhere, most
:math:`\lambda_i\approx1` and each adds :math:`\approx(\lambda_i-1)^2/2`, not :math:`O(\epsilon_{\rm mach}\kappa)`
roundoff.

**Jitter.** The same :math:`\epsilon` is added to **both** covariances. In the sparse case the exact precisions differ
only in the ``u`` block, :math:`\boldsymbol\Lambda_q-\boldsymbol\Lambda_p=
\operatorname{blkdiag}(\mathbf S^{-1}-\mathbf K_{uu}^{-1},\mathbf 0)`, hence

.. math::
    \frac{\partial\,\mathrm{KL}}{\partial\epsilon}\Big|_{\epsilon=0}
    =-\tfrac12\operatorname{tr}\big[(\mathbf S^{-1}-\mathbf K_{uu}^{-1})\,\mathbf S\,
    (\mathbf S^{-1}-\mathbf K_{uu}^{-1})\big]:

the bias is :math:`O(\epsilon)` times a quantity of the inducing block only, not of the grid's condition number.
``jitter=0`` (the default) is exact; measured on SE kernels it gives ~1e-14 relative error up to
:math:`\kappa(\mathbf K_{DD})\approx10^{8}`. Denser grids (:math:`\kappa\approx10^{17}`, where the plain Cholesky fails)
need :math:`\epsilon\approx10^{-10}` times the kernel scale, which gave ~1e-9 relative error.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import cholesky, require_float64, tril_solve

__all__ = ["process_kl"]


def process_kl(m_q: Tensor, S_q: Tensor, m_p: Tensor, S_p: Tensor, jitter: float = 0.0) -> Tensor:
    r"""KL between two Gaussians on a finite domain, robust to nearly singular covariances.

    .. math::
        \mathrm{KL}\big[\mathcal N(\mathbf m_q,\mathbf S_q+\epsilon\mathbf I)\,\Vert\,
        \mathcal N(\mathbf m_p,\mathbf S_p+\epsilon\mathbf I)\big],

    evaluated through the eigenvalues of the :math:`p`-whitened :math:`q` covariance (see the module docstring).

    :param m_q: ``(..., n)`` mean of :math:`q` on the domain.
    :param S_q: ``(..., n, n)`` covariance of :math:`q` on the domain.
    :param m_p: ``(..., n)`` mean of :math:`p` (the prior mean on the domain, usually zeros).
    :param S_p: ``(..., n, n)`` covariance of :math:`p` (the prior kernel matrix :math:`\mathbf K_{DD}`).
    :param jitter: :math:`\epsilon\ge0`, added to both covariances.
    :raises ValueError: if :math:`\mathbf S_p+\epsilon\mathbf I` is not positive definite or the whitened :math:`q`
        covariance has a non-positive eigenvalue.
    """
    require_float64(m_q=m_q, S_q=S_q, m_p=m_p, S_p=S_p)
    if jitter < 0:
        raise ValueError(f"jitter must be non-negative, got {jitter}")
    eye = torch.eye(S_p.shape[-1], dtype=S_p.dtype, device=S_p.device)
    L_p = cholesky(S_p + jitter * eye, "S_p + jitter I")
    A = tril_solve(L_p, tril_solve(L_p, S_q + jitter * eye).mT)
    eigvals = torch.linalg.eigvalsh(0.5 * (A + A.mT))
    if bool((eigvals <= 0).any()):
        raise ValueError("q covariance is not positive definite relative to p; increase the jitter")
    delta = eigvals - 1.0
    # log1p keeps (delta - log(1 + delta)) ~ delta^2/2 accurate for the many eigenvalues close to one.
    cov_part = (delta - torch.log1p(delta)).sum(-1)
    maha = tril_solve(L_p, (m_q - m_p).unsqueeze(-1)).squeeze(-1).square().sum(-1)
    return 0.5 * (cov_part + maha)
