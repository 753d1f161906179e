"""Kernels, inputs and a dense float64 reference shared by the tests of the fused kernel products."""

from __future__ import annotations

from contextlib import contextmanager

import gpytorch
import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel
from torch import Tensor
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from tests.oracles import matern, rbf

BATCH = torch.Size([2])


def kernels() -> dict[str, gpytorch.kernels.Kernel]:
    """Every kind of block the fused products support: each profile, ARD or one length-scale, with and without an
    output scale, batched hyperparameters and ``active_dims``."""
    return {
        "rbf": RBFKernel(),
        "rbf-ard": RBFKernel(ard_num_dims=3),
        "scaled-rbf-ard": ScaleKernel(RBFKernel(ard_num_dims=3)),
        "matern32": MaternKernel(nu=1.5, ard_num_dims=3),
        "scaled-matern52": ScaleKernel(MaternKernel(nu=2.5)),
        "batched-scaled-rbf": ScaleKernel(RBFKernel(batch_shape=BATCH, ard_num_dims=3), batch_shape=BATCH),
        "batched-matern52": MaternKernel(nu=2.5, batch_shape=BATCH),
        "active-dims-rbf": RBFKernel(active_dims=(0, 2)),
    }


def randomize(kernel: gpytorch.kernels.Kernel) -> gpytorch.kernels.Kernel:
    """Hyperparameters away from their defaults (and different per batch element), reproducibly."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in kernel.parameters():
            parameter.add_(0.4 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return kernel


def oracle_block(kernel: gpytorch.kernels.Kernel, x1: Tensor, x2: Tensor) -> Tensor:
    """The dense block of ``kernel`` from the formula (:mod:`tests.oracles`), not from GPyTorch's code."""
    outputscale = 1.0
    if isinstance(kernel, ScaleKernel):
        outputscale, kernel = kernel.outputscale.unsqueeze(-1).unsqueeze(-1), kernel.base_kernel
    if kernel.active_dims is not None:
        x1, x2 = x1[..., kernel.active_dims], x2[..., kernel.active_dims]
    lengthscale = kernel.lengthscale  # shape: (*batch, 1, D) or (*batch, 1, 1)
    x1, x2 = x1 / lengthscale, x2 / lengthscale
    if isinstance(kernel, RBFKernel):
        return outputscale * rbf(x1, x2, 1.0)
    return outputscale * matern(x1, x2, kernel.nu, 1.0)


class LargestTensor(TorchDispatchMode):
    """Records the number of elements of the largest tensor any operation creates, and the elements passed through
    ``exp`` or ``exp2``, while active."""

    def __init__(self):
        super().__init__()
        self.largest, self.exponentials = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gpytorch_decoupled":
            # This package's operators (the tile sweeps): their Python implementation runs under the mode, so that
            # what they create is recorded too (the operator itself is one opaque call).
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **(kwargs or {}))
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for output in outputs:
            if isinstance(output, Tensor):
                self.largest = max(self.largest, output.numel())
                if func.overloadpacket in (
                    torch.ops.aten.exp,
                    torch.ops.aten.exp_,
                    torch.ops.aten.exp2,
                    torch.ops.aten.exp2_,
                ):
                    self.exponentials += output.numel()
        return result


@contextmanager
def largest_tensor():
    with LargestTensor() as mode:
        yield mode
