r"""
The checks of the package's public entry points, in one place: every strategy call, update step, objective and
model method validates its arguments with these functions before it computes or changes anything, so that bad input
gets the same clear error everywhere (naming the argument and the problem) and a call that raises leaves every object
as it was.

Errors are :class:`TypeError` for an argument of the wrong kind (not a tensor, not an integer) and :class:`ValueError`
for a tensor of the wrong shape, dtype or device, an empty batch, NaN or inf, or labels the likelihood does not take.
The checks run in an order that never computes on a tensor that another check would refuse (the device before the
values, so that a ``meta`` tensor or one on another GPU is refused by name).

Targets are checked against the likelihood the way GPyTorch 1.15 reads them: real-valued for Gaussian, Student-t and
Laplace likelihoods (in the model's dtype), in :math:`(0, 1)` for the Beta likelihood, class indices
:math:`0, \dots, C-1` for the softmax likelihood, and :math:`\{0, 1\}` for the Bernoulli likelihood (GPyTorch still
reads :math:`\{-1, 1\}`, with a ``DeprecationWarning``; a mixture of the two conventions is refused).

Example:
    >>> import torch
    >>> from gpytorch_decoupled.validation import check_inputs
    >>> check_inputs(torch.zeros(3, 2), "x", like=torch.zeros(1))
    >>> check_inputs(torch.zeros(0, 2), "x", like=torch.zeros(1))
    Traceback (most recent call last):
    ...
    ValueError: x is empty (shape (0, 2)): a mini-batch needs at least one row.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection

import torch
from gpytorch.likelihoods import BernoulliLikelihood, BetaLikelihood, Likelihood, SoftmaxLikelihood
from torch import Tensor

from .linalg import all_finite

__all__ = [
    "check_device",
    "check_dtype",
    "check_finite",
    "check_inputs",
    "check_labels",
    "check_positive_int",
    "check_positive_number",
    "check_targets",
    "check_tensor",
    "checks_target_values",
]

# Likelihoods whose observations are labels (any numeric dtype), not real values in the model's dtype.
_LABEL_LIKELIHOODS = (BernoulliLikelihood, SoftmaxLikelihood)


def check_tensor(value, name: str) -> None:
    """:raises TypeError: If ``value`` is not a :class:`torch.Tensor`."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")


def check_positive_int(value, name: str, minimum: int = 1) -> None:
    """:raises TypeError: If ``value`` is not an integer (booleans are not).
    :raises ValueError: If it is below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def check_positive_number(value, name: str) -> None:
    """:raises TypeError: If ``value`` is not a real number (booleans are not).
    :raises ValueError: If it is not finite and positive."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value}.")


def check_device(value: Tensor, name: str, like: Tensor, like_name: str = "the model") -> None:
    """:raises ValueError: If ``value`` is not on the device of ``like``."""
    if value.device != like.device:
        raise ValueError(
            f"{name} is on {value.device} but {like_name} is on {like.device}; move one of them (e.g. {name}.to(...) "
            "or model.to(...))."
        )


def check_dtype(value: Tensor, name: str, like: Tensor, like_name: str = "the model") -> None:
    """:raises ValueError: If ``value`` does not have the dtype of ``like``."""
    if value.dtype != like.dtype:
        raise ValueError(
            f"{name} is {value.dtype} but {like_name} is {like.dtype}; convert one of them (e.g. {name}.to(...) or "
            "model.double())."
        )


def check_finite(value: Tensor, name: str) -> None:
    """:raises ValueError: If ``value`` contains NaN or inf (checked after its device: never on a ``meta`` tensor)."""
    if value.is_floating_point() or value.is_complex():
        if not all_finite(value):
            raise ValueError(f"{name} contains NaN or inf.")


def check_inputs(
    x,
    name: str,
    like: Tensor,
    widths: Collection[int] | None = None,
    dim: int | None = None,
    min_rows: int = 1,
    like_name: str = "the model",
) -> None:
    r"""
    Checks inputs of shape ``(..., n, D)``: a floating-point tensor on the device and of the dtype of ``like``, with
    ``dim`` dimensions exactly (when given, else at least 2), a width ``D`` in ``widths`` (when given), at least
    ``min_rows`` rows and no NaN or inf.

    :param x: The inputs.
    :param name: The argument's name, for the errors.
    :param like: A tensor of the model (e.g. its inducing points) whose dtype and device the inputs must have.
    :param widths: The widths the model takes.
    :param dim: The exact number of dimensions (e.g. 2 for ``(n, D)``).
    :param min_rows: The fewest rows ``n`` accepted.
    :param like_name: What ``like`` is, for the errors.
    :raises TypeError: If ``x`` is not a tensor.
    :raises ValueError: On any other failed check.
    """
    check_tensor(x, name)
    if (dim is not None and x.dim() != dim) or x.dim() < 2:
        expected = "(n, D)" if dim == 2 else f"{dim} dimensions" if dim is not None else "(..., n, D)"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}.")
    if widths is not None and x.size(-1) not in widths:
        expected = " or ".join(str(width) for width in sorted(widths))
        raise ValueError(f"{name} has {x.size(-1)} columns, expected {expected} (the width of {like_name}).")
    check_device(x, name, like, like_name)
    check_dtype(x, name, like, like_name)
    if x.size(-2) < min_rows:
        if x.size(-2) == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)}): a mini-batch needs at least one row.")
        raise ValueError(f"{name} has {x.size(-2)} rows, at least {min_rows} are needed.")
    check_finite(x, name)


def check_targets(
    y,
    name: str,
    shape: torch.Size | tuple[int, ...],
    like: Tensor,
    likelihood: Likelihood | None = None,
    batch_shape: torch.Size | tuple[int, ...] = (),
    rows_name: str = "x",
) -> None:
    r"""
    Checks targets: a tensor on the device of ``like``, of shape ``shape`` (one entry per row of the inputs, e.g.
    ``(n,)``, or ``(n, T)`` for T tasks), optionally with leading dimensions that broadcast into ``batch_shape``
    without enlarging it, with values the likelihood takes (:func:`check_labels`; real values in the dtype of ``like``
    without a likelihood).

    :param y: The targets.
    :param name: The argument's name, for the errors.
    :param shape: The shape the targets of the inputs have.
    :param like: A tensor of the model whose device (and, for real-valued targets, dtype) the targets must have.
    :param likelihood: The likelihood that reads them.
    :param batch_shape: The batch shape of the model's latent functions, which the targets may carry in front.
    :param rows_name: What the inputs are called, for the errors.
    :raises TypeError: If ``y`` is not a tensor.
    :raises ValueError: On any other failed check.
    """
    check_tensor(y, name)
    shape, batch_shape = torch.Size(shape), torch.Size(batch_shape)
    leading = y.shape[: y.dim() - len(shape)]
    try:
        fits = y.shape[y.dim() - len(shape) :] == shape and torch.broadcast_shapes(leading, batch_shape) == batch_shape
    except RuntimeError:
        fits = False
    if y.dim() < len(shape) or not fits:
        expected = tuple(shape) if not batch_shape else f"{tuple(shape)} (or {tuple(batch_shape + shape)})"
        raise ValueError(f"{name} must have shape {expected} to match {rows_name}, got {tuple(y.shape)}.")
    check_device(y, name, like)
    check_labels(y, name, likelihood, like)


def check_labels(y: Tensor, name: str, likelihood: Likelihood | None, like: Tensor) -> None:
    r"""
    Checks that the likelihood takes the values of ``y`` (see the module's description); ``y`` is on the device of
    ``like`` already. Real-valued targets must have the dtype of ``like``.

    :raises ValueError: If it does not.
    """
    if isinstance(likelihood, _LABEL_LIKELIHOODS):
        if y.is_complex():
            raise ValueError(f"{name} must hold real labels, got {y.dtype}.")
        check_finite(y, name)
        values = y.detach().unique().to(torch.float64)
        if isinstance(likelihood, BernoulliLikelihood):
            zero_one = ((values == 0) | (values == 1)).all()
            minus_one_one = ((values == -1) | (values == 1)).all()
            if not (zero_one or minus_one_one):
                raise ValueError(
                    f"{name} has values {_shown(values)}, but BernoulliLikelihood takes labels in {{0, 1}} (or, "
                    "deprecated by GPyTorch, {-1, 1})."
                )
        else:
            num_classes = likelihood.num_classes
            if ((values != values.round()) | (values < 0) | (values >= num_classes)).any():
                raise ValueError(
                    f"{name} has values {_shown(values)}, but SoftmaxLikelihood takes class indices 0, ..., "
                    f"{num_classes - 1}."
                )
        return
    if not y.is_floating_point():
        raise ValueError(f"{name} must be real-valued targets ({like.dtype}, the model's dtype), got {y.dtype}.")
    check_dtype(y, name, like)
    check_finite(y, name)
    if isinstance(likelihood, BetaLikelihood) and not ((y > 0) & (y < 1)).all():
        raise ValueError(f"{name} must lie in (0, 1) for BetaLikelihood.")


def checks_target_values(likelihood: Likelihood | None) -> bool:
    """Whether :func:`check_targets` reads the targets' values for ``likelihood`` beyond their finiteness (labels of a
    Bernoulli or softmax likelihood, the range of a Beta likelihood). For other likelihoods a target tensor of the
    shape, dtype and device of one that passed is valid exactly when its entries are finite."""
    return isinstance(likelihood, (*_LABEL_LIKELIHOODS, BetaLikelihood))


def _shown(values: Tensor, limit: int = 6) -> str:
    """A few of the distinct values, for an error message."""
    listed = ", ".join(f"{value:g}" for value in values[:limit].tolist())
    return "{" + listed + (", ..." if values.numel() > limit else "") + "}"
