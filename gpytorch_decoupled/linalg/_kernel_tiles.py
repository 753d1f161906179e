#!/usr/bin/env python3
r"""
The tile sweep behind the fused kernel products: a kernel block :math:`F_{ij} = f(D_{ij})` of an isotropic profile
:math:`f` of the squared distance :math:`D_{ij} = \lVert\mathbf x_i - \mathbf z_j\rVert^2` is evaluated a tile at a
time into reused buffers, and each tile is reduced against thin matrices (a few columns: coefficients, gradients,
their products with the inputs) while it is still in cache. Nothing of size :math:`n \times m` is ever allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .settings import kernel_tile_size
from .shapes import broadcast_shapes
from .subnormal_floor import exponent_floor

# Isotropic kernels k = f(D) of the squared scaled distance D, with f and its derivative f' = df/dD.
PROFILES = ("rbf", "matern32", "matern52")
# Buffers per tile, and those that end up holding the values and the derivative (the others are scratch): the RBF's
# values are their own derivative (f' = -f / 2); Matern needs e^{-s} and, for 5/2, a third buffer.
_BUFFERS = {"rbf": (1, (0,)), "matern32": (2, (0, 1)), "matern52": (3, (0, 2))}
# Exponentials are taken as powers of 2, e^t = 2^(t log2 e): PyTorch's exp2 was the faster one on the CPU this was
# tuned on (1.8 against 1.0 G/s; on an AVX-512 Xeon exp is, 5.4 against 3.6).
_LOG2_E = 1.0 / math.log(2.0)


@dataclass
class TileReduction:
    r"""
    One reduction of every tile :math:`\mathbf T` of the block (:math:`\mathbf F`, or :math:`\mathbf F'` when
    ``derivative`` is set) against thin matrices laid out as ``(B, k, rows)`` and ``(B, k, columns)``:
    ``row_result += column_thin @ T^T`` and ``column_result += row_thin @ T``. Either side may be left out (None).
    """

    derivative: bool
    column_thin: Tensor | None = None  # shape: (B, k, m); reduced into row_result (B, k, n)
    row_result: Tensor | None = None
    row_thin: Tensor | None = None  # shape: (B, k', n); reduced into column_result (B, k', m)
    column_result: Tensor | None = None


def check_profile(profile: str) -> None:
    if profile not in PROFILES:
        raise ValueError(f"unknown kernel profile {profile!r}; available: {', '.join(PROFILES)}.")


def scaled_inputs(
    x1: Tensor, x2: Tensor, lengthscale: Tensor, *batch_operands: Tensor
) -> tuple[Tensor, Tensor, torch.Size]:
    r"""
    :math:`(\mathbf x^{(1)} - \mathbf c) / \boldsymbol\ell` and :math:`(\mathbf x^{(2)} - \mathbf c) / \boldsymbol\ell`
    for the mean :math:`\mathbf c` of :math:`\mathbf x^{(2)}` (of :math:`\mathbf x^{(1)}` if there is none; GPyTorch
    centers its distances so, and the shift leaves :math:`\mathbf D` unchanged and carries no gradient), flattened to
    one batch dimension ``(B, n, d)``, ``(B, m, d)``, and the broadcast batch shape of the inputs and the vectors
    ``batch_operands`` (whose last dimension is not batch).
    """
    # The mean of no points is NaN: without columns, center on the rows. Detached: its gradients cancel exactly.
    center = (x2 if x2.size(-2) > 0 else x1).mean(dim=-2, keepdim=True).detach()
    x, z = (x1 - center) / lengthscale, (x2 - center) / lengthscale
    batch_shape = broadcast_shapes(x.shape[:-2], z.shape[:-2], *(operand.shape[:-1] for operand in batch_operands))
    return flatten_batch(x, batch_shape, 2), flatten_batch(z, batch_shape, 2), batch_shape


def flatten_batch(tensor: Tensor, batch_shape: torch.Size, event_dims: int) -> Tensor:
    """``tensor`` broadcast to ``batch_shape`` and its batch dimensions flattened into one (a copy only when the
    broadcast needs one)."""
    event_shape = tensor.shape[tensor.dim() - event_dims :]
    if tensor.shape[: tensor.dim() - event_dims] == batch_shape and len(batch_shape) <= 1:
        return tensor.unsqueeze(0) if not batch_shape else tensor
    return tensor.expand(*batch_shape, *event_shape).reshape(batch_shape.numel(), *event_shape)


def unflatten_batch(tensor: Tensor, batch_shape: torch.Size) -> Tensor:
    """The inverse of :func:`flatten_batch`: the leading dimension of ``tensor`` back to ``batch_shape``."""
    return tensor.view(*batch_shape, *tensor.shape[1:])


class KernelTiles:
    r"""
    The block :math:`\mathbf F = f(\mathbf D(\mathbf X, \mathbf Z))` of scaled inputs ``x`` ``(B, n, d)`` and ``z``
    ``(B, m, d)``, swept in tiles of about :class:`~gpytorch_decoupled.linalg.settings.kernel_tile_size` entries.
    With ``symmetric=True`` (``x`` and ``z`` the same points) only the tiles on and above the diagonal are evaluated,
    and each off-diagonal tile is reduced both as itself and as its transpose.

    Distances come from one matrix product of augmented inputs, :math:`\mathbf D = [-2\mathbf X, \lVert\mathbf
    X\rVert^2, \mathbf 1][\mathbf Z, \mathbf 1, \lVert\mathbf Z\rVert^2]^\top`, written straight into the tile; the
    RBF's factor :math:`-\tfrac12\log_2 e` is folded into the augmented rows, so its tile is one ``exp2_`` away from
    :math:`\mathbf F` (:math:`e^{-D/2} = 2^{-D\log_2 e/2}`: PyTorch's vectorized ``exp2`` ran 1.8 times as fast as its
    ``exp`` on the CPU this was tuned on, 0.67 times on an AVX-512 Xeon; the factor rounds with the rows, adding no
    rounding step). Rounding can leave :math:`D` slightly negative for coincident points; the RBF needs no clamp there
    (:math:`e^{\epsilon} \approx 1`), Matérn clamps before its square root. Every exponential is kept at or above
    :math:`2^t` (:func:`~gpytorch_decoupled.linalg.exponent_floor`), so that no tile holds a subnormal number.
    """

    def __init__(self, x: Tensor, z: Tensor, profile: str, symmetric: bool = False, keep: bool = False):
        check_profile(profile)
        self.profile, self.symmetric = profile, symmetric
        self._floor = exponent_floor(x.dtype)
        scale = -0.5 * _LOG2_E if profile == "rbf" else 1.0
        x_norm, z_norm = x.square().sum(-1, keepdim=True), z.square().sum(-1, keepdim=True)
        rows = torch.cat([(-2.0 * scale) * x, scale * x_norm, torch.full_like(x_norm, scale)], dim=-1)
        columns = torch.cat([z, torch.ones_like(z_norm), z_norm], dim=-1)
        batch, num_rows, num_columns = x.size(0), x.size(-2), z.size(-2)
        tile_size = kernel_tile_size.value()
        if symmetric:
            side = _block_size(num_rows, max(1, math.isqrt(max(1, tile_size // max(batch, 1)))))
            self.row_blocks = self.column_blocks = _blocks(num_rows, side)
        else:
            # Tiles as square as the block allows (the distance product and the thin reductions run best so), the
            # rows split evenly so that no tile is a sliver.
            side = max(1, math.isqrt(max(1, tile_size // max(batch, 1))))
            row_block = _block_size(num_rows, side)
            column_block = _block_size(num_columns, max(1, tile_size // max(batch * row_block, 1)))
            self.row_blocks, self.column_blocks = _blocks(num_rows, row_block), _blocks(num_columns, column_block)
        self._rows = [rows[:, r0:r1] for r0, r1 in self.row_blocks]
        self._columns = [columns[:, c0:c1].mT for c0, c1 in self.column_blocks]
        self._plan = self._buffer_plan(x, batch, keep)
        self._kept: list[tuple[int, int, Tensor, Tensor | None]] | None = None
        self.keep = keep

    def _buffer_plan(self, like: Tensor, batch: int, keep: bool) -> list[tuple[int, int, list[Tensor]]]:
        """Every tile's ``(i, j, buffers)``: views of a few reused buffers, or, to keep the block, of buffers that
        hold every tile (only for the buffers the profile's values and derivative end up in)."""
        tiles = [
            (i, j, (batch, r1 - r0, c1 - c0))
            for i, (r0, r1) in enumerate(self.row_blocks)
            for j, (c0, c1) in enumerate(self.column_blocks)
            if not self.symmetric or j >= i
        ]
        sizes = [math.prod(shape) for _, _, shape in tiles]
        count, outputs = _BUFFERS[self.profile]
        kept = outputs if keep else ()
        buffers = [like.new_empty(sum(sizes) if index in kept else max(sizes, default=0)) for index in range(count)]
        plan, offset = [], 0
        for (i, j, shape), size in zip(tiles, sizes):
            views = [
                buffer[offset : offset + size].view(shape) if index in kept else buffer[:size].view(shape)
                for index, buffer in enumerate(buffers)
            ]
            plan.append((i, j, views))
            offset += size
        return plan

    def tiles(self) -> Iterator[tuple[int, int, Tensor, Tensor | None]]:
        """Yields ``(i, j, F, F')`` for every tile (row block ``i``, column block ``j``; ``F'`` is None for the RBF,
        whose derivative is ``-F / 2``). The tiles are views of reused buffers, valid until the next one, unless the
        block is kept: then they stay valid and a second sweep yields them again without evaluating anything."""
        if self._kept is not None:
            yield from self._kept
            return
        kept = [] if self.keep else None
        for i, j, (tile, *scratch) in self._plan:
            torch.bmm(self._rows[i], self._columns[j], out=tile)
            result = (i, j, *_apply_profile(tile, scratch, self.profile, self._floor))
            if kept is not None:
                kept.append(result)
            yield result
        self._kept = kept

    def reduce(self, reductions: list[TileReduction]) -> None:
        """Runs every reduction over every tile in one sweep (each tile is evaluated once)."""
        jobs = []
        for reduction in reductions:
            row_side = column_side = None
            if reduction.column_thin is not None:
                row_side = (
                    _split(reduction.row_result, self.row_blocks),
                    _split(reduction.column_thin, self.column_blocks),
                )
            if reduction.row_thin is not None:
                column_side = (
                    _split(reduction.column_result, self.column_blocks),
                    _split(reduction.row_thin, self.row_blocks),
                )
            jobs.append((reduction.derivative, row_side, column_side))
        for i, j, values, derivative in self.tiles():
            off_diagonal = not self.symmetric or i != j
            for use_derivative, row_side, column_side in jobs:
                tile = derivative if use_derivative and derivative is not None else values
                if row_side is not None:
                    row_side[0][i].baddbmm_(row_side[1][j], tile.mT)
                if column_side is not None and off_diagonal:
                    column_side[0][j].baddbmm_(column_side[1][i], tile)


def bilinear_sums(
    tiles: KernelTiles,
    x: Tensor,  # shape: (B, n, d)
    z: Tensor,  # shape: (B, m, d)
    u: Tensor,  # shape: (B, n)
    v: Tensor,  # shape: (B, m)
    needs_x: bool,
    needs_z: bool,
    needs_column_sums: bool,
    needs_row_sums: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    r"""
    For the bilinear form :math:`\mathbf u^\top\mathbf F\mathbf v` of the block of ``tiles`` (scaled inputs ``x``,
    ``z``): its gradients with respect to ``x`` and ``z``,

    .. math::

        \nabla_{\mathbf x_i} = 2 u_i \big(\mathbf x_i [\mathbf F'\mathbf v]_i - [\mathbf F'(\mathbf v \circ
        \mathbf Z)]_i\big), \qquad
        \nabla_{\mathbf z_j} = 2 v_j \big(\mathbf z_j [\mathbf F'^\top\mathbf u]_j - [\mathbf F'^\top(\mathbf u
        \circ \mathbf X)]_j\big),

    and the sums :math:`\mathbf F^\top\mathbf u` and :math:`\mathbf F\mathbf v`, each only where asked for (None
    otherwise), all from one sweep of the tiles. For the RBF (:math:`\mathbf F' = -\tfrac12\mathbf F`) the factor
    :math:`2` becomes :math:`-1` with :math:`\mathbf F` in place of :math:`\mathbf F'`, and the first columns of the
    point reductions are the sums. For symmetric ``tiles`` (``x is z``, ``u is v``) every quantity comes from the
    tiles on and above the diagonal and the two gradients (and sums) are the same tensor.
    """
    rbf, symmetric = tiles.profile == "rbf", tiles.symmetric
    factor = -1.0 if rbf else 2.0
    if symmetric:
        needs_x = needs_z = needs_x or needs_z
        needs_row_sums = needs_column_sums = needs_row_sums or needs_column_sums
    reductions = []
    point_rows = point_columns = row_sums = column_sums = None

    def thin(weights: Tensor, points: Tensor, with_points: bool) -> Tensor:
        if not with_points:
            return weights.unsqueeze(-2)
        return torch.cat([weights.unsqueeze(-2), (weights.unsqueeze(-1) * points).mT], dim=-2)

    # The reduction into the rows (against v) and the one into the columns (against u); for symmetric tiles they are
    # one reduction, both sides of which land in the same result.
    row_points = needs_x or (rbf and needs_row_sums)
    if row_points:
        point_rows = x.new_zeros(x.size(0), x.size(-1) + 1 if needs_x else 1, x.size(-2))
        column_thin = thin(v, z, needs_x)
        both = dict(row_thin=column_thin, column_result=point_rows) if symmetric else {}
        reductions.append(TileReduction(True, column_thin=column_thin, row_result=point_rows, **both))
    column_points = not symmetric and (needs_z or (rbf and needs_column_sums))
    if column_points:
        point_columns = z.new_zeros(z.size(0), z.size(-1) + 1 if needs_z else 1, z.size(-2))
        reductions.append(TileReduction(True, row_thin=thin(u, x, needs_z), column_result=point_columns))
    if needs_row_sums and not rbf:
        row_sums = x.new_zeros(x.size(0), 1, x.size(-2))
        both = dict(row_thin=v.unsqueeze(-2), column_result=row_sums) if symmetric else {}
        reductions.append(TileReduction(False, column_thin=v.unsqueeze(-2), row_result=row_sums, **both))
    if needs_column_sums and not rbf and not symmetric:
        column_sums = z.new_zeros(z.size(0), 1, z.size(-2))
        reductions.append(TileReduction(False, row_thin=u.unsqueeze(-2), column_result=column_sums))
    tiles.reduce(reductions)
    if symmetric:
        point_columns, column_sums = point_rows, row_sums
    if rbf:
        row_sums, column_sums = point_rows, point_columns
    grad_x = (factor * u).unsqueeze(-1) * (x * point_rows[:, :1].mT - point_rows[:, 1:].mT) if needs_x else None
    if symmetric:
        grad_z = grad_x
    elif needs_z:
        grad_z = (factor * v).unsqueeze(-1) * (z * point_columns[:, :1].mT - point_columns[:, 1:].mT)
    else:
        grad_z = None
    row_sums = row_sums[:, 0] if needs_row_sums else None
    column_sums = (row_sums if symmetric else column_sums[:, 0]) if needs_column_sums else None
    return grad_x, grad_z, column_sums, row_sums


def _apply_profile(tile: Tensor, scratch: list[Tensor], profile: str, floor: float) -> tuple[Tensor, Tensor | None]:
    r""":math:`f(D)` and :math:`f'(D)` (None for the RBF) in place, from the tile of :math:`D` (of
    :math:`-D\log_2 e/2` for the RBF) and the scratch buffers; every exponential at least :math:`2^{\text{floor}}`
    (:func:`~gpytorch_decoupled.linalg.exponent_floor` of the tile's dtype)."""
    if profile == "rbf":
        return tile.clamp_min_(floor).exp2_(), None
    # s = sqrt(2 nu) r with r^2 = D
    scaled = tile.clamp_min_(0.0).sqrt_().mul_(math.sqrt(3.0) if profile == "matern32" else math.sqrt(5.0))
    decay = torch.mul(scaled, -_LOG2_E, out=scratch[0]).clamp_min_(floor).exp2_()  # e^-s
    if profile == "matern32":
        # f = (1 + s) e^-s with s^2 = 3 D: f' = df/ds * ds/dD = -s e^-s * 3 / (2 s) = -1.5 e^-s
        return scaled.add_(1.0).mul_(decay), decay.mul_(-1.5)
    # Matern 5/2: f = (1 + s + s^2 / 3) e^-s with s^2 = 5 D: f' = -(s (1 + s) / 3) e^-s * 5 / (2 s) = -(5/6)(1 + s) e^-s
    values = torch.mul(scaled, scaled, out=scratch[1]).div_(3.0)
    scaled.add_(1.0)
    values.add_(scaled).mul_(decay)
    return values, scaled.mul_(decay).mul_(-5.0 / 6.0)


def _split(tensor: Tensor, blocks: list[tuple[int, int]]) -> list[Tensor]:
    """Views of ``tensor``'s last dimension, one per block."""
    return [tensor[..., start:end] for start, end in blocks]


def _block_size(size: int, target: int) -> int:
    """The size of ``ceil(size / target)`` equal blocks that cover ``size``."""
    if size <= 0:
        return 1
    count = -(-size // max(1, min(target, size)))
    return -(-size // count)


def _blocks(size: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, size)) for start in range(0, size, block)]
