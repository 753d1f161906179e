from __future__ import annotations

from gpytorch.distributions import MultivariateNormal
from gpytorch.module import Module
from torch import Tensor

from ._input_checks import checked_inputs


class _DirectCallMixin:
    r"""
    ``__call__`` for strategies whose state needs no initialization from the prior and is not a Gaussian over the
    inducing values (decoupled parameters, dual sites, a Kalman state), so GPyTorch's ``_VariationalStrategy.__call__``
    (which initializes the distribution on the first call and passes its mean and covariance on) does not apply.

    It validates the inputs before anything is computed, returns the prior for ``prior=True``, clears the training
    caches, records the first call as GPyTorch's strategies do (without resetting state set or loaded before it, and
    without reading the flag back from the device), broadcasts the inputs against the inducing points and calls
    ``forward(x, inducing_points, diag=...)``.
    """

    def __call__(self, x: Tensor, prior: bool = False, diag: bool = True, **kwargs) -> MultivariateNormal:
        x = checked_inputs(x, self.inducing_points, self.model)
        if prior:
            return self.model.forward(x, **kwargs)
        if self.training:
            self._clear_cache()
        self.variational_params_initialized.fill_(1)
        inducing_points = self.inducing_points
        if inducing_points.shape[:-2] != x.shape[:-2]:
            x, inducing_points = self._expand_inputs(x, inducing_points)
        return Module.__call__(self, x, inducing_points, diag=diag, **kwargs)
