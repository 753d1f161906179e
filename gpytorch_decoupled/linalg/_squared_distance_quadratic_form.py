#!/usr/bin/env python3
r"""
The fused bilinear form :math:`q = s\,\mathbf u^\top\mathbf F\mathbf v` of a squared-distance kernel block, one value
per batch element, in one sweep of cache-sized tiles, as a PyTorch operator (:func:`torch.library.custom_op`): eager
code and :func:`torch.compile` graphs (the lean training path, :mod:`gpytorch_decoupled.training`) call the same
sweep, which a compiled graph keeps as one opaque call instead of tracing (and breaking on) its loop over tiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._kernel_tiles import KernelTiles, bilinear_sums, flatten_batch, scaled_inputs


def squared_distance_quadratic_form(
    x1: Tensor,  # shape: (*batch, n, d)
    x2: Tensor,  # shape: (*batch, m, d)
    u: Tensor,  # shape: (*batch, n)
    v: Tensor,  # shape: (*batch, m)
    lengthscale: Tensor,
    outputscale: Tensor | None,
    profile: str,
    symmetric: bool,
) -> Tensor:  # shape: (*batch)
    r"""
    :math:`q = s\,\mathbf u^\top\mathbf F\mathbf v` for the block :math:`F_{ij} = f(\lVert\mathbf x_i -
    \mathbf z_j\rVert^2)` of the scaled inputs :math:`\mathbf x_i = (\mathbf x^{(1)}_i - \mathbf c) /
    \boldsymbol\ell`, :math:`\mathbf z_j = (\mathbf x^{(2)}_j - \mathbf c) / \boldsymbol\ell` (:math:`\mathbf c` the
    mean of :math:`\mathbf x^{(2)}`, which leaves the distances unchanged and carries no gradient), a profile :math:`f`
    of :data:`~gpytorch_decoupled.linalg._kernel_tiles.PROFILES` and an optional output scale :math:`s`; all
    arguments broadcast over batch dimensions.

    The result is a scalar per batch element, so its gradients with respect to the scaled inputs and to
    :math:`\mathbf u, \mathbf v` are reduced in the same sweep as the value, when autograd will need them, and the
    backward pass only scales them by the incoming gradient: the block is evaluated once per step. The scaling, the
    centring and the output scale are ordinary differentiable operations around the sweep. With ``symmetric=True``
    the caller guarantees :math:`\mathbf x^{(1)} = \mathbf x^{(2)}` and :math:`\mathbf u = \mathbf v` (in value;
    they may be different tensors), and only the tiles on and above the diagonal are evaluated, half the work of the
    full block; each of the two inputs then receives the gradient of one side (together the gradient of the points),
    and so do :math:`\mathbf u` and :math:`\mathbf v` (:math:`s\,\mathbf F\mathbf v` each). Twice differentiating it
    raises (the sweep's gradients are not themselves differentiable). This is what
    :func:`~gpytorch_decoupled.linalg.kernel_quadratic_form` computes for a lazy block of a kernel it fuses; call it
    directly with the kernel's inputs and hyperparameters where there is no lazy block (a compiled graph).

    :param x1: Row inputs.
    :param x2: Column inputs.
    :param u: Left vector.
    :param v: Right vector.
    :param lengthscale: Length-scales, ``(..., 1, d)`` or ``(..., 1, 1)``.
    :param outputscale: Output scale :math:`s`, one per batch element, or None for :math:`s = 1`.
    :param profile: ``"rbf"``, ``"matern32"`` or ``"matern52"``.
    :param symmetric: Whether ``x1`` equals ``x2`` and ``u`` equals ``v`` (half the tiles are swept).
    :return: :math:`s\,\mathbf u^\top\mathbf F\mathbf v`, ``(*batch)``.

    Example:
        >>> import gpytorch, torch
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        >>> gamma, a = torch.randn(300, 2), torch.randn(300)
        >>> ell, s = kernel.base_kernel.lengthscale, kernel.outputscale
        >>> value = squared_distance_quadratic_form(gamma, gamma, a, a, ell, s, "rbf", symmetric=True)
        >>> torch.allclose(value, a @ kernel(gamma, gamma).to_dense() @ a, rtol=1e-4)
        True
    """
    scale_operand = () if outputscale is None else (outputscale.unsqueeze(-1),)
    x, z, batch_shape = scaled_inputs(x1, x2, lengthscale, u, v, *scale_operand)
    left, right = flatten_batch(u, batch_shape, 1), flatten_batch(v, batch_shape, 1)
    recording = torch.is_grad_enabled()
    needs = [recording and tensor.requires_grad for tensor in (x, z, right)]
    # Eager calls skip the operator's dispatch (a third of a small sweep's time); compiled graphs keep the operator.
    sweep = _bilinear_sweep if torch.compiler.is_compiling() else _EagerBilinearSweep.apply
    value = sweep(x, z, left, right, profile, symmetric, *needs)[0].view(batch_shape)
    return value if outputscale is None else value * outputscale


def _sweep(
    x: Tensor,  # shape: (B, n, d)
    z: Tensor,  # shape: (B, m, d)
    u: Tensor,  # shape: (B, n)
    v: Tensor,  # shape: (B, m)
    profile: str,
    symmetric: bool,
    needs_x: bool,
    needs_z: bool,
    needs_v: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""
    :math:`\mathbf u^\top\mathbf F\mathbf v` ``(B,)`` and, from the same sweep, the gradients with respect to ``x`` and
    ``z`` (where asked for), :math:`\mathbf F\mathbf v` (always: the value needs it) and :math:`\mathbf F^\top\mathbf
    u` (where asked for); an empty tensor in place of each one not computed, and of ``z``'s gradient and
    :math:`\mathbf F^\top\mathbf u` when ``symmetric`` (they equal ``x``'s and :math:`\mathbf F\mathbf v`).
    """
    if symmetric:
        z, v = x, u
    tiles = KernelTiles(x, z, profile, symmetric=symmetric)
    grad_x, grad_z, column_sums, row_sums = bilinear_sums(tiles, x, z, u, v, needs_x, needs_z, needs_v, True)
    value = (u * row_sums).sum(-1)
    if symmetric:
        grad_z = column_sums = None
    # An operator's outputs may not alias each other or its inputs: copies where bilinear_sums returned a view.
    outputs = (value, grad_x, grad_z, row_sums, column_sums)
    return tuple(x.new_empty(0) if tensor is None else tensor.clone() for tensor in outputs)


# The same function as an operator, for compiled graphs.
_bilinear_sweep = torch.library.custom_op(
    "gpytorch_decoupled::squared_distance_bilinear_sweep", _sweep, mutates_args=()
)


@_bilinear_sweep.register_fake
def _(x, z, u, v, profile, symmetric, needs_x, needs_z, needs_v):
    needs_z, needs_v = needs_z and not symmetric, needs_v and not symmetric
    return (
        x.new_empty(x.size(0)),
        x.new_empty(x.shape if needs_x or (symmetric and needs_z) else 0),
        z.new_empty(z.shape if needs_z else 0),
        u.new_empty(u.shape),
        v.new_empty(v.shape if needs_v else 0),
    )


def _scaled_gradients(grad: Tensor, *gradients: Tensor) -> tuple[Tensor, ...]:
    """The sweep's gradients (of the points, ``(B, n, d)``, or of the vectors, ``(B, n)``) scaled by the incoming one,
    ``grad`` ``(B,)``; an empty placeholder stays one."""
    weight = grad.unsqueeze(-1)
    return tuple(
        tensor.new_empty(0) if tensor.dim() == 1 else (weight.unsqueeze(-1) if tensor.dim() == 3 else weight) * tensor
        for tensor in gradients
    )


@torch.library.custom_op("gpytorch_decoupled::squared_distance_bilinear_backward", mutates_args=())
def _bilinear_backward(
    grad: Tensor, grad_x: Tensor, grad_z: Tensor, row_sums: Tensor, column_sums: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_scaled_gradients` as an operator of its own without an autograd formula, so that differentiating the
    backward pass raises instead of treating the sums as constants."""
    return _scaled_gradients(grad, grad_x, grad_z, row_sums, column_sums)


@_bilinear_backward.register_fake
def _(grad, grad_x, grad_z, row_sums, column_sums):
    return tuple(torch.empty_like(tensor) for tensor in (grad_x, grad_z, row_sums, column_sums))


def _setup_context(ctx, inputs, output) -> None:
    ctx.symmetric = inputs[5]
    ctx.save_for_backward(*output[1:])


def _backward(ctx, grad: Tensor, *unused: Tensor):
    grad_x, grad_z, row_sums, column_sums = ctx.saved_tensors
    if ctx.symmetric:
        grad_z, column_sums = grad_x, row_sums
    needs_x, needs_z, needs_u, needs_v = ctx.needs_input_grad[:4]
    # A backward pass that autograd records (create_graph) scales through the operator, whose differentiation raises;
    # otherwise plain operations, which a compiled graph fuses (torch.compile does not differentiate twice anyway).
    recorded = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    scale = _bilinear_backward if recorded else _scaled_gradients
    # Empty where the sweep did not compute a gradient (its input needs none): scaled as empty, returned as None.
    results = scale(grad, grad_x, grad_z, row_sums, column_sums)
    return (
        *(result if needed else None for result, needed in zip(results, (needs_x, needs_z, needs_u, needs_v))),
        None,
        None,
        None,
        None,
        None,
    )


_bilinear_sweep.register_autograd(_backward, setup_context=_setup_context)


class _EagerBilinearSweep(torch.autograd.Function):
    """The operator's autograd for eager calls, around the same :func:`_sweep` and :func:`_scaled_gradients`, without
    the operator's dispatch; differentiating its backward pass raises as the operator's does."""

    @staticmethod
    def forward(ctx, x, z, u, v, profile, symmetric, needs_x, needs_z, needs_v):
        outputs = _sweep(x, z, u, v, profile, symmetric, needs_x, needs_z, needs_v)
        _setup_context(ctx, (x, z, u, v, profile, symmetric), outputs)
        return outputs

    @staticmethod
    def backward(ctx, grad: Tensor, *unused: Tensor):
        return _backward(ctx, grad)
