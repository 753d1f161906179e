from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.utils.memoize import _add_to_cache_ignore_args, _get_from_cache_ignore_args, _is_in_cache_ignore_args
from linear_operator import to_dense
from linear_operator.operators import LinearOperator
from torch import Tensor

from ..linalg import column_sampled_quadratic_form, kernel_matvec
from ._input_checks import checked_inputs
from ._replace_tensor import replace_tensor


class _MeanBasisMixin:
    r"""
    The mean basis every decoupled strategy shares: points :math:`\alpha` (``mean_inducing_points``, shared by every
    latent of the batch) with coefficients :math:`\mathbf a` (``mean_coefficients``, one row per latent), the mean
    function :math:`\mathbf k_{\mathbf x\alpha}\mathbf a`, and the quadratic form
    :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a` of its KL, column-sampled in training
    (:ref:`derivations-column-sampled-kl`) and exact, in row blocks of bounded memory, in eval mode or with
    ``num_kl_columns=None``. No :math:`M_\alpha\times M_\alpha` matrix is ever formed.

    Everything the mean basis contributes to a training step is the same product
    :math:`\mathbf K_{\cdot\alpha}\mathbf a` at other rows (the data, the sampled KL rows and, for the hybrid and
    orthogonal bases, the covariance basis): all of them go through one kernel evaluation in
    :meth:`_fused_mean_basis_values`.

    Inducing points may be wider than the data when a kernel of the model declares ``basis_parameter_dims``: their
    trailing columns then hold per-basis kernel parameters (for example the log length-scale multipliers of
    :class:`~gpytorch_decoupled.kernels.GeneralizedRBFKernel`), and data rows are padded with zeros, the kernel's value
    for a data point.
    """

    def _init_mean_basis(
        self, mean_inducing_points: Tensor, learn_inducing_locations: bool, num_kl_columns: int | None, kl_block_size
    ) -> None:
        if mean_inducing_points.dim() == 1:
            mean_inducing_points = mean_inducing_points.unsqueeze(-1)
        width = self.inducing_points.size(-1)
        if mean_inducing_points.dim() != 2 or mean_inducing_points.size(-1) != width:
            raise ValueError(
                f"mean_inducing_points must have shape (M_mean, {width}) to match inducing_points "
                f"{tuple(self.inducing_points.shape)}, got {tuple(mean_inducing_points.shape)}."
            )
        if not torch.isfinite(mean_inducing_points).all():
            raise ValueError("mean_inducing_points contains NaN or inf.")
        if num_kl_columns is not None and num_kl_columns < 1:
            raise ValueError(f"num_kl_columns must be a positive integer or None, got {num_kl_columns}.")
        points = mean_inducing_points.detach().clone().to(self.inducing_points)
        if learn_inducing_locations:
            self.register_parameter("mean_inducing_points", torch.nn.Parameter(points))
        else:
            self.register_buffer("mean_inducing_points", points)
        self.num_kl_columns = num_kl_columns
        self.kl_block_size = kl_block_size

    @torch.no_grad()
    def _append_mean_points(self, points: Tensor, owner: torch.nn.Module) -> None:
        """Appends mean-basis points with zero coefficients (``owner.mean_coefficients``): the process is unchanged."""
        if points.dim() != 2:
            raise ValueError(f"new mean basis points must have shape (n, D), got {tuple(points.shape)}.")
        replace_tensor(self, "mean_inducing_points", torch.cat([self.mean_inducing_points, points]))
        coefficients = owner.mean_coefficients
        padding = coefficients.new_zeros(*coefficients.shape[:-1], points.size(-2))
        replace_tensor(owner, "mean_coefficients", torch.cat([coefficients, padding], dim=-1))

    # ------------------------------------------------------------------ kernel blocks
    def _joint_prior(self, x1: Tensor, x2: Tensor, **kwargs) -> MultivariateNormal:
        """The model's prior at the stacked inputs ``[x1; x2]`` (batch dimensions broadcast), as ``model.forward``
        returns it: lazy for a GPyTorch kernel, so only the blocks that are used are ever evaluated."""
        batch_shape = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
        x1 = x1.expand(*batch_shape, *x1.shape[-2:])
        x2 = x2.expand(*batch_shape, *x2.shape[-2:])
        return self.model.forward(torch.cat([x1, x2], dim=-2), **kwargs)

    def _lazy_cross_covariance(self, x1: Tensor, x2: Tensor, **kwargs) -> Tensor | LinearOperator:
        """Prior covariance between two input sets through ``model.forward`` (lazy for a GPyTorch kernel)."""
        return self._joint_prior(x1, x2, **kwargs).lazy_covariance_matrix[..., : x1.size(-2), x1.size(-2) :]

    def _cross_covariance(self, x1: Tensor, x2: Tensor, **kwargs) -> Tensor:
        """Dense prior covariance between two input sets through ``model.forward`` (only that block is evaluated)."""
        return to_dense(self._lazy_cross_covariance(x1, x2, **kwargs))

    def _mean_basis_values(self, x: Tensor, **kwargs) -> Tensor:
        r""":math:`\mathbf K_{\mathbf x\alpha}\mathbf a`, the mean basis function at ``x``, ``(..., N)``, fused for
        the common kernels (:func:`~gpytorch_decoupled.linalg.kernel_matvec`)."""
        return self._mean_basis_values_and_prior(x, **kwargs)[0]

    def _mean_basis_values_and_prior(self, x: Tensor, **kwargs) -> tuple[Tensor, MultivariateNormal]:
        """:meth:`_mean_basis_values` and the joint prior at ``[x; alpha]`` it was computed from."""
        prior = self._joint_prior(x, self.mean_inducing_points, **kwargs)
        block = prior.lazy_covariance_matrix[..., : x.size(-2), x.size(-2) :]
        return kernel_matvec(block, self.mean_coefficients), prior

    def _sampled_rows(self) -> Tensor | None:
        r"""Rows of :math:`\mathbf K_\alpha` for this training step's KL estimate, or None when the KL is exact."""
        num_points = self.mean_inducing_points.size(-2)
        if not self.training or self.num_kl_columns is None or self.num_kl_columns >= num_points:
            return None
        return torch.randperm(num_points, device=self.mean_inducing_points.device)[: self.num_kl_columns]

    def _fused_mean_basis_values(
        self, x: Tensor, model_rows: list[Tensor], **kwargs
    ) -> tuple[list[Tensor], Tensor, MultivariateNormal | None]:
        r"""
        :math:`\mathbf K_{\cdot\alpha}\mathbf a` at ``model_rows`` (inputs of the model, e.g. the covariance basis) and
        at the data ``x``, plus, in training, at this step's sampled KL rows :math:`C`, whose estimate
        :math:`\tfrac{M_\alpha}{b}\mathbf a_C^\top[\mathbf K_{C\alpha}\mathbf a]` is cached for
        :meth:`mean_basis_quadratic_form`.

        When ``x`` has the model's batch shape, everything comes from one call of ``model.forward`` at
        ``[model_rows; C; x; alpha]``, which is returned as well (its lazy covariance also holds the blocks among
        ``model_rows`` and ``x``, for the caller to reuse); otherwise the third value is None.
        """
        points = self.mean_inducing_points
        sampled = self._sampled_rows()
        batch_shape = model_rows[0].shape[:-2] if model_rows else self.mean_coefficients.shape[:-1]
        rows = list(model_rows)
        if sampled is not None:
            rows.append(points[sampled].expand(*batch_shape, -1, -1))
        sizes = [row.size(-2) for row in rows]
        prior = None
        if not rows:
            return [], self._mean_basis_values(x, **kwargs), prior
        if x.shape[:-2] == batch_shape:
            values, prior = self._mean_basis_values_and_prior(torch.cat([*rows, x], dim=-2), **kwargs)
            *row_values, data_values = values.split([*sizes, x.size(-2)], dim=-1)
        else:  # a data batch the model does not have: keep the model's quantities free of it
            row_values = list(self._mean_basis_values(torch.cat(rows, dim=-2), **kwargs).split(sizes, dim=-1))
            data_values = self._mean_basis_values(x, **kwargs)
        if sampled is not None:
            coefficients = self.mean_coefficients[..., sampled]
            estimate = (points.size(-2) / sampled.numel()) * (coefficients * row_values.pop()).sum(-1)
            _add_to_cache_ignore_args(self, "sampled_mean_basis_quadratic", estimate)
        return row_values, data_values, prior

    def mean_basis_quadratic_form(self, indices: Tensor | None = None) -> Tensor:
        r"""
        :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a`: exact in eval mode or with ``num_kl_columns=None``; in
        training, the unbiased column-sampled estimate of this step (drawn in the forward pass, or here if no forward
        pass came first); for explicit ``indices``, the estimate for that sample of rows of :math:`\mathbf K_\alpha`.
        """
        if indices is None and _is_in_cache_ignore_args(self, "sampled_mean_basis_quadratic"):
            return _get_from_cache_ignore_args(self, "sampled_mean_basis_quadratic")
        return column_sampled_quadratic_form(
            self._lazy_cross_covariance,
            self.mean_inducing_points,
            self.mean_coefficients,
            indices=self._sampled_rows() if indices is None else indices,
            block_size=self.kl_block_size,
        )

    # ------------------------------------------------------------------ inputs
    def _checked_inputs(self, x: Tensor) -> Tensor:
        """Validates ``x`` before anything is computed and pads data rows to the width of the inducing points."""
        return checked_inputs(x, self.inducing_points, self.model)
