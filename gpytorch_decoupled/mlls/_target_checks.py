from __future__ import annotations

from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import SoftmaxLikelihood
from torch import Tensor

from ..validation import check_targets


class _TargetChecks:
    r"""
    Mixin for the approximate objectives of :mod:`gpytorch.mlls`: checks the targets against the model's output and
    the likelihood (:mod:`gpytorch_decoupled.validation`) before GPyTorch's ``forward`` reads them, so that targets of
    the wrong shape (e.g. ``(B, 1)`` against an output of shape ``(B,)``, which GPyTorch broadcasts into a
    :math:`B \times B` sum), dtype or device, NaN or inf, or labels the likelihood does not take raise a clear error
    instead of a wrong loss whose gradient reaches the parameters.
    """

    def forward(self, approximate_dist_f: MultivariateNormal, target: Tensor, **kwargs) -> Tensor:
        r"""
        The objective at the model's output ``approximate_dist_f`` (``model(x)``) and the targets, as GPyTorch's.

        :raises TypeError: If ``target`` is not a tensor.
        :raises ValueError: If ``target`` does not have the output's shape (``(B,)``, or ``(B, T)`` for T tasks; class
            labels ``(B,)`` for a softmax likelihood; leading batch dimensions that broadcast into the output's), device
            or dtype, or holds NaN/inf or values the likelihood does not take.
        """
        shape = approximate_dist_f.event_shape
        if isinstance(self.likelihood, SoftmaxLikelihood) and isinstance(
            approximate_dist_f, MultitaskMultivariateNormal
        ):
            shape = shape[:-1]  # the latent functions are the tasks; the labels have one entry per row
        check_targets(
            target,
            "target",
            shape,
            approximate_dist_f.mean,
            self.likelihood,
            approximate_dist_f.batch_shape,
            rows_name="the model's output",
        )
        return super().forward(approximate_dist_f, target, **kwargs)
