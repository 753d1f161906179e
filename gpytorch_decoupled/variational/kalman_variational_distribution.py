from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.distributions import MultivariateNormal
from torch import Tensor

from ..gpytorch_compat import VariationalDistributionBase

_STATE_BUFFERS = ("information_vector", "information_matrix", "bound", "num_observed")


class KalmanVariationalDistribution(VariationalDistributionBase):
    r"""
    What a :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` has absorbed: the data part of its
    information-form state in the transformed coordinates :math:`\tilde{\mathbf u} = \mathbf K_{\mathbf{uu}}^{-1}
    \mathbf u` (``information_vector`` :math:`\tilde{\boldsymbol\eta} = \sum_k \mathbf K_{\mathbf uk}\mathbf V_k^{-1}
    \mathbf y_k`, ``information_matrix`` :math:`\tilde{\boldsymbol\Lambda} - \mathbf K_{\mathbf{uu}} = \sum_k
    \mathbf K_{\mathbf uk}\mathbf V_k^{-1}\mathbf K_{k\mathbf u}`), the running bound :math:`\sum_k\psi_k` and the
    number of points absorbed (Schuerch et al. 2020, Sec. 3.2; :ref:`derivations-information-form`).

    It takes the variational-distribution slot of GPyTorch's strategy constructors, ``strategy_cls(model,
    inducing_points, variational_distribution, ...)``, so that the strategy is built as any other (also by
    :class:`gpytorch.test.VariationalTestCase` and BoTorch). It has no parameters (nothing here is trained by
    gradients), only buffers, which round-trip through ``state_dict``. They stay float64 whatever dtype the model is
    converted to (``.to(device)`` moves them), so that a stream survives ``model.float()`` and back unchanged. All
    zeros is the prior.

    :param num_inducing_points: Number :math:`M` of inducing points.
    :param batch_shape: Batch shape of independent latents.

    Example:
        >>> from gpytorch_decoupled.variational import KalmanVariationalDistribution
        >>> state = KalmanVariationalDistribution(num_inducing_points=20, batch_shape=torch.Size([2]))
        >>> state.information_vector.shape, state.information_matrix.dtype, int(state.num_observed)
        (torch.Size([2, 20]), torch.float64, 0)
    """

    def __init__(self, num_inducing_points: int, batch_shape: torch.Size = torch.Size([])):
        super().__init__(num_inducing_points=num_inducing_points, batch_shape=batch_shape)
        f64 = torch.float64
        self.register_buffer("information_vector", torch.zeros(*batch_shape, num_inducing_points, dtype=f64))
        matrix = torch.zeros(*batch_shape, num_inducing_points, num_inducing_points, dtype=f64)
        self.register_buffer("information_matrix", matrix)
        self.register_buffer("bound", torch.zeros(batch_shape, dtype=f64))
        self.register_buffer("num_observed", torch.zeros((), dtype=torch.long))

    @property
    def device(self) -> torch.device:
        return self.information_vector.device

    @property
    def dtype(self) -> torch.dtype:
        return self.information_vector.dtype

    def forward(self) -> tuple[Tensor, Tensor]:
        return self.information_vector, self.information_matrix

    def initialize_variational_distribution(self, prior_dist: MultivariateNormal) -> None:
        """All zeros is already the prior, at any hyperparameters."""

    @torch.no_grad()
    def reset(self) -> None:
        for name in _STATE_BUFFERS:
            getattr(self, name).zero_()

    @torch.no_grad()
    def absorb(self, information_vector: Tensor, information_matrix: Tensor, bound: Tensor, count: int) -> None:
        """Adds one mini-batch's (finite, already validated) increments; nothing here can fail half-way."""
        self.information_vector.add_(information_vector)
        self.information_matrix.add_(information_matrix)
        self.bound.add_(bound)
        self.num_observed.add_(count)

    def add_fantasy(self, information_vector: Tensor, information_matrix: Tensor, bound: Tensor, count: int) -> None:
        """Adds a fantasy's (finite, already validated) increments out of place, keeping their autograd graph (BoTorch
        differentiates acquisition values through fantasies). Increments with batch dimensions beyond the state's (a
        sample batch of targets) enlarge its batch shape: each sum has its own broadcast shape, so that the matrix
        keeps the batch shape of the inputs."""
        sums = {
            "information_vector": self.information_vector + information_vector,
            "information_matrix": self.information_matrix + information_matrix,
            "bound": self.bound + bound,
        }
        for name, value in sums.items():
            setattr(self, name, value)
        self.num_observed.add_(count)
        self.batch_shape = torch.broadcast_shapes(self.batch_shape, sums["bound"].shape)

    def _apply(self, fn: Callable[[Tensor], Tensor], *args, **kwargs):
        saved = {name: self._buffers[name] for name in _STATE_BUFFERS}
        result = super()._apply(fn, *args, **kwargs)
        for name, value in saved.items():
            # Take the device of the converted buffer, but keep the float64 values themselves.
            self._buffers[name] = value.to(device=self._buffers[name].device)
        return result
