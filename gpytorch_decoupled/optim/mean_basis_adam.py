from __future__ import annotations

import torch
from torch import Tensor

from ..variational import DecoupledVariationalStrategy, MeanBasis, joint_prior
from ._decoupled_natural_step import decoupled_natural_step

#: The default ``lr``: Adam's rate in function space, and the decoupled strategy's Gauss-Newton step size.
ADAM_LR, NATURAL_LR = 0.5, 0.1
#: The decoupled step's state (running averages of the data's curvature), beside a coefficient parameter.
NATURAL_STATE = ("step", "mean_precision", "residual_curvature", "kl_residual_gradient")


class MeanBasisAdam(torch.optim.Adam):
    r"""
    Adam on the mean coefficients :math:`\mathbf a` of the decoupled strategies (orthogonally decoupled, hybrid,
    decoupled), with its step measured in function space, so that one learning rate works whatever the mean basis's
    size, the kernel's length-scales and output scale (:ref:`derivations-scale-free-mean-steps`).

    Adam moves every coordinate by about ``lr`` whatever its gradient's scale. The gradient of a coefficient is a
    kernel-smoothed residual, alike for neighbouring basis points, so the mean function
    :math:`m(\mathbf x) = \sum_i a_i k(\mathbf x, \gamma_i)` moves by about ``lr`` times
    :math:`\sum_i k(\mathbf x, \gamma_i)`: the step grows with the number of basis points within a length-scale,
    i.e. linearly in :math:`M_\gamma`. This optimizer divides the coefficients' step by

    .. math::

        s = \sigma\,\bar d, \qquad
        \bar d = 1 + (M - 1)\,\frac{\mathbb E_{i \neq j}\, k(\gamma_i, \gamma_j)}{\sigma^2},
        \qquad \sigma^2 = \mathbb E_i\, k(\gamma_i, \gamma_i),

    the mean degree of the basis's kernel graph (at least 1: the safe floor of a basis whose points do not overlap)
    times the prior standard deviation, so that ``lr`` is the step of the mean function in units of its prior standard
    deviation. :math:`\mathbb E_{i\neq j}` is estimated every ``refresh_every`` steps from the kernel block between
    two disjoint random subsets of ``num_samples`` basis points (:math:`O(\text{num\_samples}^2)` kernel entries, one
    evaluation of the model's prior) and smoothed over the estimates with an exponential moving average; the steps in
    between keep the last smoothed value (the scale follows the hyperparameters, which move little in a few steps, and
    an estimate costs about as much as a small step's arithmetic).

    The other parameters (hyperparameters, the covariance block) take their own optimizer: exclude the mean
    coefficients from it.

    **The decoupled strategy** (:class:`~gpytorch_decoupled.variational.DecoupledVariationalStrategy`) is stepped
    otherwise (:ref:`derivations-decoupled-step`): Adam-type steps leave its unwhitened :math:`\mathbf a` far behind its
    optimum, and Adam on :math:`\mathbf L_B` cannot grow :math:`\mathbf B` as fast as the data's precision. The
    optimizer has the strategy record derivatives of the loss :math:`\mathcal L` in its backward passes
    (:class:`~gpytorch_decoupled.variational.DecoupledCurvature`: at the data, :math:`\partial\mathcal L/\partial s_n`
    and :math:`\partial\mathcal L/\partial m_n` of the marginals, and the KL's weight :math:`c`; reset by
    :meth:`zero_grad`), and each step takes

    * a natural-gradient step of size ``covariance_lr`` on :math:`\mathbf B = \mathbf L_B\mathbf L_B^\top` with the
      mean held fixed, :math:`\mathbf B \leftarrow (1 - \rho_B)\mathbf B + \rho_B\hat{\mathbf B}`, towards
      :math:`\hat{\mathbf B} = \mathbf K_\beta^{-1}\mathbf K_{\beta\mathbf x}\boldsymbol\Lambda
      \mathbf K_{\mathbf x\beta}\mathbf K_\beta^{-1}/c`, :math:`\boldsymbol\Lambda = \operatorname{diag}(2\,
      \partial\mathcal L/\partial s_n)_+` (the optimum of the covariance for the step's data: :math:`\mathbf B^\star`
      of a Gaussian likelihood with the full data);
    * a damped Gauss-Newton step of size ``lr`` on :math:`\mathbf a`, with the curvature of the prior and of the data
      (a running average at the rate ``covariance_lr``) through the covariance basis, the diagonal exact, and
      Levenberg-Marquardt damping ``damping`` times the mean curvature; the step size is cut where ``lr`` would pass
      the minimum along the step's direction of the quadratic model with this step's data curvature (a dense mean
      basis couples each coefficient to many neighbours, which the diagonal does not see), and a column-sampled KL's
      gradient (a basis above ``exact_kl_size``) enters with its part through the covariance basis exact and the
      rest averaged over steps, with the damping multiplied by the sampling ratio :math:`M_\alpha / b`.

    Both cost :math:`O(M_\alpha M_\beta^2 + M_\beta^3)` plus the kernel between the mean basis and the step's data
    (the forward pass's size), linear in the mean basis. The precision factor :math:`\mathbf L_B` is not in
    ``param_groups`` (the optimizer holds no per-entry state for it); another optimizer that also has it, as when
    every other parameter goes to Adam, moves it by at most its own rate per step, and the next step pulls
    :math:`\mathbf B` back towards its target. The step assumes, as GPyTorch's objectives do, that the data term
    averages over the batch.

    :param model: The model whose decoupled strategies (its own, or the base of a multitask wrapper) have their mean
        coefficients stepped.
    :param lr: Adam's rate in function space: the step of the mean function per iteration is about ``lr`` times its
        prior standard deviation at most (less once the gradients turn noisy); default 0.5. For the decoupled strategy,
        the size of its Gauss-Newton step (1 the full damped step); default 0.1, the rate of GPyTorch's NGD.
    :param betas: Adam's moment decays.
    :param eps: Adam's :math:`\epsilon`.
    :param num_samples: Basis points per subset of the degree estimate.
    :param smoothing: Weight of the previous estimate in the moving average.
    :param refresh_every: Steps per estimate of the scale (1: every step).
    :param generator: Random generator for the subsets (default: PyTorch's global one).
    :param covariance_lr: The decoupled strategy's natural-gradient step size on :math:`\mathbf B`, in
        :math:`(0, 1]` (1 sets :math:`\mathbf B` to its target), and the rate of its running averages.
    :param damping: The decoupled strategy's Levenberg-Marquardt damping, relative to the mean curvature; default
        0.05 (multiplied by :math:`M_\alpha / b` when the KL samples :math:`b` of the :math:`M_\alpha` rows). The
        defaults train kin40k (batches of 256) from :math:`M_\alpha = 10^3` to :math:`10^5` without tuning
        (``bench decoupled-speed``'s scale runs).

    The optimizer holds the coefficient parameters it was built with: after
    :class:`~gpytorch_decoupled.optim.OnlineBasisGrowth` replaces them, build a new one.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.optim import MeanBasisAdam
        >>> from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy
        >>> class ODVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self):
        ...         q = gpytorch.variational.NaturalVariationalDistribution(8)
        ...         beta, gamma = torch.linspace(-2, 2, 8).unsqueeze(-1), torch.linspace(-2, 2, 400).unsqueeze(-1)
        ...         super().__init__(OrthogonallyDecoupledVariationalStrategy(self, beta, q, gamma))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> model, likelihood = ODVGP(), gpytorch.likelihoods.GaussianLikelihood()
        >>> x = torch.linspace(-2, 2, 100).unsqueeze(-1)
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=100)
        >>> a_gamma = model.variational_strategy.mean_coefficients
        >>> ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=100, lr=0.1)
        >>> mean_step = MeanBasisAdam(model)  # one rate for any basis size
        >>> others = [p for p in [*model.hyperparameters(), *likelihood.parameters()] if p is not a_gamma]
        >>> adam = torch.optim.Adam(others, lr=0.01)
        >>> for _ in range(3):
        ...     for optimizer in (ngd, mean_step, adam):
        ...         optimizer.zero_grad()
        ...     (-mll(model(x), torch.sin(3 * x[:, 0]))).backward()
        ...     for optimizer in (ngd, mean_step, adam):
        ...         optimizer.step()
        >>> bool(mean_step.function_scale(model.variational_strategy) > 1)  # 400 overlapping basis functions
        True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        num_samples: int = 200,
        smoothing: float = 0.35,
        refresh_every: int = 10,
        generator: torch.Generator | None = None,
        covariance_lr: float = 0.5,
        damping: float = 0.05,
    ):
        strategies = [m for m in model.modules() if isinstance(getattr(m, "mean_basis", None), MeanBasis)]
        if not strategies:
            raise TypeError(
                "MeanBasisAdam needs a model with a decoupled strategy (OrthogonallyDecoupledVariationalStrategy, "
                f"HybridVariationalStrategy or DecoupledVariationalStrategy), got {type(model).__name__}."
            )
        if lr is not None and not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}.")
        if num_samples < 1 or refresh_every < 1:
            raise ValueError(
                f"num_samples and refresh_every must be positive integers, got {num_samples} and {refresh_every}."
            )
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing must lie in [0, 1), got {smoothing}.")
        if not 0 < covariance_lr <= 1:
            raise ValueError(f"covariance_lr must lie in (0, 1], got {covariance_lr}.")
        if not damping > 0:
            raise ValueError(f"damping must be positive, got {damping}.")
        groups = []
        for strategy in strategies:
            group = {"params": [strategy.mean_basis.coefficients], "lr": ADAM_LR if lr is None else lr}
            if isinstance(strategy, DecoupledVariationalStrategy):
                group.update(lr=NATURAL_LR if lr is None else lr, covariance_lr=covariance_lr, damping=damping)
                strategy.record_curvature = True
            groups.append(group)
        super().__init__(groups, lr=ADAM_LR if lr is None else lr, betas=betas, eps=eps)
        self.strategies = strategies
        self.num_samples = num_samples
        self.smoothing = smoothing
        self.refresh_every = refresh_every
        self.generator = generator

    @torch.no_grad()
    def function_scale(self, strategy) -> Tensor:
        r"""This step's estimate of :math:`s = \sigma\bar d` for one strategy's mean basis (not smoothed)."""
        basis = strategy.mean_basis
        points = basis.inducing_points
        num_points = points.size(-2)
        order = torch.randperm(num_points, generator=self.generator, device=points.device)
        size = min(self.num_samples, num_points // 2)
        first = points.index_select(-2, order[:size])
        if size == 0:  # a basis of one point has no pairs: its degree is 1
            return basis.cross_covariance(first, first).diagonal(dim1=-2, dim2=-1).mean().sqrt()
        # One evaluation of the prior for both blocks: each costs the model's whole forward pass.
        prior = joint_prior(basis.model, first, points.index_select(-2, order[size : 2 * size]))
        variance = prior.diagonal(0).mean()
        covariance = prior.dense(0, 1).mean()
        return variance.sqrt() * (1 + (num_points - 1) * covariance.clamp_min(0) / variance)

    @torch.no_grad()
    def step(self, closure=None) -> Tensor | None:
        """One Adam step on every strategy's mean coefficients, its rate divided by the basis's function scale, and
        the natural-gradient step of every decoupled strategy (all computed before anything changes).

        :param closure: Re-evaluates the model and returns the loss (optional, as for :class:`torch.optim.Optimizer`).
        :return: The closure's loss, or None.
        :raises RuntimeError: If a decoupled strategy's coefficients have a gradient but no curvature was recorded
            (no training call with gradients since :meth:`zero_grad` reached both its data terms and its KL), or a
            step is not finite; then nothing changes.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        natural = [
            (group, strategy, self._natural_step(group, strategy)) for group, strategy in self._decoupled_groups()
        ]
        scales = self.smoothed_function_scales()
        rates = [group["lr"] for group in self.param_groups]
        groups = self.param_groups
        try:
            adam_groups = [(group, scale) for group, scale in zip(groups, scales, strict=True) if scale is not None]
            self.param_groups = [group for group, _ in adam_groups]
            for group, scale in adam_groups:
                group["lr"] = group["lr"] / float(scale)
            super().step()
        finally:
            self.param_groups = groups
            for group, rate in zip(self.param_groups, rates, strict=True):
                group["lr"] = rate
        for group, strategy, values in natural:
            if values is not None:
                distribution = strategy._variational_distribution
                distribution.mean_coefficients.copy_(values[0])
                distribution.precision_factor.copy_(values[1])
                self.state[group["params"][0]].update(values[2])
                strategy._clear_cache()
        self.keep_function_scales(scales)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients and the curvature the decoupled strategies recorded."""
        super().zero_grad(set_to_none)
        for _, strategy in self._decoupled_groups():
            strategy.reset_curvature()

    def _decoupled_groups(self) -> list[tuple[dict, DecoupledVariationalStrategy]]:
        return [
            (group, strategy)
            for group, strategy in zip(self.param_groups, self.strategies, strict=True)
            if isinstance(strategy, DecoupledVariationalStrategy)
        ]

    # The decoupled strategy's step as a function, computed without changing anything: what step() applies, and what
    # the lean training step applies to the curvature from its own gradient computation (documented by the function).
    decoupled_step = staticmethod(decoupled_natural_step)

    def _natural_step(self, group: dict, strategy: DecoupledVariationalStrategy) -> tuple | None:
        """The new raw ``(mean_coefficients, precision_factor)`` of a decoupled strategy and its new state, or None
        without a gradient."""
        gradient = group["params"][0].grad
        if gradient is None:
            return None
        curvature = strategy.curvature
        if curvature is None:
            raise RuntimeError(
                "MeanBasisAdam: the decoupled strategy recorded no curvature since zero_grad() (its training call with "
                "gradients must reach both the data terms and the KL before step()); nothing was changed."
            )
        state = {key: value for key, value in self.state[group["params"][0]].items() if key in NATURAL_STATE}
        values = self.decoupled_step(
            strategy, curvature, gradient, group["lr"], group["covariance_lr"], group["damping"], state
        )
        if not all(torch.isfinite(value).all() for value in values[:2]):
            raise RuntimeError("MeanBasisAdam: the decoupled strategy's step is not finite; nothing was changed.")
        return values

    @torch.no_grad()
    def smoothed_function_scales(self) -> list[Tensor | None]:
        r"""This step's function scale of every group: the last one kept, or, on the first step and every
        ``refresh_every`` steps, a new estimate (:meth:`function_scale`) smoothed with it; None for a decoupled
        strategy, whose step does not use one.

        :raises RuntimeError: If a scale is not finite and positive (before anything changes).
        """
        scales = []
        for group, strategy in zip(self.param_groups, self.strategies, strict=True):
            if isinstance(strategy, DecoupledVariationalStrategy):
                scales.append(None)
                continue
            state = self.state[group["params"][0]]
            previous = state.get("function_scale")
            if previous is not None and state["function_scale_age"] + 1 < self.refresh_every:
                scales.append(previous)
                continue
            scale = self.function_scale(strategy)
            scales.append(scale if previous is None else torch.lerp(scale, previous, self.smoothing))
            if not torch.isfinite(scales[-1]) or not scales[-1] > 0:
                raise RuntimeError(f"the mean basis's function scale is {float(scales[-1])}; nothing was changed.")
        return scales

    def keep_function_scales(self, scales: list[Tensor | None]) -> None:
        """Keeps a step's scales for the next steps, beside Adam's moments (after them: Adam creates its state on the
        first step), with the number of steps since each was estimated."""
        for group, scale in zip(self.param_groups, scales, strict=True):
            if scale is None:
                continue
            state = self.state[group["params"][0]]
            # A scale that is not the kept tensor itself is a new estimate (smoothed_function_scales returns the kept
            # one between estimates).
            refreshed = scale is not state.get("function_scale")
            state["function_scale_age"] = 0 if refreshed else state["function_scale_age"] + 1
            state["function_scale"] = scale
