#!/usr/bin/env python3

from __future__ import annotations

import torch  # noqa: F401 (the example's namespace)
from torch import Tensor

from .diagonal import identity_like
from .triangular import cholesky_logdet, solve_lower


def whitened_kl(
    precision_cholesky: Tensor,  # shape: (*batch, M, M)
    mean: Tensor | None = None,  # shape: (*batch, M)
) -> Tensor:  # shape: (*batch)
    r"""
    The KL divergence of a Gaussian given by the Cholesky factor :math:`\mathbf R` of its precision
    :math:`\mathbf H = \mathbf R\mathbf R^\top` from the standard normal (the whitened prior):

    .. math::

        \mathrm{KL}[\mathcal N(\mathbf m, \mathbf H^{-1}) \Vert \mathcal N(\mathbf 0, \mathbf I)]
        = \tfrac12\big[\operatorname{tr}(\mathbf H^{-1}) + \mathbf m^\top\mathbf m - M + \log\lvert\mathbf H\rvert\big],

    with :math:`\operatorname{tr}(\mathbf H^{-1}) = \lVert\mathbf R^{-1}\rVert_F^2` (one triangular solve,
    :math:`O(M^3)`). It is the KL of the dual (t-SVGP) :math:`q(\mathbf u)` in whitened coordinates, where
    :math:`\mathbf H = \mathbf I + \mathbf L_K^\top\mathbf L_2\mathbf L_K` (`Adam et al. (2021)`_, eq. 51), and the
    covariance part of the decoupled KL (``mean=None``), where :math:`\mathbf H = \mathbf I +
    \mathbf L_B^\top\mathbf K_\beta\mathbf L_B` (`Cheng & Boots (2017)`_, App. B.1.1, Theorem 1): both factor only
    :math:`\mathbf H \succeq \mathbf I`.

    :param precision_cholesky: Lower Cholesky factor :math:`\mathbf R` of the precision (positive diagonal).
    :param mean: The mean :math:`\mathbf m`; ``None`` for a zero mean.
    :return: The KL divergence, one value per batch member, in the dtype of :attr:`precision_cholesky`.

    Example:
        >>> H = torch.tensor([[2.0, 0.5], [0.5, 1.5]], dtype=torch.float64)
        >>> m = torch.tensor([0.3, -0.2], dtype=torch.float64)
        >>> q = torch.distributions.MultivariateNormal(m, precision_matrix=H)
        >>> p = torch.distributions.MultivariateNormal(torch.zeros(2, dtype=torch.float64), torch.eye(2).double())
        >>> torch.allclose(whitened_kl(torch.linalg.cholesky(H), m), torch.distributions.kl_divergence(q, p))
        True

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """
    size = precision_cholesky.size(-1)
    trace_inverse = solve_lower(precision_cholesky, identity_like(precision_cholesky)).pow(2).sum((-2, -1))
    terms = trace_inverse if mean is None else trace_inverse + mean.pow(2).sum(-1)
    return 0.5 * (terms - size + cholesky_logdet(precision_cholesky))
