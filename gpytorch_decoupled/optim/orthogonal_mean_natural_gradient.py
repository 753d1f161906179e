from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ..variational import OrthogonallyDecoupledVariationalStrategy


class OrthogonalMeanNaturalGradient(torch.optim.Optimizer):
    r"""
    The approximate natural-gradient rule for the mean coefficients of an orthogonally decoupled strategy
    (`Salimbeni et al. (2018)`_, eq. 17).

    The exact natural gradient of :math:`\mathbf a_\gamma` preconditions by
    :math:`\mathbf K_{\gamma\perp\beta}^{-1}` (an :math:`M_\gamma \times M_\gamma` solve); replacing
    :math:`\mathbf K_{\gamma\perp\beta}` by its diagonal :math:`\mathbf D_{\gamma\mid\beta}` gives the linear-cost step

    .. math::

        \mathbf a_\gamma \leftarrow \mathbf a_\gamma - \tau\, N \,(\mathbf D_{\gamma\mid\beta} + \epsilon
        \mathbf I)^{-1} \nabla_{\mathbf a_\gamma}\!\left(-\tfrac{\mathrm{ELBO}}{N}\right),

    where the factor :math:`N` (``num_data``) undoes the :math:`1/N` of GPyTorch's ELBO, as in
    :class:`gpytorch.optim.NGD`. It costs :math:`O(M_\beta^2 M_\gamma)` per step. The step is stable only for
    :math:`\tau` below :math:`2/\lambda_{\max}` of the preconditioned Hessian; the paper therefore prefers Adam for this
    block (the default OrthNat scheme), and this rule is the option it describes.

    Use it next to :class:`gpytorch.optim.NGD` on ``model.variational_parameters()`` (the covariance block) and Adam
    on the remaining hyperparameters (exclude ``mean_coefficients`` from Adam).

    Like :class:`gpytorch.optim.NGD` it is a :class:`torch.optim.Optimizer` over the parameters it steps (learning-rate
    schedulers and ``state_dict`` work as usual) with ``step(closure=None)``; since the preconditioner needs their
    strategies' kernel blocks as well, it is built from the model that holds them (see :ref:`update-steps-contract`).

    :param model: The model (e.g. the :class:`~gpytorch.models.ApproximateGP`) whose orthogonally decoupled strategies
        (its own, or the base of a multitask wrapper) have their mean coefficients stepped. Passing a strategy still
        works for one release, with a ``DeprecationWarning``.
    :param num_data: Number of training points :math:`N`.
    :param lr: Step size :math:`\tau`.
    :param jitter: :math:`\epsilon`, keeps the preconditioner finite where a mean-basis point lies in
        :math:`\operatorname{span}\Psi_\beta` (then :math:`D_i = 0`).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.optim import OrthogonalMeanNaturalGradient
        >>> from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy
        >>> class ODVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self):
        ...         q = gpytorch.variational.NaturalVariationalDistribution(8)
        ...         beta, gamma = torch.linspace(-2, 2, 8).unsqueeze(-1), torch.linspace(-2, 2, 40).unsqueeze(-1)
        ...         super().__init__(OrthogonallyDecoupledVariationalStrategy(self, beta, q, gamma))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> model, likelihood = ODVGP(), gpytorch.likelihoods.GaussianLikelihood()
        >>> mean_step = OrthogonalMeanNaturalGradient(model, num_data=100, lr=0.02)
        >>> x = torch.linspace(-2, 2, 100).unsqueeze(-1)
        >>> loss = -gpytorch.mlls.VariationalELBO(likelihood, model, num_data=100)(model(x), torch.sin(3 * x[:, 0]))
        >>> loss.backward()
        >>> mean_step.step()

    .. _Salimbeni et al. (2018):
        https://arxiv.org/abs/1809.08820
    """

    def __init__(self, model: torch.nn.Module, num_data: int, lr: float = 0.01, jitter: float = 1e-6):
        if isinstance(model, OrthogonallyDecoupledVariationalStrategy):
            warnings.warn(
                "OrthogonalMeanNaturalGradient(strategy, ...) is deprecated: pass the model (the module that holds the "
                "strategy), as for the package's other update steps; the strategy form will be removed in the next "
                "release.",
                DeprecationWarning,
                stacklevel=2,
            )
            strategies = [model]
        elif isinstance(model, torch.nn.Module):
            strategies = [m for m in model.modules() if isinstance(m, OrthogonallyDecoupledVariationalStrategy)]
        else:
            strategies = []
        if not strategies:
            raise TypeError(
                "OrthogonalMeanNaturalGradient needs a model with an OrthogonallyDecoupledVariationalStrategy, got "
                f"{type(model).__name__}."
            )
        if lr <= 0 or num_data <= 0 or jitter <= 0:
            raise ValueError(f"lr, num_data and jitter must be positive, got {lr}, {num_data}, {jitter}.")
        super().__init__([strategy.mean_coefficients for strategy in strategies], {"lr": lr})
        self.strategies = strategies
        self.num_data = num_data
        self.jitter = jitter

    @torch.no_grad()
    def step(self, closure=None) -> Tensor | None:
        """
        One step on every strategy's mean coefficients that has a gradient (all of them are checked before any
        changes).

        :param closure: Re-evaluates the model and returns the loss (optional, as for :class:`torch.optim.Optimizer`).
        :return: The closure's loss, or None.
        :raises RuntimeError: If a step is not finite; then no coefficient changes.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates = []
        for strategy in self.strategies:
            # Read from the strategy, not from param_groups: growing the basis replaces the parameter.
            coefficients = strategy.mean_coefficients
            if coefficients.grad is None:
                continue
            preconditioner = strategy.residual_variances().clamp_min(0) + self.jitter
            update = self.param_groups[0]["lr"] * self.num_data * coefficients.grad / preconditioner
            if not torch.isfinite(update).all():
                raise RuntimeError("the natural-gradient step on mean_coefficients is not finite; nothing was changed.")
            updates.append((coefficients, update))
        for coefficients, update in updates:
            coefficients.sub_(update)
        return loss
