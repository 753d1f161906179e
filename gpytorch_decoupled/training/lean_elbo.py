from __future__ import annotations

import torch
from gpytorch.means import ConstantMean, ZeroMean
from gpytorch.mlls import VariationalELBO
from torch import Tensor

from ..linalg import LeanKernel
from ..mlls import DualVariationalELBO
from ..mlls import VariationalELBO as CheckedVariationalELBO
from .lean_likelihood import LeanLikelihood
from .lean_strategies import STRATEGY_TERMS


class LeanELBO:
    r"""
    The negative ELBO of a :class:`~gpytorch.mlls.VariationalELBO` (or of t-SVGP's
    :class:`~gpytorch_decoupled.mlls.DualVariationalELBO`) per datum (what ``-mll(model(x), y)`` returns in
    training mode),

    .. math::

        \mathcal L = -\frac1B\sum_{n=1}^B \mathbb E_{q(f_n)}[\log p(y_n\mid f_n)]
            + \frac{\beta}{N}\,\mathrm{KL}[q(\mathbf u)\Vert p(\mathbf u)],

    as plain tensor operations (the lean training path): the same values and gradients, without GPyTorch's
    :class:`~linear_operator.operators.LinearOperator` layers, memoization and data-dependent checks, so that
    :func:`torch.compile` captures a whole training step in one graph. Built by :meth:`of` when every part of the model
    is of a supported type: a strategy of :data:`~gpytorch_decoupled.training.lean_strategies.STRATEGY_TERMS` (with
    its supported variational distributions), a zero or constant mean and a kernel supported by
    :class:`~gpytorch_decoupled.linalg.LeanKernel` as ``model.mean_module`` and ``model.covar_module``, whose
    ``model.forward`` is checked once to be exactly the Gaussian prior they define, a likelihood supported by
    :class:`~gpytorch_decoupled.training.LeanLikelihood`, no priors on any parameter and no added loss terms. Everything
    is read from the modules at every call, so the lean path always sees the current parameters.

    :param mll: The objective.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.training import LeanELBO
        >>> class SVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z):
        ...         q = gpytorch.variational.CholeskyVariationalDistribution(z.size(0))
        ...         super().__init__(gpytorch.variational.VariationalStrategy(self, z, q))
        ...         self.mean_module = gpytorch.means.ConstantMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-2, 2, 30, dtype=torch.float64).unsqueeze(-1)
        >>> y = torch.sin(3 * x.squeeze(-1))
        >>> model = SVGP(x[::3].clone()).double()
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=30)
        >>> lean = LeanELBO.of(mll)
        >>> general = -mll(model(x), y)
        >>> bool(torch.allclose(lean(x, y, lean.draws()), general, rtol=1e-12))
        True
    """

    def __init__(self, mll: VariationalELBO, kernel: LeanKernel, likelihood: LeanLikelihood):
        self.mll = mll
        self.model = mll.model
        self.strategy = mll.model.variational_strategy
        self.kernel = kernel
        self.likelihood = likelihood
        self._supports, self._draws, self._terms = STRATEGY_TERMS[type(self.strategy)]

    @classmethod
    def of(cls, mll) -> LeanELBO | None:
        """The lean objective of ``mll``, or None where some part is not supported (:meth:`unsupported` says which)."""
        if cls.unsupported(mll) is not None:
            return None
        return cls(mll, LeanKernel.of(mll.model.covar_module), LeanLikelihood.of(mll.likelihood))

    @staticmethod
    def unsupported(mll) -> str | None:
        """Why the lean path cannot compute ``mll``, or None when it can."""
        if type(mll) not in (VariationalELBO, CheckedVariationalELBO, DualVariationalELBO):
            return f"{type(mll).__name__} (supported: VariationalELBO, this package's checked one, DualVariationalELBO)"
        if not mll.combine_terms:
            return "an objective with combine_terms=False (a step needs one loss)"
        model = mll.model
        strategy = getattr(model, "variational_strategy", None)
        if type(strategy) not in STRATEGY_TERMS:
            names = ", ".join(sorted(kind.__name__ for kind in STRATEGY_TERMS))
            return f"the strategy {type(strategy).__name__} (supported: {names}; subclasses are not matched)"
        reason = STRATEGY_TERMS[type(strategy)][0](strategy)
        if reason is not None:
            return reason
        if LeanLikelihood.of(mll.likelihood) is None:
            return (
                f"the likelihood {type(mll.likelihood).__name__} (supported: GaussianLikelihood, BernoulliLikelihood)"
            )
        if any(True for _ in model.named_priors()) or any(True for _ in mll.likelihood.named_priors()):
            return "a parameter has a prior (its log-density term is not part of the lean objective)"
        if any(True for _ in model.added_loss_terms()):
            return "the model has added loss terms"
        return unsupported_prior(model)

    def prior_mean(self, x: Tensor) -> Tensor:
        r"""The prior mean :math:`\mu_0(\mathbf x)`, ``(N,)``."""
        return prior_mean(self.model, x)

    def draws(self) -> Tensor | None:
        """This step's random draws of the strategy (e.g. sampled KL rows), made eagerly, before a compiled region."""
        return self._draws(self.strategy)

    def __call__(self, x: Tensor, y: Tensor, draws: Tensor | None) -> Tensor:
        """The loss ``-mll(model(x), y)`` of a training step at the batch ``(x, y)`` with this step's ``draws``."""
        return self.loss_and_statistics(x, y, draws)[0]

    def loss_and_statistics(self, x: Tensor, y: Tensor, draws: Tensor | None):
        """The loss and what an update of the step needs of the forward pass besides it (t-SVGP's E-step: the
        :class:`~gpytorch_decoupled.variational.DualSiteStatistics` of the batch), or None."""
        mean, variance, kl, statistics = self._terms(self.strategy, self.kernel, self.prior_mean, x, draws)
        expected_log_lik = self.likelihood(y, mean, variance).sum(-1).div(y.size(-1))
        return kl.div(self.mll.num_data / self.mll.beta) - expected_log_lik, statistics


def unsupported_prior(model) -> str | None:
    """Why the lean path cannot compute the prior of ``model`` (its ``mean_module``, ``covar_module`` and
    ``forward``), or None when it can."""
    mean_module, covar_module = getattr(model, "mean_module", None), getattr(model, "covar_module", None)
    if type(mean_module) not in (ZeroMean, ConstantMean) or mean_module.batch_shape != torch.Size([]):
        return f"model.mean_module {type(mean_module).__name__} (supported: ZeroMean, ConstantMean)"
    if covar_module is None or LeanKernel.of(covar_module) is None:
        return f"model.covar_module {type(covar_module).__name__} (supported: [ScaleKernel of] RBF, Matern)"
    if not _forward_is_prior(model, LeanKernel.of(covar_module)):
        return "model.forward is not MultivariateNormal(mean_module(x), covar_module(x))"
    return None


def prior_mean(model, x: Tensor) -> Tensor:
    r"""The prior mean :math:`\mu_0(\mathbf x)` of a model whose prior the lean path computes, ``(N,)``."""
    mean_module = model.mean_module
    if type(mean_module) is ZeroMean:
        return x.new_zeros(x.shape[:-1])
    return mean_module.constant.expand(x.shape[:-1])


@torch.no_grad()
def _forward_is_prior(model, kernel: LeanKernel) -> bool:
    """Whether ``model.forward`` gives the prior of ``mean_module`` and ``covar_module`` at a few probe points."""
    z = model.variational_strategy.inducing_points[:8]
    probe = torch.cat([z, z + 0.5, z.flip(-1) if z.size(-1) > 1 else -z], dim=-2)
    prior = model.forward(probe)
    expected_mean = model.mean_module(probe)
    return bool(
        torch.allclose(prior.mean, expected_mean)
        and torch.allclose(prior.lazy_covariance_matrix.to_dense(), kernel(probe, probe), rtol=1e-4, atol=1e-6)
    )
