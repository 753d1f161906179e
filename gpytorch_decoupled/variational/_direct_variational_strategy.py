from __future__ import annotations

from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.module import Module
from torch import Tensor

from ..gpytorch_compat import VariationalDistributionBase, VariationalStrategyBase, cache_safe
from ._fantasies import no_fantasy_model
from .checked_inputs import checked_inputs


@cache_safe
class _DirectVariationalStrategy(VariationalStrategyBase):
    r"""
    The base of the strategies whose state needs no initialization from the prior and is not a Gaussian over the
    inducing values (decoupled parameters, dual sites, a Kalman state), so that GPyTorch's ``__call__`` (which
    initializes the distribution on the first call and passes its mean and covariance on) does not apply.

    ``__call__`` validates the inputs before anything is computed, returns the prior for ``prior=True``, clears the
    caches in training (and in eval mode when a parameter or buffer they depend on has changed), records the first call
    as GPyTorch's strategies do (without resetting state set or loaded before it, and without reading the flag back
    from the device), broadcasts the inputs against the inducing points and calls
    ``forward(x, inducing_points, diag=..., **kwargs)``. GPyTorch's ``forward`` also takes ``inducing_values`` and
    ``variational_inducing_covar``, the moments of a Gaussian :math:`q(\mathbf u)`, which these strategies do not
    have: theirs hands the inputs to the subclass's ``_predictive_distribution(x, inducing_points, diag, **kwargs)``.

    Values that one computation leaves for another (a factor the forward pass and the KL of a training step share, or
    that eval-mode predictions reuse) are explicit attributes, named in ``_step_attributes`` and documented by each
    subclass: None until computed, and forgotten with GPyTorch's memoized caches
    (:func:`~gpytorch_decoupled.gpytorch_compat.cache_safe`).
    """

    _step_attributes: tuple[str, ...] = ()

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: VariationalDistributionBase,
        learn_inducing_locations: bool = True,
        jitter_val: float | None = None,
    ):
        super().__init__(model, inducing_points, variational_distribution, learn_inducing_locations, jitter_val)

    def forward(
        self,
        x: Tensor,
        inducing_points: Tensor,
        inducing_values: Tensor | None = None,
        variational_inducing_covar=None,
        diag: bool = True,
        **kwargs,
    ) -> MultivariateNormal:
        return self._predictive_distribution(x, inducing_points, diag, **kwargs)

    def _predictive_distribution(self, x: Tensor, inducing_points: Tensor, diag: bool, **kwargs) -> MultivariateNormal:
        r""":math:`q(f(\mathbf x))` at inputs broadcast against the inducing points (marginal variances only in
        training mode with ``diag``); ``kwargs`` go to the model's prior."""
        raise NotImplementedError

    def get_fantasy_model(self, inputs: Tensor, targets: Tensor, **kwargs) -> ApproximateGP:
        """Closed-form conditioning where the subclass has it; otherwise a ``NotImplementedError`` that names the
        strategies with one."""
        raise no_fantasy_model(self)

    def checked_inputs(self, x: Tensor, name: str = "x", dim: int | None = None) -> Tensor:
        """``x`` validated against the inducing points (see :func:`~gpytorch_decoupled.variational.checked_inputs`)."""
        return checked_inputs(x, self.inducing_points, self.model, name, dim)

    def _cache_dependencies(self) -> tuple[Module, ...]:
        """The modules whose parameters and buffers the eval-mode caches are computed from."""
        return (self.model,)

    def __call__(self, x: Tensor, prior: bool = False, diag: bool = True, **kwargs) -> MultivariateNormal:
        x = self.checked_inputs(x)
        if prior:
            return self.model.forward(x, **kwargs)
        if self.training:
            self._clear_cache()
        else:
            self._clear_cache_if_stale(*self._cache_dependencies(), ignore=(self.variational_params_initialized,))
        self.variational_params_initialized.fill_(1)
        inducing_points = self.inducing_points
        if inducing_points.shape[:-2] != x.shape[:-2]:
            x, inducing_points = self._expand_inputs(x, inducing_points)
        return Module.__call__(self, x, inducing_points, diag=diag, **kwargs)
