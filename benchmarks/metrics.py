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


def classification_test_metrics(probabilities: Tensor, y: Tensor) -> dict[str, float]:
    r"""Test negative log predictive density and accuracy of predicted class probabilities.

    .. math::

        \mathrm{NLL} = -\tfrac1n \textstyle\sum_i \log p_i(y_i), \qquad
        \mathrm{accuracy} = \tfrac1n \textstyle\sum_i [\arg\max_c p_i(c) = y_i].

    :param probabilities: :math:`p_i(1)` for 0/1 labels, ``(n,)``, or :math:`p_i(c)` for :math:`C` classes,
        ``(n, C)``.
    :param y: Test labels (0/1, or ``0 .. C - 1``).

    Example:
        >>> classification_test_metrics(torch.tensor([0.9, 0.2]), torch.tensor([1.0, 1.0]))["accuracy"]
        0.5
    """
    if probabilities.dim() == 1:
        probabilities = torch.stack([1 - probabilities, probabilities], dim=-1)
    labels = y.long()
    chosen = probabilities.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    nll = -chosen.clamp_min(torch.finfo(chosen.dtype).tiny).log().mean()
    accuracy = (probabilities.argmax(-1) == labels).to(probabilities.dtype).mean()
    return {"nll": nll.item(), "accuracy": accuracy.item()}
