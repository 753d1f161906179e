from __future__ import annotations

from gpytorch.distributions import MultivariateNormal
from gpytorch.module import Module
from linear_operator.operators import LinearOperator
from torch import Tensor
from torch.distributions.kl import kl_divergence, register_kl


class _StrategyMultivariateNormal(MultivariateNormal):
    r"""
    The ``variational_distribution`` of a strategy whose KL divergence is not that of a single Gaussian over the
    inducing values (decoupled and orthogonal bases, t-SVGP sites, a Kalman state): a
    :class:`~gpytorch.distributions.MultivariateNormal` with the strategy's mean and covariance at its inducing
    points, whose divergence from the strategy's own ``prior_distribution`` is the strategy's ``kl_divergence()``.

    GPyTorch's :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy` and
    :class:`~gpytorch.variational.LMCVariationalStrategy` compute the KL of their base as
    ``torch.distributions.kl_divergence(base.variational_distribution, base.prior_distribution)`` instead of calling
    ``base.kl_divergence()``; the rule registered for this class makes that call return the base's own KL, so that the
    ELBO is right under GPyTorch's wrappers too. Against any other distribution it is the Gaussian KL of
    ``base_distribution`` (the Gaussian it was built from), and so is a copy that GPyTorch rebuilds from the mean and
    covariance alone (expanded or indexed).

    :param mean: Mean at the inducing points.
    :param covariance_matrix: Covariance at the inducing points.
    :param validate_args: As for :class:`~gpytorch.distributions.MultivariateNormal`.
    :param strategy: The strategy whose KL this distribution stands for.
    :param base_distribution: The Gaussian (possibly a subclass with a KL rule of its own) for other divergences.
    """

    def __init__(
        self,
        mean: Tensor,
        covariance_matrix: Tensor | LinearOperator,
        validate_args: bool = False,
        strategy: Module | None = None,
        base_distribution: MultivariateNormal | None = None,
    ):
        super().__init__(mean, covariance_matrix, validate_args=validate_args)
        self.strategy = strategy
        self.base_distribution = base_distribution

    @classmethod
    def of(cls, distribution, strategy: Module):
        """``distribution``'s mean and covariance, standing for ``strategy``'s KL (a distribution that is not a
        Gaussian, e.g. GPyTorch's ``Delta``, is returned as it is)."""
        if not isinstance(distribution, MultivariateNormal):
            return distribution
        return cls(
            distribution.mean, distribution.lazy_covariance_matrix, strategy=strategy, base_distribution=distribution
        )


@register_kl(_StrategyMultivariateNormal, MultivariateNormal)
def _kl_strategy_mvn(q: _StrategyMultivariateNormal, p: MultivariateNormal) -> Tensor:
    if q.strategy is not None and p is q.strategy.prior_distribution:
        return q.strategy.kl_divergence()
    base = q.base_distribution
    if base is None:
        base = MultivariateNormal(q.mean, q.lazy_covariance_matrix)
    return kl_divergence(base, p)
