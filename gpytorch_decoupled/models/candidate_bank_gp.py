from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.means import ConstantMean
from gpytorch.models import ApproximateGP
from gpytorch.variational import (
    CholeskyVariationalDistribution,
    UnwhitenedVariationalStrategy,
    VariationalStrategy,
)
from torch import Tensor

from ..gpytorch_compat import VariationalStrategyBase
from ..kernels import CandidateKernelBank

StrategyFactory = Callable[[ApproximateGP, Tensor, int], VariationalStrategyBase]


class CandidateBankGP(ApproximateGP):
    r"""
    The :math:`C` sparse variational sub-models of VBKS as one batched GPyTorch model: latent :math:`c` of the batch
    has its own constant mean, the :math:`c`-th kernel of a
    :class:`~gpytorch_decoupled.kernels.CandidateKernelBank`, and its own :math:`q(u_c)`; the inducing inputs
    :math:`Z` are shared. Calling it on inputs ``(n, d)`` returns a :class:`~gpytorch.distributions.MultivariateNormal`
    with batch shape ``(C,)``: one kernel evaluation and one batched Cholesky for all candidates, not a Python loop.

    :param kernel: The candidate kernels.
    :param inducing_points: :math:`Z`, shape ``(M, d)``.
    :param variational_strategy: ``factory(model, inducing_points, num_candidates)`` returning the variational
        strategy (any strategy of this package or GPyTorch that supports a batch of independent latents); by default
        GPyTorch's whitened SVGP with a full-covariance :math:`q(u_c)`, as the reference code.
    :param whitened: Default strategy only: whitened (GPyTorch ``VariationalStrategy``) or unwhitened (needed when the
        hyperparameters get a posterior: :ref:`derivations-vbks-whitening`).
    :param learn_inducing_locations: Default strategy only: whether :math:`Z` is trained (the reference keeps it
        fixed).
    """

    def __init__(
        self,
        kernel: CandidateKernelBank,
        inducing_points: Tensor,
        variational_strategy: StrategyFactory | None = None,
        whitened: bool = True,
        learn_inducing_locations: bool = False,
    ):
        num_candidates = kernel.batch_shape[0]
        if variational_strategy is None:
            strategy_class = VariationalStrategy if whitened else UnwhitenedVariationalStrategy
            distribution = CholeskyVariationalDistribution(
                inducing_points.size(-2), batch_shape=torch.Size([num_candidates])
            )
            strategy = strategy_class(
                self, inducing_points, distribution, learn_inducing_locations=learn_inducing_locations
            )
        else:
            strategy = variational_strategy(self, inducing_points, num_candidates)
        super().__init__(strategy)
        self.mean_module = ConstantMean(batch_shape=torch.Size([num_candidates]))
        self.covar_module = kernel

    def forward(self, x: Tensor) -> MultivariateNormal:
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))
