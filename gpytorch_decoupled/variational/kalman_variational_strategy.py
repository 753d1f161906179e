from __future__ import annotations

import warnings

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import GaussianLikelihood, Likelihood, MultitaskGaussianLikelihood
from gpytorch.models import ApproximateGP
from gpytorch.utils.memoize import cached
from gpytorch.variational import IndependentMultitaskVariationalStrategy
from linear_operator.operators import DiagLinearOperator, MatmulLinearOperator
from torch import Tensor

from ..linalg import add_to_diagonal, cholesky_logdet, cholesky_solve, jittered_cholesky, solve_lower, symmetrized
from ..validation import check_targets, check_tensor
from ._direct_variational_strategy import _DirectVariationalStrategy
from ._fantasies import checked_fantasy_data, fantasy_copy, latent_fantasy_data, task_noise_variances
from ._kalman_terms import (
    KalmanIncrements,
    KalmanStatistics,
    ObservationTerms,
    bound_term,
    checked_approximation,
    collapsed_bound_tail,
    held_in_u_space,
    observation_terms,
)
from ._strategy_multivariate_normal import _StrategyMultivariateNormal
from .joint_prior import JointPrior, joint_prior
from .kalman_variational_distribution import KalmanVariationalDistribution


class KalmanVariationalStrategy(_DirectVariationalStrategy):
    r"""
    The recursive (Kalman-filter) sparse GP of `Schuerch et al. (2020)`_: the posterior of the inducing values
    :math:`\mathbf u = f(\mathbf Z)` is computed in closed form, one mini-batch at a time, with :meth:`update`, for a
    Gaussian likelihood and any of the sparse models of the PEP family (Sec. 3.1 of the paper;
    :ref:`derivations-pep-family`). Each mini-batch :math:`k` is observed through

    .. math::

        \mathbf y_k = \mathbf H_k\mathbf u + \boldsymbol\gamma_k + \boldsymbol\varepsilon_k,\qquad
        \mathbf H_k = \mathbf K_{k\mathbf u}\mathbf K_{\mathbf{uu}}^{-1},\qquad
        \boldsymbol\gamma_k + \boldsymbol\varepsilon_k \sim \mathcal N(\mathbf 0,
        \mathbf V_k = \bar{\mathbf V}_k + \sigma^2\mathbf I),

    with the model chosen by ``approximation`` (:math:`\boldsymbol\Delta_k = \mathbf K_{kk} - \mathbf Q_{kk}`,
    :math:`\boldsymbol\delta_k` its diagonal; :math:`\rho_k` is subtracted from each bound term):

    * ``"vfe"`` (Titsias' collapsed bound): :math:`\bar{\mathbf V}_k = \mathbf 0`, regularizer
      :math:`\rho_k = \operatorname{tr}\boldsymbol\Delta_k / 2\sigma^2`;
    * ``"dtc"``: :math:`\bar{\mathbf V}_k = \mathbf 0`, :math:`\rho_k = 0`;
    * ``"fitc"``: :math:`\bar{\mathbf V}_k = \operatorname{Diag}(\boldsymbol\delta_k)`, :math:`\rho_k = 0`;
    * ``"pitc"``: :math:`\bar{\mathbf V}_k = \boldsymbol\Delta_k` (the blocks are the mini-batches),
      :math:`\rho_k = 0`;
    * ``"pep"`` (power EP, :math:`0 < \alpha \le 1`): :math:`\bar{\mathbf V}_k = \alpha\operatorname{Diag}
      (\boldsymbol\delta_k)`, :math:`\rho_k = \frac{1-\alpha}{2\alpha}\sum_{i\in\mathcal B_k}
      \log(1+\alpha\delta_i/\sigma^2)`.

    Every :meth:`update` returns the mini-batch's term of the recursive collapsed bound (eqs. 23 and 25 of the paper),
    computed from the state *before* the mini-batch is absorbed,

    .. math::

        \psi_k = \log\mathcal N(\mathbf y_k - \mathbf H_k\mathbf m_{k-1} \mid \mathbf 0,
        \mathbf H_k\mathbf S_{k-1}\mathbf H_k^\top + \mathbf V_k) - \rho_k,

    and after all mini-batches, at fixed hyperparameters and in any order (for PITC: any order of the same blocks),
    :attr:`recursive_bound` :math:`= \sum_k\psi_k` equals the model's batch bound (for VFE, Titsias' bound) and
    :attr:`variational_distribution` equals its batch posterior :math:`q(\mathbf u) = \mathcal N(\mathbf m,\mathbf S)`
    (eq. 14). Predictions, through the ordinary ``model(x)`` call, are (eq. 17; :ref:`derivations-recursive-prediction`)

    .. math::

        q(\mathbf f_*) = \mathcal N\big(\mu_0(\mathbf X_*) + \mathbf H_*\mathbf m,\;
        \mathbf H_*\mathbf S\mathbf H_*^\top + \mathbf K_{**} - \mathbf Q_{**}\big),

    and ``likelihood(model(x))`` adds :math:`\sigma^2`.

    **State.** The state is kept in information form in the transformed coordinates
    :math:`\tilde{\mathbf u} = \mathbf K_{\mathbf{uu}}^{-1}\mathbf u` of the paper's Sec. 3.2, where a mini-batch
    only *adds* :math:`\Delta\tilde{\boldsymbol\eta}_k = \mathbf K_{\mathbf uk}\mathbf V_k^{-1}\mathbf y_k` and
    :math:`\Delta\tilde{\boldsymbol\Lambda}_k = \mathbf K_{\mathbf uk}\mathbf V_k^{-1}\mathbf K_{k\mathbf u}` (no
    inverse of :math:`\mathbf K_{\mathbf{uu}}` and no downdate anywhere), and the posterior is recovered with the
    Cholesky factor of :math:`\mathbf A = \mathbf K_{\mathbf{uu}} + \sum_k\Delta\tilde{\boldsymbol\Lambda}_k`:
    :math:`\mathbf m = \mathbf K_{\mathbf{uu}}\mathbf A^{-1}\tilde{\boldsymbol\eta}`,
    :math:`\mathbf S = \mathbf K_{\mathbf{uu}}\mathbf A^{-1}\mathbf K_{\mathbf{uu}}`. Only the data's sums are
    stored (float64 buffers, whatever the model's dtype, so a stream can be checkpointed with ``state_dict`` and
    resumed exactly); the prior :math:`\mathbf K_{\mathbf{uu}}` is always the one at the current hyperparameters.
    Each mini-batch's sums are those at the hyperparameters of the moment it was absorbed: after the
    hyperparameters change, :meth:`reset` and a new pass give the exact posterior again. The strategy has no
    trainable variational parameters at all.

    Every factorization is a float64 Cholesky with escalating jitter. :meth:`update` validates its input and
    computes everything before it changes the state, so a failed update leaves the model exactly as it was.

    Hyperparameters and inducing inputs are learned by maximizing the collapsed bound: by stochastic recursive
    gradient propagation, :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation` (the paper's SRGP), or with
    the exact full-data gradient of :class:`~gpytorch_decoupled.mlls.StreamingCollapsedBound`. ``kl_divergence``
    is :math:`\mathrm{KL}(q(\mathbf u)\Vert p(\mathbf u))`, so :class:`~gpytorch.mlls.VariationalELBO` works too (at
    the VFE posterior it equals Titsias' bound), and so does :class:`~gpytorch.mlls.PredictiveLogLikelihood`.

    **Gradients.** A training forward pass and ``kl_divergence`` differentiate :math:`q(\mathbf u)` with the absorbed
    data held fixed as sites in u-space, as the M-step of t-SVGP holds its sites (`Adam et al. (2021)`_, App. B): with
    :math:`\bar{\mathbf K}` the value of :math:`\mathbf K_{\mathbf{uu}}`, the sites :math:`\boldsymbol\ell_1 =
    \bar{\mathbf K}^{-1}\tilde{\boldsymbol\eta}` and :math:`\mathbf L_2 = \bar{\mathbf K}^{-1}
    \sum_k\Delta\tilde{\boldsymbol\Lambda}_k\bar{\mathbf K}^{-1}` are constants and
    :math:`q(\mathbf u) \propto \mathcal N(\mathbf u; \mu_0(\mathbf Z), \mathbf K_{\mathbf{uu}}(\theta))
    \exp(\boldsymbol\ell_1^\top\mathbf u' - \tfrac12\mathbf u'^\top\mathbf L_2\mathbf u')` with
    :math:`\mathbf u' = \mathbf u - \mu_0(\mathbf Z)`. The values are those of the closed-form state, bit for bit;
    only the gradients with respect to the hyperparameters and inducing inputs are this :math:`q`'s
    (:ref:`derivations-kalman-gradients`). SRGP and :class:`~gpytorch_decoupled.mlls.StreamingCollapsedBound`
    differentiate the bound through the statistics themselves and are not affected. Holding the sums
    :math:`\tilde{\boldsymbol\eta}`, :math:`\sum_k\Delta\tilde{\boldsymbol\Lambda}_k` fixed instead would move the
    u-space sites with :math:`\mathbf K_{\mathbf{uu}}^{-1}`, whose derivatives grow without bound as inducing inputs
    come close (training on ``PredictiveLogLikelihood`` is then chaotic). At the fresh VFE state (all data absorbed at
    the current hyperparameters) the ELBO's gradient is the collapsed bound's either way.

    **Training loops.** The state moves only through :meth:`update` (or the update steps built on it), never by
    gradients: a training forward pass with gradients while nothing is absorbed raises a ``RuntimeError`` that names
    the call to add, rather than fitting the hyperparameters to the prior. In GPyTorch's standard mini-batch loop,
    add ``model.variational_strategy.update(x_batch, y_batch, likelihood)`` before ``model(x_batch)`` and call
    :meth:`reset` before each further pass over the data (each point is absorbed once per pass: absorbing it again
    would count it twice).

    The constructor takes GPyTorch's arguments in GPyTorch's order, so that the strategy is built as any other (by
    :class:`gpytorch.test.VariationalTestCase`, by BoTorch's ``SingleTaskVariationalGP``); the Kalman-specific
    settings are keywords. The likelihood may come later than the model (BoTorch creates it separately): it is read
    from the model's ``likelihood`` attribute if there is one, attached by assignment (``strategy.likelihood =
    likelihood``), or passed to the first :meth:`update`. Its predictions and its KL do not need it.

    :param model: Model this strategy is applied to (typically the :class:`~gpytorch.models.ApproximateGP` itself).
    :param inducing_points: Inducing inputs :math:`\mathbf Z`, ``(M, D)`` (or ``(M,)`` for one input dimension), or
        ``(*batch, M, D)`` for a batch of independent latent GPs (the kernel's batch shape must broadcast to it).
    :param variational_distribution: The state, a :class:`~gpytorch_decoupled.variational.KalmanVariationalDistribution`
        (default: an empty one for the inducing points' number and batch shape; its batch shape may add latents that
        share the inducing points).
    :param args: ``learn_inducing_locations`` and ``jitter_val`` given by position, as in GPyTorch.
    :param likelihood: The :class:`~gpytorch.likelihoods.GaussianLikelihood` whose noise :math:`\sigma^2` the
        updates use (kept by reference: train it as usual, and move it with the model); optional, see above. For
        several outputs (the base of an :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy`, one
        latent per task, as BoTorch builds them), a :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood`
        without correlated task noise (``rank=0``): each latent's :math:`\sigma^2` is its task's noise.
    :param approximation: ``"vfe"`` (default), ``"dtc"``, ``"fitc"``, ``"pitc"`` or ``"pep"``.
    :param alpha: The power :math:`0 < \alpha \le 1` of ``"pep"`` (1 is FITC, :math:`\alpha \to 0` VFE).
    :param learn_inducing_locations: Make :math:`\mathbf Z` a parameter (default True).
    :param jitter_val: Jitter added to the diagonal of :math:`\mathbf K_{\mathbf{uu}}`, part of the prior as in
        GPyTorch's strategies (default: GPyTorch's variational jitter for the model's dtype, ``1e-4`` for float32
        and ``1e-6`` for float64: the kernel matrices carry the rounding errors of that dtype).

    The order of version 0.1, ``(model, inducing_points, likelihood, approximation, alpha, learn_inducing_locations,
    jitter_val)``, still works for one more release, with a ``DeprecationWarning``.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points):
        ...         super().__init__(KalmanVariationalStrategy(self, inducing_points, approximation="fitc"))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> model = RecursiveGP(torch.linspace(-3, 3, 15).unsqueeze(-1))
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> x = torch.linspace(-3, 3, 400).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(400)
        >>> for x_batch, y_batch in zip(x.split(100), y.split(100)):  # a stream of mini-batches
        ...     psi = model.variational_strategy.update(x_batch, y_batch, likelihood)
        >>> model.variational_strategy.num_observed
        400
        >>> model.eval()(x[:3]).variance.le(model(x[:3], prior=True).variance).all()
        tensor(True)

    .. _Schuerch et al. (2020):
        https://arxiv.org/abs/1910.08393
    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """

    _step_attributes = ("_kept_posterior_factors",)
    _kept_posterior_factors: tuple[Tensor, Tensor, Tensor] | None = None
    _likelihood: GaussianLikelihood | None = None

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: KalmanVariationalDistribution | None = None,
        *args,
        likelihood: GaussianLikelihood | None = None,
        approximation: str = "vfe",
        alpha: float | None = None,
        learn_inducing_locations: bool = True,
        jitter_val: float | None = None,
    ):
        # Positional arguments after the distribution are GPyTorch's (learn_inducing_locations, jitter_val), or, in
        # version 0.1's order, (approximation, alpha, learn_inducing_locations, jitter_val) after a likelihood.
        keywords = {"learn_inducing_locations": learn_inducing_locations, "jitter_val": jitter_val}
        names = ("learn_inducing_locations", "jitter_val")
        if isinstance(variational_distribution, Likelihood):
            warnings.warn(
                "KalmanVariationalStrategy(model, inducing_points, likelihood, approximation, alpha, ...) is "
                "deprecated: use GPyTorch's order, KalmanVariationalStrategy(model, inducing_points, "
                "variational_distribution=None, learn_inducing_locations=True, jitter_val=None, likelihood=..., "
                "approximation=..., alpha=...); the old order will be removed in the next release.",
                DeprecationWarning,
                stacklevel=2,
            )
            likelihood, variational_distribution = variational_distribution, None
            keywords.update(approximation=approximation, alpha=alpha)
            names = ("approximation", "alpha", *names)
        if len(args) > len(names):
            raise TypeError(f"KalmanVariationalStrategy takes at most {3 + len(names)} positional arguments.")
        for name, value in zip(names, args):
            if keywords[name] != KalmanVariationalStrategy.__init__.__kwdefaults__[name]:
                raise TypeError(f"KalmanVariationalStrategy got multiple values for argument {name!r}.")
            keywords[name] = value
        learn_inducing_locations, jitter_val = keywords["learn_inducing_locations"], keywords["jitter_val"]
        approximation, alpha = keywords.get("approximation", approximation), keywords.get("alpha", alpha)
        approximation, alpha = checked_approximation(approximation, alpha)
        points = inducing_points.unsqueeze(-1) if inducing_points.dim() == 1 else inducing_points
        if points.dim() < 2 or not torch.isfinite(points).all():
            raise ValueError(f"inducing_points must be a finite (..., M, D) tensor, got shape {tuple(points.shape)}.")
        if variational_distribution is None:
            variational_distribution = KalmanVariationalDistribution(points.size(-2), batch_shape=points.shape[:-2])
        _check_distribution(variational_distribution, points)
        super().__init__(model, points, variational_distribution, learn_inducing_locations, jitter_val)
        if likelihood is not None:
            self.likelihood = likelihood
        self.approximation = approximation
        self.alpha = alpha

    # ------------------------------------------------------------------ likelihood
    @property
    def likelihood(self) -> GaussianLikelihood | None:
        r"""
        The :class:`~gpytorch.likelihoods.GaussianLikelihood` whose noise :math:`\sigma^2` the updates use: the one
        attached (at construction, by assignment, or by the first :meth:`update` or update step given one), else the
        model's ``likelihood`` attribute if it is Gaussian, else ``None``. It is kept by reference, outside the module
        tree (like ``model``): train and save it as usual.
        """
        if self._likelihood is not None:
            return self._likelihood
        likelihood = getattr(self.model, "likelihood", None)
        return likelihood if isinstance(likelihood, GaussianLikelihood | MultitaskGaussianLikelihood) else None

    def __setattr__(self, name: str, value) -> None:
        if name == "likelihood":
            object.__setattr__(self, "_likelihood", _checked_likelihood(value, self._variational_distribution))
        else:
            super().__setattr__(name, value)

    def resolved_likelihood(self, likelihood: GaussianLikelihood | None, user: str) -> GaussianLikelihood:
        r"""
        The likelihood to use: ``likelihood`` if given (it must be the strategy's own if one is attached), else the
        strategy's :attr:`likelihood`. Attaches nothing (see :meth:`attach_likelihood`).

        :param likelihood: A likelihood a caller was given, or ``None``.
        :param user: What asks, named in the errors.
        :raises TypeError: If ``likelihood`` is not Gaussian.
        :raises ValueError: If another likelihood is attached already, or if there is none at all.
        :raises NotImplementedError: For a multitask likelihood, unless this strategy is the base of an
            :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy` (``task_dim=-1``) with one latent
            per task: under a mixing of latents (LMC) no latent has a noise of its own.
        """
        current = self.likelihood
        if likelihood is not None:
            _checked_likelihood(likelihood, self._variational_distribution)
            if current is not None and likelihood is not current:
                raise ValueError(f"{user}: the likelihood must be the one the model's KalmanVariationalStrategy uses.")
            current = likelihood
        if current is None:
            raise ValueError(
                f"{user} needs the GaussianLikelihood whose noise the Kalman updates use: pass it (e.g. "
                "update(x, y, likelihood=likelihood)) or attach it once with strategy.likelihood = likelihood."
            )
        wrapper = getattr(self.model, "variational_strategy", None)
        if isinstance(current, MultitaskGaussianLikelihood) and not (
            isinstance(wrapper, IndependentMultitaskVariationalStrategy)
            and wrapper.base_variational_strategy is self
            and wrapper.task_dim == -1
        ):
            raise NotImplementedError(
                f"{user}: KalmanVariationalStrategy takes a MultitaskGaussianLikelihood only as the base of an "
                "IndependentMultitaskVariationalStrategy (task_dim=-1) with one latent per task, got a "
                f"{type(wrapper).__name__}: its closed-form updates need each latent's own Gaussian noise, which a "
                "mixing of latents (LMC) does not give."
            )
        return current

    def attach_likelihood(self, likelihood: GaussianLikelihood | None, user: str) -> GaussianLikelihood:
        r"""The strategy's likelihood after attaching ``likelihood`` if none is attached yet (errors as
        :meth:`resolved_likelihood`)."""
        likelihood = self.resolved_likelihood(likelihood, user)
        if self._likelihood is None:
            self.likelihood = likelihood
        return likelihood

    # ------------------------------------------------------------------ state
    @property
    def recursive_bound(self) -> Tensor:
        r""":math:`\sum_k\psi_k` over the mini-batches absorbed since the last :meth:`reset`, one value per latent."""
        return self._variational_distribution.bound.to(self.inducing_points.dtype, copy=True)

    @property
    def num_observed(self) -> int:
        """Number of data points absorbed since the last :meth:`reset`."""
        return int(self._variational_distribution.num_observed)

    @property
    def statistics(self) -> KalmanStatistics:
        r"""The absorbed statistics :math:`\tilde{\boldsymbol\eta}` and :math:`\tilde{\boldsymbol\Lambda} -
        \mathbf K_{\mathbf{uu}}` (float64, the state's own buffers: read them, do not change them in place)."""
        return KalmanStatistics(*self._variational_distribution())

    def _cache_dependencies(self) -> tuple[torch.nn.Module, ...]:
        # predictions read the likelihood's noise as well (through the state's update terms)
        return (self.model,) if self.likelihood is None else (self.model, self.likelihood)

    def reset(self) -> None:
        """Forgets all data: back to the prior (at the current hyperparameters)."""
        self._variational_distribution.reset()
        self._clear_cache()

    @torch.no_grad()
    def update(self, x: Tensor, y: Tensor, likelihood: GaussianLikelihood | None = None) -> Tensor:
        r"""
        Absorbs one mini-batch in closed form (an information-filter update, :ref:`derivations-information-form`) and
        returns its bound term :math:`\psi_k`, computed before the mini-batch is absorbed.

        :param x: Inputs, ``(B, D)`` (or ``(*batch, B, D)``).
        :param y: Targets, ``(B,)`` (or ``(*batch, B)``), same dtype and device as ``x``.
        :param likelihood: The Gaussian likelihood whose noise the update uses; attached to the strategy on the first
            successful update (see :attr:`likelihood`). Not needed once one is attached.
        :return: :math:`\psi_k`, one value per latent (a scalar without batch), in the model's dtype.
        :raises ValueError: On bad shapes, dtypes, devices or NaN/inf, before anything changes.
        :raises ~linear_operator.utils.errors.NotPSDError: If a matrix is not positive definite even with the
            maximum jitter; the state is then unchanged.
        """
        likelihood = self.resolved_likelihood(likelihood, "KalmanVariationalStrategy.update")
        x, y = self.checked_data(x, y)
        terms, inducing_covariance = self.observation_terms(x, y, likelihood)
        psi = self.bound_term(terms, inducing_covariance, *self.statistics)
        self.absorb(self.increments(terms, psi), x.size(-2))
        self.attach_likelihood(likelihood, "KalmanVariationalStrategy.update")
        return psi.to(self.inducing_points.dtype)

    def get_fantasy_model(
        self,
        inputs: Tensor,
        targets: Tensor,
        likelihood: GaussianLikelihood | None = None,
        noise: Tensor | None = None,
    ) -> ApproximateGP:
        r"""
        A new model whose state has absorbed the observations :math:`(\mathbf X_*, \mathbf y_*)` as well: exact
        closed-form conditioning, the same information-form update as :meth:`update` (:math:`\tilde{\boldsymbol\eta}
        \mathrel{+}= \mathbf K_{\mathbf u*}\mathbf V_*^{-1}(\mathbf y_* - \mu_0(\mathbf X_*))`,
        :math:`\tilde{\boldsymbol\Lambda} \mathrel{+}= \mathbf K_{\mathbf u*}\mathbf V_*^{-1}\mathbf K_{*\mathbf u}`,
        :ref:`derivations-information-form`) with no refit and no pass over the data absorbed before, so that the new
        model's posterior is the model's batch posterior of all the data (for VFE, Titsias' collapsed posterior) and its
        :attr:`recursive_bound` includes the new points' term. This model is left unchanged; the new one shares its
        likelihood (GPyTorch's :meth:`~gpytorch.models.ApproximateGP.get_fantasy_model` calls this).

        Targets with batch dimensions beyond the inputs' (``num_fantasies x batch x k``, as BoTorch's ``fantasize``
        passes a sample batch) give a batched fantasy model whose predictions have that batch shape; the information
        matrix, which does not depend on the targets, is kept once per batch of inputs.

        **Cost.** :math:`O(kM^2)` for :math:`k` new points (their kernel columns and the rank-:math:`k` increment of the
        information matrix; PITC adds :math:`O(k^3)` for the new block), plus the factorizations of
        :math:`\mathbf K_{\mathbf{uu}} + \tilde{\boldsymbol\Lambda}` before and after (:math:`O(M^3)` once per
        fantasy model and batch of inputs, independent of :math:`k` and of the number of fantasies), where a refit
        costs :math:`O(nM^2)` over all :math:`n` points.

        :param inputs: New inputs :math:`\mathbf X_*`, ``(..., k, D)`` (``(k,)`` for one input dimension).
        :param targets: New targets :math:`\mathbf y_*`, ``(..., k)``; ``(..., k, T)`` for the base of an
            :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy` of :math:`T` tasks (BoTorch's
            several outputs), whose new model is then the wrapper's model, conditioned task by task.
        :param likelihood: The Gaussian likelihood (default: the strategy's :attr:`likelihood`).
        :param noise: The new observations' noise variances, broadcastable to the targets, in place of the
            likelihood's :math:`\sigma^2` (BoTorch passes them for observations of known noise).
        :return: The conditioned copy of the model.
        :raises ValueError: On bad shapes, dtypes, devices, NaN/inf or noise, before anything is computed.
        :raises NotImplementedError: If the strategy is inside a wrapper other than an independent multitask one
            (LMC).

        Example:
            >>> import gpytorch, torch
            >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
            >>> class RecursiveGP(gpytorch.models.ApproximateGP):
            ...     def __init__(self, inducing_points):
            ...         super().__init__(KalmanVariationalStrategy(self, inducing_points))
            ...         self.mean_module = gpytorch.means.ZeroMean()
            ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            ...     def forward(self, x):
            ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
            >>> model, likelihood = RecursiveGP(torch.linspace(-3, 3, 15)), gpytorch.likelihoods.GaussianLikelihood()
            >>> x = torch.linspace(-3, 3, 100)
            >>> _ = model.variational_strategy.update(x, torch.sin(2 * x), likelihood)
            >>> fantasy = model.get_fantasy_model(torch.tensor([0.5]), torch.randn(8, 1))  # 8 fantasies at x = 0.5
            >>> fantasy.eval()(torch.tensor([0.5, 1.0])).mean.shape, fantasy.variational_strategy.num_observed
            (torch.Size([8, 2]), 101)
        """
        likelihood = self.resolved_likelihood(likelihood, "KalmanVariationalStrategy.get_fantasy_model")
        if self.model.variational_strategy is not self:
            inputs, targets, noise = latent_fantasy_data(self, inputs, targets, noise)
        x, y, noise, _ = checked_fantasy_data(self, inputs, targets, noise, likelihood)
        terms, inducing_covariance = self.observation_terms(x, y, likelihood, noise, fantasy=True)
        psi = self.bound_term(terms, inducing_covariance, *self.statistics)
        increments = self.increments(terms, psi, keep_graph=True)
        fantasy = fantasy_copy(self.model, likelihood)
        strategy = getattr(fantasy.variational_strategy, "base_variational_strategy", fantasy.variational_strategy)
        strategy._variational_distribution.add_fantasy(*increments, x.size(-2))
        strategy.attach_likelihood(likelihood, "KalmanVariationalStrategy.get_fantasy_model")
        return fantasy

    # ------------------------------------------------------------------ the update protocol
    # update() is these steps in turn; the optimizers of gpytorch_decoupled.optim, the collapsed bound of
    # gpytorch_decoupled.mlls and the distributed helpers take them apart (gradients, several processes).
    def checked_data(self, x: Tensor, y: Tensor, names: tuple[str, str] = ("x", "y")) -> tuple[Tensor, Tensor]:
        r"""
        A mini-batch validated before anything is computed from it (:mod:`gpytorch_decoupled.validation`): ``x`` as
        ``(..., B, D)`` (padded like the inducing points, see :func:`~gpytorch_decoupled.variational.checked_inputs`)
        and ``y`` as ``(..., B)``, in the model's dtype and on its device.

        :param names: What ``x`` and ``y`` are called in the errors.
        :raises TypeError: If ``x`` or ``y`` is not a tensor.
        :raises ValueError: On bad shapes (also batch shapes that do not broadcast to the latents'), dtypes, devices,
            an empty mini-batch or NaN/inf.
        """
        x_name, y_name = names
        check_tensor(x, x_name)
        check_tensor(y, y_name)
        if x.dim() == 1:
            x = x.unsqueeze(-1)
        x = self.checked_inputs(x, x_name)
        latent_shape = self._variational_distribution.batch_shape
        check_targets(y, y_name, (x.size(-2),), self.inducing_points, self.likelihood, latent_shape, x_name)
        try:
            batch_shape = torch.broadcast_shapes(x.shape[:-2], y.shape[:-1], latent_shape)
        except RuntimeError:
            batch_shape = None
        if batch_shape != latent_shape:
            raise ValueError(
                f"{x_name} {tuple(x.shape)} and {y_name} {tuple(y.shape)} do not broadcast to the latent batch shape "
                f"{tuple(latent_shape)} of the inducing points."
            )
        return x, y

    def observation_terms(
        self,
        x: Tensor,
        y: Tensor,
        likelihood: GaussianLikelihood | None = None,
        noise: Tensor | None = None,
        fantasy: bool = False,
    ) -> tuple[ObservationTerms, Tensor]:
        r"""
        A validated mini-batch's likelihood in the transformed coordinates (:class:`ObservationTerms`, whose
        ``information_vector`` and ``information_matrix`` are its increments of the state) and the jittered float64
        :math:`\mathbf K_{\mathbf{uu}}`, from one evaluation of the prior at :math:`[\mathbf Z; \mathbf x]`;
        differentiable in the hyperparameters outside ``torch.no_grad``.

        :param noise: One noise variance per point, ``(..., B)``, in place of the likelihood's :math:`\sigma^2`
            (observations with known noise, as BoTorch passes them to fantasies).
        :param fantasy: Whether ``x`` and ``y`` may have batch dimensions beyond the latents' (fantasies).
        """
        prior = self._joint_prior(x, predictive=fantasy)
        inducing_covariance = self._jittered(prior.dense(0, 0).double())
        cross_covariance = prior.dense(0, 1).double()
        if self.approximation == "pitc":
            data_covariance = prior.dense(1, 1).double()
        else:
            data_covariance = prior.diagonal(1).double()
        residual = y.double() - prior.mean(1).double()
        noise = self.noise_variance(likelihood).unsqueeze(-1) if noise is None else noise.double()
        return self.terms_of_blocks(inducing_covariance, cross_covariance, data_covariance, residual, noise)

    def terms_of_blocks(
        self,
        inducing_covariance: Tensor,
        cross_covariance: Tensor,
        data_covariance: Tensor,
        residual: Tensor,
        noise: Tensor,
    ) -> tuple[ObservationTerms, Tensor]:
        r"""
        :meth:`observation_terms` from the mini-batch's prior blocks, float64: the jittered
        :math:`\mathbf K_{\mathbf{uu}}` ``(..., M, M)``, :math:`\mathbf K_{\mathbf u\mathbf x}` ``(..., M, B)``, the
        diagonal of :math:`\mathbf K_{\mathbf{xx}}` ``(..., B)`` (its whole block for PITC), the residual
        :math:`\mathbf y - \mu_0(\mathbf x)` and the noise variance (``(..., 1)``, or one per point). The lean
        training path (:class:`~gpytorch_decoupled.training.LeanKalmanBlocks`) computes the blocks without GPyTorch's
        lazy kernel tensors and passes them here.
        """
        terms = observation_terms(
            self.approximation,
            self.alpha,
            jittered_cholesky(inducing_covariance, name="K_uu"),
            cross_covariance,
            data_covariance,
            residual,
            noise,
        )
        return terms, inducing_covariance

    @staticmethod
    def bound_term(
        terms: ObservationTerms, inducing_covariance: Tensor, information_vector: Tensor, information_matrix: Tensor
    ) -> Tensor:
        r"""
        :math:`\psi_k` of a mini-batch (its :meth:`observation_terms`) given the statistics absorbed before it (float64,
        differentiable in the hyperparameters and in the statistics outside ``torch.no_grad``).
        """
        return bound_term(inducing_covariance, information_vector, information_matrix, terms)

    @staticmethod
    def increments(terms: ObservationTerms, psi: Tensor, keep_graph: bool = False) -> KalmanIncrements:
        r"""A mini-batch's increments of the state and its bound term :math:`\psi_k`, checked to be finite; detached
        unless ``keep_graph`` (fantasies, through which BoTorch differentiates).

        :raises RuntimeError: If any of them is NaN or inf (the state is then left as it was)."""
        increments = KalmanIncrements(terms.information_vector, symmetrized(terms.information_matrix), psi)
        if not keep_graph:
            increments = KalmanIncrements(*(increment.detach() for increment in increments))
        if not all(torch.isfinite(increment).all() for increment in increments):
            raise RuntimeError(
                "the Kalman update produced NaN or inf (check the kernel hyperparameters and the noise); the state "
                "was left unchanged."
            )
        return increments

    def absorb(self, increments: KalmanIncrements, count: int) -> None:
        """Adds a mini-batch's :meth:`increments` (and its number of points) to the state; nothing here can fail
        half-way."""
        self._variational_distribution.absorb(*increments, count)
        self.variational_params_initialized.fill_(1)
        self._clear_cache()

    def collapsed_bound_tail(self, information_vector: Tensor, information_matrix: Tensor) -> Tensor:
        r"""The part :math:`F` of the batch bound that is not a sum over mini-batches (:math:`\mathcal L = \sum_k
        \text{offset}_k + F`), given all data's statistics; differentiable in them and in the hyperparameters."""
        return collapsed_bound_tail(self._inducing_prior()[0], information_vector, information_matrix)

    def inducing_covariance(self) -> Tensor:
        r""":math:`\mathbf K_{\mathbf{uu}}` with the strategy's jitter, float64, ``(..., M, M)``: the prior of the state
        (differentiable in the hyperparameters outside ``torch.no_grad``)."""
        return self._inducing_prior()[0]

    def noise_variance(self, likelihood: GaussianLikelihood | None = None) -> Tensor:
        r"""The noise :math:`\sigma^2` of ``likelihood`` or else of the strategy's :attr:`likelihood`, in float64, one
        value per latent (for a :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood`, its tasks' noises: one
        per latent, errors as :meth:`resolved_likelihood`)."""
        likelihood = self.resolved_likelihood(likelihood, "KalmanVariationalStrategy")
        if isinstance(likelihood, GaussianLikelihood):
            return likelihood.noise.double()[..., 0]
        return task_noise_variances(likelihood, likelihood.num_tasks, "KalmanVariationalStrategy").double()

    def data_prior(self, x: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`\mathbf K_{\mathbf u\mathbf x}`, ``(..., M, B)``, and the prior mean :math:`\mu_0(\mathbf x)`,
        ``(..., B)``, for a validated mini-batch, in the model's dtype (differentiable in the hyperparameters outside
        ``torch.no_grad``): what the increments of the models with :math:`\mathbf V_k = \sigma^2\mathbf I` (VFE, DTC)
        are made of."""
        prior = self._joint_prior(x)
        return prior.dense(0, 1), prior.mean(1)

    @staticmethod
    def of_model(model: ApproximateGP, likelihood: Likelihood, user: str) -> KalmanVariationalStrategy:
        """
        The model's :class:`KalmanVariationalStrategy` (or the base of its
        :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy`, whose latents are the tasks: it then
        takes targets ``(..., T, B)``), with ``likelihood`` (whose noise its updates use) attached if it had none, or
        checked to be the one it has.

        :param model: The model whose strategy is sought.
        :param likelihood: The likelihood the caller was given.
        :param user: The class asking, named in the errors.
        :raises TypeError: If the model's strategy is not a :class:`KalmanVariationalStrategy`, or the likelihood is
            not Gaussian.
        :raises ValueError: If ``likelihood`` is not the one the strategy uses.
        """
        strategy = getattr(model, "variational_strategy", None)
        if isinstance(strategy, IndependentMultitaskVariationalStrategy):  # several outputs, one latent per task
            strategy = strategy.base_variational_strategy
        if not isinstance(strategy, KalmanVariationalStrategy):
            raise TypeError(
                f"{user} needs a model whose variational_strategy is a KalmanVariationalStrategy, got "
                f"{type(strategy).__name__}."
            )
        strategy.attach_likelihood(likelihood, user)
        return strategy

    # ------------------------------------------------------------------ prior blocks (float64)
    def _jittered(self, covariance: Tensor) -> Tensor:
        return add_to_diagonal(covariance, self.jitter_val)

    def _checked_batch(self, prior: MultivariateNormal, predictive: bool = False) -> None:
        """The kernel's batch shape must broadcast to the latents' (a kernel may be shared by every latent);
        predictions may add batch dimensions of their inputs."""
        latent_shape, prior_shape = self._variational_distribution.batch_shape, prior.batch_shape
        try:
            shape = torch.broadcast_shapes(prior_shape, latent_shape)
        except RuntimeError:
            shape = None
        if shape is None or (not predictive and shape != latent_shape):
            raise ValueError(
                f"the prior has batch shape {tuple(prior.batch_shape)} but the inducing points define latents of batch "
                f"shape {tuple(latent_shape)}; give inducing points the shape (*batch, M, D) of the kernel's batch."
            )

    def _joint_prior(self, x: Tensor, predictive: bool = False, **kwargs) -> JointPrior:
        """The prior at :math:`[\\mathbf Z; \\mathbf x]`, checked to have the latents' batch shape."""
        prior = joint_prior(self.model, self.inducing_points, x, **kwargs)
        self._checked_batch(prior.distribution, predictive)
        return prior

    def _inducing_prior(self) -> tuple[Tensor, Tensor]:
        """Float64 jittered :math:`\\mathbf K_{\\mathbf{uu}}` and prior mean :math:`\\mu_0(\\mathbf Z)`."""
        prior = joint_prior(self.model, self.inducing_points)
        self._checked_batch(prior.distribution)
        return self._jittered(prior.dense(0, 0).double()), prior.mean(0).double()

    def _posterior_factors(self, inducing_covariance: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r"""Float64 :math:`\mathbf L_{\mathbf{uu}}`, :math:`\mathbf L_A` (:math:`\mathbf A = \mathbf K_{\mathbf{uu}} +
        \tilde{\boldsymbol\Lambda}`) and :math:`\mathbf A^{-1}\tilde{\boldsymbol\eta}`; kept
        (``_kept_posterior_factors``) across predictions in eval mode and, in training, from the forward pass to the
        KL of the same step (one factorization and one ``held_in_u_space`` per step). In training with gradients, the
        statistics are those of the absorbed data held fixed as sites in u-space (``held_in_u_space``: the same values,
        other gradients)."""
        factors = self._kept_posterior_factors
        # Inputs with extra batch dimensions give expanded factors: those are not reused for other shapes. Factors
        # computed without gradients do not serve a computation with gradients (nor the other way round).
        if (
            factors is not None
            and factors[0].shape == inducing_covariance.shape
            and factors[0].requires_grad == inducing_covariance.requires_grad
        ):
            return factors
        information_vector, information_matrix = self.statistics
        prior_cholesky = jittered_cholesky(inducing_covariance, name="K_uu")
        if self.training and inducing_covariance.requires_grad:
            information_vector, information_matrix = held_in_u_space(
                prior_cholesky, inducing_covariance, information_vector, information_matrix
            )
        cholesky = jittered_cholesky(inducing_covariance + information_matrix, name="Kalman precision K_uu + Lambda")
        coefficients = cholesky_solve(cholesky, information_vector.unsqueeze(-1)).squeeze(-1)
        self._kept_posterior_factors = (prior_cholesky, cholesky, coefficients)
        return self._kept_posterior_factors

    # ------------------------------------------------------------------ GPyTorch interface
    @property
    @cached(name="prior_distribution_memo")
    def prior_distribution(self) -> MultivariateNormal:
        r"""The prior :math:`p(\mathbf u) = \mathcal N(\mu_0(\mathbf Z), \mathbf K_{\mathbf{uu}})` (with jitter)."""
        inducing_covariance, prior_mean = self._inducing_prior()
        dtype = self.inducing_points.dtype
        return MultivariateNormal(prior_mean.to(dtype), inducing_covariance.to(dtype))

    @property
    def variational_distribution(self) -> MultivariateNormal:
        r"""The current posterior :math:`q(\mathbf u) = \mathcal N(\mu_0(\mathbf Z) + \mathbf m, \mathbf S)` of the
        inducing values (u-space, at the current hyperparameters)."""
        inducing_covariance, prior_mean = self._inducing_prior()
        _, cholesky, coefficients = self._posterior_factors(inducing_covariance)
        mean = prior_mean + (inducing_covariance @ coefficients.unsqueeze(-1)).squeeze(-1)
        root = solve_lower(cholesky, inducing_covariance)
        dtype = self.inducing_points.dtype
        return _StrategyMultivariateNormal(mean.to(dtype), symmetrized(root.mT @ root).to(dtype), strategy=self)

    def kl_divergence(self) -> Tensor:
        r"""
        :math:`\mathrm{KL}(\mathcal N(\mathbf m, \mathbf S) \Vert \mathcal N(\mathbf 0, \mathbf K_{\mathbf{uu}}))
        = \tfrac12[\operatorname{tr}(\mathbf A^{-1}\mathbf K_{\mathbf{uu}}) - M + \tilde{\boldsymbol\eta}^\top
        \mathbf A^{-1}\mathbf K_{\mathbf{uu}}\mathbf A^{-1}\tilde{\boldsymbol\eta} + \log\lvert\mathbf A\rvert
        - \log\lvert\mathbf K_{\mathbf{uu}}\rvert]`, differentiable in the hyperparameters with the absorbed data held
        fixed as u-space sites (see **Gradients** in the class's description).
        """
        inducing_covariance, _ = self._inducing_prior()
        prior_cholesky, cholesky, coefficients = self._posterior_factors(inducing_covariance)
        trace = solve_lower(cholesky, prior_cholesky).square().sum((-2, -1))
        quadratic = (prior_cholesky.mT @ coefficients.unsqueeze(-1)).square().sum((-2, -1))
        log_det_ratio = cholesky_logdet(cholesky) - cholesky_logdet(prior_cholesky)
        kl = 0.5 * (trace - coefficients.size(-1) + quadratic + log_det_ratio)
        return kl.to(self.inducing_points.dtype)

    def _predictive_distribution(self, x: Tensor, inducing_points: Tensor, diag: bool, **kwargs) -> MultivariateNormal:
        r""":math:`q(\mathbf f_*)` above, from one evaluation of the prior at :math:`[\mathbf Z; \mathbf x]` and the
        factors of the state (float64, cast to the inputs' dtype)."""
        if self.training and torch.is_grad_enabled() and self.num_observed == 0:
            raise RuntimeError(_PRIOR_IN_TRAINING)
        prior = self._joint_prior(x, predictive=True, **kwargs)
        if x.shape[:-2] == self.inducing_points.shape[:-2]:
            inducing_covariance = self._jittered(prior.dense(0, 0).double())
        else:
            # Inputs with batch dimensions of their own: K_uu (and the factors) keep the state's batch shape rather
            # than being expanded to the inputs' and factorized once per batch member.
            inducing_covariance = self._inducing_prior()[0]
        cross_covariance = prior.dense(0, 1).double()

        prior_cholesky, cholesky, coefficients = self._posterior_factors(inducing_covariance)
        dtype = x.dtype
        mean = prior.mean(1) + (cross_covariance.mT @ coefficients.unsqueeze(-1)).squeeze(-1).to(dtype)
        # Cov = K_xx - K_xu K_uu^{-1} K_ux + K_xu A^{-1} K_ux = K_xx - P^T P + R^T R
        prior_root = solve_lower(prior_cholesky, cross_covariance)
        posterior_root = solve_lower(cholesky, cross_covariance)
        if diag and self.training:
            correction = posterior_root.square().sum(-2) - prior_root.square().sum(-2)
            variance = prior.diagonal(1) + correction.to(dtype)
            return MultivariateNormal(mean, DiagLinearOperator(variance.expand(mean.shape)))
        # A fantasy state's factor may have a batch shape (of its inputs) that the prior's does not.
        shape = torch.broadcast_shapes(prior_root.shape, posterior_root.shape)
        prior_root, posterior_root = prior_root.expand(shape), posterior_root.expand(shape)
        left = torch.cat([posterior_root, prior_root.neg()], dim=-2).mT.to(dtype)
        right = torch.cat([posterior_root, prior_root], dim=-2).to(dtype)
        covariance = prior.covariance(1, 1) + MatmulLinearOperator(left, right)
        return MultivariateNormal(mean, covariance.expand(*mean.shape[:-1], *covariance.shape[-2:]))


# Raised by a training forward pass with gradients while nothing is absorbed: gradient steps never move q(u) here, so a
# standard GPyTorch loop would otherwise train the hyperparameters against the prior without a word.
_PRIOR_IN_TRAINING = (
    "KalmanVariationalStrategy: q(u) is still the prior (no data absorbed), and gradient steps do not change it: its "
    "posterior is computed in closed form. Add model.variational_strategy.update(x_batch, y_batch, likelihood) "
    "before model(x_batch) in the training loop (once per data point: call model.variational_strategy.reset() before "
    "each further pass), or train with gpytorch_decoupled.optim.RecursiveGradientPropagation (with BoTorch: "
    "gpytorch_decoupled.botorch.SingleTaskVariationalGP and fit_gpytorch_mll)."
)


def _checked_likelihood(
    likelihood, distribution: KalmanVariationalDistribution
) -> GaussianLikelihood | MultitaskGaussianLikelihood | None:
    """A Gaussian likelihood, or a multitask one of independent task noises with one task per latent (the last
    dimension of the latents' batch shape), or None."""
    multitask = (
        isinstance(likelihood, MultitaskGaussianLikelihood)
        and likelihood.rank == 0
        and distribution.batch_shape[-1:] == (likelihood.num_tasks,)
    )
    if likelihood is not None and not (isinstance(likelihood, GaussianLikelihood) or multitask):
        raise TypeError(
            "KalmanVariationalStrategy needs a gpytorch.likelihoods.GaussianLikelihood (its closed-form updates "
            "are for Gaussian noise sigma^2; for several outputs, a MultitaskGaussianLikelihood with rank=0 and one "
            f"latent per task), got {type(likelihood).__name__}."
        )
    return likelihood


def _check_distribution(distribution, inducing_points: Tensor) -> None:
    """The state must be a :class:`KalmanVariationalDistribution` for the inducing points' number and batch."""
    if not isinstance(distribution, KalmanVariationalDistribution):
        raise TypeError(
            "KalmanVariationalStrategy needs a KalmanVariationalDistribution (or None, for one built from the "
            f"inducing points), got {type(distribution).__name__}."
        )
    num_inducing, batch_shape = inducing_points.size(-2), inducing_points.shape[:-2]
    try:
        broadcasts = torch.broadcast_shapes(batch_shape, distribution.batch_shape) == distribution.batch_shape
    except RuntimeError:
        broadcasts = False
    if distribution.num_inducing_points != num_inducing or not broadcasts:
        raise ValueError(
            f"the variational distribution is for M={distribution.num_inducing_points} inducing points and latents of "
            f"batch shape {tuple(distribution.batch_shape)}, but the inducing points have shape "
            f"{tuple(inducing_points.shape)}."
        )
