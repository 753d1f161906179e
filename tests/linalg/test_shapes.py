"""broadcast_shapes against torch.broadcast_shapes: the same shape (a torch.Size) or the same error."""

from __future__ import annotations

import pytest
import torch

from gpytorch_decoupled.linalg import broadcast_shapes


def test_equal_shapes_return_that_shape():
    shape = broadcast_shapes(torch.Size([2, 3]), (2, 3), [2, 3])
    assert isinstance(shape, torch.Size) and shape == torch.Size([2, 3])
    assert broadcast_shapes(torch.Size([])) == torch.Size([])
    assert broadcast_shapes() == torch.Size([])


@pytest.mark.parametrize("shapes", [((3, 1), (4,)), ((), (2, 1), (1, 5)), ((1,), ()), ((2, 1, 3), (4, 1))])
def test_different_shapes_broadcast_as_pytorch_does(shapes):
    assert broadcast_shapes(*shapes) == torch.broadcast_shapes(*shapes)


def test_shapes_that_do_not_broadcast_raise():
    with pytest.raises(RuntimeError):
        broadcast_shapes((2,), (3,))
