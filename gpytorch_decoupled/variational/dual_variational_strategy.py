from __future__ import annotations

from typing import NamedTuple

import torch
from gpytorch import settings
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import GaussianLikelihood, Likelihood
from gpytorch.models import ApproximateGP
from gpytorch.utils.memoize import cached
from gpytorch.variational import IndependentMultitaskVariationalStrategy
from linear_operator.operators import DiagLinearOperator, MatmulLinearOperator, RootLinearOperator
from torch import Tensor

from ..linalg import (
    add_to_diagonal,
    all_finite,
    cholesky_logdet,
    cholesky_solve,
    congruence,
    jittered_cholesky,
    solve_lower,
    solve_lower_transpose,
    weighted_gram,
    whitened_kl,
)
from ._direct_variational_strategy import _DirectVariationalStrategy
from ._fantasies import checked_fantasy_data, fantasy_copy, latent_fantasy_data, task_noise_variances
from ._strategy_multivariate_normal import _StrategyMultivariateNormal
from .dual_variational_distribution import DualVariationalDistribution
from .joint_prior import JointPrior, joint_prior


class DualPosteriorFactors(NamedTuple):
    r"""
    :math:`q(\mathbf u)` in whitened coordinates :math:`\mathbf v = \mathbf L_K^{-1}\mathbf u`:
    :math:`q(\mathbf v) = \mathcal N(\mathbf H^{-1}\mathbf h, \mathbf H^{-1})`.
    """

    prior_cholesky: Tensor  # L_K, K_uu = L_K L_K^T
    whitened_site_precision: Tensor  # P = L_K^T L_2 L_K
    inner_cholesky: Tensor  # L_H, H = I + P = L_H L_H^T
    whitened_site_mean: Tensor  # h = L_K^T ell_1
    whitened_mean: Tensor  # H^{-1} h


class DualSiteStatistics(NamedTuple):
    r"""What the E-step needs at a mini-batch, computed without an autograd graph."""

    prior_mean: Tensor  # m_0(x), (..., B)
    centred_mean: Tensor  # mu_i - m_0(x_i), (..., B)
    variance: Tensor  # v_i, (..., B)
    whitened_cross: Tensor  # W = L_K^{-1} K_ux, (..., M, B); the projections are a_i = K_uu^{-1} k_ui = L_K^{-T} w_i
    factors: DualPosteriorFactors  # q(u) before the step


class DualVariationalStrategy(_DirectVariationalStrategy):
    r"""
    The dual parameterization of SVGP, t-SVGP (`Adam et al. (2021)`_): :math:`q(\mathbf u)` is the prior
    :math:`\mathcal N(\mathbf 0, \mathbf K_{\mathbf{uu}})` times the Gaussian sites of a
    :class:`~gpytorch_decoupled.variational.DualVariationalDistribution`, unwhitened. With the summaries
    :math:`\bar{\boldsymbol\lambda}_1 = \mathbf K_{\mathbf{uu}}\boldsymbol\ell_1`,
    :math:`\bar{\boldsymbol\Lambda}_2 = \mathbf K_{\mathbf{uu}}\mathbf L_2\mathbf K_{\mathbf{uu}}` and
    :math:`\mathbf R = \mathbf K_{\mathbf{uu}} + \bar{\boldsymbol\Lambda}_2`, the predictive (`Adam et al. (2021)`_,
    App. C, eq. 49, with the subscripts restored that the printed equation lost: :ref:`derivations-tsvgp-predictive`) is

    .. math::

        \mathbb E[f(\mathbf x)] = \mu_0(\mathbf x) + \mathbf k_{\mathbf x\mathbf u}\mathbf R^{-1}
            \bar{\boldsymbol\lambda}_1, \qquad
        \operatorname{Cov}[f(\mathbf x), f(\mathbf x')] = k(\mathbf x, \mathbf x')
            - \mathbf k_{\mathbf x\mathbf u}\mathbf K_{\mathbf{uu}}^{-1}\mathbf k_{\mathbf u\mathbf x'}
            + \mathbf k_{\mathbf x\mathbf u}\mathbf R^{-1}\mathbf k_{\mathbf u\mathbf x'},

    and the KL (eq. 51)

    .. math::

        \mathrm{KL}[q \Vert p] = \tfrac12\big[\operatorname{tr}(\mathbf R^{-1}\mathbf K_{\mathbf{uu}}) - M
            + \bar{\boldsymbol\lambda}_1^\top\mathbf R^{-1}\mathbf K_{\mathbf{uu}}\mathbf R^{-1}
            \bar{\boldsymbol\lambda}_1 + \log\lvert\mathbf R\rvert - \log\lvert\mathbf K_{\mathbf{uu}}\rvert\big].

    Both are evaluated through :math:`\mathbf R = \mathbf L_K\mathbf H\mathbf L_K^\top` with
    :math:`\mathbf H = \mathbf I + \mathbf L_K^\top\mathbf L_2\mathbf L_K \succeq \mathbf I`, so the only
    factorizations are of :math:`\mathbf K_{\mathbf{uu}}` and of the well-conditioned :math:`\mathbf H`
    (:math:`O(M^3)`, float64 with escalating jitter).

    Training alternates two steps (`Adam et al. (2021)`_, Algorithm 2): the E-step
    :class:`~gpytorch_decoupled.optim.DualEStep` sets the sites in closed form (a natural-gradient step on :math:`q`,
    with no autograd graph), and the M-step maximizes :class:`~gpytorch_decoupled.mlls.DualVariationalELBO` over the
    hyperparameters and inducing inputs with any torch optimizer, the sites held fixed. Because :math:`q_\theta` is
    re-derived from the sites at every :math:`\theta`, the M-step objective is the "tighter bound"
    :math:`\tilde{\mathcal L}(\theta)` of `Adam et al. (2021)`_, App. B, eqs. 39-41 (:ref:`derivations-tsvgp-m-step`);
    its value and gradient equal those of the ELBO with :math:`q` held fixed at a converged E-step.

    **Training loops.** The sites start at zero (:math:`q` is the prior) and move only through the E-step, never by
    gradients: a second training forward pass with gradients while every site is still zero (no E-step after the
    first) raises a ``RuntimeError`` that names the call to add (``DualEStep(...).step(x_batch, y_batch)`` after
    ``loss.backward()``), rather than fitting the hyperparameters to the prior. With BoTorch,
    :class:`~gpytorch_decoupled.botorch.SingleTaskVariationalGP` and ``fit_gpytorch_mll`` run the E-steps.

    The factors of :math:`q` (:meth:`posterior_factors`) are kept in the attribute ``_posterior_factors`` from their
    first use in a training step to the step's KL, and in eval mode across predictions; like GPyTorch's caches they are
    dropped on every training call, ``train()``/``eval()``, ``load_state_dict`` and ``.to()``. A training forward pass
    also keeps, detached, the marginals it computed at its mini-batch (``_batch_statistics``, with a
    :meth:`state_snapshot` of the model), so that an E-step at the same mini-batch before anything in the model changes
    (after the M-step's ``backward()``, before its optimizer step: the default schedule of
    :class:`~gpytorch_decoupled.optim.DualEStep`) takes them from there instead of evaluating the kernel and
    factorizing again.

    :param model: Model this strategy is applied to (typically the :class:`~gpytorch.models.ApproximateGP` itself).
    :param inducing_points: Inducing inputs :math:`\mathbf Z`, ``(..., M, D)``.
    :param variational_distribution: A :class:`~gpytorch_decoupled.variational.DualVariationalDistribution`.
    :param learn_inducing_locations: Learn :math:`\mathbf Z` in the M-step (default True).
    :param jitter_val: Jitter added to :math:`\mathbf K_{\mathbf{uu}}` (default: GPyTorch's
        ``variational_cholesky_jitter`` for the dtype).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.mlls import DualVariationalELBO
        >>> from gpytorch_decoupled.optim import DualEStep
        >>> from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy
        >>> class DualGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points):
        ...         q = DualVariationalDistribution(inducing_points.size(0))
        ...         super().__init__(DualVariationalStrategy(self, inducing_points, q))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 300).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(300)
        >>> model, likelihood = DualGP(x[::20].clone()), gpytorch.likelihoods.GaussianLikelihood()
        >>> e_step = DualEStep(model, likelihood, num_data=300, lr=1.0)
        >>> objective = DualVariationalELBO(likelihood, model, num_data=300)
        >>> m_step = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
        >>> for _ in range(10):  # EM: a closed-form E-step, then a few M-steps
        ...     e_step.step(x, y)
        ...     for _ in range(5):
        ...         m_step.zero_grad()
        ...         loss = -objective(model(x), y)
        ...         loss.backward()
        ...         m_step.step()
        >>> _ = model.eval()
        >>> bool((model(x).mean - torch.sin(2 * x.squeeze(-1))).abs().mean() < 0.1)
        True

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """

    #: The E-step's default :math:`\beta_{\min}` (the reference code's :math:`\partial\mathrm{VE}/\partial v \le
    #: -10^{-8}`).
    DEFAULT_MIN_CURVATURE: float = 2e-8
    #: Whether the last training forward pass was at the prior (a second one without an E-step in between raises).
    _trained_at_prior: bool = False
    _step_attributes = ("_posterior_factors", "_batch_statistics")
    _posterior_factors: DualPosteriorFactors | None = None
    _batch_statistics: tuple[Tensor, dict[str, Tensor], DualSiteStatistics] | None = None

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: DualVariationalDistribution,
        learn_inducing_locations: bool = True,
        jitter_val: float | None = None,
    ):
        if not isinstance(variational_distribution, DualVariationalDistribution):
            raise TypeError(
                "DualVariationalStrategy needs a DualVariationalDistribution, got "
                f"{type(variational_distribution).__name__}."
            )
        # 1-D inducing points are one input dimension, as in GPyTorch's strategies: (M,) is read as (M, 1).
        num_inducing = inducing_points.size(-2) if inducing_points.dim() > 1 else inducing_points.numel()
        if variational_distribution.num_inducing_points != num_inducing:
            raise ValueError(
                f"the variational distribution is for M={variational_distribution.num_inducing_points} inducing "
                f"points, but {num_inducing} were given."
            )
        super().__init__(model, inducing_points, variational_distribution, learn_inducing_locations, jitter_val)

    @staticmethod
    def of_model(model: ApproximateGP, user: str) -> tuple[DualVariationalStrategy, int | None]:
        r"""
        The dual strategy of :attr:`model` (its own, or the base of an independent multitask wrapper) and the
        wrapper's task dimension (``None`` without a wrapper).

        :param model: The model whose strategy is sought.
        :param user: The class asking, named in the error.
        :raises TypeError: If the model's strategy is neither.
        """
        strategy, task_dim = model.variational_strategy, None
        if isinstance(strategy, IndependentMultitaskVariationalStrategy):
            strategy, task_dim = strategy.base_variational_strategy, strategy.task_dim
        if not isinstance(strategy, DualVariationalStrategy):
            raise TypeError(
                f"{user} needs a model whose variational strategy is a DualVariationalStrategy (optionally inside an "
                f"IndependentMultitaskVariationalStrategy), got {type(model.variational_strategy).__name__}."
            )
        return strategy, task_dim

    # ------------------------------------------------------------------ q(u)
    @property
    @cached(name="prior_distribution_memo")
    def prior_distribution(self) -> MultivariateNormal:
        r"""The prior :math:`p(\mathbf u) = \mathcal N(\mathbf 0, \mathbf K_{\mathbf{uu}})` of the centred inducing
        values (the model's mean function is added to predictions: :ref:`derivations-tsvgp-mean-function`)."""
        prior = self.model.forward(self.inducing_points)
        return MultivariateNormal(
            torch.zeros_like(prior.mean), prior.lazy_covariance_matrix.add_jitter(self.jitter_val)
        )

    def posterior_factors(self, prior_covariance: Tensor | None = None) -> DualPosteriorFactors:
        r"""
        :math:`q(\mathbf u)` from the sites at the current hyperparameters, in whitened coordinates
        (:class:`DualPosteriorFactors`); computed once per training step and cached in eval mode.

        :param prior_covariance: :math:`\mathbf K_{\mathbf{uu}}` (with jitter) when the caller has it already from a
            joint kernel evaluation; evaluated from :attr:`prior_distribution` otherwise.
        """
        if self._posterior_factors is not None:
            return self._posterior_factors
        if prior_covariance is None:
            prior_covariance = self.prior_distribution.lazy_covariance_matrix.to_dense()
        prior_chol = jittered_cholesky(prior_covariance, name="DualVariationalStrategy K_uu")
        site_mean, site_precision = self._variational_distribution()
        if self._variational_distribution.per_datum:
            # Variant C: ell_1 = K_uu^-1 K_uf lambda_1 and L_2 = K_uu^-1 K_uf diag(lambda_2) K_fu K_uu^-1, so in
            # whitened coordinates h = W_f lambda_1 and P = W_f diag(lambda_2) W_f^T with W_f = L_K^-1 K_uf.
            _, _, datum_cross, _ = self._joint_prior(self.checked_inputs(self._variational_distribution.datum_inputs))
            whitened_cross = solve_lower(prior_chol, datum_cross)
            whitened_site_mean = (whitened_cross @ site_mean.unsqueeze(-1)).squeeze(-1)
            whitened_precision = (whitened_cross * site_precision.unsqueeze(-2)) @ whitened_cross.mT
            whitened_sites = whitened_site_mean, whitened_precision
        else:
            whitened_sites = whitened_u_space_sites(prior_chol, site_mean, site_precision)
        self._posterior_factors = whitened_posterior_factors(prior_chol, *whitened_sites)
        return self._posterior_factors

    @property
    @cached(name="variational_distribution_memo")
    def variational_distribution(self) -> MultivariateNormal:
        r""":math:`q(\mathbf u) = \mathcal N(\mathbf m, \mathbf S)` of the centred inducing values, with
        :math:`\mathbf m = \mathbf K_{\mathbf{uu}}\mathbf R^{-1}\bar{\boldsymbol\lambda}_1` and
        :math:`\mathbf S = \mathbf K_{\mathbf{uu}}\mathbf R^{-1}\mathbf K_{\mathbf{uu}}` (eqs. 47-48)."""
        prior_chol, _, inner_chol, _, whitened_mean = self.posterior_factors()
        mean = (prior_chol @ whitened_mean.unsqueeze(-1)).squeeze(-1)
        root = solve_lower(inner_chol, prior_chol.mT).mT  # L_K H^{-T/2}
        return _StrategyMultivariateNormal(mean, RootLinearOperator(root), strategy=self)

    def site_summaries(self) -> tuple[Tensor, Tensor]:
        r"""
        The summaries of the sites at the current hyperparameters (Adam et al. 2021, App. C, eq. 44), the paper's
        Algorithm 2 state:

        .. math::

            \bar{\boldsymbol\lambda}_1 = \mathbf K_{\mathbf{uu}}\boldsymbol\ell_1 = \mathbf K_{\mathbf uf}
            \boldsymbol\lambda_1, \qquad
            \bar{\boldsymbol\Lambda}_2 = \mathbf K_{\mathbf{uu}}\mathbf L_2\mathbf K_{\mathbf{uu}}
            = \mathbf K_{\mathbf uf}\operatorname{diag}(\boldsymbol\lambda_2)\mathbf K_{\mathbf fu}

        (the right-hand forms for per-datum sites), computed as :math:`\mathbf L_K\mathbf h` and
        :math:`\mathbf L_K\mathbf P\mathbf L_K^\top` from the whitened factors.

        :return: :math:`\bar{\boldsymbol\lambda}_1`, ``(..., M)``, and :math:`\bar{\boldsymbol\Lambda}_2`,
            ``(..., M, M)``.
        """
        prior_chol, whitened_precision, _, whitened_site_mean, _ = self.posterior_factors()
        summary_mean = (prior_chol @ whitened_site_mean.unsqueeze(-1)).squeeze(-1)
        summary_precision = prior_chol @ whitened_precision @ prior_chol.mT
        return summary_mean, 0.5 * (summary_precision + summary_precision.mT)

    def site_log_normalizer(self) -> Tensor:
        r"""
        :math:`\log\mathcal Z(\theta) = \log\int p_\theta(\mathbf u)\,t(\mathbf u)\,d\mathbf u` for the unnormalized
        sites :math:`t(\mathbf u) = \exp(\boldsymbol\ell_1^\top\mathbf u - \tfrac12\mathbf u^\top\mathbf L_2\mathbf
        u)` (Adam et al. 2021, App. B, eq. 41, for unnormalized sites: :ref:`derivations-tsvgp-m-step`):

        .. math::

            \log\mathcal Z = -\tfrac12\big(\log\lvert\mathbf R\rvert - \log\lvert\mathbf K_{\mathbf{uu}}\rvert\big)
            + \tfrac12\bar{\boldsymbol\lambda}_1^\top\mathbf R^{-1}\bar{\boldsymbol\lambda}_1
            = -\tfrac12\log\lvert\mathbf H\rvert + \tfrac12\mathbf h^\top\mathbf H^{-1}\mathbf h.
        """
        _, _, inner_chol, whitened_site_mean, whitened_mean = self.posterior_factors()
        return 0.5 * ((whitened_site_mean * whitened_mean).sum(-1) - cholesky_logdet(inner_chol))

    def kl_divergence(self) -> Tensor:
        _, _, inner_chol, _, whitened_mean = self.posterior_factors()
        return whitened_kl(inner_chol, whitened_mean)

    # ------------------------------------------------------------------ q(f)
    def _joint_prior(self, x: Tensor, **kwargs) -> tuple[Tensor, Tensor | None, Tensor, JointPrior]:
        r"""
        The prior mean at :math:`\mathbf x`, :math:`\mathbf K_{\mathbf{uu}}` with jitter (``None`` when
        :math:`\mathbf x` has a larger batch shape than :math:`\mathbf Z`, so that its block would be expanded),
        :math:`\mathbf K_{\mathbf u\mathbf x}`, and the joint prior (whose input set 1 is :math:`\mathbf x`), from one
        evaluation of the prior at :math:`[\mathbf Z; \mathbf x]` (``kwargs`` go to ``model.forward``).
        """
        inducing_points = self.inducing_points
        prior = joint_prior(self.model, inducing_points, x, **kwargs)
        # One kernel evaluation k(Z, [Z; x]) gives both K_uu and K_ux.
        inducing_rows = prior.dense(0, slice(0, 2))
        num_inducing = inducing_points.size(-2)
        prior_covariance = None
        if inducing_points.shape[:-2] == x.shape[:-2]:
            prior_covariance = add_to_diagonal(inducing_rows[..., :num_inducing], self.jitter_val)
        return prior.mean(1), prior_covariance, inducing_rows[..., num_inducing:], prior

    def _marginals(
        self, x: Tensor, factors: DualPosteriorFactors | None = None, **kwargs
    ) -> tuple[DualPosteriorFactors, Tensor, JointPrior, Tensor, Tensor]:
        r"""
        The factors of :math:`q`, the prior mean at :math:`\mathbf x` and the joint prior (input set 1),
        :math:`\mathbf W = \mathbf L_K^{-1}\mathbf K_{\mathbf u\mathbf x}` and :math:`\mathbf L_H^{-1}\mathbf W`,
        from which :math:`q(f(\mathbf x))` has mean :math:`\mu_0 + \mathbf W^\top\mathbf H^{-1}\mathbf h` and
        covariance :math:`\mathbf K_{\mathbf{xx}} - \mathbf W^\top\mathbf W
        + (\mathbf L_H^{-1}\mathbf W)^\top\mathbf L_H^{-1}\mathbf W`.
        """
        prior_mean, prior_covariance, cross, prior = self._joint_prior(x, **kwargs)
        if factors is None:
            factors = self.posterior_factors(prior_covariance)
        whitened_cross = solve_lower(factors.prior_cholesky, cross)
        return factors, prior_mean, prior, whitened_cross, solve_lower(factors.inner_cholesky, whitened_cross)

    def _predictive_distribution(self, x: Tensor, inducing_points: Tensor, diag: bool, **kwargs) -> MultivariateNormal:
        r""":math:`q(f(\mathbf x))` of eq. 49, from the whitened factors of :math:`q` (:meth:`_marginals`)."""
        if self.training and torch.is_grad_enabled():
            # One training pass at the prior is t-SVGP's default schedule (its E-step follows the backward pass); a
            # second one with no E-step in between is a loop that never moves q.
            at_prior = self.at_prior()
            if at_prior and self._trained_at_prior:
                raise RuntimeError(_PRIOR_IN_TRAINING)
            self._trained_at_prior = at_prior
        factors, prior_mean, prior, whitened_cross, reduced_cross = self._marginals(x, **kwargs)
        centred_mean = (whitened_cross * factors.whitened_mean.unsqueeze(-1)).sum(-2)
        mean = prior_mean + centred_mean
        if diag and self.training:
            variance = _marginal_variances(prior.diagonal(1), whitened_cross, reduced_cross)
            if not kwargs:  # what an E-step at this mini-batch needs (see site_statistics)
                detached = (t.detach() for t in (prior_mean, centred_mean, variance, whitened_cross))
                factors = DualPosteriorFactors(*(t.detach() for t in factors))
                statistics = self._site_statistics(*detached, factors)
                self._batch_statistics = (x.detach(), self.state_snapshot(), statistics)
            return MultivariateNormal(mean, DiagLinearOperator(variance.expand(mean.shape)))
        covariance = (
            prior.covariance(1, 1)
            + MatmulLinearOperator(whitened_cross.mT.neg(), whitened_cross)
            + MatmulLinearOperator(reduced_cross.mT, reduced_cross)
        )
        # A fantasy's sites may have a sample batch (of targets) that the covariance does not.
        return MultivariateNormal(mean, covariance.expand(*mean.shape[:-1], *covariance.shape[-2:]))

    def state_snapshot(self) -> dict[str, Tensor]:
        r"""A copy of everything :math:`q` and its marginals depend on: the model's ``state_dict`` (hyperparameters,
        inducing inputs, sites) and the jitter. :meth:`matches_snapshot` compares it exactly with the current state,
        so that values computed at it can be reused safely whatever changed in between (an optimizer step, a
        ``load_state_dict``, a manual assignment)."""
        state = {name: value.detach().clone() for name, value in self.model.state_dict(keep_vars=True).items()}
        state["jitter"] = torch.tensor(self.jitter_val)
        return state

    def matches_snapshot(self, snapshot: dict[str, Tensor]) -> bool:
        """Whether the model's state is exactly (bit for bit, same dtypes and devices) that of ``snapshot``."""
        current = dict(self.model.state_dict(keep_vars=True))
        current["jitter"] = torch.tensor(self.jitter_val)
        return current.keys() == snapshot.keys() and all(
            value.dtype == current[name].dtype
            and value.device == current[name].device
            and torch.equal(value, current[name])
            for name, value in snapshot.items()
        )

    def at_prior(self) -> bool:
        r"""Whether every site is zero, so that :math:`q(\mathbf u)` is the prior: as built, or after
        :meth:`~gpytorch_decoupled.variational.DualVariationalDistribution.reset_sites`."""
        return not any(bool(site.any()) for site in self._variational_distribution())

    @torch.no_grad()
    def site_statistics(self, x: Tensor, factors: DualPosteriorFactors | None = None) -> DualSiteStatistics:
        r"""
        The marginals :math:`q(f_i) = \mathcal N(\mu_i, v_i)` at a mini-batch and the whitened cross-covariance
        :math:`\mathbf W = \mathbf L_K^{-1}\mathbf K_{\mathbf u\mathbf x}` (the projections are
        :math:`\mathbf a_i = \mathbf K_{\mathbf{uu}}^{-1}\mathbf k_{\mathbf u i} = \mathbf L_K^{-\top}\mathbf w_i`),
        without an autograd graph: what the E-step (:class:`~gpytorch_decoupled.optim.DualEStep`) needs.
        :math:`O(BM^2 + M^3)`.

        Those of the last training forward pass are returned as they are if it was at the same inputs and nothing in
        the model has changed since (:meth:`state_snapshot`).

        :param x: Mini-batch inputs, ``(B, D)``.
        :param factors: The factors of :math:`q` at the current hyperparameters and sites when the caller knows them
            (consecutive E-steps at fixed hyperparameters); recomputed otherwise.
        """
        x = self.checked_inputs(x)
        if factors is None and (statistics := self.forward_site_statistics(x)) is not None:
            return statistics
        # Hyperparameters may have moved since the cached factors were computed (an M-step in between).
        self._clear_cache()
        factors, prior_mean, prior, whitened_cross, reduced_cross = self._marginals(x, factors)
        centred_mean = (whitened_cross * factors.whitened_mean.unsqueeze(-1)).sum(-2)
        variance = _marginal_variances(prior.diagonal(1), whitened_cross, reduced_cross)
        return self._site_statistics(prior_mean, centred_mean, variance, whitened_cross, factors)

    def forward_site_statistics(self, x: Tensor) -> DualSiteStatistics | None:
        r"""
        The :meth:`site_statistics` that the last training forward pass kept, if it was at the inputs :attr:`x` (as
        :meth:`checked_inputs` returns them) and nothing in the model has changed since (:meth:`state_snapshot`);
        None otherwise.
        """
        stored = self._batch_statistics
        if stored is None:
            return None
        inputs, snapshot, statistics = stored
        if inputs.shape == x.shape and torch.equal(inputs, x) and self.matches_snapshot(snapshot):
            return statistics
        return None

    @staticmethod
    def site_targets(
        likelihood: Likelihood,
        y: Tensor,
        statistics: DualSiteStatistics,
        min_curvature: float = DEFAULT_MIN_CURVATURE,
        task_dim: int | None = None,
        num_likelihood_samples: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        r"""
        The E-step's natural-gradient targets at a batch's marginals :math:`q(f_i) = \mathcal N(\mu_i, v_i)`
        (:class:`~gpytorch_decoupled.optim.DualEStep`; `Adam et al. (2021)`_, App. E): through the likelihood's
        ``expected_log_prob`` :math:`\mathrm{VE}_i`,

        .. math::

            g_{1,i} = \beta_i(\mu_i - \mu_0(\mathbf x_i)) + \frac{\partial\mathrm{VE}_i}{\partial\mu_i}, \qquad
            g_{2,i} = \beta_i = \max\!\Big(-2\frac{\partial\mathrm{VE}_i}{\partial v_i}, \beta_{\min}\Big).

        For a Gaussian likelihood they do not depend on :math:`q`: :math:`g_{1,i} = (y_i - \mu_0(\mathbf x_i)) /
        \sigma^2`, :math:`g_{2,i} = 1/\sigma^2`.

        :param likelihood: Any GPyTorch likelihood with ``expected_log_prob``.
        :param y: Targets, of the shape the likelihood expects; leading batch dimensions beyond the marginals' (a sample
            batch of targets) give targets of that batch shape.
        :param statistics: The batch's :meth:`site_statistics`.
        :param min_curvature: :math:`\beta_{\min}`.
        :param task_dim: The task dimension of an independent multitask wrapper, if any.
        :param num_likelihood_samples: Monte Carlo samples for likelihoods without quadrature.
        :return: :math:`\mathbf g_1` and :math:`\mathbf g_2`, ``(..., B)`` per latent.
        :raises RuntimeError: If they are not finite.
        """
        mean = statistics.prior_mean + statistics.centred_mean
        if type(likelihood) is GaussianLikelihood and task_dim is None:
            # VE_i = -((y_i - mu_i)^2 + v_i) / (2 sigma^2) - log(2 pi sigma^2) / 2 (GaussianLikelihood's
            # expected_log_prob): its derivatives in closed form, without an autograd pass through it
            noise = likelihood.noise
            mean_gradient = (y - mean) / noise
            variance_gradient = (-0.5 / noise).expand(mean_gradient.shape)
        else:
            mean_gradient, variance_gradient = _expected_log_prob_gradients(
                likelihood, y, mean, statistics.variance, task_dim, num_likelihood_samples
            )
        curvature = (-2.0 * variance_gradient).clamp_min(min_curvature)
        first_target = curvature * statistics.centred_mean + mean_gradient
        if not all_finite(first_target, curvature):
            raise RuntimeError(
                "the likelihood's expected_log_prob has non-finite derivatives at these targets; the sites were not "
                "changed."
            )
        return first_target, curvature

    def get_fantasy_model(
        self,
        inputs: Tensor,
        targets: Tensor,
        likelihood: Likelihood | None = None,
        noise: Tensor | None = None,
    ) -> ApproximateGP:
        r"""
        A new model whose sites include the observations :math:`(\mathbf X_*, \mathbf y_*)` as well, with no refit:
        each new point :math:`i` adds its site :math:`(\lambda_{1,i}, \lambda_{2,i})` (`Adam et al. (2021)`_, eq. 44)
        to the u-space sites, :math:`\boldsymbol\ell_1 \mathrel{+}= \sum_i\mathbf a_i\lambda_{1,i}` and
        :math:`\mathbf L_2 \mathrel{+}= \sum_i\lambda_{2,i}\mathbf a_i\mathbf a_i^\top` with
        :math:`\mathbf a_i = \mathbf K_{\mathbf{uu}}^{-1}\mathbf k_{\mathbf u i}` (per-datum sites: the new points and
        their sites are appended). The sites are the E-step's targets (:meth:`site_targets`) at the model's marginals
        at the new points:

        * **Gaussian likelihood** (or ``noise`` given): :math:`\lambda_{1,i} = (y_i - \mu_0(\mathbf x_i))/\sigma^2`
          and :math:`\lambda_{2,i} = 1/\sigma^2` (in the paper's natural coordinates :math:`\lambda_{2,i} =
          -1/2\sigma^2`), which do not depend on :math:`q`: exact conditioning, the posterior with the sites of all the
          data (after a converged E-step on the old data, Titsias' collapsed posterior of all the data);
        * **any other likelihood**: the sites one E-step with :math:`r = 1` gives the new points at the current
          :math:`q` (an approximation, as the exact posterior is not Gaussian; the old sites are kept). Further
          :class:`~gpytorch_decoupled.optim.DualEStep` steps on the new model refine it.

        This model is left unchanged. Targets with batch dimensions beyond the inputs' (``num_fantasies x batch x k``,
        as BoTorch's ``fantasize`` passes a sample batch) give a batched fantasy model whose predictions have that
        batch shape; :math:`\mathbf L_2` is kept once per batch of inputs where the sites' precisions do not depend on
        the targets (Gaussian).

        **Cost.** :math:`O(kM^2)` for :math:`k` new points (their kernel columns, projections and the rank-:math:`k`
        increment of :math:`\mathbf L_2`), plus the factorizations of :math:`\mathbf K_{\mathbf{uu}}` and of
        :math:`\mathbf H` of the first prediction (:math:`O(M^3)` once per fantasy model and batch of inputs, as after
        any change of the sites, independent of :math:`k` and of the number of fantasies), where a refit (an E-step
        over all :math:`n` points) costs :math:`O(nM^2 + M^3)`.

        :param inputs: New inputs :math:`\mathbf X_*`, ``(..., k, D)`` (``(k,)`` for one input dimension).
        :param targets: New targets :math:`\mathbf y_*`, ``(..., k)``.
        :param likelihood: The likelihood (default: the model's ``likelihood`` attribute).
        :param noise: The new observations' noise variances (Gaussian), broadcastable to the targets, in place of the
            likelihood's (BoTorch passes them for observations of known noise).
        :return: The conditioned copy of the model.
        :raises ValueError: On bad shapes, dtypes, devices, NaN/inf or noise, or without a likelihood, before anything
            is computed.
        :raises NotImplementedError: If the strategy is inside a wrapper other than an independent multitask one with
            tasks in the last latent dimension (whose targets are ``(..., k, T)``, with a
            :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood` without correlated noise), or for per-datum
            sites with batched inputs or targets.

        Example:
            >>> import gpytorch, torch
            >>> from gpytorch_decoupled.optim import DualEStep
            >>> from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy
            >>> class DualGP(gpytorch.models.ApproximateGP):
            ...     def __init__(self, inducing_points):
            ...         q = DualVariationalDistribution(inducing_points.size(0))
            ...         super().__init__(DualVariationalStrategy(self, inducing_points, q))
            ...         self.mean_module = gpytorch.means.ZeroMean()
            ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            ...     def forward(self, x):
            ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
            >>> model, likelihood = DualGP(torch.linspace(-3, 3, 15)), gpytorch.likelihoods.GaussianLikelihood()
            >>> x = torch.linspace(-3, 3, 100)
            >>> DualEStep(model, likelihood, num_data=100).step(x.unsqueeze(-1), torch.sin(2 * x))
            >>> fantasy = model.get_fantasy_model(torch.tensor([0.5]), torch.randn(8, 1), likelihood=likelihood)
            >>> fantasy.eval()(torch.tensor([0.5, 1.0])).mean.shape
            torch.Size([8, 2])
        """
        if likelihood is None:
            likelihood = getattr(self.model, "likelihood", None)
        wrapper = self.model.variational_strategy
        if wrapper is not self:
            inputs, targets, noise = latent_fantasy_data(self, inputs, targets, noise)
            if noise is None:
                noise = task_noise_variances(likelihood, wrapper.num_tasks, "get_fantasy_model").unsqueeze(-1)
            likelihood = None
        if likelihood is None and noise is None:
            raise ValueError(
                "DualVariationalStrategy.get_fantasy_model needs the likelihood of the new observations: pass "
                "likelihood=... (the model has no likelihood attribute)."
            )
        if noise is not None and not isinstance(likelihood, (GaussianLikelihood, type(None))):
            raise ValueError(f"noise is for Gaussian observations, but the likelihood is {type(likelihood).__name__}.")
        x, y, noise, batch_shape = checked_fantasy_data(self, inputs, targets, noise, likelihood)
        distribution = self._variational_distribution
        if distribution.per_datum and (x.dim() != 2 or batch_shape != distribution.batch_shape):
            raise NotImplementedError(
                "per-datum sites (datum_inputs) condition on inputs (k, D) and targets of the latents' batch shape "
                f"{tuple(distribution.batch_shape)} only; use u-space sites (no datum_inputs) for batched fantasies."
            )
        if noise is not None or isinstance(likelihood, GaussianLikelihood):
            # The targets in closed form (what site_targets gives, without a sample batch in the precisions), and
            # differentiable in the inputs and targets (BoTorch differentiates acquisition values through fantasies).
            # (the factors from K_uu alone, not from the joint prior with x: a factor kept for later predictions must
            # not carry the graph of these inputs)
            factors, prior_mean, _, whitened_cross, _ = self._marginals(x, self.posterior_factors())
            precision = (likelihood.noise[..., :1] if noise is None else noise).to(y.dtype).reciprocal()
            first_target = (y - prior_mean) * precision
            second_target = precision.expand(torch.broadcast_shapes(precision.shape, prior_mean.shape))
        else:
            statistics = self.site_statistics(x)
            factors, whitened_cross = statistics.factors, statistics.whitened_cross
            first_target, second_target = self.site_targets(likelihood, y, statistics)
        fantasy = fantasy_copy(self.model, likelihood)
        fantasy_strategy = fantasy.variational_strategy
        fantasy_sites = getattr(
            fantasy_strategy, "base_variational_strategy", fantasy_strategy
        )._variational_distribution
        if distribution.per_datum:
            fantasy_sites.append_datum_sites(x, first_target, second_target)
        else:
            projections = solve_lower_transpose(factors.prior_cholesky, whitened_cross)  # a_i = L_K^{-T} w_i
            mean_increment = (projections @ first_target.unsqueeze(-1)).squeeze(-1)
            fantasy_sites.add_sites(mean_increment, weighted_gram(projections, second_target))
        return fantasy

    def _site_statistics(
        self,
        prior_mean: Tensor,
        centred_mean: Tensor,
        variance: Tensor,
        whitened_cross: Tensor,
        factors: DualPosteriorFactors,
    ) -> DualSiteStatistics:
        batch_shape = torch.broadcast_shapes(centred_mean.shape[:-1], self._variational_distribution.batch_shape)
        return DualSiteStatistics(
            prior_mean.expand(*batch_shape, -1),
            centred_mean.expand(*batch_shape, -1),
            variance.expand(*batch_shape, -1),
            whitened_cross,
            factors,
        )


def whitened_u_space_sites(prior_chol: Tensor, site_mean: Tensor, site_precision: Tensor) -> tuple[Tensor, Tensor]:
    r"""The u-space sites in whitened coordinates: :math:`\mathbf h = \mathbf L_K^\top\boldsymbol\ell_1` and
    :math:`\mathbf P = \mathbf L_K^\top\mathbf L_2\mathbf L_K`."""
    whitened_site_mean = (prior_chol.mT @ site_mean.unsqueeze(-1)).squeeze(-1)
    return whitened_site_mean, congruence(prior_chol, site_precision)  # backward: one M x M product


def whitened_posterior_factors(
    prior_chol: Tensor, whitened_site_mean: Tensor, whitened_precision: Tensor
) -> DualPosteriorFactors:
    r"""The factors of :math:`q(\mathbf v) = \mathcal N(\mathbf H^{-1}\mathbf h, \mathbf H^{-1})` with
    :math:`\mathbf H = \mathbf I + \mathbf P` (float64 factorization with escalating jitter). Plain tensor
    operations: the strategy's training pass and the compiled t-SVGP iteration
    (:func:`~gpytorch_decoupled.training.compile_training_step`) both compute :math:`q` here."""
    inner_chol = jittered_cholesky(add_to_diagonal(whitened_precision, 1.0), name="DualVariationalStrategy H")
    whitened_mean = cholesky_solve(inner_chol, whitened_site_mean.unsqueeze(-1)).squeeze(-1)
    return DualPosteriorFactors(prior_chol, whitened_precision, inner_chol, whitened_site_mean, whitened_mean)


def _marginal_variances(prior_variance: Tensor, whitened_cross: Tensor, reduced_cross: Tensor) -> Tensor:
    return prior_variance - whitened_cross.pow(2).sum(-2) + reduced_cross.pow(2).sum(-2)


_PRIOR_IN_TRAINING = (
    "DualVariationalStrategy: q(u) is still the prior (every site is zero) at a second training step, and gradient "
    "steps do not change it: its sites move only through the closed-form E-step. Create e_step = "
    "gpytorch_decoupled.optim.DualEStep(model, likelihood, num_data) before the loop and call "
    "e_step.step(x_batch, y_batch) in it, after loss.backward() and before optimizer.step() (t-SVGP's algorithm), or "
    "fit with BoTorch's fit_gpytorch_mll and gpytorch_decoupled.botorch.SingleTaskVariationalGP."
)


def _expected_log_prob_gradients(
    likelihood: Likelihood,
    y: Tensor,
    mean: Tensor,
    variance: Tensor,
    task_dim: int | None,
    num_likelihood_samples: int | None,
) -> tuple[Tensor, Tensor]:
    r""":math:`\partial\mathrm{VE}_i/\partial\mu_i` and :math:`\partial\mathrm{VE}_i/\partial v_i` of the likelihood's
    ``expected_log_prob`` at the marginals :math:`\mathcal N(\mu_i, v_i)`, by autograd."""
    if task_dim is None:
        mean = mean.expand(torch.broadcast_shapes(mean.shape, y.shape))
    mean = mean.clone().requires_grad_(True)
    variance = variance.expand(mean.shape).clone().requires_grad_(True)
    with torch.enable_grad():
        marginals = MultivariateNormal(mean, DiagLinearOperator(variance))
        if task_dim is not None:
            marginals = MultitaskMultivariateNormal.from_batch_mvn(marginals, task_dim=task_dim)
        samples = num_likelihood_samples or settings.num_likelihood_samples.value()
        with settings.num_likelihood_samples(samples):
            expected_log_prob = likelihood.expected_log_prob(y, marginals)
        mean_gradient, variance_gradient = torch.autograd.grad(expected_log_prob.sum(), [mean, variance])
    return mean_gradient, variance_gradient
