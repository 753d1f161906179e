from __future__ import annotations

import functools

import torch
from gpytorch import settings
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.settings import trace_mode
from gpytorch.utils.errors import CachingError
from gpytorch.utils.memoize import cached, pop_from_cache_ignore_args
from linear_operator import to_linear_operator
from linear_operator.operators import (
    CholLinearOperator,
    DiagLinearOperator,
    LinearOperator,
    SumLinearOperator,
    TriangularLinearOperator,
)
from torch import Tensor
from torch.distributions.kl import kl_divergence

from ..gpytorch_compat import (
    VariationalDistributionBase,
    VariationalStrategyBase,
    cache_safe,
    compute_predictive_updates,
    whitened_cholesky_factor,
)
from ..linalg import (
    add_to_diagonal,
    data_landmark_residual,
    jittered_cholesky,
    landmark_blocks,
    landmark_controlled_estimate,
    landmark_quadratic_form,
    solve_lower,
    symmetrized,
)
from ..linalg.landmark_quadratic_form import row_probabilities
from ._fantasies import no_fantasy_model
from ._replace_tensor import replace_tensor
from ._strategy_multivariate_normal import _StrategyMultivariateNormal
from .checked_inputs import checked_basis_points, checked_inputs
from .joint_prior import JointPrior, joint_prior
from .mean_basis import EXACT_KL_SIZE, MeanBasis, MeanBasisAttribute, SampledRows, load_renamed_keys

# Keys of checkpoints saved before the mean basis became a component, and GPyTorch's whitening flag, which a strategy
# that was never unwhitened has no use for.
_OLD_KEYS = {"mean_inducing_points": "mean_basis.inducing_points", "mean_coefficients": "mean_basis.coefficients"}


@cache_safe
class _ResidualMeanVariationalStrategy(VariationalStrategyBase):
    r"""
    A whitened SVGP block on the covariance basis :math:`\beta` plus an extra mean basis :math:`\gamma` with
    coefficients :math:`\mathbf a_\gamma` (the :class:`~gpytorch_decoupled.variational.MeanBasis` component
    ``mean_basis``, whose coefficients are a hyperparameter of the strategy, not a variational parameter: an NGD step
    on them is not a natural-gradient step). Both the hybrid and the orthogonally decoupled bases are of this form
    (Cheng & Boots 2017, App. A.3; Salimbeni et al. 2018, eqs. 11-12); they differ only in how the :math:`\beta`
    block's mean relates to the :math:`\gamma` block (:meth:`_covariance_block_mean`) and so in their KL.

    The SVGP block is GPyTorch's whitened one (:class:`~gpytorch.variational.VariationalStrategy`: the same prior,
    jitter, cached factor and predictive updates), computed here from the blocks of one joint prior. The quantity both
    bases need is :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma`
    (:meth:`residual_coordinates`), the whitened coordinates of the :math:`\gamma` mean at :math:`\beta`; in training it
    comes out of the same kernel evaluation as the data's mean-basis values and the KL's sampled rows.

    :math:`\mathbf c` is kept in the attribute ``_residual_coordinates`` from the forward pass of a training step to
    its KL, and in eval mode from the first prediction on; None until computed, it is forgotten with GPyTorch's caches
    (:func:`~gpytorch_decoupled.gpytorch_compat.cache_safe`).

    The mean basis's quadratic form splits as :math:`\mathbf a_\gamma^\top\mathbf K_\gamma\mathbf a_\gamma =
    \lVert\mathbf c\rVert^2 + R` (:meth:`residual_quadratic_form`). Where it is not exact, :math:`R` is estimated
    with :math:`\beta` as landmarks (:func:`~gpytorch_decoupled.linalg.landmark_quadratic_form`,
    :ref:`derivations-landmark-kl`): the rows of :math:`\mathbf K_\gamma` drawn in proportion to
    :math:`\lvert a_i\rvert` (stratified) come out of the step's one kernel evaluation, and so do their blocks with
    :math:`\beta` and the data, which are landmarks too (:meth:`_data_landmark_residual`, unless
    ``kl_data_landmarks=False``); the estimate is kept in ``_residual_quadratic_form`` for the step's KL.
    """

    _step_attributes = ("_residual_coordinates", "_residual_quadratic_form")
    _residual_coordinates: Tensor | None = None
    _residual_quadratic_form: Tensor | None = None

    mean_inducing_points = MeanBasisAttribute("inducing_points", r"The mean basis :math:`\gamma`, ``(M_gamma, D)``.")
    mean_coefficients = MeanBasisAttribute("coefficients", r"The mean coefficients :math:`\mathbf a_\gamma`.")
    num_kl_columns = MeanBasisAttribute("num_kl_columns", "Rows of the mean basis's kernel matrix sampled for the KL.")
    exact_kl_size = MeanBasisAttribute("exact_kl_size", "Mean bases of at most this many points have an exact KL.")

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: VariationalDistributionBase,
        mean_inducing_points: Tensor,
        learn_inducing_locations: bool = True,
        num_kl_columns: int | None = 64,
        kl_block_size: int = 4096,
        mean_init_std: float = 1e-3,
        jitter_val: float | None = None,
        exact_kl_size: int = EXACT_KL_SIZE,
        kl_control_variate: bool = True,
        kl_data_landmarks: bool = True,
    ):
        super().__init__(model, inducing_points, variational_distribution, learn_inducing_locations, jitter_val)
        self.mean_basis = MeanBasis(
            model,
            mean_inducing_points,
            self.inducing_points,
            learn_inducing_locations,
            num_kl_columns,
            kl_block_size,
            batch_shape=variational_distribution.batch_shape,
            init_std=mean_init_std,
            exact_kl_size=exact_kl_size,
            importance_sampling=kl_control_variate,
        )
        self.kl_data_landmarks = kl_data_landmarks
        self.register_load_state_dict_pre_hook(functools.partial(load_renamed_keys, _OLD_KEYS, ("updated_strategy",)))

    # ------------------------------------------------------------------ the mean basis
    def get_fantasy_model(self, inputs: Tensor, targets: Tensor, **kwargs) -> ApproximateGP:
        """No closed-form conditioning here: raises a ``NotImplementedError`` that names the strategies with one."""
        raise no_fantasy_model(self)

    def mean_basis_quadratic_form(self, indices: Tensor | None = None) -> Tensor:
        r"""
        :math:`\mathbf a_\gamma^\top\mathbf K_\gamma\mathbf a_\gamma`: exact in eval mode, with
        ``num_kl_columns=None`` or for a mean basis of at most ``exact_kl_size`` points; in training otherwise, the
        unbiased estimate of this step (drawn in the forward pass, or here if no forward pass came first): with the
        control variate, :math:`\lVert\mathbf c\rVert^2` plus :meth:`residual_quadratic_form`; without it, the
        column-sampled estimate. For explicit ``indices``, the estimate for those draws.
        """
        if not self.mean_basis.importance_sampling:
            return self.mean_basis.quadratic_form(self.mean_coefficients, indices)
        return self.residual_coordinates().pow(2).sum(-1) + self.residual_quadratic_form(indices)

    def residual_quadratic_form(self, indices: Tensor | None = None, data: Tensor | None = None) -> Tensor:
        r"""
        :math:`R = \mathbf a_\gamma^\top(\mathbf K_\gamma - \mathbf K_{\gamma\beta}\mathbf K_\beta^{-1}
        \mathbf K_{\beta\gamma})\mathbf a_\gamma = \mathbf a_\gamma^\top\mathbf K_\gamma\mathbf a_\gamma -
        \lVert\mathbf c\rVert^2` (with :math:`\mathbf K_\beta`'s jitter): exact where
        :meth:`mean_basis_quadratic_form` is; in training otherwise, this step's estimate with :math:`\beta` as
        landmarks (:func:`~gpytorch_decoupled.linalg.landmark_quadratic_form`), or, without the control variate, the
        column-sampled estimate minus :math:`\lVert\mathbf c\rVert^2`. A training step's estimate has the step's
        data as landmarks too (:meth:`_data_landmark_residual`). For explicit ``indices``, the estimate for those
        draws, with the inputs ``data`` as landmarks besides :math:`\beta` if given.
        """
        if indices is None and self._residual_quadratic_form is not None:
            return self._residual_quadratic_form
        if data is not None:
            if indices is None:
                raise ValueError("data (extra landmarks) needs explicit indices.")
            return self._drawn_rows_residual(indices, data)
        basis, coefficients = self.mean_basis, self.mean_coefficients
        if not basis.importance_sampling or (indices is None and basis.exact_quadratic_form()):
            return basis.quadratic_form(coefficients, indices) - self.residual_coordinates().pow(2).sum(-1)
        return landmark_quadratic_form(
            basis.cross_covariance,
            basis.inducing_points,
            coefficients,
            self.inducing_points,
            self._beta_cholesky().to_dense(),
            num_columns=basis.num_kl_columns,
            residual=True,
            generator=basis.generator,
            indices=indices,
        )

    def _data_landmark_residual(
        self, sampled: SampledRows, landmark_values: Tensor, landmark_covariance: Tensor, row_block: Tensor
    ) -> Tensor:
        r"""
        The estimate of :math:`R` from this step's drawn rows :math:`C` with landmarks :math:`\mathbf Z = [\beta;
        \mathbf x]`, the covariance basis and the step's data, whose products :math:`\mathbf K_{\mathbf Z\gamma}
        \mathbf a_\gamma` (``landmark_values``) the step computes anyway: more landmarks at no cost in kernel
        evaluations (:func:`~gpytorch_decoupled.linalg.data_landmark_residual`, with the strategy's jitter).

        :param sampled: The drawn rows, their probabilities and :math:`\mathbf K_{C\gamma}\mathbf a_\gamma`.
        :param landmark_values: :math:`\mathbf K_{\mathbf Z\gamma}\mathbf a_\gamma`, ``(..., M_beta + N_b)``.
        :param landmark_covariance: :math:`\mathbf K_{\mathbf Z}`, dense.
        :param row_block: :math:`\mathbf K_{C\mathbf Z}`, dense.
        """
        return data_landmark_residual(
            self.mean_coefficients[..., sampled.indices],
            sampled.values,
            row_block,
            landmark_values,
            landmark_covariance,
            self.residual_coordinates(),
            sampled.probabilities,
            self.jitter_val,
        )

    def _drawn_rows_residual(self, indices: Tensor, data: Tensor) -> Tensor:
        """:meth:`_data_landmark_residual` for explicit draws and data, every block evaluated here."""
        basis, coefficients = self.mean_basis, self.mean_coefficients
        beta = self.inducing_points
        data = checked_inputs(data, beta, self.model)
        batch_shape = torch.broadcast_shapes(beta.shape[:-2], data.shape[:-2])
        landmarks = torch.cat([beta.expand(*batch_shape, -1, -1), data.expand(*batch_shape, -1, -1)], dim=-2)
        drawn = basis.inducing_points.index_select(-2, indices).expand(*batch_shape, -1, -1)
        values = basis.values(torch.cat([drawn, landmarks], dim=-2), coefficients)
        row_values, landmark_values = values.split([indices.numel(), landmarks.size(-2)], dim=-1)
        sampled = SampledRows(indices, row_probabilities(coefficients).index_select(-1, indices), row_values)
        landmark_covariance = basis.cross_covariance(landmarks, landmarks).to_dense()
        row_block = basis.cross_covariance(drawn, landmarks).to_dense()
        return self._data_landmark_residual(sampled, landmark_values, landmark_covariance, row_block)

    def _sampled_residual(self, sampled: SampledRows, chol: LinearOperator, landmark_block: Tensor) -> None:
        r"""Keeps this step's estimate of :math:`R` from the drawn rows' values and their block with :math:`\beta`."""
        self._residual_quadratic_form = landmark_controlled_estimate(
            self.mean_coefficients[..., sampled.indices],
            sampled.values,
            landmark_block,
            self._residual_coordinates,
            chol.to_dense(),
            sampled.probabilities,
        )

    # ------------------------------------------------------------------ the whitened SVGP block
    @property
    @cached(name="prior_distribution_memo")
    def prior_distribution(self) -> MultivariateNormal:
        r"""The whitened prior :math:`\mathcal N(\mathbf 0, \mathbf I)` of the :math:`\beta` block."""
        distribution = self._variational_distribution
        zeros = torch.zeros(distribution.shape(), dtype=distribution.dtype, device=distribution.device)
        return MultivariateNormal(zeros, DiagLinearOperator(torch.ones_like(zeros)))

    @property
    @cached(name="variational_distribution_memo")
    def variational_distribution(self) -> MultivariateNormal:
        r"""The distribution's :math:`q(\mathbf v)` of the whitened :math:`\beta` block; its divergence from
        :attr:`prior_distribution` is the strategy's whole KL (also under GPyTorch's multitask wrappers)."""
        return _StrategyMultivariateNormal.of(self._variational_distribution(), self)

    def _block_kl_divergence(self) -> Tensor:
        r""":math:`\mathrm{KL}[q(\mathbf v) \Vert \mathcal N(\mathbf 0, \mathbf I)]` of the whitened :math:`\beta`
        block alone, by the distribution's own rule (GPyTorch's, or the fast one of a natural distribution)."""
        q = self.variational_distribution
        with settings.max_preconditioner_size(0):
            return kl_divergence(getattr(q, "base_distribution", q), self.prior_distribution)

    def _cholesky_factor(self, covariance: LinearOperator) -> LinearOperator:
        """The factor of :math:`\\mathbf K_\\beta` plus jitter (``covariance``), memoized for the step (training) or
        for every prediction (eval mode); recomputed when inputs of another batch shape need another one. In eval mode
        GPyTorch's (float64, as its strategy's predictions solve with it); in training the package's float64
        factorization in the model's dtype (:func:`~gpytorch_decoupled.linalg.jittered_cholesky`: its backward pass in
        that dtype), which GPyTorch's training pass casts its factor to anyway."""
        factorize, name = (
            (self._training_cholesky_factor, "training_cholesky_factor")
            if self.training
            else (functools.partial(whitened_cholesky_factor, self), "cholesky_factor")
        )
        factor = factorize(covariance)
        if factor.shape != covariance.shape:
            try:
                pop_from_cache_ignore_args(self, name)
            except CachingError:
                pass
            factor = factorize(covariance)
        return factor

    @cached(name="training_cholesky_factor", ignore_args=True)
    def _training_cholesky_factor(self, covariance: LinearOperator) -> TriangularLinearOperator:
        return TriangularLinearOperator(jittered_cholesky(covariance.to_dense(), name="K_beta"))

    def _beta_cholesky(self, covariance: LinearOperator | None = None) -> LinearOperator:
        """Cholesky factor of :math:`\\mathbf K_\\beta` (``covariance`` when given, e.g. a block of a joint prior) plus
        jitter."""
        if covariance is None:
            covariance = self.model.forward(self.inducing_points).lazy_covariance_matrix
        return self._cholesky_factor(covariance.add_jitter(self.jitter_val))

    def residual_coordinates(self) -> Tensor:
        r"""
        :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma`, so that the mean of the
        :math:`\gamma` block at :math:`\beta` is :math:`\mathbf L_\beta \mathbf c`. Kept in eval mode (where predictions
        then need only :math:`\mathbf k_{\mathbf x\gamma}`) and within one training step (shared by the forward pass and
        the KL).
        """
        if self._residual_coordinates is None:
            self._set_residual_coordinates(self.mean_basis.values(self.inducing_points, self.mean_coefficients))
        return self._residual_coordinates

    def _set_residual_coordinates(self, beta_values: Tensor, chol: LinearOperator | None = None) -> Tensor:
        chol = self._beta_cholesky() if chol is None else chol
        coordinates = chol.solve(beta_values.unsqueeze(-1).type(chol.dtype)).squeeze(-1).type(beta_values.dtype)
        self._residual_coordinates = coordinates
        return coordinates

    def _covariance_block_mean(self, inducing_values: Tensor, coordinates: Tensor) -> Tensor:
        r"""
        The whitened mean the SVGP block interpolates, given the variational mean :math:`\mathbf m_w` and the residual
        coordinates :math:`\mathbf c`.
        """
        raise NotImplementedError

    def _predictive(
        self,
        prior: JointPrior,
        chol: LinearOperator,
        block_mean: Tensor,
        variational_inducing_covar: LinearOperator | None,
        diag: bool,
    ) -> tuple[Tensor, LinearOperator | Tensor]:
        r"""
        The mean and covariance of GPyTorch's whitened SVGP predictive at the data, from the blocks of ``prior`` (input
        set 0 is :math:`\beta`, the last the data), the factor ``chol`` of :math:`\mathbf K_\beta` and the whitened
        block mean and covariance.
        """
        data = len(prior.sizes) - 1
        induc_data_covar = prior.dense(0, data)
        if diag and self.training and induc_data_covar.size(-2) < induc_data_covar.size(-1):
            # GPyTorch's training pass with diag=True (its fused variance-only update, for more data than inducing
            # points), in plain tensor operations: with W = L^-1 K_beta,x, the mean W^T m and the variances
            # k_xx + diag(W^T (S - I) W) (the whitened prior is N(0, I)); the off-diagonal entries are not computed.
            whitened = solve_lower(chol.to_dense().type(induc_data_covar.dtype), induc_data_covar)
            mean_update = (whitened * block_mean.unsqueeze(-1)).sum(-2)
            if variational_inducing_covar is None:  # S = 0
                variance_update = -whitened.pow(2).sum(-2)
            else:
                middle = add_to_diagonal(variational_inducing_covar.to_dense(), -1.0)
                variance_update = ((middle @ whitened) * whitened).sum(-2)
            variances = prior.diagonal(data) + self.jitter_val + variance_update
            return prior.mean(data) + mean_update, DiagLinearOperator(variances)
        mean_update, covariance_update = compute_predictive_updates(
            self,
            chol=chol,
            induc_data_covar=induc_data_covar,
            inducing_values=block_mean,
            variational_inducing_covar=variational_inducing_covar,
            prior_covar=self.prior_distribution.lazy_covariance_matrix,
            diag=diag,
        )
        covariance = SumLinearOperator(prior.covariance(data, data).add_jitter(self.jitter_val), covariance_update)
        if trace_mode.on():
            covariance = covariance.to_dense()
        return prior.mean(data) + mean_update, covariance

    def forward(
        self,
        x: Tensor,
        inducing_points: Tensor,
        inducing_values: Tensor,
        variational_inducing_covar: LinearOperator | None = None,
        diag: bool = True,
        **kwargs,
    ) -> MultivariateNormal:
        if self._residual_coordinates is not None:
            data_values = self.mean_basis.fused_values(x, [], self.mean_coefficients, **kwargs).data_values
        else:
            values = self.mean_basis.fused_values(x, [self.inducing_points], self.mean_coefficients, **kwargs)
            (beta_values,), data_values = values.row_values, values.data_values
            if values.prior is not None and self.training and diag:
                # One model.forward per step: the mean basis's joint prior at [beta; C; x; gamma] holds K_beta,
                # K_beta,x and K_xx too.
                prior = values.prior
                chol = self._beta_cholesky(to_linear_operator(prior.dense(0, 0)))
                coordinates = self._set_residual_coordinates(beta_values, chol)
                sampled = self.mean_basis.sampled_rows
                if sampled is not None and not self.kl_data_landmarks:  # input set 1 holds the drawn rows
                    self._sampled_residual(sampled, chol, prior.dense(1, 0))
                elif sampled is not None:  # and set 2 the data: with beta, the landmarks
                    # One block of [beta; C; x] with itself, sliced (landmark_blocks): every block of the joint prior
                    # sliced separately would cost a gradient as large as all its inputs, gamma included.
                    small = prior.dense(slice(0, 3), slice(0, 3))
                    landmark_covariance, row_block = landmark_blocks(small, prior.sizes[0], prior.sizes[1])
                    self._residual_quadratic_form = self._data_landmark_residual(
                        sampled, torch.cat([beta_values, data_values], -1), landmark_covariance, row_block
                    )
                blocks = JointPrior(prior.distribution, prior.sizes[:-1], prior.lean)  # without gamma: data last
                mean, covariance = self._predictive(
                    blocks,
                    chol,
                    self._covariance_block_mean(inducing_values, coordinates),
                    variational_inducing_covar,
                    diag,
                )
                return MultivariateNormal(mean + data_values, covariance)
            self._set_residual_coordinates(beta_values)
            sampled = self.mean_basis.sampled_rows
            if sampled is not None:
                drawn = self.mean_inducing_points[sampled.indices]
                block = self.mean_basis.cross_covariance(drawn, self.inducing_points).to_dense()
                self._sampled_residual(sampled, self._beta_cholesky(), block)
        block_mean = self._covariance_block_mean(inducing_values, self.residual_coordinates())
        prior = joint_prior(self.model, inducing_points, x, **kwargs)
        chol = self._cholesky_factor(to_linear_operator(prior.dense(0, 0)).add_jitter(self.jitter_val))
        mean, covariance = self._predictive(prior, chol, block_mean, variational_inducing_covar, diag)
        return MultivariateNormal(mean + data_values, covariance)

    def __call__(self, x: Tensor, prior: bool = False, diag: bool = True, **kwargs) -> MultivariateNormal:
        x = checked_inputs(x, self.inducing_points, self.model)
        if not self.training:
            # GPyTorch keeps its eval-mode factors whatever happens to the hyperparameters; these do not go stale.
            self._clear_cache_if_stale(self.model)
        return super().__call__(x, prior=prior, diag=diag, **kwargs)

    # ------------------------------------------------------------------ growth
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
        mean_points = (
            None
            if mean_points is None
            else checked_basis_points(mean_points, self.inducing_points, self.model, "mean_points")
        )
        target = None
        if inducing_points is not None:
            old = self.inducing_points
            points = checked_basis_points(inducing_points, old, self.model, "inducing_points")
            new = torch.cat([old, points.expand(*old.shape[:-2], -1, -1)], dim=-2)
            q = self.variational_distribution
            old_chol = self._beta_cholesky()
            block_mean = self._covariance_block_mean(q.mean, self.residual_coordinates())
            # A = L^-1 K_{b b'}: the old whitened coordinates of the new covariance basis functions
            cross_covariance = self.mean_basis.cross_covariance(old, new).to_dense()
            projection = old_chol.solve(cross_covariance.type(old_chol.dtype)).type(old.dtype)
            new_prior = self.model.forward(new).lazy_covariance_matrix.add_jitter(self.jitter_val)
            excess = add_to_diagonal(q.covariance_matrix, -1.0)
            new_covariance = new_prior.to_dense() + projection.mT @ excess @ projection
            unwhitened_block = (projection.mT @ block_mean.unsqueeze(-1)).squeeze(-1)
            # New gamma points come with zero coefficients, so the mean basis at beta' is known already.
            new_values = self.mean_basis.values(new, self.mean_coefficients)
            self._clear_cache()  # the next factor is of K_beta', not K_beta
            new_chol = self._cholesky_factor(new_prior)
            self._clear_cache()

            def whiten(tensor: Tensor) -> Tensor:
                return new_chol.solve(tensor.type(new_chol.dtype)).type(old.dtype)

            whitened_block = whiten(unwhitened_block.unsqueeze(-1)).squeeze(-1)
            shift = -self._covariance_block_mean(
                torch.zeros_like(whitened_block), whiten(new_values.unsqueeze(-1)).squeeze(-1)
            )
            # Far-apart or nearly coincident new points can leave the whitened covariance indefinite after rounding:
            # factorize it in float64 with escalating jitter (a warning), or fail with a NotPSDError naming it.
            factor = jittered_cholesky(
                symmetrized(whiten(whiten(new_covariance).mT)), name="S_w grown with the covariance basis"
            )
            target = MultivariateNormal(whitened_block + shift, CholLinearOperator(TriangularLinearOperator(factor)))
            replace_tensor(self, "inducing_points", new)
        if mean_points is not None:
            self.mean_basis.grow(mean_points)
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
