#!/usr/bin/env python3

from __future__ import annotations

import warnings

import torch
from gpytorch.utils.warnings import NumericalWarning
from linear_operator.utils.errors import NotPSDError
from torch import Tensor

from ._unbound_function import UnboundFunction
from .diagonal import add_to_diagonal
from .finite import all_finite
from .triangular import solve_lower, solve_lower_transpose

# Relative jitter (times the mean absolute diagonal) of the first escalation step. A float32 matrix that is PSD in
# exact arithmetic can carry negative eigenvalues of about 1e-7 times its scale from rounding alone, so float32 (and
# anything coarser) starts one decade above that; float64 inputs only need to absorb float64 rounding.
_RELATIVE_JITTER = {torch.float64: 1e-8}
_RELATIVE_JITTER_DEFAULT = 1e-6

# Names that have already produced a jitter warning in this process.
_WARNED_NAMES: set[str] = set()


def reset_jitter_warnings() -> None:
    r"""
    Forget which names :func:`jittered_cholesky` has already warned about, so that the next escalation for any name
    warns again. Meant for tests.

    Example:
        >>> reset_jitter_warnings()
    """
    _WARNED_NAMES.clear()


def jittered_cholesky(
    A: Tensor,  # shape: (*batch, n, n)
    *,
    jitter: float | None = None,
    max_tries: int = 6,
    name: str = "matrix",
) -> Tensor:  # shape: (*batch, n, n)
    r"""
    Lower Cholesky factor :math:`\mathbf L` of a (batch of) symmetric PSD matrices, computed in float64 with
    escalating diagonal jitter, and returned in the dtype of :attr:`A`.

    The first attempt factorizes :math:`\mathbf A + \epsilon_0 \mathbf I`, where :math:`\epsilon_0` is :attr:`jitter`
    (zero when omitted). Every batch member whose factorization fails is retried with

    .. math::

        \epsilon_k = \epsilon_1 10^{k - 1}, \qquad k = 1, \ldots, \texttt{max\_tries},
        \qquad
        \epsilon_1 = \begin{cases}
            10 \, \epsilon_0 & \text{if } \texttt{jitter} \text{ is given,} \\
            c \, \tfrac{1}{n} \sum_i \lvert A_{ii} \rvert & \text{otherwise,}
        \end{cases}

    with :math:`c = 10^{-8}` for float64 inputs and :math:`c = 10^{-6}` for float32 (and lower precision) inputs:
    a float32 matrix that is PSD in exact arithmetic can have eigenvalues of about :math:`-10^{-7}` times its scale
    from rounding alone. Members that factorize on an earlier attempt keep their smaller jitter; members that never
    failed keep the first attempt's jitter (none by default), so their factor is exactly the first attempt's.

    When jitter had to be escalated, a :class:`~gpytorch.utils.warnings.NumericalWarning` is emitted once per process
    for each :attr:`name` (see :func:`reset_jitter_warnings`).

    Under :func:`torch.compile` the same jitter ladder runs without data-dependent Python control flow (so without a
    graph break): an operator (``gpytorch_decoupled::escalated_if_failed``) runs the escalation only when the first
    factorization fails, so the factor equals the eager one. It is opaque to the compiler, so Inductor runs it between
    CUDA graphs on a GPU (where it synchronizes once to read the factorization's status), and a compiled graph that
    holds it can be cached on disk (one holding :func:`torch.cond`, which this once used on the CPU, could not: every
    process compiled the training step from scratch). A compiled call
    neither checks for NaN nor warns nor raises: a matrix that is still not positive definite at the last jitter gives
    a NaN factor, which the caller detects (the compiled training step of
    :func:`gpytorch_decoupled.training.compile_training_step` checks that its loss is finite).

    Gradients flow back to :attr:`A` as through :func:`torch.linalg.cholesky` (the gradient is that of a symmetric
    input), computed in the dtype of :attr:`A` from the returned factor: only the factorization needs float64, and
    for float32 inputs its backward pass (two triangular solves and a product with :math:`n \times n` right-hand
    sides) in float32 costs half as much.

    :param A: Symmetric PSD matrix or batch of matrices, on any device, in a floating dtype.
    :param jitter: Diagonal jitter added to every batch member before the first attempt. When omitted, the first
        attempt adds nothing and escalation starts from a relative, dtype-aware value.
    :param max_tries: Number of escalation attempts after the first one.
    :param name: Name of the matrix used in the warning and error messages (e.g. ``"K_beta"``).
    :return: Lower-triangular factor with positive diagonal, same shape, dtype and device as :attr:`A`.
    :raises ValueError: If :attr:`A` is not a (batch of) square matrices, or contains NaN or inf.
    :raises ~linear_operator.utils.errors.NotPSDError: If some batch member still fails after :attr:`max_tries`
        escalations.

    Example:
        >>> x = torch.linspace(0, 1, 20).unsqueeze(-1)
        >>> K = torch.exp(-0.5 * torch.cdist(x, x).pow(2))  # indefinite after rounding to float32
        >>> L = jittered_cholesky(K, name="K_beta")  # warns once: jitter 1e-6 was added
        >>> L.shape, L.dtype
        (torch.Size([20, 20]), torch.float32)
    """
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name} must be a (batch of) square matrices, got shape {tuple(A.shape)}.")
    if not A.dtype.is_floating_point:
        raise ValueError(f"{name} must have a floating dtype, got {A.dtype}.")
    compiling = torch.compiler.is_compiling()
    if not compiling and not all_finite(A):
        raise ValueError(f"{name} (shape {tuple(A.shape)}, dtype {A.dtype}) contains NaN or inf.")

    with torch.no_grad():
        factor = _traceable_factor if compiling else _factor
        L = factor(A.detach(), jitter, max_tries, name)
    return (_CompiledCholeskyFactor if compiling else _CholeskyFactor).apply(A, L)


class _CompiledCholeskyFactor(UnboundFunction):
    r"""The factor ``L`` of ``A`` (computed by :func:`jittered_cholesky`) as a differentiable function of ``A``, with
    the derivatives of :func:`torch.linalg.cholesky` in ``L``'s dtype. Backward:
    :math:`\bar{\mathbf A} = \mathbf L^{-\top}\tfrac12(\boldsymbol\Phi + \boldsymbol\Phi^\top)\mathbf L^{-1}`
    with :math:`\boldsymbol\Phi` the lower triangle of :math:`\mathbf L^\top\bar{\mathbf L}`, its diagonal
    halved. Reverse mode only: what :func:`torch.compile` traces (Dynamo does not trace custom forward-mode rules).
    """

    @staticmethod
    def forward(A: Tensor, L: Tensor) -> Tensor:
        return L.clone()

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        # The output, not the detached factor: the backward's operations on it are then recorded under
        # ``create_graph=True``, so second derivatives (Hessians, double backward) flow through L(A) as well.
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad_L: Tensor) -> tuple[Tensor, None]:
        (L,) = ctx.saved_tensors
        phi = (L.mT @ grad_L).tril()
        phi = 0.5 * (phi + phi.tril(-1).mT)
        grad_A = solve_lower_transpose(L, phi)
        return solve_lower_transpose(L, grad_A.mT).mT, None


class _CholeskyFactor(_CompiledCholeskyFactor):
    r""":class:`_CompiledCholeskyFactor` with forward mode as well: :math:`\dot{\mathbf L} = \mathbf L\,
    \Psi(\mathbf L^{-1}\dot{\mathbf A}\mathbf L^{-\top})`, :math:`\Psi` the lower triangle with the diagonal halved
    (the diagonal jitter is a constant, so the formulas of the jittered matrix hold)."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        _CompiledCholeskyFactor.setup_context(ctx, inputs, output)
        ctx.factor = inputs[1]  # forward mode has no saved tensors

    @staticmethod
    def jvp(ctx, tangent_A: Tensor, tangent_L: Tensor | None) -> Tensor:
        L = ctx.factor
        inner = solve_lower(L, solve_lower(L, tangent_A).mT).mT  # L^-1 dA L^-T
        psi = inner.tril(-1) + 0.5 * torch.diag_embed(inner.diagonal(dim1=-2, dim2=-1))
        return L @ psi


def _factor(A: Tensor, jitter: float | None, max_tries: int, name: str) -> Tensor:
    """The jittered float64 factorization of :func:`jittered_cholesky` (no gradient), in the dtype of ``A``."""
    A64 = A.to(torch.float64)
    member_jitter = torch.full(A.shape[:-2], jitter or 0.0, dtype=A64.dtype, device=A64.device)
    L, info = torch.linalg.cholesky_ex(add_to_diagonal(A64, member_jitter) if jitter else A64)
    if not info.any():
        return L.to(A.dtype)

    if jitter:
        first_step = 10.0 * member_jitter
    else:
        scale = A64.detach().diagonal(dim1=-2, dim2=-1).abs().mean(-1)
        # An all-zero diagonal gives no scale to be relative to; fall back to an absolute one.
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        first_step = _RELATIVE_JITTER.get(A.dtype, _RELATIVE_JITTER_DEFAULT) * scale

    # Every attempt refactorizes the whole batch with a per-member jitter (the first attempt's for members that never
    # failed), so the returned factor comes from a single differentiable factorization of a positive definite matrix.
    escalated = torch.zeros_like(info, dtype=torch.bool)
    for k in range(max_tries):
        failed = info > 0
        member_jitter = torch.where(failed, first_step * 10.0**k, member_jitter)
        escalated = escalated | failed
        L, info = torch.linalg.cholesky_ex(add_to_diagonal(A64, member_jitter))
        if not info.any():
            break
    else:
        raise NotPSDError(
            f"{name} (shape {tuple(A.shape)}, dtype {A.dtype}) is not positive definite: the float64 Cholesky "
            f"factorization failed for {int((info > 0).sum())} batch member(s) even with jitter up to "
            f"{member_jitter.max().item():.1e} on the diagonal."
        )

    if name not in _WARNED_NAMES:
        _WARNED_NAMES.add(name)
        warnings.warn(
            f"{name} (shape {tuple(A.shape)}, dtype {A.dtype}) was not positive definite; used jitter up to "
            f"{member_jitter.max().item():.1e} on the diagonal of {int(escalated.sum())} of {info.numel()} batch "
            f"member(s). Further jitter warnings for {name!r} are suppressed in this process.",
            NumericalWarning,
            stacklevel=3,
        )
    return L.to(A.dtype)


def _traceable_factor(A: Tensor, jitter: float | None, max_tries: int, name: str) -> Tensor:
    """:func:`_factor` without data-dependent Python control flow (for :func:`torch.compile`): the escalation runs
    only when the first factorization fails, to the end of the schedule (members that succeed keep their jitter), and
    a member that never factorizes gets a NaN factor instead of an error. It runs in an operator, opaque to the
    compiler: Inductor leaves it out of CUDA graphs (a graph holding :func:`torch.cond` is not captured at all; on a
    GPU reading the status costs one synchronization), and Inductor's on-disk cache keeps graphs that hold it (it
    skips those with :func:`torch.cond`)."""
    A64 = A.to(torch.float64)
    member_jitter = torch.full(A.shape[:-2], jitter or 0.0, dtype=A64.dtype, device=A64.device)
    L, info = torch.linalg.cholesky_ex(add_to_diagonal(A64, member_jitter) if jitter else A64)
    relative = _RELATIVE_JITTER.get(A.dtype, _RELATIVE_JITTER_DEFAULT)
    upper = _escalated_if_failed(A64, L, info, member_jitter, jitter or 0.0, relative, max_tries)
    return upper.mT.to(A.dtype)


def _escalated(
    A64: Tensor, info: Tensor, member_jitter: Tensor, jitter: float | None, relative: float, max_tries: int
) -> Tensor:
    """The float64 factor after the whole escalation schedule of :func:`_factor` from a first attempt's ``info``
    (NaN for members that never factorize); ``relative`` is the first step's jitter relative to the diagonal's scale
    when no ``jitter`` was given."""
    if jitter:
        first_step = 10.0 * member_jitter
    else:
        scale = A64.diagonal(dim1=-2, dim2=-1).abs().mean(-1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        first_step = relative * scale
    for k in range(max_tries):
        member_jitter = torch.where(info > 0, first_step * 10.0**k, member_jitter)
        factor, info = torch.linalg.cholesky_ex(add_to_diagonal(A64, member_jitter))
    return torch.where((info > 0)[..., None, None], float("nan"), factor)


# The escalation's operator, declared with the C++ dispatcher directly (torch.library.custom_op's Python wrapper cost
# about 60 microseconds per call, against about 12 for this: the step calls it once per factorization). Tagged, where
# this torch has the tag, so that Inductor runs it between CUDA graphs instead of inside one.
_LIBRARY = torch.library.Library("gpytorch_decoupled", "FRAGMENT")
_CUDAGRAPH_UNSAFE = getattr(torch._C.Tag, "cudagraph_unsafe", None)
_LIBRARY.define(
    "escalated_if_failed(Tensor A64, Tensor L, Tensor info, Tensor member_jitter, float jitter, float relative, "
    "int max_tries) -> Tensor",
    tags=() if _CUDAGRAPH_UNSAFE is None else (_CUDAGRAPH_UNSAFE,),
)


def _escalated_if_failed_kernel(
    A64: Tensor, L: Tensor, info: Tensor, member_jitter: Tensor, jitter: float, relative: float, max_tries: int
) -> Tensor:
    r"""The upper factor :math:`\mathbf L^\top` in row-major order (the caller transposes it back): of ``L`` where the
    first factorization succeeded for every member, else of the escalated factor (:func:`_escalated`). LAPACK's
    ``L`` is column-major, so this is a plain copy (an operator's output may not alias its input), not a transposing
    one, and the factor the caller gets is column-major, as its triangular solves want it."""
    if not info.any():
        return L.mT.clone(memory_format=torch.contiguous_format)
    return _escalated(A64, info, member_jitter, jitter or None, relative, max_tries).mT.contiguous()


_LIBRARY.impl("escalated_if_failed", _escalated_if_failed_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("gpytorch_decoupled::escalated_if_failed", lib=_LIBRARY)
def _(A64: Tensor, L: Tensor, info: Tensor, member_jitter: Tensor, jitter: float, relative: float, max_tries: int):
    return torch.empty_like(L.mT, memory_format=torch.contiguous_format)


_escalated_if_failed = torch.ops.gpytorch_decoupled.escalated_if_failed.default
