from __future__ import annotations

import itertools
import math
import types
import warnings

import gpytorch
import torch
from torch import Tensor

from ..gpytorch_compat import initialize_variational_distribution
from ..linalg import all_finite, keep_freed_cpu_memory
from ..optim import DualEStep, MeanBasisAdam
from ..validation import check_inputs, check_targets, checks_target_values
from ..variational import DecoupledCurvature, DualVariationalStrategy
from .eager_training_step import eager_training_step
from .lean_e_step import LeanEStep
from .lean_elbo import LeanELBO
from .optimizer_updates import (
    current_update,
    natural_strategies,
    optimizer_update,
    rate_tensor,
    unsupported_optimizer,
)


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
      (:mod:`~gpytorch_decoupled.training.optimizer_updates`). ``.grad`` is not written. For t-SVGP
      (:class:`~gpytorch_decoupled.variational.DualVariationalStrategy` with its
      :class:`~gpytorch_decoupled.optim.DualEStep` among the optimizers) the step is the iteration of the default
      schedule: the E-step (:class:`~gpytorch_decoupled.training.LeanEStep`) at the forward pass's marginals, after
      the gradients and before the other updates. For the decoupled strategy
      (:class:`~gpytorch_decoupled.variational.DecoupledVariationalStrategy`) stepped by
      :class:`~gpytorch_decoupled.optim.MeanBasisAdam`, the same :func:`torch.autograd.grad` call differentiates the
      loss by the marginals and the KL as well: the curvature that the strategy's hooks record in an eager backward
      pass (:class:`~gpytorch_decoupled.variational.DecoupledCurvature`), from which the optimizer's update takes its
      natural-gradient and Gauss-Newton step. Where that step is not finite, the strategy's parameters and the
      optimizer's state keep their values and a ``RuntimeError`` follows the step (the other updates were applied).
    * **Eager fallback.** Anything else (an unsupported strategy, kernel, likelihood, objective or optimizer, or
      ``lean=False``) runs the ordinary eager step (:func:`~gpytorch_decoupled.training.eager_training_step`), with
      one warning that names the reason (:attr:`fallback_reason`). GPyTorch's general path is not compiled: its
      :class:`~linear_operator.operators.LinearOperator` layers and memoization break the graph dozens of times, and
      each break costs more than it saves at the sizes where overhead matters.
    * **Outside the compiled region**, once per step and cheaply: the model and likelihood are put in training mode,
      :math:`q(\mathbf u)` is initialized on the first step as GPyTorch does, the model's and likelihood's parameters
      are checked to be the tensors the step was built with (a ``RuntimeError`` where, e.g., a basis growth replaced
      them: the step would train the old ones), the inputs are validated (shape, dtype,
      device, NaN/inf: a ``ValueError`` before anything changes), the step's random draws (sampled KL rows) are made
      from the same generator calls as the eager step's, and the returned loss is checked to be finite: a
      non-finite loss (e.g. a kernel matrix not positive definite at the largest jitter, which the compiled
      factorization reports as NaN instead of raising) raises a ``RuntimeError`` after the step, whose update is then
      not meaningful.
    * **CUDA graphs** (``mode="reduce-overhead"`` or ``"max-autotune"`` on a GPU): Inductor replays a captured graph
      only if every tensor the step updates in place has a fixed address. Parameters have one; the optimizers' state
      and the model's and likelihood's buffers are marked so (:func:`torch._dynamo.mark_static_address`), t-SVGP's new
      sites are stored after the graph (as on every device), the jitter escalation of the Cholesky factorizations
      runs between graphs (:func:`~gpytorch_decoupled.linalg.jittered_cholesky`), and the returned loss is a copy (a
      graph's outputs are overwritten by its next replay).

    :param mll: The objective (e.g. :class:`gpytorch.mlls.VariationalELBO`), with its model and likelihood.
    :param optimizers: The optimizers to step after each backward pass (each parameter in at most one of them).
    :param compile: Compile the step with :func:`torch.compile` (False runs the same lean step eagerly).
    :param lean: Use the lean path where supported (False always runs the eager general step).
    :param compile_options: Keyword arguments of :func:`torch.compile` (``mode``, ``dynamic``, ``backend`` ...).
    """

    def __init__(self, mll, optimizers, *, compile: bool = True, lean: bool = True, **compile_options):
        keep_freed_cpu_memory()
        self.mll = mll
        self.model = mll.model
        self.likelihood = mll.likelihood
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.compiled = compile
        # t-SVGP's E-steps update the sites from the forward pass's marginals, not from gradients.
        e_steps = [optimizer for optimizer in self.optimizers if isinstance(optimizer, DualEStep)]
        gradient_optimizers = [optimizer for optimizer in self.optimizers if not isinstance(optimizer, DualEStep)]
        self.parameters: list[torch.nn.Parameter] = []
        positions: dict[int, int] = {}
        optimizer_positions = []
        for optimizer in gradient_optimizers:
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

        reason = "lean=False" if not lean else _unsupported(mll, e_steps, gradient_optimizers)
        self.lean = LeanELBO.of(mll) if reason is None else None
        self._e_step = LeanEStep(e_steps[0], self.lean.likelihood) if self.lean is not None and e_steps else None
        self.fallback_reason: str | None = reason
        r"""Why the step runs eagerly on GPyTorch's general path, or None when it runs the (compiled) lean path."""
        if reason is not None:
            if lean:
                warn_fallback(reason, "the lean training path", "on GPyTorch's general path")
            self._updates = []
            self._function = None
            return
        self._positions = optimizer_positions
        kernel = self.lean.kernel
        self._updates = [
            optimizer_update(optimizer, groups, kernel)
            for optimizer, groups in zip(gradient_optimizers, optimizer_positions)
        ]
        # the decoupled strategy's curvature step reads the loss's derivatives by its marginals and KL
        self._reads_curvature = any(natural_strategies(optimizer) for optimizer in gradient_optimizers)
        self._gradient_optimizers = gradient_optimizers
        # where each optimizer's group rates start in the step's tensor of rates
        ends = list(itertools.accumulate(len(optimizer.param_groups) for optimizer in gradient_optimizers))
        self._rate_slices = [
            slice(end - len(optimizer.param_groups), end) for end, optimizer in zip(ends, gradient_optimizers)
        ]
        self._cuda_graphs = compile and _uses_cuda_graphs(compile_options)
        self._dynamic_batch = compile and batch_size_is_dynamic(compile_options)
        if self._cuda_graphs:
            for tensor in _updated_in_place(self.optimizers, self.model, self.likelihood):
                torch._dynamo.mark_static_address(tensor)
        self._function = torch.compile(_own_code(self._lean_step), **compile_options) if compile else self._lean_step
        # Dynamo traces torch.autograd.grad into the graph only with this setting (else it breaks the graph there).
        # One patch object for every call: making one costs more than entering it.
        self._trace_autograd_ops = torch._dynamo.config.patch(trace_autograd_ops=True)
        self._checked_signature: tuple | None = None
        self._parameter_ids = _parameter_ids(self.model, self.likelihood)
        self._finiteness_suffices = not checks_target_values(self.likelihood)

    def _lean_step(self, x: Tensor, y: Tensor, draws: Tensor | None, e_step_lr: Tensor | None, rates: Tensor):
        loss, statistics = self.lean.loss_and_statistics(x, y, draws)
        value = loss.detach()
        curvature = None
        if self._reads_curvature:
            terms = (statistics.mean, statistics.variance, statistics.kl)
            *gradients, mean_gradient, variance_gradient, kl_weight = torch.autograd.grad(
                loss, [*self.parameters, *terms], allow_unused=True
            )
            # what DecoupledVariationalStrategy's hooks record of an eager backward pass
            kl_rows = statistics.kl_rows  # the rows of a column-sampled KL, with its weight
            curvature = DecoupledCurvature(
                inputs=statistics.inputs.detach(),
                variance_weights=2 * variance_gradient,
                mean_weights=mean_gradient.pow(2) * mean_gradient.size(-1),
                kl_weight=kl_weight,
                kl_samples=() if kl_rows is None else ((kl_rows, kl_weight),),
            )
        else:
            gradients = torch.autograd.grad(loss, self.parameters, allow_unused=True)
        natural_done = None
        with torch.no_grad():
            # The E-step at this forward pass's marginals (t-SVGP's default schedule; the other updates do not change
            # what it reads); its new sites are stored after the compiled region (LeanEStep).
            e_step = None if self._e_step is None else self._e_step(y, statistics, e_step_lr)
            for update, rate_slice in zip(self._updates, self._rate_slices, strict=True):
                done = update(gradients, rates[rate_slice], curvature)
                if done is not None:
                    natural_done = done if natural_done is None else natural_done & done
        return value, e_step, natural_done

    def _check(self, x: Tensor, y: Tensor) -> None:
        """Validates the mini-batch before anything changes. A batch whose tensors have the types, shapes, dtypes and
        devices of the last one that passed (against the same inducing points) is valid when its entries are finite,
        which one reduction per tensor decides, unless the likelihood reads the targets' values (labels)."""
        reference = self.model.variational_strategy.inducing_points
        signature = _signature(x, y, reference)
        if signature == self._checked_signature and self._finiteness_suffices and all_finite(x, y):
            return
        check_inputs(x, "x", reference, widths={reference.size(-1)}, dim=2, like_name="the inducing points")
        check_targets(y, "y", x.shape[:1], reference, self.likelihood)
        self._checked_signature = signature

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """Takes one step on the mini-batch ``(x, y)`` and returns its loss (detached, before the update)."""
        for module in (self.model, self.likelihood):
            if not module.training:
                module.train()
        if self._function is None:
            return eager_training_step(self.mll, self.optimizers, x, y)
        if _parameter_ids(self.model, self.likelihood) != self._parameter_ids:
            raise RuntimeError(
                "the model's parameters were replaced since this training step was built (e.g. by OnlineBasisGrowth or "
                "grow_bases, which replace the bases and coefficients): the step would train the old tensors; build "
                "the optimizers and the training step again."
            )
        self._check(x, y)
        strategy = self.model.variational_strategy
        if self._e_step is None:
            initialize_variational_distribution(strategy)
        else:  # t-SVGP's strategy records its first call without resetting sites set before it (by an E-step)
            strategy.variational_params_initialized.fill_(1)
        draws = self.lean.draws()
        e_step_lr = None
        if self._e_step is not None:
            e_step_lr = torch.tensor(self._e_step.lr(), dtype=torch.float64, device=x.device)
        # Every group's learning rate as one tensor (a scheduler's new rate is new data, not a new graph), with
        # MeanBasisAdam's divided by its function scales from kernel draws at the current parameters, as its step()
        # computes them (it comes before any optimizer that moves the kernel: _unsupported).
        scales = [
            optimizer.smoothed_function_scales() if type(optimizer) is MeanBasisAdam else None
            for optimizer in self._gradient_optimizers
        ]
        rates = rate_tensor(self._gradient_optimizers, scales, x.device)
        self._updates = [
            current_update(update, optimizer, positions)
            for update, optimizer, positions in zip(self._updates, self._gradient_optimizers, self._positions)
        ]
        if self._dynamic_batch:
            mark_batch_dynamic(x, y)
        with self._trace_autograd_ops:
            loss, e_step, natural_done = self._function(x, y, draws, e_step_lr, rates)
        if self._cuda_graphs:  # the graph's output memory is overwritten by its next replay
            loss = loss.clone()
        for optimizer, group_scales in zip(self._gradient_optimizers, scales, strict=True):
            if group_scales is not None:
                optimizer.keep_function_scales(group_scales)
        mark_stepped(self.optimizers)
        e_step_done = None
        if self._e_step is not None:
            e_step_done, *sites = e_step
            self._e_step.keep(*sites)
            # What the eager E-step leaves behind: no cached factors of the old sites.
            self.model.variational_strategy._clear_cache()
            self._e_step.e_step._last_factors = None
        if not math.isfinite(loss.item()):
            raise RuntimeError(
                "the training step's loss is not finite (e.g. a kernel matrix that is not positive definite even "
                "with the largest jitter); the parameters were updated with non-finite values."
            )
        if natural_done is not None and not natural_done:
            raise RuntimeError(
                "MeanBasisAdam: the decoupled strategy's step is not finite; its mean coefficients, precision factor "
                "and the optimizer's state were not changed (the other updates were applied)."
            )
        if e_step_done is not None and not e_step_done:
            raise RuntimeError(
                "the E-step's targets were not finite or its new sites would make q(u) not positive definite; the "
                "sites were not changed (the M-step's update was applied)."
            )
        return loss


def unsupported_torch() -> str | None:
    """Why this torch cannot run the lean (and compiled) steps, or None when it can: they are tested with torch 2.11
    and 2.13; torch 2.5 lacks Dynamo's ``trace_autograd_ops`` and breaks their graphs."""
    if torch.__version__ < (2, 11):
        return f"torch {torch.__version__} (the lean and compiled steps need torch >= 2.11)"
    return None


def _unsupported(mll, e_steps: list, gradient_optimizers: list) -> str | None:
    """Why the lean path cannot take this step, or None when it can."""
    reason = unsupported_torch()
    if reason is not None:
        return reason
    reason = next((r for r in map(unsupported_optimizer, gradient_optimizers) if r is not None), None)
    if reason is None:
        reason = LeanELBO.unsupported(mll)
    if reason is not None:
        return reason
    strategy = mll.model.variational_strategy
    for optimizer in gradient_optimizers:
        if any(stepped is not strategy for stepped in natural_strategies(optimizer).values()):
            return "MeanBasisAdam stepping a decoupled strategy other than the objective's model's"
    for number, optimizer in enumerate(gradient_optimizers):
        # Its rate is computed from the kernel before the compiled region: no earlier optimizer may move the kernel.
        if type(optimizer) is MeanBasisAdam and any(
            type(o) is not gpytorch.optim.NGD for o in gradient_optimizers[:number]
        ):
            return "MeanBasisAdam after an optimizer other than NGD (its rate reads the kernel after their steps)"
    dual = type(mll.model.variational_strategy) is DualVariationalStrategy
    if len(e_steps) > 1 or (e_steps and not dual):
        return "DualEStep other than one, for a DualVariationalStrategy"
    if dual and not e_steps:
        return "a DualVariationalStrategy without its DualEStep among the optimizers (its sites move only by E-steps)"
    return LeanEStep.unsupported(e_steps[0], mll) if e_steps else None


def batch_size_is_dynamic(compile_options: dict) -> bool:
    """Whether a compiled step takes the batch size as a dynamic dimension from its first compilation: unless
    ``dynamic=False`` is asked for, or CUDA graphs are (they are recorded, and were tested, for static shapes)."""
    return compile_options.get("dynamic", None) is not False and not _uses_cuda_graphs(compile_options)


def mark_batch_dynamic(x: Tensor, y: Tensor) -> None:
    r"""Marks the data dimension of a step's mini-batch (``x``'s second to last, ``y``'s first after ``x``'s batch
    dimensions) as dynamic, so that one compilation serves
    every batch size: a loader's last, smaller batch (``drop_last=False``, its default) would otherwise compile the
    step again, with the size dynamic then (16-20 s for OrthNat on this project's CPU). The dynamic graph's steps cost
    what the static graph's do (kin40k, M = 200, batch 256, in lockstep: FastNatural SVGP 7.45 against 7.43 ms, OrthNat
    10.73 against 10.68 ms). ``maybe``: a size the graph must specialize on stays static, without an error."""
    data_dimension = x.dim() - 2
    torch._dynamo.maybe_mark_dynamic(x, data_dimension)
    torch._dynamo.maybe_mark_dynamic(y, data_dimension)


def mark_stepped(optimizers) -> None:
    """Marks the optimizers as stepped, as their ``step()`` does under a learning-rate scheduler (PyTorch's schedulers
    wrap ``step`` to set this flag, and warn that ``scheduler.step()`` came first where it is not set)."""
    for optimizer in optimizers:
        optimizer._opt_called = True


def _uses_cuda_graphs(compile_options: dict) -> bool:
    """Whether :func:`torch.compile` with these options captures CUDA graphs (on a GPU)."""
    options = compile_options.get("options") or {}
    return compile_options.get("mode") in ("reduce-overhead", "max-autotune") or bool(options.get("triton.cudagraphs"))


def _updated_in_place(optimizers: list, *modules: torch.nn.Module) -> list[Tensor]:
    """The tensors other than parameters that a step may update in place: the optimizers' state and the modules'
    buffers."""
    states = [
        value
        for optimizer in optimizers
        for state in getattr(optimizer, "state", {}).values()
        for value in state.values()
        if isinstance(value, Tensor)
    ]
    return [*states, *(buffer for module in modules for buffer in module.buffers())]


def _parameter_ids(*modules: torch.nn.Module) -> tuple[int, ...]:
    """The identities of the modules' parameters, in order."""
    return tuple(id(parameter) for module in modules for parameter in module.parameters())


def _signature(*tensors: Tensor) -> tuple:
    """The types, shapes, dtypes and devices of tensors (None in place of anything that is not a tensor)."""
    return tuple(
        (type(tensor), tensor.shape, tensor.dtype, tensor.device) if isinstance(tensor, Tensor) else None
        for tensor in tensors
    )


def warn_fallback(reason: str, path: str, eager: str) -> None:
    """The one warning of a step that runs eagerly because ``path`` does not support ``reason``."""
    warnings.warn(
        f"compile_training_step: {reason} is not supported by {path}; the step runs eagerly {eager}.",
        UserWarning,
        stacklevel=4,
    )


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
