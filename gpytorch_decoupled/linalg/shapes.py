#!/usr/bin/env python3

from __future__ import annotations

from collections.abc import Sequence

import torch


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """
    :func:`torch.broadcast_shapes` of shapes (sequences of ints), returned at once where they are all equal, the common
    case on a training step's hot path: PyTorch's general rule costs tens of microseconds per call, as much as a small
    kernel tile's arithmetic.

    :param shapes: The shapes.
    :return: The shape they broadcast to.
    :raises RuntimeError: If they do not broadcast (PyTorch's error).

    Example:
        >>> broadcast_shapes(torch.Size([2, 1]), (2, 1))
        torch.Size([2, 1])
        >>> broadcast_shapes((3, 1), (4,))
        torch.Size([3, 4])
    """
    first = shapes[0] if shapes else ()
    if all(shape == first for shape in shapes):
        return torch.Size(first)
    return torch.broadcast_shapes(*shapes)
