from __future__ import annotations

from typing import NamedTuple

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import LinearOperator
from torch import Tensor


class JointPrior(NamedTuple):
    r"""
    The prior at stacked input sets :math:`[\mathbf X_0; \mathbf X_1; \ldots]`, as :func:`joint_prior` returns it,
    with its blocks addressed by the index of the input set: ``covariance(0, 1)`` is :math:`\mathbf K_{01}`, lazy (for
    a GPyTorch kernel, evaluating only that block), and ``mean(1)`` the prior mean at :math:`\mathbf X_1`.
    """

    distribution: MultivariateNormal  # the model's prior at the stacked inputs
    sizes: tuple[int, ...]  # the number of rows of each input set

    def _rows(self, index: int | slice) -> slice:
        """The rows of the stacked inputs of one input set or of a range of consecutive ones."""
        blocks = range(len(self.sizes))[index] if isinstance(index, slice) else range(index, index + 1)
        start = sum(self.sizes[: blocks.start])
        return slice(start, start + sum(self.sizes[blocks.start : blocks.stop]))

    def covariance(self, rows: int | slice, columns: int | slice) -> LinearOperator:
        """The (lazy) prior covariance between input sets ``rows`` and ``columns`` (an index, or a slice of consecutive
        input sets, e.g. ``slice(0, 2)`` for :math:`[\\mathbf X_0; \\mathbf X_1]`)."""
        return self.distribution.lazy_covariance_matrix[..., self._rows(rows), self._rows(columns)]

    def mean(self, rows: int | slice) -> Tensor:
        """The prior mean at input set ``rows`` (an index, or a slice of consecutive input sets)."""
        return self.distribution.mean[..., self._rows(rows)]


def joint_prior(model: torch.nn.Module, *inputs: Tensor, **kwargs) -> JointPrior:
    r"""
    One evaluation of the model's prior at the stacked input sets :math:`[\mathbf X_0; \mathbf X_1; \ldots]`: what
    every strategy of this package does to get :math:`\mathbf K_{\mathbf{uu}}`, :math:`\mathbf K_{\mathbf u\mathbf x}`,
    :math:`\mathbf K_{\mathbf{xx}}` and the prior mean from one call of ``model.forward`` (as GPyTorch's
    :class:`~gpytorch.variational.VariationalStrategy` does), so that a kernel is evaluated once per step and only in
    the blocks that are used. The batch dimensions of the input sets broadcast; ``kwargs`` go to ``model.forward``.

    :param model: The model whose ``forward`` gives the prior (typically the :class:`~gpytorch.models.ApproximateGP`).
    :param inputs: The input sets, ``(..., n_i, D)``.
    :return: The :class:`JointPrior`, whose blocks are addressed by the position of the input set.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import joint_prior
        >>> class Prior(gpytorch.models.ApproximateGP):
        ...     def __init__(self):
        ...         super().__init__(None)
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(torch.zeros_like(x[..., 0]), self.covar_module(x))
        >>> model, z, x = Prior(), torch.randn(5, 1), torch.randn(3, 1)
        >>> prior = joint_prior(model, z, x)
        >>> prior.covariance(0, 1).shape, prior.mean(1).shape
        (torch.Size([5, 3]), torch.Size([3]))
        >>> torch.allclose(prior.covariance(0, 1).to_dense(), model.covar_module(z, x).to_dense())
        True
    """
    batch_shape = torch.broadcast_shapes(*(x.shape[:-2] for x in inputs))
    stacked = torch.cat([x.expand(*batch_shape, *x.shape[-2:]) for x in inputs], dim=-2)
    return JointPrior(model.forward(stacked, **kwargs), tuple(x.size(-2) for x in inputs))
