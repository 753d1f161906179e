from __future__ import annotations

from typing import NamedTuple

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import LinearOperator
from torch import Tensor

from ..linalg import LeanKernel, broadcast_shapes


class JointPrior(NamedTuple):
    r"""
    The prior at stacked input sets :math:`[\mathbf X_0; \mathbf X_1; \ldots]`, as :func:`joint_prior` returns it,
    with its blocks addressed by the index of the input set: ``covariance(0, 1)`` is :math:`\mathbf K_{01}`, lazy (for
    a GPyTorch kernel, evaluating only that block), ``dense(0, 1)`` the same block evaluated, ``diagonal(1)`` the
    prior variances at :math:`\mathbf X_1`, and ``mean(1)`` the prior mean at :math:`\mathbf X_1`.

    Where the model's covariance is the lazy block of a kernel that :class:`~gpytorch_decoupled.linalg.LeanKernel`
    supports (``covar_module(x)`` of a [scaled] RBF or Matérn kernel), :meth:`dense` and :meth:`diagonal` evaluate it
    in plain tensor operations, with GPyTorch's values and gradients and without its lazy-tensor and kernel-call
    layers; otherwise through the lazy covariance.
    """

    distribution: MultivariateNormal | None  # the model's prior at the stacked inputs (None: of_kernel)
    sizes: tuple[int, ...]  # the number of rows of each input set
    lean: tuple[LeanKernel, Tensor, Tensor] | None = None  # LeanKernel.of_block of the covariance

    @classmethod
    def of_kernel(cls, kernel: LeanKernel, *inputs: Tensor) -> JointPrior:
        r"""The covariance blocks and variances of a prior with the lean ``kernel`` at the stacked input sets (the
        values :meth:`dense` and :meth:`diagonal` return for a model whose ``forward`` is that kernel's prior), without
        evaluating the model: what the lean training step uses where :func:`joint_prior` would call ``model.forward``.
        It has no distribution: :meth:`covariance` and :meth:`mean` are not available."""
        stacked = _stacked(inputs)
        return cls(None, tuple(x.size(-2) for x in inputs), (kernel, stacked, stacked))

    def _rows(self, index: int | slice) -> slice:
        """The rows of the stacked inputs of one input set or of a range of consecutive ones."""
        blocks = range(len(self.sizes))[index] if isinstance(index, slice) else range(index, index + 1)
        start = sum(self.sizes[: blocks.start])
        return slice(start, start + sum(self.sizes[blocks.start : blocks.stop]))

    def covariance(self, rows: int | slice, columns: int | slice) -> LinearOperator:
        """The (lazy) prior covariance between input sets ``rows`` and ``columns`` (an index, or a slice of consecutive
        input sets, e.g. ``slice(0, 2)`` for :math:`[\\mathbf X_0; \\mathbf X_1]`)."""
        row_slice, column_slice = self._rows(rows), self._rows(columns)
        covariance = self.distribution.lazy_covariance_matrix
        if row_slice == column_slice == slice(0, sum(self.sizes)):
            return covariance  # the whole block: slicing a lazy kernel block costs more than its tile sweep
        return covariance[..., row_slice, column_slice]

    def dense(self, rows: int | slice, columns: int | slice) -> Tensor:
        """:meth:`covariance` evaluated, ``(..., n_rows, n_columns)``."""
        if self.lean is None:
            return self.covariance(rows, columns).to_dense()
        kernel, x1, x2 = self.lean
        row_slice, column_slice = self._rows(rows), self._rows(columns)
        left = x1[..., row_slice, :]
        # A diagonal block of a symmetric covariance is symmetric (GPyTorch zeroes the rounding residual of its
        # diagonal distances where no gradient is taken, as the lean kernel does for identical arguments).
        right = left if x1 is x2 and row_slice == column_slice else x2[..., column_slice, :]
        return kernel(left, right)

    def diagonal(self, rows: int | slice) -> Tensor:
        """The prior variances at input set ``rows``, the diagonal of ``covariance(rows, rows)``, ``(..., n_rows)``."""
        if self.lean is not None and self.lean[1] is self.lean[2]:
            kernel, x1, _ = self.lean
            return kernel.diagonal(x1[..., self._rows(rows), :])
        return self.covariance(rows, rows).diagonal(dim1=-2, dim2=-1)

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
    distribution = model.forward(_stacked(inputs), **kwargs)
    lean = LeanKernel.of_block(distribution.lazy_covariance_matrix)
    return JointPrior(distribution, tuple(x.size(-2) for x in inputs), lean)


def _stacked(inputs: tuple[Tensor, ...]) -> Tensor:
    """The input sets stacked along the rows, ``(..., sum n_i, D)``, their batch dimensions broadcast."""
    batch_shape = broadcast_shapes(*(x.shape[:-2] for x in inputs))
    return torch.cat([x.expand(*batch_shape, *x.shape[-2:]) for x in inputs], dim=-2)
