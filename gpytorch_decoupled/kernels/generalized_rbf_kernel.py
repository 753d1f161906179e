from __future__ import annotations

import math

import torch
from gpytorch import settings
from gpytorch.kernels import Kernel
from torch import Tensor

from ..linalg import floored_exp


class GeneralizedRBFKernel(Kernel):
    r"""
    The generalised SE-ARD kernel of `Cheng & Boots (2017)`_ (eq. 19), in which every variational basis function
    :math:`\mathbf z` carries its own length-scales :math:`l_{\mathbf z,d} = s_d\, c_{\mathbf z,d}` (multipliers
    :math:`c_{\mathbf z,d} > 0`), while data points have :math:`c = 1`:

    .. math::

       \begin{equation*}
          k(\mathbf z, \mathbf z') = \prod_{d=1}^D \left( \frac{2\, l_{\mathbf z,d}\, l_{\mathbf z',d}}
          {l_{\mathbf z,d}^2 + l_{\mathbf z',d}^2} \right)^{1/2}
          \exp\left( -\frac{(z_d - z'_d)^2}{l_{\mathbf z,d}^2 + l_{\mathbf z',d}^2} \right).
       \end{equation*}

    With :math:`c \equiv 1` it is exactly :class:`gpytorch.kernels.RBFKernel` with ARD length-scales :math:`s_d`.
    It is a product of one-dimensional Gibbs kernels and hence positive semi-definite jointly over data and basis
    points; its diagonal is 1.

    Where a basis point takes part, values below about :math:`10^{-30}` in float32 (:math:`10^{-246}` in float64) are
    raised to that floor (:func:`~gpytorch_decoupled.linalg.exponent_floor`) and have no gradient, as in every kernel
    product of this package: smaller ones would be subnormal numbers, many times slower to compute with (a float32
    block of 256 data points against 1,000 basis points with learned multipliers, D = 8, length-scales 0.3: 7-8 ms
    without the floor, 1.7-2.2 ms with it). Between data points alone the values are
    :class:`gpytorch.kernels.RBFKernel`'s.

    The multipliers travel as trailing input columns. An input row of width :math:`D` is a data point
    (:math:`c = 1`); a row of width :math:`2D` is a basis point :math:`[\mathbf z, \log \mathbf c]`, so any real
    log-multiplier is valid and a learned inducing-point tensor of shape :math:`M \times 2D` learns locations and
    multipliers together (build one with :meth:`basis_points`). Direct calls accept inputs of different widths (rows of
    width :math:`D` get :math:`\log c = 0`); wrappers such as :class:`gpytorch.kernels.ScaleKernel` require equal
    widths, so pad data points with :meth:`basis_points` there.

    .. note::

        This kernel does not have an `outputscale` parameter. To add a scaling parameter :math:`\rho^2`,
        decorate this kernel with a :class:`gpytorch.kernels.ScaleKernel`.

    :param ard_num_dims: The data dimension :math:`D` (required: it tells data rows from basis rows).
    :param kwargs: Passed to :class:`gpytorch.kernels.Kernel` (`batch_shape`, `lengthscale_prior`,
        `lengthscale_constraint`). `active_dims` is not supported.

    :ivar torch.Tensor lengthscale: The shared length-scales :math:`s_d`, of shape `(*batch_shape, 1, D)`.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.kernels import GeneralizedRBFKernel
        >>> kernel = GeneralizedRBFKernel(ard_num_dims=3)
        >>> x = torch.randn(10, 3)  # data points, c = 1
        >>> z = GeneralizedRBFKernel.basis_points(torch.randn(4, 3), multipliers=torch.full((4, 3), 2.0))
        >>> kernel(x, z).shape
        torch.Size([10, 4])
        >>> covar_module = gpytorch.kernels.ScaleKernel(kernel)
        >>> covar_module(GeneralizedRBFKernel.basis_points(x), z).shape
        torch.Size([10, 4])
        >>> kernel(z, diag=True)
        tensor([1., 1., 1., 1.], grad_fn=<ExpBackward0>)

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """

    has_lengthscale = True

    def __init__(self, ard_num_dims: int | None = None, **kwargs):
        if ard_num_dims is None:
            raise ValueError(
                "GeneralizedRBFKernel needs ard_num_dims, the data dimension D (basis rows have width 2D)."
            )
        if kwargs.get("active_dims") is not None:
            raise ValueError("GeneralizedRBFKernel does not support active_dims; select the columns before calling it.")
        super().__init__(ard_num_dims=ard_num_dims, **kwargs)

    @property
    def data_dim(self) -> int:
        """The data dimension :math:`D`: data rows have width :math:`D`, basis rows :math:`2D`."""
        return self.ard_num_dims

    @property
    def basis_parameter_dims(self) -> int:
        """
        Trailing columns that basis rows carry beyond the data (the :math:`D` log-multipliers). The strategies of
        :mod:`gpytorch_decoupled.variational` read it to accept inducing points of width :math:`2D` with data of width
        :math:`D`, padding the data rows with zeros (:math:`c = 1`).
        """
        return self.ard_num_dims

    @staticmethod
    def basis_points(points: Tensor, multipliers: Tensor | None = None) -> Tensor:
        r"""
        Basis rows :math:`[\mathbf z, \log \mathbf c]` from locations and multipliers.

        :param points: Locations, `(..., M, D)`.
        :param multipliers: Positive multipliers :math:`\mathbf c`, broadcastable to `points` (default: ones).
        :return: `(..., M, 2D)`.
        """
        log_c = torch.zeros_like(points) if multipliers is None else multipliers.log().expand_as(points)
        return torch.cat([points, log_c], dim=-1)

    def split_basis_points(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """
        The inverse of :meth:`basis_points`: locations and multipliers of rows of width :math:`D` or :math:`2D`.

        :param x: `(..., M, D)` or `(..., M, 2D)`.
        :return: Locations and multipliers, each `(..., M, D)` (multipliers are ones for rows of width :math:`D`).
        """
        z, log_c = self._split(x)
        return z, torch.ones_like(z) if log_c is None else log_c.exp()

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        d = self.ard_num_dims
        if x.size(-1) == d:
            return x, None
        if x.size(-1) == 2 * d:
            return x[..., :d], x[..., d:]
        raise ValueError(
            f"GeneralizedRBFKernel(ard_num_dims={d}) expects inputs of width {d} (data points) or {2 * d} "
            f"(basis points [z, log c]), got width {x.size(-1)}."
        )

    def __call__(self, x1: Tensor, x2: Tensor | None = None, **params):
        for x in (x1, x2):
            if x is not None and x.dim() > 1:
                self._split(x)  # validates the width eagerly, before the lazy evaluation
        if x2 is not None and x1.dim() > 1 and x2.dim() > 1 and x1.size(-1) != x2.size(-1):
            # Kernel.__call__ needs equal widths: give the data rows log c = 0.
            x1, x2 = (x if x.size(-1) == 2 * self.ard_num_dims else self.basis_points(x) for x in (x1, x2))
        # Kernel.__call__'s debug check requires width == ard_num_dims, which basis rows (width 2D) break by design.
        with settings.debug(False):
            return super().__call__(x1, x2, **params)

    def forward(self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params) -> Tensor:
        if last_dim_is_batch:
            raise NotImplementedError("GeneralizedRBFKernel does not support last_dim_is_batch.")
        z1, log_c1 = self._split(x1)
        z2, log_c2 = self._split(x2)
        lengthscale = self.lengthscale
        z1, z2 = z1.div(lengthscale), z2.div(lengthscale)
        if _is_data(log_c1) and _is_data(log_c2):  # plain SE-ARD, as RBFKernel computes it
            return self.covar_dist(z1, z2, square_dist=True, diag=diag, **params).div(-2).exp()
        log_c1 = torch.zeros_like(z1) if log_c1 is None else log_c1
        log_c2 = torch.zeros_like(z2) if log_c2 is None else log_c2
        if diag:
            return _pairwise_covariance(z1, log_c1, z2, log_c2)
        covariance = _blocked_covariance(z1, log_c1, z2, log_c2)
        if x1 is x2 or (x1.shape == x2.shape and torch.equal(x1, x2)):
            # the blocks use different (equally exact) formulas: keep a Gram matrix exactly symmetric
            covariance = 0.5 * (covariance + covariance.mT)
        return covariance


def _is_data(log_multipliers: Tensor | None) -> bool:
    """Rows with :math:`c = 1` throughout that no gradient flows into (data rows, possibly zero-padded)."""
    return log_multipliers is None or (not log_multipliers.requires_grad and not log_multipliers.any())


def _unit_rows(log_multipliers: Tensor) -> Tensor:
    """Which rows have :math:`c = 1` in every dimension (and every batch member), ``(N,)``."""
    unit = (log_multipliers == 0).all(-1)
    return unit.reshape(-1, unit.size(-1)).all(0)


def _blocked_covariance(z1: Tensor, log_c1: Tensor, z2: Tensor, log_c2: Tensor) -> Tensor:
    r"""
    The full covariance, with every block in which one side has :math:`c = 1` (data rows, and basis rows whose
    multipliers are still 1) computed through matrix products (:func:`_unit_basis_covariance`), and only the rest
    pairwise. The strategies concatenate data with basis rows, so both kinds meet in one call.
    """
    unit1, unit2 = _unit_rows(log_c1), _unit_rows(log_c2)
    if unit1.all():
        return _unit_basis_covariance(z1, log_c1, z2, log_c2)
    if unit2.all():
        return _unit_basis_covariance(z2, log_c2, z1, log_c1).mT
    if not unit1.any() and not unit2.any():
        return _pairwise_covariance(z1.unsqueeze(-2), log_c1.unsqueeze(-2), z2.unsqueeze(-3), log_c2.unsqueeze(-3))
    if unit1.any():  # split the rows of side 1 into unit rows and the others, then restore their order
        order = torch.cat([unit1.nonzero().squeeze(-1), (~unit1).nonzero().squeeze(-1)])
        blocks = [
            _unit_basis_covariance(z1[..., unit1, :], log_c1[..., unit1, :], z2, log_c2),
            _blocked_covariance(z1[..., ~unit1, :], log_c1[..., ~unit1, :], z2, log_c2),
        ]
        return torch.cat(blocks, dim=-2)[..., order.argsort(), :]
    return _blocked_covariance(z2, log_c2, z1, log_c1).mT


def _pairwise_covariance(z1: Tensor, log_c1: Tensor, z2: Tensor, log_c2: Tensor) -> Tensor:
    """The formula term by term, for broadcastable (row, column) pairs; inputs in units of :math:`s_d`."""
    # l = c in these units; the product over dimensions is a sum of logs. (One log and one reciprocal per entry:
    # torch.logaddexp would cost several times more, and c^2 overflows only for multipliers beyond 1e19.)
    sums = (2 * log_c1).exp() + (2 * log_c2).exp()
    log_k = 0.5 * (math.log(2) + (log_c1 + log_c2) - sums.log()) - (z1 - z2).square().mul(sums.reciprocal())
    return floored_exp(log_k.sum(-1))


def _unit_basis_covariance(unit: Tensor, log_unit: Tensor, basis: Tensor, log_multipliers: Tensor) -> Tensor:
    r"""
    :math:`k(\mathbf x, \mathbf z)` for rows with :math:`c = 1` against any rows, inputs in units of :math:`s_d`.
    Then :math:`l^2 + l'^2 = 1 + c_{\mathbf z,d}^2` depends on the column only, so with
    :math:`w_{\mathbf z,d} = 1 / (1 + c_{\mathbf z,d}^2)` the exponent :math:`\sum_d w_{\mathbf z,d}(x_d - z_d)^2`
    expands into matrix products and no :math:`N \times M \times D` tensor is formed. If the unit rows' own
    log-multipliers :math:`t` need a gradient (basis rows that still have :math:`c = 1`), the first-order term
    :math:`\sum_d t_d\,[\tfrac12 - w_{\mathbf z,d} + 2 w_{\mathbf z,d}^2 (x_d - z_d)^2]` is added: it is zero in value
    and gives the exact first derivatives.
    """
    centre = unit.mean(-2, keepdim=True)  # as GPyTorch's distances: less cancellation in the expansion
    unit, basis = unit - centre, basis - centre
    log_denominator = torch.nn.functional.softplus(2 * log_multipliers)  # log(1 + c^2)
    weights = log_denominator.neg().exp()
    log_prefactor = 0.5 * (math.log(2) + log_multipliers - log_denominator).sum(-1)

    def weighted_squared_distances(scale: Tensor, column_weights: Tensor) -> Tensor:
        # sum_d scale_id w_jd (x_id - z_jd)^2 as three matrix products
        return (
            (scale * unit.square()) @ column_weights.mT
            - 2 * (scale * unit) @ (basis * column_weights).mT
            + scale @ (basis.square() * column_weights).mT
        )

    log_k = log_prefactor.unsqueeze(-2) - weighted_squared_distances(torch.ones_like(unit), weights).clamp_min(0)
    if log_unit.requires_grad:
        log_k = log_k + log_unit @ (0.5 - weights).mT + 2 * weighted_squared_distances(log_unit, weights.square())
    return floored_exp(log_k)
