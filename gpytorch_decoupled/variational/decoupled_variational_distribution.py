from __future__ import annotations

from typing import NamedTuple

import torch
from gpytorch.distributions import MultivariateNormal
from torch import Tensor

from ..gpytorch_compat import VariationalDistributionBase


class DecoupledVariationalParameters(NamedTuple):
    r"""What a :class:`DecoupledVariationalDistribution` returns: :math:`\mathbf a` and the lower-triangular
    :math:`\mathbf L_B`."""

    mean_coefficients: Tensor
    precision_factor: Tensor


class DecoupledVariationalDistribution(VariationalDistributionBase):
    r"""
    Variational parameters of the decoupled (SVDGP) basis of `Cheng & Boots (2017)`_, for
    :class:`~gpytorch_decoupled.variational.DecoupledVariationalStrategy`: mean coefficients :math:`\mathbf a`
    (``mean_coefficients``, one per mean basis point :math:`\alpha`) and a lower-triangular factor :math:`\mathbf L_B`
    (``precision_factor``, one row and column per covariance basis point :math:`\beta`) of

    .. math::

        \mathbf B = \mathbf L_B \mathbf L_B^\top \succeq 0, \qquad
        \mu = \Psi_\alpha \mathbf a, \qquad \Sigma = (I + \Psi_\beta \mathbf B \Psi_\beta^\top)^{-1}

    in the RKHS of the prior: :math:`\mathbf B` adds to the prior precision, so the posterior variance never exceeds
    the prior's, and :math:`\mathbf B = \mathbf 0` is the prior covariance. :math:`\mathbf L_B` is unconstrained
    (only its lower triangle is read, and :math:`\mathbf B` may be singular). It starts near zero, as the paper's
    reference code does: exactly zero would be a saddle point of the ELBO in :math:`\mathbf L_B`.

    There is no natural gradient of both blocks together for this parametrization (Salimbeni et al. 2018, App. C.1;
    :ref:`derivations-decoupled-natural-gradient`); :class:`~gpytorch_decoupled.optim.MeanBasisAdam` steps
    :math:`\mathbf a` and :math:`\mathbf B` block by block (:ref:`derivations-decoupled-step`).

    :param num_mean_points: Size :math:`M_\alpha` of the mean basis.
    :param num_inducing_points: Size :math:`M_\beta` of the covariance basis.
    :param batch_shape: Batch shape of independent latents.
    :param mean_init_std: Standard deviation of the initial :math:`\mathbf a` around 0.
    :param precision_init_std: Standard deviation of the initial lower-triangular entries of :math:`\mathbf L_B`.

    Example:
        >>> from gpytorch_decoupled.variational import DecoupledVariationalDistribution
        >>> q = DecoupledVariationalDistribution(num_mean_points=1000, num_inducing_points=50)
        >>> q().mean_coefficients.shape, q().precision_factor.shape
        (torch.Size([1000]), torch.Size([50, 50]))

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """

    def __init__(
        self,
        num_mean_points: int,
        num_inducing_points: int,
        batch_shape: torch.Size = torch.Size([]),
        mean_init_std: float = 1e-3,
        precision_init_std: float = 1e-3,
    ):
        super().__init__(num_inducing_points=num_inducing_points, batch_shape=batch_shape, mean_init_std=mean_init_std)
        self.num_mean_points = num_mean_points
        self.precision_init_std = precision_init_std
        self.register_parameter("mean_coefficients", torch.nn.Parameter(torch.zeros(*batch_shape, num_mean_points)))
        self.register_parameter(
            "precision_factor", torch.nn.Parameter(torch.zeros(*batch_shape, num_inducing_points, num_inducing_points))
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        r"""Starts again near the prior: :math:`\mathbf a \approx \mathbf 0`, :math:`\mathbf B \approx \mathbf 0`."""
        with torch.no_grad():
            self.mean_coefficients.normal_(0.0, self.mean_init_std)
            self.precision_factor.copy_(torch.randn_like(self.precision_factor).tril() * self.precision_init_std)

    def forward(self) -> DecoupledVariationalParameters:
        return DecoupledVariationalParameters(self.mean_coefficients, self.precision_factor.tril())

    def initialize_variational_distribution(self, prior_dist: MultivariateNormal) -> None:
        self.reset_parameters()
