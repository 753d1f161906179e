from __future__ import annotations

import torch
from torch import Tensor


def replace_tensor(module: torch.nn.Module, name: str, value: Tensor) -> None:
    """
    Replaces the parameter or buffer ``name`` of ``module`` by ``value``, possibly of another shape.

    A parameter becomes a *new* :class:`~torch.nn.Parameter`: resizing a leaf in place (``.data = ...``) would leave
    autograd's cached gradient accumulator, still alive while an old graph is, expecting the old shape. Optimizers
    that hold the old parameter must be told (:class:`~gpytorch_decoupled.optim.OnlineBasisGrowth` does that).
    """
    if name in module._parameters:
        old = module._parameters[name]
        module._parameters[name] = torch.nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad)
    else:
        module._buffers[name] = value.detach().clone()
