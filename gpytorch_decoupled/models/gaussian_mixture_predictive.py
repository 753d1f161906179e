from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Categorical, MixtureSameFamily, Normal


class GaussianMixturePredictive(MixtureSameFamily):
    r"""
    The Bayesian-model-averaging predictive of VBKS (`Teng et al. (2020)`_, eqs. 14-15): at each test input,
    the mixture :math:`\sum_c w_c\,\mathcal N(\mu_{*,c}, \sigma^2_{*,c})` of the candidate kernels' marginal
    predictives, with moments

    .. math::

        \mu_* = \sum_c w_c\,\mu_{*,c}, \qquad
        \sigma_*^2 = \sum_c w_c\,(\sigma^2_{*,c} + \mu^2_{*,c}) - \mu_*^2 .

    A :class:`torch.distributions.MixtureSameFamily` (so ``mean``, ``variance``, ``log_prob``, ``cdf`` and ``sample``
    work as usual) with the quantile function :meth:`icdf` added, computed by bisection on the mixture CDF, and
    :meth:`confidence_region` built from it: unlike mean :math:`\pm 2\sigma`, the mixture's quantiles follow its skew
    and multiple modes.

    :param weights: Mixture weights :math:`w_c` (normalized here), shape ``(C,)``.
    :param means: Component means, shape ``(C, n)``.
    :param variances: Component variances, shape ``(C, n)``.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.models import GaussianMixturePredictive
        >>> mixture = GaussianMixturePredictive(torch.tensor([0.5, 0.5]), torch.tensor([[-1.0], [1.0]]),
        ...                                     torch.tensor([[1.0], [1.0]]))
        >>> mixture.mean, mixture.variance  # 0 and 1 + 1
        (tensor([0.]), tensor([2.]))
        >>> mixture.icdf(torch.tensor(0.5)).abs().item() < 1e-6
        True
    """

    def __init__(self, weights: Tensor, means: Tensor, variances: Tensor, validate_args: bool | None = None):
        if means.dim() != 2 or variances.shape != means.shape or weights.shape != means.shape[:1]:
            raise ValueError(
                f"need weights (C,), means and variances (C, n); got {tuple(weights.shape)}, {tuple(means.shape)} "
                f"and {tuple(variances.shape)}."
            )
        if (weights < 0).any() or not weights.sum() > 0:
            raise ValueError("mixture weights must be non-negative with a positive sum.")
        super().__init__(
            Categorical(probs=(weights / weights.sum()).expand(means.size(-1), -1), validate_args=validate_args),
            Normal(
                means.mT, variances.clamp_min(torch.finfo(variances.dtype).tiny).sqrt().mT, validate_args=validate_args
            ),
            validate_args=validate_args,
        )

    @property
    def weights(self) -> Tensor:
        """Normalized mixture weights, shape ``(C,)``."""
        return self.mixture_distribution.probs[..., 0, :]

    def icdf(self, value: Tensor, tolerance: float | None = None) -> Tensor:
        r"""
        The quantile function: the :math:`x` with mixture CDF :math:`F(x) = p`, by bisection between the smallest and
        largest component quantiles (which bracket the mixture quantile), to ``tolerance`` (default: 64 halvings of
        the bracket, i.e. machine precision).

        :param value: Probabilities :math:`p \in (0, 1)`, broadcastable with the batch shape ``(n,)``.
        :return: Quantiles, the broadcast shape.
        """
        value = torch.as_tensor(value, dtype=self.mean.dtype, device=self.mean.device)
        if ((value <= 0) | (value >= 1)).any():
            raise ValueError("quantile probabilities must lie strictly between 0 and 1.")
        components = self.component_distribution
        component_quantiles = components.icdf(value.unsqueeze(-1).expand(*value.shape, 1))
        low, high = component_quantiles.min(-1).values, component_quantiles.max(-1).values
        low, high, value = torch.broadcast_tensors(low, high, value)
        low, high = low.clone(), high.clone()
        for _ in range(64):
            middle = 0.5 * (low + high)
            below = self.cdf(middle) < value
            low = torch.where(below, middle, low)
            high = torch.where(below, high, middle)
            if tolerance is not None and (high - low).max() <= tolerance:
                break
        return 0.5 * (low + high)

    def confidence_region(self, level: float = 0.95) -> tuple[Tensor, Tensor]:
        """The central ``level`` interval of the mixture: its ``(1 - level)/2`` and ``(1 + level)/2`` quantiles."""
        if not 0 < level < 1:
            raise ValueError(f"level must lie in (0, 1), got {level}.")
        return self.icdf(torch.tensor((1 - level) / 2)), self.icdf(torch.tensor((1 + level) / 2))
