from __future__ import annotations

import torch
from torch import Tensor


def checked_inputs(x: Tensor, inducing_points: Tensor, model: torch.nn.Module) -> Tensor:
    r"""
    Validates inputs before a strategy computes anything from them (so that bad input changes no state), and pads
    data rows with zeros to the width of the inducing points when a kernel of :attr:`model` declares
    ``basis_parameter_dims`` (per-basis kernel parameters carried as trailing inducing-point columns).

    :param x: Inputs, ``(..., n, D)``.
    :param inducing_points: The strategy's inducing points, whose width, dtype and device :attr:`x` must match.
    :param model: The model whose kernels may declare ``basis_parameter_dims``.
    :return: :attr:`x`, padded where needed.
    :raises ValueError: On a width, dtype or device mismatch, or NaN/inf in :attr:`x`.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.variational import checked_inputs
        >>> z = torch.zeros(4, 2)
        >>> checked_inputs(torch.ones(3, 2), z, torch.nn.Module()).shape
        torch.Size([3, 2])
        >>> checked_inputs(torch.ones(3, 1), z, torch.nn.Module())
        Traceback (most recent call last):
        ...
        ValueError: inputs have 1 dimensions but the inducing points have 2.
    """
    width = inducing_points.size(-1)
    extra = width - x.size(-1)
    if extra and extra not in {getattr(module, "basis_parameter_dims", None) for module in model.modules()}:
        raise ValueError(f"inputs have {x.size(-1)} dimensions but the inducing points have {width}.")
    if x.dtype != inducing_points.dtype or x.device != inducing_points.device:
        raise ValueError(
            f"inputs are {x.dtype} on {x.device} but the model is {inducing_points.dtype} on "
            f"{inducing_points.device}; convert one of them (e.g. model.double() or x.to(...))."
        )
    if not torch.isfinite(x).all():
        raise ValueError("inputs contain NaN or inf.")
    return torch.nn.functional.pad(x, (0, extra)) if extra else x
