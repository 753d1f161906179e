from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood, SoftmaxLikelihood
from gpytorch.models import ApproximateGP
from torch import Tensor

from ..linalg import add_to_diagonal, cholesky_solve, solve_lower_transpose, weighted_gram
from ..validation import check_targets, check_tensor
from ..variational import DualPosteriorFactors, DualSiteStatistics, DualVariationalStrategy


class DualEStep(torch.optim.Optimizer):
    r"""
    The E-step of t-SVGP (`Adam et al. (2021)`_, App. E, Algorithm 2): a closed-form natural-gradient step of size
    :math:`r` on the sites of a :class:`~gpytorch_decoupled.variational.DualVariationalStrategy`.

    At a mini-batch :math:`\mathcal B` of :math:`B` points the marginals :math:`q(f_i) = \mathcal N(\mu_i, v_i)` give,
    through the likelihood's ``expected_log_prob`` :math:`\mathrm{VE}_i(\mu_i, v_i)` (closed form for Gaussian,
    quadrature or Monte Carlo otherwise) and two scalar derivatives,

    .. math::

        \alpha_i = \frac{\partial\mathrm{VE}_i}{\partial\mu_i}, \qquad
        \beta_i = \max\!\Big(-2\frac{\partial\mathrm{VE}_i}{\partial v_i}, \beta_{\min}\Big), \qquad
        g_{1,i} = \beta_i(\mu_i - \mu_0(\mathbf x_i)) + \alpha_i, \qquad g_{2,i} = \beta_i,

    and the sites move to the damped, unbiased (:math:`s = n/B`) target

    .. math::

        \boldsymbol\ell_1 \leftarrow (1 - r)\boldsymbol\ell_1 + r s\sum_{i\in\mathcal B}\mathbf a_i g_{1,i}, \qquad
        \mathbf L_2 \leftarrow (1 - r)\mathbf L_2 + r s\sum_{i\in\mathcal B} g_{2,i}\mathbf a_i\mathbf a_i^\top.

    This is exactly one natural-gradient step of size :math:`r` on the ELBO of SVGP (:ref:`derivations-tsvgp-e-step`),
    at :math:`O(BM^2 + M^3)` with no autograd graph through the model: only the scalar :math:`\mathrm{VE}_i` are
    differentiated. With a Gaussian likelihood and the full data set one step with :math:`r = 1` gives Titsias' optimal
    :math:`q(\mathbf u)` from any starting point. With per-datum sites (``datum_inputs`` on the distribution) the step
    updates :math:`\lambda_{1,i}, \lambda_{2,i} \leftarrow (1-r)\lambda_{\cdot,i} + r g_{\cdot,i}` for the batch's
    points (no :math:`s`), and ``indices`` must say which points they are.

    The clamp :math:`\beta_{\min}` keeps :math:`\mathbf L_2 \succeq 0` for likelihoods that are not log-concave (e.g.
    Student-t) and absorbs Monte Carlo noise (softmax). A step whose result is not finite, or whose :math:`q` cannot be
    factorized, raises an error and leaves the sites unchanged. A learning-rate scheduler may drive :math:`r` (e.g.
    :math:`r_t = 1/t` over one epoch of a partition gives the full-batch step exactly, identity T4).

    **The default schedule for mini-batches** (README, notebook 04): per mini-batch, the M-step's forward and backward
    pass on :class:`~gpytorch_decoupled.mlls.DualVariationalELBO`, then :meth:`step` at the same mini-batch, then the
    M-step's optimizer step, with :math:`r_t = \max(1/t, 0.1)` (``torch.optim.lr_scheduler.LambdaLR(e_step,
    lambda t: max(1 / (t + 1), 0.1))`` on ``lr=1``): the running average of the mini-batch estimates at first, then
    a constant weight so that the sites keep following the hyperparameters. The E-step then takes the marginals that
    the forward pass computed (:meth:`~gpytorch_decoupled.variational.DualVariationalStrategy.site_statistics`), with
    no kernel evaluation or factorization of its own, and costs :math:`O(BM^2)` plus one :math:`M \times M`
    factorization; it must come after ``backward()`` (it changes the sites the graph holds) and before the optimizer
    step (which changes what the marginals depend on; they would be recomputed). Both steps are then taken at the same
    :math:`(\theta_t, q_t)`, as GPyTorch's NGD and Adam are from one forward pass: the E-step is the natural-gradient
    step of the ELBO at :math:`\theta_t`, and the M-step ascends the tighter bound of the sites :math:`q_t`, a lower
    bound of the marginal likelihood for any sites (`Adam et al. (2021)`_, App. B).

    Models with several independent latents (``batch_shape``, also wrapped in an
    :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy`, as for a softmax likelihood with one latent
    per class) are updated per latent, mean-field across latents.

    :param model: An :class:`~gpytorch.models.ApproximateGP` whose strategy is a
        :class:`~gpytorch_decoupled.variational.DualVariationalStrategy` (possibly inside an independent multitask
        wrapper).
    :param likelihood: Any GPyTorch likelihood with ``expected_log_prob`` (Gaussian, Bernoulli, Student-t, softmax...).
    :param num_data: Number :math:`n` of training points.
    :param lr: Step size :math:`r \in (0, 1]`.
    :param min_curvature: :math:`\beta_{\min}` (the reference code's :math:`\partial\mathrm{VE}/\partial v \le
        -10^{-8}`).
    :param num_likelihood_samples: Monte Carlo samples for likelihoods without quadrature (GPyTorch's setting when
        ``None``).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.optim import DualEStep
        >>> from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy
        >>> class DualGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points):
        ...         q = DualVariationalDistribution(inducing_points.size(0))
        ...         super().__init__(DualVariationalStrategy(self, inducing_points, q))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 200).unsqueeze(-1)
        >>> y = (x.squeeze(-1).sin() > 0).float()
        >>> model, likelihood = DualGP(x[::20].clone()), gpytorch.likelihoods.BernoulliLikelihood()
        >>> e_step = DualEStep(model, likelihood, num_data=200, lr=0.5)
        >>> for _ in range(20):
        ...     e_step.step(x, y)
        >>> _ = model.eval()
        >>> accuracy = (likelihood(model(x)).mean.gt(0.5).float() == y).float().mean()
        >>> bool(accuracy > 0.95)
        True

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """

    def __init__(
        self,
        model: ApproximateGP,
        likelihood: Likelihood,
        num_data: int,
        lr: float = 1.0,
        min_curvature: float = DualVariationalStrategy.DEFAULT_MIN_CURVATURE,
        num_likelihood_samples: int | None = None,
    ):
        strategy, self.task_dim = DualVariationalStrategy.of_model(model, "DualEStep")
        if not 0 < lr <= 1 or num_data <= 0 or min_curvature <= 0:
            raise ValueError(
                f"need 0 < lr <= 1, num_data > 0 and min_curvature > 0, got {lr}, {num_data}, {min_curvature}."
            )
        self.strategy = strategy
        self.likelihood = likelihood
        self.num_data = num_data
        self.min_curvature = min_curvature
        self.num_likelihood_samples = num_likelihood_samples
        # The factors of q after the last step and the model state they belong to (see _reusable_factors).
        self._last_factors: tuple[dict[str, Tensor], DualPosteriorFactors] | None = None
        super().__init__(list(strategy._variational_distribution()), {"lr": lr})

    def _reusable_factors(self) -> DualPosteriorFactors | None:
        r"""
        The factors of :math:`q` that the last step computed for its new sites, if nothing in the model
        (hyperparameters, inducing inputs, sites, jitter) has changed since: consecutive E-steps then skip the
        :math:`O(M^3)` refactorization of :math:`\mathbf K_{\mathbf{uu}}` and :math:`\mathbf H` (Algorithm 2 takes
        several E-steps per M-step). The comparison is exact, over the whole ``state_dict``, so any change made in
        between (an optimizer step, ``load_state_dict``, a manual assignment) falls back to a fresh computation.
        """
        if self._last_factors is None:
            return None
        state, factors = self._last_factors
        return factors if self.strategy.matches_snapshot(state) else None

    def _targets(self, x: Tensor, y: Tensor, per_datum: bool) -> tuple[Tensor, Tensor, DualSiteStatistics]:
        r"""The natural-gradient targets :math:`g_1, g_2` per latent, ``(..., B)``, and the batch's statistics: those
        of the training forward pass at this batch where it is still valid (the default schedule), else computed,
        at the factors of the last step where nothing has changed since (consecutive E-steps)."""
        statistics = self.strategy.forward_site_statistics(x)
        if statistics is None:
            statistics = self.strategy.site_statistics(x, None if per_datum else self._reusable_factors())
        first_target, curvature = self.strategy.site_targets(
            self.likelihood, y, statistics, self.min_curvature, self.task_dim, self.num_likelihood_samples
        )
        return first_target, curvature, statistics

    @torch.no_grad()
    def step(self, x: Tensor, y: Tensor, indices: Tensor | None = None) -> None:
        r"""
        One E-step at the mini-batch :math:`(\mathbf x, \mathbf y)`.

        :param x: Mini-batch inputs, ``(B, D)``.
        :param y: Mini-batch targets, of the shape the likelihood expects (``(B,)``, or ``(B, T)`` for a multitask
            wrapper), with values it takes (e.g. labels in :math:`\{0, 1\}` for a Bernoulli likelihood).
        :param indices: Positions of the batch in ``datum_inputs``; required with per-datum sites, ignored otherwise.
        :raises TypeError: If an argument is not a tensor.
        :raises ValueError: On bad shapes, dtypes, devices, an empty batch, NaN/inf or labels the likelihood does not
            take (:mod:`gpytorch_decoupled.validation`), before anything changes.
        :raises RuntimeError: If the likelihood's derivatives are not finite or :math:`q` would not be positive
            definite; the sites are then unchanged.
        """
        distribution = self.strategy._variational_distribution
        inputs = self.strategy.checked_inputs(x, dim=2)  # padded as the strategy's own calls pad them
        shape, batch_shape = self._target_shape(x.size(0))
        check_targets(y, "y", shape, self.strategy.inducing_points, self.likelihood, batch_shape)
        if distribution.per_datum:
            self._check_indices(indices, x)
        first_target, second_target, statistics = self._targets(inputs, y, distribution.per_datum)
        self._last_factors = None
        lr = self.param_groups[0]["lr"]
        site_mean, site_precision = distribution()
        if distribution.per_datum:
            indices, first_target, second_target = self._combined_datum_targets(indices, first_target, second_target)
            new_mean = site_mean.index_copy(-1, indices, (1 - lr) * site_mean[..., indices] + lr * first_target)
            new_precision = site_precision.index_copy(
                -1, indices, (1 - lr) * site_precision[..., indices] + lr * second_target
            )
        else:
            whitened_cross = statistics.whitened_cross
            whitened_mean_sum, whitened_gram, batch_size = self._combined_sums(
                *whitened_site_sums(whitened_cross, first_target, second_target), x.size(0)
            )
            # Projecting the batch's own columns is cheaper than two M x M solves when B < M; it needs the sums to be
            # this batch's alone (not combined with other processes' batches).
            own_columns = (whitened_cross, second_target) if batch_size == x.size(0) else None
            new_mean, new_precision, new_factors, factorized = updated_sites(
                site_mean,
                site_precision,
                statistics.factors,
                whitened_mean_sum,
                whitened_gram,
                lr,
                self.num_data,
                batch_size,
                own_columns,
            )
            if not factorized:
                raise RuntimeError(
                    "the E-step produced site precisions with which q(u) is not positive definite; the sites were not "
                    "changed."
                )
        site_mean.copy_(new_mean)
        site_precision.copy_(new_precision)
        self.strategy._clear_cache()
        if not distribution.per_datum:
            self._last_factors = (self.strategy.state_snapshot(), new_factors)

    def _target_shape(self, batch_size: int) -> tuple[torch.Size, torch.Size]:
        """The shape of a batch's targets and the batch shape of the latents they may have in front: ``(B,)`` per
        latent, or ``(B, T)`` for the T tasks of a multitask wrapper (``(B,)`` for a softmax likelihood, whose
        targets are class labels)."""
        latent_shape = self.strategy._variational_distribution.batch_shape
        if self.task_dim is None:
            return torch.Size([batch_size]), latent_shape
        tasks = latent_shape[self.task_dim]
        other = [size for dim, size in enumerate(latent_shape) if dim != self.task_dim % len(latent_shape)]
        shape = [batch_size] if isinstance(self.likelihood, SoftmaxLikelihood) else [batch_size, tasks]
        return torch.Size(shape), torch.Size(other)

    def _check_indices(self, indices: Tensor | None, x: Tensor) -> None:
        """Per-datum sites need the batch's distinct positions in ``datum_inputs``, whose rows must be ``x``."""
        datum_inputs = self.strategy._variational_distribution.datum_inputs
        if indices is None:
            raise ValueError("indices are required with per-datum sites: the batch's positions in datum_inputs.")
        check_tensor(indices, "indices")
        if indices.dtype != torch.int64 or indices.shape != (x.size(0),):
            raise ValueError(
                f"indices must be int64 of shape ({x.size(0)},), one per row of x, got {indices.dtype} of shape "
                f"{tuple(indices.shape)}."
            )
        if indices.device != datum_inputs.device:
            raise ValueError(f"indices are on {indices.device} but datum_inputs is on {datum_inputs.device}.")
        if ((indices < 0) | (indices >= datum_inputs.size(0))).any() or indices.unique().numel() != indices.numel():
            raise ValueError(f"indices must be distinct positions in 0..{datum_inputs.size(0) - 1} of datum_inputs.")
        if not torch.equal(datum_inputs[indices], x):
            raise ValueError("x is not datum_inputs[indices]; the sites were not changed.")

    def _combined_sums(
        self, whitened_mean_sum: Tensor, whitened_gram: Tensor, batch_size: int
    ) -> tuple[Tensor, Tensor, int]:
        r"""
        The step's additive statistics :math:`\mathbf W\mathbf g_1`, :math:`\mathbf W\mathbf G\mathbf W^\top` and
        :math:`B`, summed over every process that takes this step together: here, one process, so unchanged;
        :class:`~gpytorch_decoupled.distributed.DistributedEStep` all-reduces them, which gives exactly the step of
        one process at the union of the batches.
        """
        return whitened_mean_sum, whitened_gram, batch_size

    def _combined_datum_targets(
        self, indices: Tensor, first_target: Tensor, second_target: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        r"""The per-datum sites' targets :math:`g_{1,i}, g_{2,i}` and their indices, gathered from every process that
        takes this step together (one process here; see :meth:`_combined_sums`)."""
        return indices, first_target, second_target


def site_targets(
    centred_mean: Tensor, mean_gradient: Tensor, variance_gradient: Tensor, min_curvature: float
) -> tuple[Tensor, Tensor]:
    r"""The E-step's targets :math:`g_{1,i} = \beta_i(\mu_i - \mu_0(\mathbf x_i)) + \alpha_i` and :math:`g_{2,i} =
    \beta_i = \max(-2\,\partial\mathrm{VE}_i/\partial v_i, \beta_{\min})` from the derivatives
    :math:`\alpha_i = \partial\mathrm{VE}_i/\partial\mu_i` and :math:`\partial\mathrm{VE}_i/\partial v_i`."""
    curvature = (-2.0 * variance_gradient).clamp_min(min_curvature)
    return curvature * centred_mean + mean_gradient, curvature


def whitened_site_sums(whitened_cross: Tensor, first_target: Tensor, second_target: Tensor) -> tuple[Tensor, Tensor]:
    r"""A batch's additive statistics of the E-step, :math:`\mathbf W\mathbf g_1` and :math:`\mathbf W
    \operatorname{diag}(\mathbf g_2)\mathbf W^\top`, from the whitened cross-covariance :math:`\mathbf W` and the
    targets."""
    return (whitened_cross @ first_target.unsqueeze(-1)).squeeze(-1), weighted_gram(whitened_cross, second_target)


def updated_sites(
    site_mean: Tensor,
    site_precision: Tensor,
    factors: DualPosteriorFactors,
    whitened_mean_sum: Tensor,
    whitened_gram: Tensor,
    lr: float | Tensor,
    num_data: int,
    batch_size: int,
    own_columns: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, DualPosteriorFactors, Tensor]:
    r"""
    The u-space sites after an E-step of size :math:`r` (``lr``) with the scale :math:`s = n/B`
    (``num_data / batch_size``),

    .. math::

        \boldsymbol\ell_1 \leftarrow (1-r)\boldsymbol\ell_1 + rs\sum_i\mathbf a_i g_{1,i}, \qquad
        \mathbf L_2 \leftarrow (1-r)\mathbf L_2 + rs\sum_i g_{2,i}\mathbf a_i\mathbf a_i^\top,

    with :math:`\mathbf a_i = \mathbf L_K^{-\top}\mathbf w_i`, from the whitened sums :math:`\mathbf W\mathbf g_1`
    and :math:`\mathbf W\mathbf G\mathbf W^\top` (:func:`whitened_site_sums`); the factors of the new :math:`q`; and
    whether :math:`\mathbf H = \mathbf I + \mathbf P` of the new sites factorizes (a boolean tensor: :math:`q` exists
    only then; the caller raises, or keeps the old sites, when it does not). In whitened coordinates the step is
    :math:`\mathbf h \leftarrow (1-r)\mathbf h + rs\mathbf W\mathbf g_1` and :math:`\mathbf P \leftarrow
    (1-r)\mathbf P + rs\mathbf W\mathbf G\mathbf W^\top`; the whitened sum is mapped back to u-space with two
    :math:`M \times M` triangular solves (:math:`O(M^3)`), or, given the batch's own columns :math:`(\mathbf W,
    \mathbf g_2)` with :math:`B < M`, by forming the projections (:math:`O(BM^2)`). Plain tensor operations without
    data-dependent branches: the eager E-step and the compiled t-SVGP iteration
    (:func:`~gpytorch_decoupled.training.compile_training_step`) both take their step here; ``lr`` may be a tensor.
    """
    scale = lr * num_data / batch_size
    prior_chol = factors.prior_cholesky
    # q exists only while H = I + P stays positive definite (P is PSD by construction, up to rounding).
    precision = (1 - lr) * factors.whitened_site_precision + scale * whitened_gram
    inner_chol, info = torch.linalg.cholesky_ex(add_to_diagonal(precision.double(), 1.0))
    inner_chol = inner_chol.to(precision.dtype)
    whitened_site_mean = (1 - lr) * factors.whitened_site_mean + scale * whitened_mean_sum
    whitened_mean = cholesky_solve(inner_chol, whitened_site_mean.unsqueeze(-1)).squeeze(-1)
    new_factors = DualPosteriorFactors(prior_chol, precision, inner_chol, whitened_site_mean, whitened_mean)

    mean_increment = solve_lower_transpose(prior_chol, whitened_mean_sum.unsqueeze(-1)).squeeze(-1)
    if own_columns is None or own_columns[0].size(-1) >= own_columns[0].size(-2):
        half = solve_lower_transpose(prior_chol, whitened_gram)  # L_K^-T W G W^T
        precision_increment = solve_lower_transpose(prior_chol, half.mT).mT
        precision_increment = 0.5 * (precision_increment + precision_increment.mT)
    else:
        whitened_cross, second_target = own_columns
        projections = solve_lower_transpose(prior_chol, whitened_cross)
        precision_increment = weighted_gram(projections, second_target)
    new_mean = (1 - lr) * site_mean + scale * mean_increment
    new_precision = (1 - lr) * site_precision + scale * precision_increment
    return new_mean, new_precision, new_factors, (info == 0).all()
