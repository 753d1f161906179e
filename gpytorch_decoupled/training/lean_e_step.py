from __future__ import annotations

import torch
from torch import Tensor

from ..optim import DualEStep
from ..optim.dual_e_step import site_targets, updated_sites, whitened_site_sums
from ..variational import DualSiteStatistics
from .lean_likelihood import LeanLikelihood


class LeanEStep:
    r"""
    t-SVGP's E-step (:class:`~gpytorch_decoupled.optim.DualEStep`, `Adam et al. (2021)`_, App. E, Algorithm 2) inside
    a compiled training step: at the marginals :math:`q(f_i) = \mathcal N(\mu_i, v_i)` that the step's forward pass
    computed (:class:`~gpytorch_decoupled.variational.DualSiteStatistics`), the targets

    .. math::

        g_{1,i} = \beta_i(\mu_i - \mu_0(\mathbf x_i)) + \alpha_i, \qquad g_{2,i} = \beta_i
        = \max\!\Big(-2\frac{\partial\mathrm{VE}_i}{\partial v_i}, \beta_{\min}\Big),

    from the likelihood's derivatives (:meth:`~gpytorch_decoupled.training.LeanLikelihood.derivatives`: a Gaussian
    likelihood's in closed form, a Bernoulli one's by autograd of its quadrature), and the damped site update of size
    :math:`r` with the unbiased scale :math:`n/B`, by the E-step's own functions
    (:func:`~gpytorch_decoupled.optim.dual_e_step.site_targets`,
    :func:`~gpytorch_decoupled.optim.dual_e_step.updated_sites`): the same step as
    ``DualEStep.step(x, y)`` after the backward pass, the default schedule. The step size is read from the E-step's
    ``param_groups[0]["lr"]`` at every step and enters the graph as a tensor (a schedule such as
    :math:`r_t = \max(1/t, 0.1)` does not recompile).

    Where the eager E-step raises (non-finite targets, or new sites with which :math:`q` is not positive definite),
    the compiled one cannot (no data-dependent branch in the graph): it keeps the sites unchanged and returns False;
    the caller raises after the step.

    :param e_step: The E-step.
    :param likelihood: The lean form of its likelihood.

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """

    def __init__(self, e_step: DualEStep, likelihood: LeanLikelihood):
        self.e_step = e_step
        self.likelihood = likelihood

    @staticmethod
    def unsupported(e_step, mll) -> str | None:
        """Why the compiled step cannot take ``e_step`` for ``mll``, or None when it can."""
        if type(e_step) is not DualEStep:
            return f"{type(e_step).__name__} (supported among E-steps: DualEStep)"
        if e_step.strategy is not getattr(mll.model, "variational_strategy", None) or e_step.likelihood is not (
            mll.likelihood
        ):
            return "a DualEStep of another model or likelihood than the objective's"
        return None

    def lr(self) -> float:
        """The E-step's current step size :math:`r`."""
        return self.e_step.param_groups[0]["lr"]

    def __call__(self, y: Tensor, statistics: DualSiteStatistics, lr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The sites updated from the batch's targets ``y`` and ``statistics`` and whether the update succeeded (a
        boolean tensor; where it failed, the sites are the current ones). The caller stores them (:meth:`keep`)
        after the compiled region: written in place inside it, torch 2.11's Inductor (CPU) let the gradients of the
        same graph read the new sites."""
        mean = statistics.prior_mean + statistics.centred_mean
        mean_gradient, variance_gradient = self.likelihood.derivatives(y, mean, statistics.variance)
        first_target, second_target = site_targets(
            statistics.centred_mean, mean_gradient, variance_gradient, self.e_step.min_curvature
        )
        whitened_cross = statistics.whitened_cross
        site_mean, site_precision = self.e_step.strategy._variational_distribution()
        new_mean, new_precision, _, factorized = updated_sites(
            site_mean,
            site_precision,
            statistics.factors,
            *whitened_site_sums(whitened_cross, first_target, second_target),
            lr,
            self.e_step.num_data,
            y.size(-1),
            (whitened_cross, second_target),
        )
        done = factorized & torch.isfinite(first_target).all() & torch.isfinite(second_target).all()
        return done, torch.where(done, new_mean, site_mean), torch.where(done, new_precision, site_precision)

    def keep(self, site_mean: Tensor, site_precision: Tensor) -> None:
        """Stores sites computed by a call as the distribution's."""
        current_mean, current_precision = self.e_step.strategy._variational_distribution()
        with torch.no_grad():
            current_mean.copy_(site_mean)
            current_precision.copy_(site_precision)
