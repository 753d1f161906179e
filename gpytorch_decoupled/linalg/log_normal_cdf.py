from __future__ import annotations

import math

import torch
from torch import Tensor

from ._unbound_function import UnboundFunction

# GPyTorch's coefficients (gpytorch.functions.log_normal_cdf): a series near zero and a rational tail for z < -1
_NEAR_ZERO = (
    0.00048204,
    -0.00142906,
    0.0013200243174,
    0.0009461589032,
    -0.0045563339802,
    0.00556964649138,
    0.00125993961762116,
    -0.01621575378835404,
    0.02629651521057465,
    -0.001829764677455021,
    2 * (1 - math.pi / 3),
    (4 - math.pi) / 3,
    1,
    1,
)
_TAIL_NUMERATOR = (1.2753666447299659525, 5.019049726784267463450, 6.1602098531096305441, 7.409740605964741794425)
_TAIL_NUMERATOR += (2.9788656263939928886,)
_TAIL_DENOMINATOR = (2.260528520767326969592, 9.3960340162350541504, 12.048951927855129036034, 17.081440747466004316)
_TAIL_DENOMINATOR += (9.608965327192787870698, 3.3690752069827527677)


def log_normal_cdf(z: Tensor) -> Tensor:
    r"""
    :math:`\log\Phi(z)`, the logarithm of the standard normal distribution function, elementwise, with the values and
    gradients of GPyTorch's :func:`gpytorch.functions.log_normal_cdf` (which the Bernoulli likelihood's expected
    log-likelihood integrates) without its data-dependent branches: every case (a series for :math:`z^2 < 0.04`, a
    rational approximation of the tail for :math:`z < -1`, :math:`\log\Phi` from the error function elsewhere) is
    computed on safe inputs for all entries and the right one selected, so that :func:`torch.compile` captures it
    in one graph. The gradient is GPyTorch's, :math:`\phi(z)/\Phi(z)` from the returned value (and from the tail's
    rational function for :math:`z < -1`), not the derivative of the approximations.

    :param z: Any shape, floating dtype.
    :return: :math:`\log\Phi(z)`, the shape of ``z``.

    Example:
        >>> import gpytorch
        >>> z = torch.linspace(-40, 6, 200, dtype=torch.float64)
        >>> torch.allclose(log_normal_cdf(z), gpytorch.functions.log_normal_cdf(z), rtol=1e-14)
        True
    """
    return _LogNormalCDF.apply(z)


def _tail(z: Tensor) -> tuple[Tensor, Tensor]:
    """The rational approximation's numerator and denominator (GPyTorch's recursions, operation for operation)."""
    numerator = torch.full_like(z, 0.5641895835477550741)
    denominator = torch.ones_like(z)
    for coefficient in _TAIL_NUMERATOR:
        numerator = -z * (numerator / math.sqrt(2)) + coefficient
    for coefficient in _TAIL_DENOMINATOR:
        denominator = -z * (denominator / math.sqrt(2)) + coefficient
    return numerator, denominator


class _LogNormalCDF(UnboundFunction):
    @staticmethod
    def forward(z: Tensor) -> Tensor:
        near_zero, small = z.pow(2) < 0.04, z < -1
        # the series near zero, on every entry (a polynomial: finite everywhere)
        first = -z / math.sqrt(2 * math.pi)
        series = torch.zeros_like(z)
        for coefficient in _NEAR_ZERO:
            series = first * (coefficient + series)
        near_zero_value = series * -2 - math.log(2)
        # the tail on entries below -1, a safe input elsewhere
        tail_z = torch.where(small, z, -2.0)
        numerator, denominator = _tail(tail_z)
        tail_value = torch.log(numerator / denominator / 2) - tail_z.pow(2) / 2
        # log Phi from the error function (torch.distributions.Normal(0, 1).cdf) on the others, a safe input elsewhere
        ordinary_z = torch.where(small, 0.0, z)
        ordinary_value = torch.log(0.5 * (1 + torch.erf(ordinary_z / math.sqrt(2))))
        return torch.where(near_zero, near_zero_value, torch.where(small, tail_value, ordinary_value))

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> Tensor:
        z, log_phi = ctx.saved_tensors
        small = z < -1
        numerator, denominator = _tail(torch.where(small, z, -2.0))
        tail_gradient = torch.abs(denominator / numerator) * math.sqrt(2 / math.pi)
        ordinary_exponent = z.pow(2) / -2 - torch.where(small, 0.0, log_phi) + math.log(0.5)
        ordinary_gradient = torch.exp(torch.where(small, 0.0, ordinary_exponent)) * math.sqrt(2 / math.pi)
        return torch.where(small, tail_gradient, ordinary_gradient) * grad_output
