from __future__ import annotations

import torch
from torch import Tensor

# The models whose mini-batch noise V_k = sigma^2 I does not depend on the inducing inputs (docs/derivations.md, "The
# sparse models of the PEP family").
STRUCTURED_APPROXIMATIONS = ("vfe", "dtc")


class InducingJacobians:
    r"""
    The Jacobians of the Kalman statistics :math:`\tilde{\boldsymbol\eta}` and :math:`\tilde{\boldsymbol\Lambda} -
    \mathbf K_{\mathbf{uu}}` with respect to the inducing inputs :math:`\mathbf Z` (``(*batch, M, D)``), exactly and
    in :math:`O(M^2D)` floats per latent, for the models whose noise :math:`\mathbf V_k = \sigma^2\mathbf I` does not
    depend on :math:`\mathbf Z` (VFE and DTC).

    Entry :math:`(m, i)` of :math:`\mathbf K_{\mathbf uk}` depends on :math:`\mathbf z_m` only, so
    :math:`\partial\mathbf K_{\mathbf uk}/\partial Z_{md} = \mathbf e_m\mathbf c_{md}^\top` with
    :math:`\mathbf c_{md} = \partial k(\mathbf z_m, \mathbf X_k)/\partial Z_{md}`, and the increments
    :math:`\Delta\tilde{\boldsymbol\Lambda}_k = \mathbf K_{\mathbf uk}\mathbf V_k^{-1}\mathbf K_{k\mathbf u}`,
    :math:`\Delta\tilde{\boldsymbol\eta}_k = \mathbf K_{\mathbf uk}\mathbf V_k^{-1}\mathbf r_k` (:math:`\mathbf r_k =
    \mathbf y_k - \mu_0(\mathbf X_k)`) have the derivatives

    .. math::

        \frac{\partial\Delta\tilde{\boldsymbol\Lambda}_k}{\partial Z_{md}}
        = \mathbf e_m\boldsymbol\rho_{md}^\top + \boldsymbol\rho_{md}\mathbf e_m^\top,\quad
        \boldsymbol\rho_{md} = \mathbf K_{\mathbf uk}\mathbf V_k^{-1}\mathbf c_{md},\qquad
        \frac{\partial\Delta\tilde{\boldsymbol\eta}_k}{\partial Z_{md}} = \mathbf e_m\nu_{md},\quad
        \nu_{md} = \mathbf c_{md}^\top\mathbf V_k^{-1}\mathbf r_k.

    The :math:`\mathbf e_m` are the same for every mini-batch, so the sums over mini-batches keep this form: stored
    are ``rows[..., m, d, :]`` :math:`= \sum_k\boldsymbol\rho_{md}` and ``values[..., m, d]`` :math:`=
    \sum_k\nu_{md}` (float64).
    """

    def __init__(self, values: Tensor, rows: Tensor):
        self.values = values  # (*batch, M, D)
        self.rows = rows  # (*batch, M, D, M)

    @classmethod
    def zeros(cls, inducing_points: Tensor) -> InducingJacobians:
        *batch_shape, num_inducing, dims = inducing_points.shape
        options = {"dtype": torch.float64, "device": inducing_points.device}
        return cls(
            torch.zeros(*batch_shape, num_inducing, dims, **options),
            torch.zeros(*batch_shape, num_inducing, dims, num_inducing, **options),
        )

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in (self.values, self.rows))

    def all_finite(self) -> bool:
        return bool(torch.isfinite(self.values).all() and torch.isfinite(self.rows).all())

    def add_(self, other: InducingJacobians) -> None:
        self.values.add_(other.values)
        self.rows.add_(other.rows)

    def directional(self, direction: Tensor) -> tuple[Tensor, Tensor]:
        """The derivatives of the statistics (``(*batch, M)`` and ``(*batch, M, M)``) along ``direction``, a tangent
        of the inducing inputs, ``(*batch, M, D)``."""
        half = torch.einsum("...md,...mdn->...mn", direction, self.rows)
        return (direction * self.values).sum(-1), half + half.mT

    def gradient(self, vector_adjoint: Tensor, matrix_adjoint: Tensor) -> Tensor:
        r""":math:`\langle\bar{\boldsymbol\eta}, \partial\tilde{\boldsymbol\eta}/\partial Z_{md}\rangle +
        \langle\bar{\boldsymbol\Lambda}, \partial\tilde{\boldsymbol\Lambda}/\partial Z_{md}\rangle
        = \bar\eta_m\nu_{md} + ((\bar{\boldsymbol\Lambda} + \bar{\boldsymbol\Lambda}^\top)\boldsymbol\rho_{md})_m`,
        shaped like the inducing inputs."""
        weights = matrix_adjoint + matrix_adjoint.mT
        return torch.einsum("...mn,...mdn->...md", weights, self.rows) + vector_adjoint.unsqueeze(-1) * self.values

    def dense(self) -> tuple[Tensor, Tensor]:
        """The Jacobians materialized with respect to the flattened inducing inputs, as the dense propagation stores
        them: ``(*batch, M, P_Z)`` and ``(*batch, M, M, P_Z)``, :math:`P_Z` = ``Z.numel()``; a latent's statistics
        do not depend on the other latents' inducing inputs. :math:`O(M^3D)` memory: for inspection and tests."""
        *batch_shape, num_inducing, dims = self.values.shape
        latents = self.values[..., 0, 0].numel()
        values = self.values.reshape(latents, num_inducing, dims)
        rows = self.rows.reshape(latents, num_inducing, dims, num_inducing).transpose(-1, -2)  # (L, m, n, d)
        latent = torch.arange(latents, device=values.device).unsqueeze(-1)
        inducing = torch.arange(num_inducing, device=values.device).unsqueeze(0)
        vector = values.new_zeros(latents, num_inducing, latents, num_inducing, dims)
        vector[latent, inducing, latent, inducing] = values
        matrix = values.new_zeros(latents, num_inducing, num_inducing, latents, num_inducing, dims)
        matrix[latent, inducing, :, latent, inducing] = rows  # e_m rho^T
        matrix[latent, :, inducing, latent, inducing] += rows  # rho e_m^T
        size = latents * num_inducing * dims
        return (
            vector.reshape(*batch_shape, num_inducing, size),
            matrix.reshape(*batch_shape, num_inducing, num_inducing, size),
        )
