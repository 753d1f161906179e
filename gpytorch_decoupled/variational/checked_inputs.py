from __future__ import annotations

import torch
from torch import Tensor

from ..validation import check_inputs


def checked_inputs(
    x: Tensor,
    inducing_points: Tensor,
    model: torch.nn.Module,
    name: str = "x",
    dim: int | None = None,
    min_rows: int = 1,
) -> Tensor:
    r"""
    Validates inputs before a strategy computes anything from them (so that bad input changes no state; see
    :mod:`gpytorch_decoupled.validation`), and pads data rows with zeros to the width of the inducing points when a
    kernel of :attr:`model` declares ``basis_parameter_dims`` (per-basis kernel parameters carried as trailing
    inducing-point columns).

    :param x: Inputs, ``(..., n, D)`` with :math:`n \ge 1`.
    :param inducing_points: The strategy's inducing points, whose width, dtype and device :attr:`x` must match.
    :param model: The model whose kernels may declare ``basis_parameter_dims``.
    :param name: The argument's name, for the errors.
    :param dim: The exact number of dimensions :attr:`x` must have (e.g. 2 for ``(n, D)``), if any.
    :param min_rows: The fewest rows :attr:`x` may have.
    :return: :attr:`x`, padded where needed.
    :raises TypeError: If :attr:`x` is not a tensor.
    :raises ValueError: On a shape, width, dtype or device mismatch, an empty batch, or NaN/inf in :attr:`x`.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.variational import checked_inputs
        >>> z = torch.zeros(4, 2)
        >>> checked_inputs(torch.ones(3, 2), z, torch.nn.Module()).shape
        torch.Size([3, 2])
        >>> checked_inputs(torch.ones(3, 1), z, torch.nn.Module())
        Traceback (most recent call last):
        ...
        ValueError: x has 1 columns, expected 2 (the width of the inducing points).
    """
    width = inducing_points.size(-1)
    extra_widths = {getattr(module, "basis_parameter_dims", None) for module in model.modules()} - {None}
    widths = {width} | {width - extra for extra in extra_widths}
    check_inputs(x, name, inducing_points, widths=widths, dim=dim, min_rows=min_rows, like_name="the inducing points")
    extra = width - x.size(-1)
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def checked_basis_points(points: Tensor, inducing_points: Tensor, model: torch.nn.Module, name: str) -> Tensor:
    r"""
    New basis points for ``grow_bases``: :func:`checked_inputs` (2-D, at least one row), and a finite prior covariance
    among them and one of the current inducing points, so that points the kernel cannot evaluate next to the others
    (e.g. :math:`10^{200}` times the data's scale, whose squared distances overflow) are refused by name before the
    bases change rather than turning a later prediction into NaN. It costs one prior evaluation at :math:`n + 1`
    points.

    :raises ValueError: On a failed check.
    """
    points = checked_inputs(points, inducing_points, model, name, dim=2)
    reference = inducing_points.reshape(-1, inducing_points.size(-1))[:1]
    with torch.no_grad():
        covariance = model.forward(torch.cat([points, reference], dim=-2)).lazy_covariance_matrix.to_dense()
    if not torch.isfinite(covariance).all():
        raise ValueError(
            f"the prior covariance among the {name} is not finite (NaN or inf): the points are too far out for the "
            f"kernel (largest magnitude {points.abs().max().item():.3g}); standardize the inputs."
        )
    return points
