from __future__ import annotations

import math

import torch
from torch import Tensor


def gaussian_test_metrics(mean: Tensor, variance: Tensor, y: Tensor, y_std: Tensor | float = 1.0) -> dict[str, float]:
    r"""Test RMSE and mean negative log predictive density of Gaussian predictions, in the targets' original units.

    Predictions and ``y`` are in standardized units; with :math:`s` the training standard deviation of the targets,

    .. math::

        \mathrm{RMSE} = s \sqrt{\tfrac1n \textstyle\sum_i (y_i - \mu_i)^2}, \qquad
        \mathrm{NLL} = \tfrac1n \textstyle\sum_i \Big[\tfrac12 \log(2\pi\sigma_i^2)
        + \tfrac{(y_i-\mu_i)^2}{2\sigma_i^2}\Big] + \log s.

    :param mean: Predictive means :math:`\mu_i`.
    :param variance: Predictive variances :math:`\sigma_i^2` of :math:`y` (noise included).
    :param y: Test targets.
    :param y_std: Training standard deviation of the targets (scalar, or one per output column).
    """
    y_std = torch.as_tensor(y_std, dtype=mean.dtype, device=mean.device)
    residual = y - mean
    rmse = (residual.pow(2).mean(0).sqrt() * y_std).mean()
    nll = 0.5 * (math.log(2 * math.pi) + variance.log() + residual.pow(2) / variance)
    nll = (nll.mean(0) + y_std.log()).mean()
    return {"rmse": rmse.item(), "nll": nll.item()}
