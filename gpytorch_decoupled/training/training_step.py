from __future__ import annotations

import types
import warnings

import torch
from torch import Tensor

from ..gpytorch_compat import initialize_variational_distribution
from .lean_elbo import LeanELBO
from .optimizer_updates import optimizer_update, unsupported_optimizer


class TrainingStep:
    r"""
    One training step of a variational GP, ``loss = step(x, y)``: the loss ``-mll(model(x), y)`` on the mini-batch,
    its gradients and every optimizer's update, as one function that :func:`torch.compile` captures whole (no graph
    break: forward, ELBO, backward and the optimizers' updates in one graph). Built by
    :func:`~gpytorch_decoupled.training.compile_training_step`, which documents the options.

    How the step is computed:

    * **The lean path.** Where every part of the model is supported (:class:`~gpytorch_decoupled.training.LeanELBO`),
      the loss is computed by plain tensor operations with the values and gradients of GPyTorch's general path, and
      the gradients by :func:`torch.autograd.grad`; each optimizer's update is applied from them
      (:mod:`~gpytorch_decoupled.training.optimizer_updates`). ``.grad`` is not written.
    * **Eager fallback.** Anything else (an unsupported strategy, kernel, likelihood, objective or optimizer, or
      ``lean=False``) runs the ordinary eager step, ``zero_grad``, ``-mll(model(x), y)``, ``backward``, ``step``, with
      one warning that names the reason (:attr:`fallback_reason`). GPyTorch's general path is not compiled: its
      :class:`~linear_operator.operators.LinearOperator` layers and memoization break the graph dozens of times, and
      each break costs more than it saves at the sizes where overhead matters.
    * **Outside the compiled region**, once per step and cheaply: the model and likelihood are put in training mode,
      :math:`q(\mathbf u)` is initialized on the first step as GPyTorch does, the inputs are validated (shape, dtype,
      device, NaN/inf: a ``ValueError`` before anything changes), the step's random draws (sampled KL rows) are made
      from the same generator calls as the eager step's, and the returned loss is checked to be finite: a
      non-finite loss (e.g. a kernel matrix not positive definite at the largest jitter, which the compiled
      factorization reports as NaN instead of raising) raises a ``RuntimeError`` after the step, whose update is then
      not meaningful.

    :param mll: The objective (e.g. :class:`gpytorch.mlls.VariationalELBO`), with its model and likelihood.
    :param optimizers: The optimizers to step after each backward pass (each parameter in at most one of them).
    :param compile: Compile the step with :func:`torch.compile` (False runs the same lean step eagerly).
    :param lean: Use the lean path where supported (False always runs the eager general step).
    :param compile_options: Keyword arguments of :func:`torch.compile` (``mode``, ``dynamic``, ``backend`` ...).
    """

    def __init__(self, mll, optimizers, *, compile: bool = True, lean: bool = True, **compile_options):
        self.mll = mll
        self.model = mll.model
        self.likelihood = mll.likelihood
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.compiled = compile
        self.parameters: list[torch.nn.Parameter] = []
        positions: dict[int, int] = {}
        optimizer_positions = []
        for optimizer in self.optimizers:
            groups = []
            for group in optimizer.param_groups:
                indices = []
                for parameter in group["params"]:
                    if id(parameter) in positions:
                        raise ValueError("a parameter is in more than one optimizer (or twice in one).")
                    positions[id(parameter)] = len(self.parameters)
                    indices.append(len(self.parameters))
                    self.parameters.append(parameter)
                groups.append(indices)
            optimizer_positions.append(groups)

        reasons = [unsupported_optimizer(optimizer) for optimizer in self.optimizers]
        reason = "lean=False" if not lean else next((r for r in reasons if r is not None), None)
        self.lean = None
        if reason is None:
            reason = LeanELBO.unsupported(mll)
            self.lean = LeanELBO.of(mll) if reason is None else None
        self.fallback_reason: str | None = reason
        r"""Why the step runs eagerly on GPyTorch's general path, or None when it runs the (compiled) lean path."""
        if reason is not None:
            if lean:
                warnings.warn(
                    f"compile_training_step: {reason} is not supported by the lean training path; the step runs "
                    "eagerly on GPyTorch's general path.",
                    UserWarning,
                    stacklevel=3,
                )
            self._updates = []
            self._function = None
            return
        self._updates = [
            optimizer_update(optimizer, groups) for optimizer, groups in zip(self.optimizers, optimizer_positions)
        ]
        self._function = torch.compile(_own_code(self._lean_step), **compile_options) if compile else self._lean_step

    def _lean_step(self, x: Tensor, y: Tensor, draws: Tensor | None) -> Tensor:
        loss = self.lean(x, y, draws)
        value = loss.detach()
        gradients = torch.autograd.grad(loss, self.parameters, allow_unused=True)
        with torch.no_grad():
            for update in self._updates:
                update(gradients)
        return value

    def _eager_step(self, x: Tensor, y: Tensor) -> Tensor:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = -self.mll(self.model(x), y)
        loss.backward()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss.detach()

    def _check(self, x: Tensor, y: Tensor) -> None:
        reference = self.model.variational_strategy.inducing_points
        if x.dim() != 2 or x.size(-1) != reference.size(-1):
            raise ValueError(f"x must have shape (B, {reference.size(-1)}), got {tuple(x.shape)}.")
        if y.shape != x.shape[:1]:
            raise ValueError(f"y must have shape ({x.size(0)},) to match x, got {tuple(y.shape)}.")
        for name, tensor in (("x", x), ("y", y)):
            if tensor.dtype != reference.dtype or tensor.device != reference.device:
                raise ValueError(
                    f"{name} is {tensor.dtype} on {tensor.device} but the model is {reference.dtype} on "
                    f"{reference.device}."
                )
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise ValueError("x or y contains NaN or inf; nothing was changed.")

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """Takes one step on the mini-batch ``(x, y)`` and returns its loss (detached, before the update)."""
        for module in (self.model, self.likelihood):
            if not module.training:
                module.train()
        if self._function is None:
            return self._eager_step(x, y)
        self._check(x, y)
        initialize_variational_distribution(self.model.variational_strategy)
        draws = self.lean.draws()
        # Dynamo traces torch.autograd.grad into the graph only with this setting (else it breaks the graph there).
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            loss = self._function(x, y, draws)
        if not torch.isfinite(loss):
            raise RuntimeError(
                "the training step's loss is not finite (e.g. a kernel matrix that is not positive definite even "
                "with the largest jitter); the parameters were updated with non-finite values."
            )
        return loss


def _own_code(method: types.MethodType) -> types.MethodType:
    """``method`` with its own copy of the function's code object. Dynamo keeps compiled graphs per code object and
    recompiles at most ``torch._dynamo.config.recompile_limit`` times before running it eagerly; every step would
    otherwise share one code object (and its limit) with every other step of the process."""
    function = method.__func__
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return types.MethodType(copy, method.__self__)
