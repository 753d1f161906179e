from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from gpytorch.module import Module


class _CacheSafeMixin:
    r"""
    Keeps GPyTorch's memoized caches from outliving the tensors they were computed from.

    GPyTorch memoizes quantities (Cholesky factors, predictive caches) in ``_memoize_cache`` and clears them on
    ``train()``/``eval()`` and ``load_state_dict``, but

    * not on ``.to()``, ``.double()``, ``.cuda()`` or ``.cpu()`` (GPyTorch issues #1619 and #1859): a model that
      predicted once and was then converted keeps stale float32 / CPU factors and fails or mixes precisions;
    * the caches of the last training step hold tensors that are part of an autograd graph, so ``copy.deepcopy(model)``
      right after a training step (the usual way to keep the best model) raises.

    Every strategy of this package mixes this class in first: conversions clear the caches of every module below it,
    and copies and pickles never carry caches (they are recomputed on the next call).
    """

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        for module in self.modules():
            if isinstance(module, Module):
                module._clear_cache()
        return result

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if "_memoize_cache" in state:
            state = {**state, "_memoize_cache": {}}
        return state
