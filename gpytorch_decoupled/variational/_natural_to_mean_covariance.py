from __future__ import annotations

import torch
from linear_operator.utils.errors import NotPSDError
from torch import Tensor

from ..linalg import jittered_cholesky


class _NaturalToMeanCovariance(torch.autograd.Function):
    r"""
    Natural parameters :math:`(\boldsymbol\theta_1, \boldsymbol\Theta_2)` of a Gaussian to its mean
    :math:`\boldsymbol\mu = \mathbf S\boldsymbol\theta_1`, dense covariance :math:`\mathbf S =
    (-2\boldsymbol\Theta_2)^{-1}` and :math:`\log\lvert\mathbf S\rvert`, with one float64 Cholesky factor of the
    precision :math:`\boldsymbol\Lambda = -2\boldsymbol\Theta_2 = \mathbf L\mathbf L^\top`.

    Like GPyTorch's natural distribution, the backward pass returns the gradient with respect to the **expectation**
    parameters :math:`\boldsymbol\eta_1 = \boldsymbol\mu`, :math:`\boldsymbol\eta_2 = \mathbf S +
    \boldsymbol\mu\boldsymbol\mu^\top`, which is the natural gradient (what :class:`gpytorch.optim.NGD` steps along).
    Because the covariance itself is an output, no Cholesky factor has to be differentiated:

    .. math::

        \mathbf G = \operatorname{sym}\frac{\partial\ell}{\partial\mathbf S}
            + \frac{\partial\ell}{\partial\log\lvert\mathbf S\rvert}\,\boldsymbol\Lambda, \qquad
        \frac{\partial\ell}{\partial\boldsymbol\eta_2} = \mathbf G, \qquad
        \frac{\partial\ell}{\partial\boldsymbol\eta_1} = \frac{\partial\ell}{\partial\boldsymbol\mu}
            - 2\mathbf G\boldsymbol\mu,

    an :math:`O(M^2)` backward pass after an :math:`O(M^3)` forward of one factorization and one inverse
    (:math:`\boldsymbol\Lambda` is the matrix actually factorized, jitter included).
    """

    @staticmethod
    def forward(ctx, natural_vec: Tensor, natural_mat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        precision = natural_mat.detach().mul(-2.0).to(torch.float64)
        try:
            factor = jittered_cholesky(precision, name="natural precision -2 natural_mat")
        except NotPSDError as error:
            raise NotPSDError(
                f"{error} The natural parameters no longer describe a Gaussian: natural_mat must stay negative "
                "definite, so train them only with natural-gradient steps (gpytorch.optim.NGD), not Adam."
            ) from error
        covariance = torch.cholesky_inverse(factor)
        mean = (covariance @ natural_vec.detach().to(torch.float64).unsqueeze(-1)).squeeze(-1)
        logdet = -2.0 * factor.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        ctx.save_for_backward(precision, factor, mean)
        dtype = natural_vec.dtype
        if dtype == torch.float64:
            # No ``.to``: torch 2.11's Dynamo gives zero gradients to a Function whose output is ``.to`` of a saved
            # tensor that returns the tensor itself.
            return mean, covariance, logdet
        return mean.to(dtype), covariance.to(dtype), logdet.to(dtype)

    @staticmethod
    def backward(ctx, grad_mean: Tensor, grad_covariance: Tensor, grad_logdet: Tensor) -> tuple[Tensor, Tensor]:
        precision, factor, mean = ctx.saved_tensors
        grad_eta2 = (grad_covariance + grad_covariance.mT).to(torch.float64).mul_(0.5)
        grad_eta2.add_(_factorized_matrix(precision, factor).mul_(grad_logdet.to(torch.float64)[..., None, None]))
        grad_eta1 = grad_mean.to(torch.float64) - 2.0 * (grad_eta2 @ mean.unsqueeze(-1)).squeeze(-1)
        return grad_eta1.to(grad_mean.dtype), grad_eta2.to(grad_mean.dtype)


def _factorized_matrix(matrix: Tensor, factor: Tensor) -> Tensor:
    r"""
    :math:`\mathbf L\mathbf L^\top` in :math:`O(M^2)`: the symmetric matrix of ``matrix``'s lower triangle (all the
    Cholesky factorization reads) plus the jitter :func:`~gpytorch_decoupled.linalg.jittered_cholesky` added, one value
    per batch member, recovered from the diagonal :math:`\sum_k L_{ik}^2 = A_{ii} + \epsilon`.
    """
    diagonal = matrix.diagonal(dim1=-2, dim2=-1)
    jitter = (factor.pow(2).sum(-1) - diagonal).mean(-1)
    symmetric = matrix.tril() + matrix.tril(-1).mT
    symmetric.diagonal(dim1=-2, dim2=-1).add_(jitter.unsqueeze(-1))
    return symmetric
