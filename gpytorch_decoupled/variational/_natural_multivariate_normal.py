from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.distributions.multivariate_normal import kl_mvn_mvn
from linear_operator.operators import DenseLinearOperator, LinearOperator
from torch import Tensor
from torch.distributions.kl import register_kl

from ..linalg import broadcast_shapes


class _NaturalMultivariateNormal(MultivariateNormal):
    r"""
    A :class:`~gpytorch.distributions.MultivariateNormal` with a dense covariance that also carries its
    :math:`\log\lvert\mathbf S\rvert`, computed with the covariance from one Cholesky factor of the precision, so that
    the KL divergence to any Gaussian prior needs no factorization of :math:`\mathbf S`.

    Built by :class:`~gpytorch_decoupled.variational.FastNaturalVariationalDistribution`. Anything GPyTorch rebuilds
    from it with ``self.__class__(mean, covariance)`` (expansion, indexing) has no stored log-determinant and uses
    GPyTorch's generic KL.
    """

    def __init__(
        self,
        mean: Tensor,
        covariance_matrix: Tensor | LinearOperator,
        validate_args: bool = False,
        covariance_logdet: Tensor | None = None,
    ):
        if not isinstance(covariance_matrix, LinearOperator):
            covariance_matrix = DenseLinearOperator(covariance_matrix)
        super().__init__(mean, covariance_matrix, validate_args=validate_args)
        self.covariance_logdet = covariance_logdet


@register_kl(_NaturalMultivariateNormal, MultivariateNormal)
def _kl_natural_mvn(q: _NaturalMultivariateNormal, p: MultivariateNormal) -> Tensor:
    r"""
    :math:`\mathrm{KL}[\mathcal N(\boldsymbol\mu, \mathbf S) \Vert \mathcal N(\mathbf m, \mathbf K)] = \tfrac12\big(
    \operatorname{tr}(\mathbf K^{-1}\mathbf S) + (\mathbf m - \boldsymbol\mu)^\top\mathbf K^{-1}(\mathbf m -
    \boldsymbol\mu) - M + \log\lvert\mathbf K\rvert - \log\lvert\mathbf S\rvert\big)` with the stored
    :math:`\log\lvert\mathbf S\rvert` and one solve with the prior's (linear-operator) covariance: for the whitened
    prior :math:`\mathbf K = \mathbf I` of GPyTorch's strategies, an :math:`O(M^2)` computation.
    """
    if q.covariance_logdet is None:
        return kl_mvn_mvn(q, p)
    # The prior may carry batch dimensions that q lacks (an unwhitened strategy's prior at inducing points expanded to
    # the data's batch shape), so both sides are broadcast before they are stacked.
    batch_shape = broadcast_shapes(q.batch_shape, p.batch_shape)
    difference = (p.mean - q.mean).expand(*batch_shape, -1)
    covariance = q.lazy_covariance_matrix.to_dense().expand(*batch_shape, -1, -1)
    solved = p.lazy_covariance_matrix.solve(torch.cat([difference.unsqueeze(-1), covariance], dim=-1))
    trace = solved[..., 1:].diagonal(dim1=-2, dim2=-1).sum(-1)
    quadratic = (difference * solved[..., 0]).sum(-1)
    logdet_ratio = p.lazy_covariance_matrix.logdet() - q.covariance_logdet
    kl = 0.5 * (trace + quadratic - difference.size(-1) + logdet_ratio)
    return kl.expand(batch_shape)
