from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.utils.memoize import cached
from linear_operator import to_linear_operator
from linear_operator.operators import DiagLinearOperator, MatmulLinearOperator
from torch import Tensor

from ..linalg import add_to_diagonal, jittered_cholesky, solve_lower, whitened_kl
from ._direct_variational_strategy import _DirectVariationalStrategy
from ._replace_tensor import replace_tensor
from ._strategy_multivariate_normal import _StrategyMultivariateNormal
from .checked_inputs import checked_basis_points
from .decoupled_variational_distribution import DecoupledVariationalDistribution
from .joint_prior import joint_prior
from .mean_basis import EXACT_KL_SIZE, MeanBasis, MeanBasisAttribute, load_renamed_keys


class DecoupledCurvature(NamedTuple):
    r"""What a :class:`DecoupledVariationalStrategy` records of the loss :math:`\mathcal L` in the backward passes of
    its training calls while ``record_curvature`` is set, since :meth:`DecoupledVariationalStrategy.reset_curvature`:
    the inputs of every call (concatenated), per datum the derivatives of :math:`\mathcal L` in its marginal mean
    :math:`m_n` and variance :math:`s_n`, the KL's weight in :math:`\mathcal L` (summed), and, for each KL whose
    quadratic form was column-sampled, its sampled rows with its weight.
    :class:`~gpytorch_decoupled.optim.MeanBasisAdam` steps the strategy with them
    (:ref:`derivations-decoupled-step`)."""

    inputs: Tensor  # x of the recorded calls, (..., n, D)
    variance_weights: Tensor  # 2 dL/ds_n, (..., n)
    mean_weights: Tensor  # b (dL/dm_n)^2, b the number of data of the datum's call, (..., n)
    kl_weight: Tensor  # dL/dKL, (...)
    kl_samples: tuple[tuple[Tensor, Tensor], ...] = ()  # per column-sampled KL: its rows of K_alpha and dL/dKL


class DecoupledVariationalStrategy(_DirectVariationalStrategy):
    r"""
    The decoupled (SVDGP) variational GP of `Cheng & Boots (2017)`_: a mean basis :math:`\alpha`
    (``mean_inducing_points``, :math:`M_\alpha` points, possibly :math:`10^5` or more) and a separate covariance basis
    :math:`\beta` (``inducing_points``, :math:`M_\beta` points), with the inverse parametrization of
    :class:`~gpytorch_decoupled.variational.DecoupledVariationalDistribution`
    (:math:`\mathbf a`, :math:`\mathbf B = \mathbf L_B\mathbf L_B^\top`):

    .. math::

        m(\mathbf x) &= \mu_0(\mathbf x) + \mathbf k_{\mathbf x\alpha}\mathbf a, \\
        s(\mathbf x, \mathbf x') &= k(\mathbf x, \mathbf x')
            - \mathbf k_{\mathbf x\beta}\mathbf L_B \mathbf H^{-1}\mathbf L_B^\top\mathbf k_{\beta\mathbf x'},
        \qquad \mathbf H = \mathbf I + \mathbf L_B^\top\mathbf K_\beta\mathbf L_B,

    (`Cheng & Boots (2017)`_, App. B.1.1 and B.2.1;
    :math:`\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top = (\mathbf B^{-1} + \mathbf K_\beta)^{-1}` stays defined for
    singular :math:`\mathbf B`), and the KL of the process (`Cheng & Boots (2017)`_, App. B.1.1, Theorem 1)

    .. math::

        \mathrm{KL}[q \Vert p] = \tfrac12 \mathbf a^\top\mathbf K_\alpha\mathbf a
        + \tfrac12\big[\log\lvert\mathbf H\rvert + \operatorname{tr}(\mathbf H^{-1}) - M_\beta\big],

    using :math:`\operatorname{tr}(\mathbf K_\beta\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top) = M_\beta -
    \operatorname{tr}(\mathbf H^{-1})`. :math:`\mathbf H \succeq \mathbf I` whatever :math:`\mathbf K_\beta` is, so
    nothing here factors :math:`\mathbf K_\beta` itself: the model stays well conditioned even when covariance basis
    points coincide. :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a` is exact for a mean basis of up to
    ``exact_kl_size`` (4,096) points and in eval mode (one sweep over cache-sized tiles of the upper triangle of
    :math:`\mathbf K_\alpha`, memory of one tile), and for a larger basis estimated without bias in training from
    ``num_kl_columns`` sampled rows of :math:`\mathbf K_\alpha` (:ref:`derivations-column-sampled-kl`), so a training
    step then costs :math:`O(N_b M_\alpha + b M_\alpha + N_b M_\beta^2 + M_\beta^3)` and memory linear in
    :math:`M_\alpha`.

    The posterior covariance is exactly the S-form of SVGP with :math:`\mathbf S = (\mathbf K_\beta^{-1} +
    \mathbf B)^{-1} \preceq \mathbf K_\beta`: variances never exceed the prior's. The parametrization is not convex and
    has no natural gradient of both blocks together (Salimbeni et al. 2018, App. C.1;
    :ref:`derivations-decoupled-natural-gradient`), and first-order steps stall on it: :math:`\mathbf K_\alpha` is
    ill-conditioned, and :math:`\mathbf B` must grow with the data's precision. Step the mean coefficients with
    :class:`~gpytorch_decoupled.optim.MeanBasisAdam` and the rest with Adam: on this strategy it takes a
    natural-gradient step on :math:`\mathbf B` and a damped Gauss-Newton step on :math:`\mathbf a` from the curvature
    the strategy records (:ref:`derivations-decoupled-step`). ``jacobi_preconditioning`` optimizes
    :math:`\mathbf a_0 = \operatorname{diag}(\mathbf K_\alpha)\mathbf a` and
    :math:`\mathbf L_0 = \operatorname{diag}(\mathbf K_\beta)\mathbf L_B` instead (`Cheng & Boots (2017)`_, App. A.1;
    :ref:`derivations-jacobi`), which makes plain Adam's steps independent of the prior's amplitude.

    Cheng & Boots' own recipe adds per-basis length-scales
    (:class:`~gpytorch_decoupled.kernels.GeneralizedRBFKernel`, as extra trailing columns of the inducing points) and
    grows both bases from incoming mini-batches (:class:`~gpytorch_decoupled.optim.OnlineBasisGrowth`).

    The mean basis is the :class:`~gpytorch_decoupled.variational.MeanBasis` component ``mean_basis`` (its
    coefficients stay the distribution's variational parameter). Values computed once and used again are explicit
    attributes, None until computed and forgotten with GPyTorch's caches (every training call, ``train()``/``eval()``,
    ``load_state_dict``, ``.to()``): ``_inner_cholesky_factor``, the factor :math:`\mathbf R` of :math:`\mathbf H`,
    from the forward pass of a training step to its KL and, in eval mode, across predictions; the mean basis keeps this
    step's sample of :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a` itself.

    While the attribute ``record_curvature`` is True (:class:`~gpytorch_decoupled.optim.MeanBasisAdam` sets it), every
    training call with gradients adds a zero vector to the marginal variances at the data (the values do not change),
    and backward hooks on it, on the mean at the data and on the KL record what :class:`DecoupledCurvature` holds
    (:attr:`curvature`): like ``.grad``, over backward passes until :meth:`reset_curvature`.

    :param model: Model this strategy is applied to (typically the :class:`~gpytorch.models.ApproximateGP` itself).
    :param inducing_points: Covariance basis :math:`\beta`, ``(..., M_beta, D)``.
    :param variational_distribution: A :class:`~gpytorch_decoupled.variational.DecoupledVariationalDistribution`
        with ``num_mean_points=M_alpha`` and ``num_inducing_points=M_beta``.
    :param mean_inducing_points: Mean basis :math:`\alpha`, ``(M_alpha, D)``, shared by every latent of the batch.
    :param learn_inducing_locations: Learn :math:`\alpha` and :math:`\beta` (default True).
    :param num_kl_columns: Rows :math:`b` of :math:`\mathbf K_\alpha` sampled for the training KL of a mean basis
        larger than ``exact_kl_size`` (the paper's 64); ``None`` always computes it exactly.
    :param kl_block_size: Rows of :math:`\mathbf K_\alpha` evaluated at once by the exact KL of a kernel without a
        fused product.
    :param jacobi_preconditioning: Scale the variational parameters by the prior variances at their basis points.
    :param jitter_val: Initial jitter for :math:`\mathbf H` should rounding make it indefinite (default: none, then
        escalating).
    :param exact_kl_size: Mean bases of at most this many points have the exact KL in training too (zero variance).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import DecoupledVariationalDistribution, DecoupledVariationalStrategy
        >>> class DecoupledGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, beta, alpha):
        ...         q = DecoupledVariationalDistribution(alpha.size(0), beta.size(0))
        ...         super().__init__(DecoupledVariationalStrategy(self, beta, q, alpha))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 500).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(500)
        >>> model, likelihood = DecoupledGP(x[::25].clone(), x[::5].clone()), gpytorch.likelihoods.GaussianLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=500)
        >>> optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
        >>> for _ in range(20):
        ...     optimizer.zero_grad()
        ...     loss = -mll(model(x), y)
        ...     loss.backward()
        ...     optimizer.step()
        >>> model.eval()(x[:3]).variance.le(model(x[:3], prior=True).variance).all()
        tensor(True)

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """

    _step_attributes = ("_inner_cholesky_factor",)
    _inner_cholesky_factor: Tensor | None = None
    #: Record :class:`DecoupledCurvature` in the backward passes of training calls.
    record_curvature: bool = False

    mean_inducing_points = MeanBasisAttribute("inducing_points", r"The mean basis :math:`\alpha`, ``(M_alpha, D)``.")
    num_kl_columns = MeanBasisAttribute("num_kl_columns", r"Rows of :math:`\mathbf K_\alpha` sampled for the KL.")
    exact_kl_size = MeanBasisAttribute("exact_kl_size", "Mean bases of at most this many points have an exact KL.")

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: DecoupledVariationalDistribution,
        mean_inducing_points: Tensor,
        learn_inducing_locations: bool = True,
        num_kl_columns: int | None = 64,
        kl_block_size: int = 4096,
        jacobi_preconditioning: bool = False,
        jitter_val: float | None = None,
        exact_kl_size: int = EXACT_KL_SIZE,
    ):
        if not isinstance(variational_distribution, DecoupledVariationalDistribution):
            raise TypeError(
                "DecoupledVariationalStrategy needs a DecoupledVariationalDistribution, got "
                f"{type(variational_distribution).__name__}."
            )
        super().__init__(model, inducing_points, variational_distribution, learn_inducing_locations, jitter_val)
        self.mean_basis = MeanBasis(
            model,
            mean_inducing_points,
            self.inducing_points,
            learn_inducing_locations,
            num_kl_columns,
            kl_block_size,
            coefficient_source=variational_distribution,
            exact_kl_size=exact_kl_size,
        )
        sizes = (self.mean_inducing_points.size(-2), self.inducing_points.size(-2))
        if (variational_distribution.num_mean_points, variational_distribution.num_inducing_points) != sizes:
            raise ValueError(
                f"the variational distribution is for M_alpha={variational_distribution.num_mean_points}, "
                f"M_beta={variational_distribution.num_inducing_points}, but the bases have sizes {sizes}."
            )
        self.jacobi_preconditioning = jacobi_preconditioning
        self.register_load_state_dict_pre_hook(
            functools.partial(load_renamed_keys, {"mean_inducing_points": "mean_basis.inducing_points"}, ())
        )

    # ------------------------------------------------------------------ parameters
    def _prior_variances(self, points: Tensor) -> Tensor:
        return joint_prior(self.model, points).diagonal(0)

    @property
    @cached(name="mean_coefficients_memo")
    def mean_coefficients(self) -> Tensor:
        r""":math:`\mathbf a`, ``(..., M_alpha)`` (computed once per training step)."""
        coefficients = self._variational_distribution().mean_coefficients
        if self.jacobi_preconditioning:
            coefficients = coefficients / self._prior_variances(self.mean_inducing_points)
        return coefficients

    @property
    @cached(name="precision_factor_memo")
    def precision_factor(self) -> Tensor:
        r""":math:`\mathbf L_B`, ``(..., M_beta, M_beta)`` lower triangular (computed once per training step)."""
        factor = self._variational_distribution().precision_factor
        if self.jacobi_preconditioning:
            factor = factor / self._prior_variances(self.inducing_points).unsqueeze(-1)
        return factor

    @property
    @cached(name="prior_distribution_memo")
    def prior_distribution(self) -> MultivariateNormal:
        r"""The prior :math:`p(f(\beta)) = \mathcal N(\mu_0(\beta), \mathbf K_\beta)` at the covariance basis."""
        prior = joint_prior(self.model, self.inducing_points)
        return MultivariateNormal(prior.mean(0), to_linear_operator(prior.dense(0, 0)))

    @property
    @cached(name="variational_distribution_memo")
    def variational_distribution(self) -> MultivariateNormal:
        r"""
        The process at the covariance basis, :math:`q(f(\beta)) = \mathcal N(\mu_0(\beta) + \mathbf K_{\beta\alpha}
        \mathbf a,\; \mathbf K_\beta - \mathbf K_\beta\mathbf L_B\mathbf H^{-1}\mathbf L_B^\top\mathbf K_\beta)`, whose
        divergence from :attr:`prior_distribution` is the strategy's KL of the whole process (also under GPyTorch's
        multitask wrappers, which compute the KL from these two distributions). The parameters themselves are the
        distribution's (``strategy._variational_distribution()``).
        """
        prior = self.prior_distribution
        beta_covariance = prior.lazy_covariance_matrix.to_dense()
        chol = self._inner_cholesky(beta_covariance)
        reduction = solve_lower(chol.to(beta_covariance.dtype), self.precision_factor.mT @ beta_covariance)
        mean = prior.mean + self.mean_basis.values(self.inducing_points, self.mean_coefficients)
        return _StrategyMultivariateNormal(mean, beta_covariance - reduction.mT @ reduction, strategy=self)

    def _inner_cholesky(self, beta_covariance: Tensor) -> Tensor:
        r"""
        Float64 Cholesky factor :math:`\mathbf R` of :math:`\mathbf H = \mathbf I + \mathbf L_B^\top\mathbf K_\beta
        \mathbf L_B`, kept (``_inner_cholesky_factor``) for the KL of the same step and for predictions in eval mode.
        """
        chol = self._inner_cholesky_factor
        # H has the batch shape of K_beta and of L_B together (latents may share one kernel and one beta).
        latent_shape = self._variational_distribution.precision_factor.shape[:-2]
        if chol is not None and chol.shape[:-2] == torch.broadcast_shapes(beta_covariance.shape[:-2], latent_shape):
            return chol
        factor = self.precision_factor.double()
        inner = factor.mT @ beta_covariance.double() @ factor
        inner = add_to_diagonal(inner, 1.0)
        chol = jittered_cholesky(inner, jitter=self._jitter_val, name="DecoupledVariationalStrategy H")
        self._inner_cholesky_factor = chol
        return chol

    def mean_basis_quadratic_form(self, indices: Tensor | None = None) -> Tensor:
        r"""
        :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a`: exact in eval mode, with ``num_kl_columns=None`` or for a
        mean basis of at most ``exact_kl_size`` points; in training otherwise, the unbiased column-sampled estimate of
        this step (drawn in the forward pass, or here if no forward pass came first); for explicit ``indices``, the
        estimate for that sample of rows of :math:`\mathbf K_\alpha`.
        """
        return self.mean_basis.quadratic_form(self.mean_coefficients, indices)

    # ------------------------------------------------------------------ curvature of the loss
    @property
    def curvature(self) -> DecoupledCurvature | None:
        r"""The :class:`DecoupledCurvature` recorded since :meth:`reset_curvature`, or None if no backward pass has
        reached both the data terms and the KL."""
        calls = self.__dict__.get("_curvature_calls", [])
        kl_weight = self.__dict__.get("_kl_weight")
        if not calls or kl_weight is None:
            return None
        inputs = torch.cat([call["inputs"] for call in calls], dim=-2)
        weights = {
            name: torch.cat([call[name] for call in calls], dim=-1) for name in ("variance_weights", "mean_weights")
        }
        kl_samples = tuple(self.__dict__.get("_kl_samples", []))
        return DecoupledCurvature(inputs=inputs, kl_weight=kl_weight, kl_samples=kl_samples, **weights)

    def reset_curvature(self) -> None:
        """Forgets the recorded curvature (:class:`~gpytorch_decoupled.optim.MeanBasisAdam` does, in ``zero_grad``)."""
        self.__dict__.update(_curvature_calls=[], _kl_weight=None, _kl_samples=[])

    def _record_kl_weight(self, rows: Tensor | None, gradient: Tensor) -> None:
        previous = self.__dict__.get("_kl_weight")
        self.__dict__["_kl_weight"] = gradient.detach() if previous is None else previous + gradient.detach()
        if rows is not None:
            self.__dict__.setdefault("_kl_samples", []).append((rows, gradient.detach()))

    def _curvature_probe(self, x: Tensor, mean: Tensor, shape: torch.Size) -> Tensor:
        r"""A zero vector :math:`\mathbf z` of the marginal variances' shape, for the caller to add to them, so that
        :math:`\partial\mathcal L/\partial\mathbf z = \partial\mathcal L/\partial\mathbf s`, with the hooks that
        record it and :math:`\partial\mathcal L/\partial\mathbf m` for this call (:class:`DecoupledCurvature`)."""
        zeros = torch.zeros(shape, dtype=x.dtype, device=x.device)
        call = {"inputs": x.detach(), "variance_weights": zeros, "mean_weights": zeros}

        def record(name: str, value: Tensor) -> None:
            calls = self.__dict__.setdefault("_curvature_calls", [])
            if not any(entry is call for entry in calls):  # the call's first hook
                calls.append(call)
            call[name] = call[name] + value.detach()

        if mean.requires_grad:
            mean.register_hook(lambda gradient: record("mean_weights", gradient.pow(2) * gradient.size(-1)))
        probe = torch.zeros(shape, dtype=x.dtype, device=x.device, requires_grad=True)
        probe.register_hook(lambda gradient: record("variance_weights", 2 * gradient))
        return probe

    @torch.no_grad()
    def grow_bases(self, mean_points: Tensor | None = None, inducing_points: Tensor | None = None) -> None:
        r"""
        Appends points to the mean basis :math:`\alpha` (coefficients 0) and to the covariance basis :math:`\beta`
        (zero rows and columns of :math:`\mathbf L_B`), which leaves the process :math:`q` exactly unchanged
        (:ref:`derivations-basis-growth`); :class:`~gpytorch_decoupled.optim.OnlineBasisGrowth` grows the bases from
        mini-batches this way.

        :param mean_points: New :math:`\alpha` points, ``(n, D)``.
        :param inducing_points: New :math:`\beta` points, ``(n, D)``, shared by every latent of the batch.
        """
        distribution = self._variational_distribution
        points_like = self.inducing_points
        mean_points = (
            None if mean_points is None else checked_basis_points(mean_points, points_like, self.model, "mean_points")
        )
        if inducing_points is not None:
            old = self.inducing_points
            points = checked_basis_points(inducing_points, old, self.model, "inducing_points").expand(
                *old.shape[:-2], -1, -1
            )
            replace_tensor(self, "inducing_points", torch.cat([old, points], dim=-2))
            padding = (0, points.size(-2), 0, points.size(-2))
            replace_tensor(
                distribution, "precision_factor", torch.nn.functional.pad(distribution.precision_factor, padding)
            )
            distribution.num_inducing_points = self.inducing_points.size(-2)
        if mean_points is not None:
            self.mean_basis.grow(mean_points)
            distribution.num_mean_points = self.mean_inducing_points.size(-2)
        self._clear_cache()

    # ------------------------------------------------------------------ GPyTorch interface
    def _predictive_distribution(self, x: Tensor, inducing_points: Tensor, diag: bool, **kwargs) -> MultivariateNormal:
        r""":math:`q(f(\mathbf x))` of the S-form above, from one evaluation of the prior at :math:`[\beta; \mathbf x]`
        and the mean basis at :math:`\mathbf x` (fused with this step's sampled KL rows in training)."""
        prior = joint_prior(self.model, inducing_points, x, **kwargs)
        beta_covariance = prior.dense(0, 0)
        beta_data = prior.dense(0, 1)

        chol = self._inner_cholesky(beta_covariance)
        factor = self.precision_factor
        # V = R^-1 L_B^T K_bx, so that the variance reduction is ||V_:n||^2 (Cheng & Boots 2017, App. B.2.1)
        reduction = solve_lower(chol.to(beta_data.dtype), factor.mT @ beta_data)
        mean = prior.mean(1) + self.mean_basis.fused_values(x, [], self.mean_coefficients, **kwargs).data_values
        probe = None
        if self.training and self.record_curvature and torch.is_grad_enabled():
            probe = self._curvature_probe(x, mean, torch.broadcast_shapes(mean.shape, reduction.shape[:-2] + (1,)))
        if diag and self.training:
            variance = prior.diagonal(1) - reduction.pow(2).sum(-2)
            return MultivariateNormal(mean, DiagLinearOperator(variance if probe is None else variance + probe))
        covariance = prior.covariance(1, 1) + MatmulLinearOperator(reduction.mT.neg(), reduction)
        return MultivariateNormal(mean, covariance if probe is None else covariance + DiagLinearOperator(probe))

    def kl_divergence(self) -> Tensor:
        chol = self._inner_cholesky_factor
        latent_shape = self._variational_distribution.precision_factor.shape[:-2]
        # The factor of this step's forward pass, where its inputs added no batch dimensions: no second evaluation of
        # K_beta (nor its backward pass) for the KL.
        if chol is None or chol.shape[:-2] != torch.broadcast_shapes(self.inducing_points.shape[:-2], latent_shape):
            chol = self._inner_cholesky(self.prior_distribution.lazy_covariance_matrix.to_dense())
        covariance_kl = whitened_kl(chol)
        kl = 0.5 * self.mean_basis_quadratic_form() + covariance_kl.to(self.inducing_points.dtype)
        if self.training and self.record_curvature and kl.requires_grad:
            kl.register_hook(functools.partial(self._record_kl_weight, self.mean_basis.sampled_indices))
        return kl
