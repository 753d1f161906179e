from __future__ import annotations

import math

import torch
from gpytorch.kernels import LinearKernel, PeriodicKernel, RBFKernel, RQKernel, ScaleKernel
from torch import Tensor

from ..kernels import CandidateKernelBank
from ..linalg import LeanKernel
from ..linalg.lean_kernel import expanded_square_distance

_BASE_TYPES = {"SE": RBFKernel, "RQ": RQKernel, "PER": PeriodicKernel, "LIN": LinearKernel}


class LeanCandidateBank:
    r"""
    The covariances of a :class:`~gpytorch_decoupled.kernels.CandidateKernelBank` (the :math:`C` candidate kernels of
    variational Bayesian kernel selection) as plain tensor operations, for the compiled training step of
    :class:`~gpytorch_decoupled.models.KernelSelectionGP`: the values and gradients of the bank's own evaluation
    (GPyTorch's formulas for each base kernel, its expansion of the squared distances operation for operation), read
    from the bank's parameters at every call, without the kernel-call and lazy-tensor layers (GPyTorch's distance
    compares its arguments' values, a graph break under :func:`torch.compile`). Inputs are shared by all candidates.

    Each base type's leaves are evaluated as one batch (batch entry :math:`i` is the :math:`i`-th leaf of that type),
    then the candidates' sums of products are gathered (:meth:`CandidateKernelBank.combine_leaves`):

    .. math::

        \mathrm{SE} = \sigma^2 e^{-\frac12 r^2}, \quad
        \mathrm{RQ} = \sigma^2 \Big(1 + \frac{r^2}{2\alpha}\Big)^{-\alpha}, \quad
        \mathrm{PER} = \sigma^2 \exp\Big(-2\sum_d \frac{\sin^2(\pi\lvert x_d - x'_d\rvert / p_d)}{\lambda_d}\Big), \quad
        \mathrm{LIN} = \sum_d v_d x_d x'_d,

    with :math:`r = \lVert\Lambda^{-1}(\mathbf x - \mathbf x')\rVert`. SE values below the floor of
    :class:`~gpytorch_decoupled.linalg.LeanKernel` (about :math:`10^{-30}` in float32) are raised to it, as there; RQ is
    computed as :math:`\sigma^2\exp(-\alpha\,\mathrm{log1p}(r^2/2\alpha))`, GPyTorch's power to rounding, which
    with its gradients costs about half as much as a power with a tensor exponent (in the compiled VBKS step of
    ``bench compiled-step``, 61 against 67 ms).

    :param bank: The candidate kernels.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.kernels import CandidateKernelBank
        >>> bank = CandidateKernelBank(["SE", "PER×LIN", "RQ + SE×PER"]).double()
        >>> lean = LeanCandidateBank.of(bank)
        >>> x1, x2 = torch.randn(5, 1, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64)
        >>> torch.allclose(lean(x1, x2), bank(x1, x2).to_dense(), rtol=1e-12)
        True
        >>> torch.allclose(lean.diagonal(x1), bank(x1, diag=True), rtol=1e-12)
        True
    """

    def __init__(self, bank: CandidateKernelBank):
        self.bank = bank

    @classmethod
    def of(cls, bank) -> LeanCandidateBank | None:
        """The lean form of ``bank``, or None where it is not a :class:`CandidateKernelBank` of the package's base
        kernels (:meth:`unsupported` says why)."""
        return cls(bank) if cls.unsupported(bank) is None else None

    @staticmethod
    def unsupported(bank) -> str | None:
        """Why the lean path cannot evaluate ``bank``, or None when it can."""
        if type(bank) is not CandidateKernelBank:
            return f"the kernel {type(bank).__name__} (supported: CandidateKernelBank)"
        for kind, kernel in bank.base_kernels.items():
            inner = kernel.base_kernel if type(kernel) is ScaleKernel else kernel
            if type(inner) is not _BASE_TYPES[kind] or (kind == "LIN") != (kernel is inner):
                return f"the bank's {kind} leaves, {type(kernel).__name__} (replaced after the bank was built)"
            if kernel.active_dims is not None or inner.active_dims is not None:
                return f"the bank's {kind} leaves with active_dims"
        return None

    def __call__(self, x1: Tensor, x2: Tensor) -> Tensor:
        r"""Every candidate's :math:`\mathbf K_{\mathbf x_1\mathbf x_2}`, ``(C, N1, N2)`` (pass the same tensor twice
        for a symmetric block)."""
        leaves = [_LEAVES[kind](kernel, x1, x2) for kind, kernel in self.bank.base_kernels.items()]
        return self.bank.combine_leaves(torch.cat(leaves, dim=-3))

    def diagonal(self, x: Tensor) -> Tensor:
        r"""Every candidate's :math:`k(\mathbf x_n, \mathbf x_n)`, ``(C, N)``."""
        leaves = [_DIAGONALS[kind](kernel, x) for kind, kernel in self.bank.base_kernels.items()]
        return self.bank.combine_leaves(torch.cat(leaves, dim=-2), diag=True)


def _stationary_squares(kernel, x1: Tensor, x2: Tensor) -> Tensor:
    """GPyTorch's squared distances of the length-scaled inputs, ``(k, N1, N2)``."""
    lengthscale = kernel.lengthscale
    return expanded_square_distance(x1.div(lengthscale), x2.div(lengthscale), x1 is x2, False, math.inf)


def _se(kernel: ScaleKernel, x1: Tensor, x2: Tensor) -> Tensor:
    return LeanKernel(kernel.base_kernel, kernel)(x1, x2)


def _rq(kernel: ScaleKernel, x1: Tensor, x2: Tensor) -> Tensor:
    # exp(-alpha log1p(r^2 / 2 alpha)), not GPyTorch's pow (the same value to rounding): a pow with a tensor exponent
    # and its backward pass (another pow, a log) cost about twice the logarithm and exponential
    alpha = kernel.base_kernel.alpha.unsqueeze(-1)
    squares = _stationary_squares(kernel.base_kernel, x1, x2)
    return torch.exp(torch.log1p(squares.div(2 * alpha)).mul(-alpha)) * kernel.outputscale[..., None, None]


def _periodic(kernel: ScaleKernel, x1: Tensor, x2: Tensor) -> Tensor:
    # GPyTorch's per-dimension distances |x_d - x'_d| (the square root of its expansion, floored at 1e-30)
    base = kernel.base_kernel
    scale = base.period_length / math.pi
    z1, z2 = x1.div(scale).mT.unsqueeze(-1), x2.div(scale).mT.unsqueeze(-1)
    distances = expanded_square_distance(z1, z1 if x1 is x2 else z2, x1 is x2, False, math.inf).clamp_min(1e-30).sqrt()
    exponent = distances.sin().pow(2.0).div(base.lengthscale[..., 0, :, None, None]).mul(-2.0).sum(-3)
    return exponent.exp() * kernel.outputscale[..., None, None]


def _linear(kernel: LinearKernel, x1: Tensor, x2: Tensor) -> Tensor:
    root = kernel.variance.sqrt()
    scaled = x1 * root
    return scaled @ (scaled if x1 is x2 else x2 * root).mT


def _unit_diagonal(kernel: ScaleKernel, x: Tensor) -> Tensor:
    """Every leaf's :math:`k(\\mathbf x_n, \\mathbf x_n) = \\sigma^2` (SE, RQ, PER: zero distance)."""
    return x.new_ones(x.shape[:-1]) * kernel.outputscale[..., None]


def _linear_diagonal(kernel: LinearKernel, x: Tensor) -> Tensor:
    return (x * kernel.variance.sqrt()).pow(2).sum(-1)


_LEAVES = {"SE": _se, "RQ": _rq, "PER": _periodic, "LIN": _linear}
_DIAGONALS = {"SE": _unit_diagonal, "RQ": _unit_diagonal, "PER": _unit_diagonal, "LIN": _linear_diagonal}
