from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.settings import trace_mode
from gpytorch.utils.memoize import _add_to_cache_ignore_args, _get_from_cache_ignore_args, _is_in_cache_ignore_args
from gpytorch.variational import VariationalStrategy
from gpytorch.variational._variational_distribution import _VariationalDistribution
from linear_operator.operators import LinearOperator, SumLinearOperator
from torch import Tensor

from ._cache_safe_mixin import _CacheSafeMixin
from ._mean_basis_mixin import _MeanBasisMixin
from ._replace_tensor import replace_tensor


class _ResidualMeanVariationalStrategy(_MeanBasisMixin, _CacheSafeMixin, VariationalStrategy):
    r"""
    A whitened SVGP block on the covariance basis :math:`\beta` plus an extra mean basis :math:`\gamma` with
    coefficients :math:`\mathbf a_\gamma` (``mean_coefficients``, a parameter of the strategy, not of the variational
    distribution: an NGD step on them is not a natural-gradient step). Both the hybrid and the orthogonally decoupled
    bases are of this form (Cheng & Boots 2017, App. A.3; Salimbeni et al. 2018, eqs. 11-12); they differ only in how
    the :math:`\beta` block's mean relates to the :math:`\gamma` block (:meth:`_covariance_block_mean`) and so in their
    KL.

    The quantity both need is :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma`
    (:meth:`residual_coordinates`), the whitened coordinates of the :math:`\gamma` mean at :math:`\beta`; it comes out
    of the same kernel evaluation as the data's mean-basis values and the KL's sampled rows.
    """

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: _VariationalDistribution,
        mean_inducing_points: Tensor,
        learn_inducing_locations: bool = True,
        num_kl_columns: int | None = 64,
        kl_block_size: int = 4096,
        mean_init_std: float = 1e-3,
        jitter_val: float | None = None,
    ):
        super().__init__(model, inducing_points, variational_distribution, learn_inducing_locations, jitter_val)
        # The fantasy (OVC) machinery of the base class assumes the single-basis SVGP.
        self.has_fantasy_strategy = False
        self._init_mean_basis(mean_inducing_points, learn_inducing_locations, num_kl_columns, kl_block_size)
        gamma = self.mean_inducing_points
        # Near zero, as GPyTorch starts variational means (mean_init_std): exactly zero would leave gamma without a
        # gradient in the first step.
        coefficients = torch.randn(*variational_distribution.batch_shape, gamma.size(-2), dtype=gamma.dtype)
        self.register_parameter("mean_coefficients", torch.nn.Parameter(coefficients.mul_(mean_init_std).to(gamma)))

    def _beta_cholesky(self, covariance: LinearOperator | None = None):
        """Cholesky factor of :math:`\\mathbf K_\\beta` (``covariance`` when given, e.g. a block of a joint prior)
        plus jitter, shared with the base class's cache."""
        if covariance is None:
            covariance = self.model.forward(self.inducing_points).lazy_covariance_matrix
        return self._cholesky_factor(covariance.add_jitter(self.jitter_val))

    def residual_coordinates(self) -> Tensor:
        r"""
        :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma`, so that the mean of the
        :math:`\gamma` block at :math:`\beta` is :math:`\mathbf L_\beta \mathbf c`. Cached in eval mode (where
        predictions then need only :math:`\mathbf k_{\mathbf x\gamma}`) and within one training step (shared by the
        forward pass and the KL).
        """
        if not _is_in_cache_ignore_args(self, "residual_coordinates"):
            self._cache_residual_coordinates(self._mean_basis_values(self.inducing_points))
        return _get_from_cache_ignore_args(self, "residual_coordinates")

    def _cache_residual_coordinates(self, beta_values: Tensor, chol: LinearOperator | None = None) -> Tensor:
        chol = self._beta_cholesky() if chol is None else chol
        coordinates = chol.solve(beta_values.unsqueeze(-1).type(chol.dtype)).squeeze(-1).type(beta_values.dtype)
        return _add_to_cache_ignore_args(self, "residual_coordinates", coordinates)

    def _covariance_block_mean(self, inducing_values: Tensor, coordinates: Tensor) -> Tensor:
        r"""
        The whitened mean the SVGP block interpolates, given the variational mean :math:`\mathbf m_w` and the residual
        coordinates :math:`\mathbf c`.
        """
        raise NotImplementedError

    def forward(
        self,
        x: Tensor,
        inducing_points: Tensor,
        inducing_values: Tensor,
        variational_inducing_covar: LinearOperator | None = None,
        diag: bool = True,
        **kwargs,
    ) -> MultivariateNormal:
        if _is_in_cache_ignore_args(self, "residual_coordinates"):
            _, data_values, _ = self._fused_mean_basis_values(x, [], **kwargs)
        else:
            (beta_values,), data_values, prior = self._fused_mean_basis_values(x, [self.inducing_points], **kwargs)
            if prior is not None and self.training and diag:
                return self._training_forward(
                    x, inducing_values, variational_inducing_covar, beta_values, data_values, prior
                )
            self._cache_residual_coordinates(beta_values)
        block_mean = self._covariance_block_mean(inducing_values, self.residual_coordinates())
        svgp = super().forward(x, inducing_points, block_mean, variational_inducing_covar, diag=diag, **kwargs)
        return MultivariateNormal(svgp.mean + data_values, svgp.lazy_covariance_matrix)

    def _training_forward(
        self,
        x: Tensor,
        inducing_values: Tensor,
        variational_inducing_covar: LinearOperator | None,
        beta_values: Tensor,
        data_values: Tensor,
        prior: MultivariateNormal,
    ) -> MultivariateNormal:
        """
        GPyTorch's training-mode SVGP block (``VariationalStrategy.forward`` with ``diag=True``: the same jitter, cached
        factor and predictive updates) on the blocks of the mean basis's joint prior at ``[beta; C; x; gamma]``, which
        already holds ``K_beta``, ``K_beta,x`` and ``K_xx``: one ``model.forward`` per step instead of three.
        """
        num_beta, num_data = self.inducing_points.size(-2), x.size(-2)
        end = prior.event_shape[-1] - self.mean_inducing_points.size(-2)
        start = end - num_data
        covariance = prior.lazy_covariance_matrix
        chol = self._beta_cholesky(covariance[..., :num_beta, :num_beta])
        coordinates = self._cache_residual_coordinates(beta_values, chol)
        mean_update, covariance_update = self._compute_predictive_updates(
            chol=chol,
            induc_data_covar=covariance[..., :num_beta, start:end].to_dense(),
            inducing_values=self._covariance_block_mean(inducing_values, coordinates),
            variational_inducing_covar=variational_inducing_covar,
            prior_covar=self.prior_distribution.lazy_covariance_matrix,
            diag=True,
        )
        data_covariance = covariance[..., start:end, start:end].add_jitter(self.jitter_val)
        predictive_covariance = SumLinearOperator(data_covariance, covariance_update)
        if trace_mode.on():
            predictive_covariance = predictive_covariance.to_dense()
        return MultivariateNormal(prior.mean[..., start:end] + mean_update + data_values, predictive_covariance)

    @torch.no_grad()
    def grow_bases(self, mean_points: Tensor | None = None, inducing_points: Tensor | None = None) -> None:
        r"""
        Appends points to the mean basis :math:`\gamma` (coefficients 0) and to the covariance basis :math:`\beta`
        without changing the process :math:`q` (:ref:`derivations-basis-growth`, up to the jitter on
        :math:`\mathbf K_\beta`). For :math:`\beta \to \beta'` the new :math:`q(\mathbf u_{\beta'})` is the current
        process at :math:`\beta'`: its covariance is :math:`s_q(\beta', \beta')` and the :math:`\beta` block's mean is
        interpolated, :math:`\mathbf K_{\beta'\beta}\mathbf K_\beta^{-1}` times the old one. The leading entries of the
        whitened parameters keep their values, so zero-padded optimizer state stays valid
        (:class:`~gpytorch_decoupled.optim.OnlineBasisGrowth` does that). Exact for full-covariance distributions;
        a mean-field distribution keeps only the diagonal of the new :math:`\mathbf S_w`.

        :param mean_points: New :math:`\gamma` points, ``(n, D)``.
        :param inducing_points: New :math:`\beta` points, ``(n, D)``, shared by every latent of the batch.
        """
        self._clear_cache()
        # Everything is validated and computed before the first change, so a failure leaves the model as it was.
        mean_points = None if mean_points is None else self._checked_inputs(mean_points)
        target = None
        if inducing_points is not None:
            old = self.inducing_points
            new = torch.cat([old, self._checked_inputs(inducing_points).expand(*old.shape[:-2], -1, -1)], dim=-2)
            q = self.variational_distribution
            old_chol = self._beta_cholesky()
            block_mean = self._covariance_block_mean(q.mean, self.residual_coordinates())
            # A = L^-1 K_{b b'}: the old whitened coordinates of the new covariance basis functions
            projection = old_chol.solve(self._cross_covariance(old, new).type(old_chol.dtype)).type(old.dtype)
            eye = torch.eye(old.size(-2), dtype=old.dtype, device=old.device)
            new_prior = self.model.forward(new).lazy_covariance_matrix.add_jitter(self.jitter_val)
            new_covariance = new_prior.to_dense() + projection.mT @ (q.covariance_matrix - eye) @ projection
            unwhitened_block = (projection.mT @ block_mean.unsqueeze(-1)).squeeze(-1)
            # New gamma points come with zero coefficients, so the mean basis at beta' is known already.
            new_values = self._mean_basis_values(new)
            self._clear_cache()  # the next factor is of K_beta', not K_beta
            new_chol = self._cholesky_factor(new_prior)
            self._clear_cache()

            def whiten(tensor: Tensor) -> Tensor:
                return new_chol.solve(tensor.type(new_chol.dtype)).type(old.dtype)

            whitened_block = whiten(unwhitened_block.unsqueeze(-1)).squeeze(-1)
            shift = -self._covariance_block_mean(
                torch.zeros_like(whitened_block), whiten(new_values.unsqueeze(-1)).squeeze(-1)
            )
            target = MultivariateNormal(whitened_block + shift, whiten(whiten(new_covariance).mT))
            replace_tensor(self, "inducing_points", new)
        if mean_points is not None:
            self._append_mean_points(mean_points, self)
        if target is not None:
            self._resize_variational_distribution(target)
        self._clear_cache()

    def _resize_variational_distribution(self, target: MultivariateNormal) -> None:
        """Gives the whitened distribution the size and value of ``target`` (its parameters keep their identity)."""
        distribution = self._variational_distribution
        old_size, new_size = distribution.num_inducing_points, target.mean.size(-1)
        for name, parameter in list(distribution.named_parameters(recurse=False)):
            shape = list(parameter.shape)
            for dim in range(1, 3):
                if len(shape) >= dim and shape[-dim] == old_size:
                    shape[-dim] = new_size
            replace_tensor(distribution, name, parameter.new_zeros(shape))
        distribution.num_inducing_points = new_size
        mean_init_std, distribution.mean_init_std = distribution.mean_init_std, 0.0
        try:
            distribution.initialize_variational_distribution(target)
        finally:
            distribution.mean_init_std = mean_init_std

    def __call__(self, x: Tensor, prior: bool = False, diag: bool = True, **kwargs) -> MultivariateNormal:
        return super().__call__(self._checked_inputs(x), prior=prior, diag=diag, **kwargs)
