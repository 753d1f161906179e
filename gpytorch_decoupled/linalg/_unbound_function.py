from __future__ import annotations

import inspect

import torch

try:  # torch >= 2.1
    from torch._functorch.utils import unwrap_dead_wrappers
except ImportError:  # pragma: no cover - older torch: every call takes torch.autograd.Function.apply
    unwrap_dead_wrappers = None


class UnboundFunction(torch.autograd.Function):
    r"""
    A :class:`torch.autograd.Function` in the ``setup_context`` style (what :func:`torch.func` transforms and
    ``generate_vmap_rule`` need) whose ``apply`` skips the per-call binding of the arguments to the signature of
    ``forward``, which :meth:`torch.autograd.Function.apply` does with :func:`inspect.signature` on every call (about
    35 µs, more than the arithmetic of a small factor's backward pass). For a ``forward`` that takes positional
    parameters without defaults, called with positional arguments only, binding changes nothing, so outside
    :mod:`torch.func` transforms the call goes straight to autograd's C++ ``apply`` with the same arguments; under a
    transform, with keyword arguments, or for a ``forward`` with defaults, it is the standard ``apply``. Under
    :func:`torch.compile`, Dynamo handles the call to ``apply`` of a Function itself.
    """

    _binding_is_identity: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        parameters = inspect.signature(cls.forward).parameters.values()
        cls._binding_is_identity = unwrap_dead_wrappers is not None and all(
            parameter.kind is parameter.POSITIONAL_OR_KEYWORD and parameter.default is parameter.empty
            for parameter in parameters
        )

    @classmethod
    def apply(cls, *args, **kwargs):
        if kwargs or not cls._binding_is_identity or torch._C._are_functorch_transforms_active():
            return super().apply(*args, **kwargs)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))
