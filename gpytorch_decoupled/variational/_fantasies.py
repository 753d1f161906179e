from __future__ import annotations

import copy

import torch
from gpytorch.likelihoods import Likelihood, MultitaskGaussianLikelihood
from gpytorch.models import ApproximateGP
from gpytorch.variational import IndependentMultitaskVariationalStrategy
from torch import Tensor

from ..validation import check_device, check_finite, check_targets, check_tensor

#: The strategies whose posterior conditions on new observations in closed form.
CONDITIONING_STRATEGIES = "KalmanVariationalStrategy and DualVariationalStrategy"


def no_fantasy_model(strategy: torch.nn.Module) -> NotImplementedError:
    """The error of a strategy without closed-form conditioning."""
    return NotImplementedError(
        f"{type(strategy).__name__} has no closed-form conditioning on new observations, so it has no fantasy models "
        f"(get_fantasy_model, BoTorch's condition_on_observations and fantasize). Of this package's strategies, "
        f"{CONDITIONING_STRATEGIES} support them (exactly for a Gaussian likelihood); GPyTorch's VariationalStrategy "
        "offers its own for a CholeskyVariationalDistribution."
    )


def checked_fantasy_data(
    strategy, inputs: Tensor, targets: Tensor, noise: Tensor | None, likelihood: Likelihood | None
) -> tuple[Tensor, Tensor, Tensor | None, torch.Size]:
    r"""
    Fantasy observations validated before anything is computed from them: ``inputs`` as ``(..., k, D)`` (``(k,)``
    for one input dimension), ``targets`` as ``(..., k)``, ``noise`` (if given) positive and finite, broadcastable to
    the targets. Their batch dimensions broadcast with each other and with the latents' (those beyond the latents'
    are the fantasy batch, e.g. BoTorch's ``num_fantasies`` samples).

    :return: The inputs, the targets, the noise (float64) and the fantasy model's batch shape: the broadcast of the
        inputs', the targets' and the latents' batch shapes.
    :raises TypeError: If an argument is not a tensor.
    :raises ValueError: On shapes that do not broadcast, NaN/inf, a dtype or device mismatch, non-positive noise or
        labels the likelihood does not take.
    """
    check_tensor(inputs, "inputs")
    check_tensor(targets, "targets")
    x = strategy.checked_inputs(inputs.unsqueeze(-1) if inputs.dim() == 1 else inputs, "inputs")
    latent_shape = strategy._variational_distribution.batch_shape
    try:
        batch_shape = torch.broadcast_shapes(x.shape[:-2], targets.shape[:-1], latent_shape)
    except RuntimeError:
        batch_shape = None
    if batch_shape is None or targets.dim() < 1 or targets.size(-1) != x.size(-2):
        raise ValueError(
            f"targets {tuple(targets.shape)} must be (..., k) for inputs (..., k, D) {tuple(x.shape)}, with batch "
            f"dimensions that broadcast with the inputs' and the latents' {tuple(latent_shape)}."
        )
    check_targets(targets, "targets", (x.size(-2),), strategy.inducing_points, likelihood, batch_shape, "inputs")
    if noise is not None:
        check_tensor(noise, "noise")
        check_device(noise, "noise", strategy.inducing_points)
        check_finite(noise, "noise")
        shape = batch_shape + targets.shape[-1:]
        try:
            fits = torch.broadcast_shapes(noise.shape, shape) == shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"noise {tuple(noise.shape)} must broadcast to the targets' shape {tuple(shape)}.")
        noise = noise.to(torch.float64)
        if not (noise > 0).all():
            raise ValueError("noise must hold positive variances.")
    return x, targets, noise, batch_shape


def fantasy_copy(model: ApproximateGP, likelihood: Likelihood | None) -> ApproximateGP:
    """A deep copy of ``model`` that shares ``likelihood`` with it (the fantasy model is used with the same one).
    Buffers that carry an autograd graph (the state of a fantasy model: a fantasy of a fantasy, as in multi-step
    lookahead) are cloned with their graph, which ``deepcopy`` cannot do."""
    memo = {} if likelihood is None else {id(likelihood): likelihood}
    memo.update({id(buffer): buffer.clone() for buffer in model.buffers() if buffer.grad_fn is not None})
    return copy.deepcopy(model, memo)


def task_noise_variances(likelihood: Likelihood | None, num_tasks: int, user: str) -> Tensor:
    r"""
    The noise variance of each task of a :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood` without correlated
    task noise (``rank=0``): its task noises plus its global noise, ``(..., num_tasks)`` (the likelihood's batch shape
    in front), as the independent latents of an :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy`
    see them.

    :raises NotImplementedError: For any other likelihood (``user`` names the caller).
    """
    if not isinstance(likelihood, MultitaskGaussianLikelihood) or likelihood.rank != 0:
        raise NotImplementedError(
            f"{user}: several tasks need a MultitaskGaussianLikelihood without correlated task noise (rank=0), got "
            f"{type(likelihood).__name__}."
        )
    noise = torch.zeros(1, dtype=likelihood.noise.dtype, device=likelihood.noise.device)
    if likelihood.has_global_noise:
        noise = noise + likelihood.noise
    if likelihood.has_task_noise:
        noise = noise + likelihood.task_noises
    return noise.expand(*noise.shape[:-1], num_tasks)


def latent_fantasy_data(
    strategy, inputs: Tensor, targets: Tensor, noise: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    r"""
    Fantasy data given to the base ``strategy`` of an
    :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy` (tasks in the last latent dimension, as
    BoTorch builds several outputs), in the latents' form: targets
    ``(..., k, T)`` become ``(..., T, k)``, the inputs ``(..., k, D)`` are shared by the latents (``(..., 1, k, D)``),
    and a ``noise`` of shape ``(..., k, T)`` becomes ``(..., T, k)``.

    :raises NotImplementedError: If the model's strategy is not such a wrapper around ``strategy``.
    :raises ValueError: If the targets do not have one column per task.
    """
    wrapper = strategy.model.variational_strategy
    independent = isinstance(wrapper, IndependentMultitaskVariationalStrategy)
    if not (independent and wrapper.base_variational_strategy is strategy and wrapper.task_dim == -1):
        raise NotImplementedError(
            "get_fantasy_model conditions the model whose own variational_strategy this is, or the base of an "
            "IndependentMultitaskVariationalStrategy with task_dim=-1; not the base of another wrapper (LMC)."
        )
    check_tensor(inputs, "inputs")
    check_tensor(targets, "targets")
    if targets.dim() < 2 or targets.size(-1) != wrapper.num_tasks:
        raise ValueError(f"targets must be (..., k, {wrapper.num_tasks}) for the tasks, got {tuple(targets.shape)}.")
    if noise is not None:
        check_tensor(noise, "noise")
        noise = noise.movedim(-1, -2) if noise.dim() >= 2 else noise
    inputs = inputs.unsqueeze(-1) if inputs.dim() == 1 else inputs
    return inputs.unsqueeze(-3), targets.movedim(-1, -2), noise
