r"""
The update of each supported optimizer as a function of the gradients (instead of ``.grad``), so that a compiled
training step computes gradients with :func:`torch.autograd.grad` and applies every update in the same graph.
:meth:`torch.optim.Optimizer.step` cannot be captured there: it graph-breaks on purpose to switch grad mode
(pytorch/pytorch#104053) and on parameters whose ``.grad`` the graph assigned. Each update reproduces the optimizer's
own eager step (the same arithmetic, the same state in ``optimizer.state``), so a compiled step and
``optimizer.step()`` can alternate freely. Every group's learning rate enters the graph as a tensor, read before the
compiled region at every step (:func:`group_rates`), so that a learning-rate scheduler changes no constant of the graph
and never recompiles it; :class:`~gpytorch_decoupled.optim.MeanBasisAdam`'s rate is divided there by its function
scale, estimated from random kernel evaluations, as its ``step()`` computes it. The other hyperparameters (Adam's
``betas``, ``eps``, ``weight_decay``, ``maximize``, SGD's ``momentum``, ``nesterov``, ``weight_decay``, NGD's
``num_data``) are constants of the graph: changing one
recompiles the step once per new value (and after ``torch._dynamo.config.recompile_limit`` values the step runs
eagerly).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import gpytorch
import torch
from torch import Tensor

from ..linalg import LeanKernel
from ..optim import MeanBasisAdam
from ..optim.mean_basis_adam import NATURAL_STATE
from ..variational import DecoupledCurvature, DecoupledVariationalStrategy, JointPrior

# An update takes the gradients of all the step's parameters, its optimizer's rates, one per parameter group (a float64
# tensor: group_rates), and the step's DecoupledCurvature (None where no optimizer reads it); it returns a boolean
# tensor that is False where a decoupled strategy's step was not finite (and not applied), or None.
Update = Callable[[Sequence[Tensor | None], Tensor, DecoupledCurvature | None], Tensor | None]


def unsupported_optimizer(optimizer) -> str | None:
    """Why the compiled step cannot apply ``optimizer``'s update, or None when it can."""
    kind = type(optimizer)
    if kind is gpytorch.optim.NGD:
        return None
    if kind not in (torch.optim.Adam, MeanBasisAdam, torch.optim.SGD):
        return (
            f"{kind.__name__} (supported: torch.optim.Adam, torch.optim.SGD, gpytorch.optim.NGD, MeanBasisAdam, "
            "DualEStep)"
        )
    name = "torch.optim.SGD" if kind is torch.optim.SGD else "torch.optim.Adam"
    for group in optimizer.param_groups:
        option = _unsupported_option(kind, group)
        if option is not None:
            return f"{name} with {option}"
    return None


def _unsupported_option(kind: type, group: dict) -> str | None:
    """The option of a parameter group of an Adam or SGD optimizer whose update the compiled step does not reproduce,
    or None."""
    if group["differentiable"] or group["fused"] or isinstance(group["lr"], Tensor):
        return "differentiable=True, fused=True or a tensor lr"
    if any(parameter.is_complex() for parameter in group["params"]):
        return "complex parameters"
    if kind is torch.optim.SGD:
        # its first step copies the gradient into the momentum buffer: a zero buffer is the same only without dampening
        return "momentum and dampening" if group["momentum"] != 0 and group["dampening"] != 0 else None
    if group["amsgrad"]:
        return "amsgrad=True"
    if group.get("decoupled_weight_decay", False):
        return "decoupled_weight_decay=True"
    return None


def group_rates(optimizer, function_scales: Sequence[Tensor] | None = None) -> list[float]:
    r"""The learning rate of each of ``optimizer``'s parameter groups for this step, as its ``step()`` would use it:
    the group's ``lr``, divided by the group's function scale for :class:`~gpytorch_decoupled.optim.MeanBasisAdam`
    (``function_scales``, from its :meth:`~gpytorch_decoupled.optim.MeanBasisAdam.smoothed_function_scales`; None for
    the group of a decoupled strategy, whose rate is its Gauss-Newton step's)."""
    if function_scales is None:
        function_scales = [None] * len(optimizer.param_groups)
    return [
        float(group["lr"]) if scale is None else group["lr"] / float(scale)  # a decoupled strategy's group: no scale
        for group, scale in zip(optimizer.param_groups, function_scales, strict=True)
    ]


def rate_tensor(optimizers: Sequence, function_scales: Sequence, device: torch.device) -> Tensor:
    """Every group's rate of ``optimizers``, in order (:func:`group_rates`, with each optimizer's function scales or
    None), as one float64 tensor: the step's rates, data of its graph."""
    rates = [
        rate
        for optimizer, scales in zip(optimizers, function_scales, strict=True)
        for rate in group_rates(optimizer, scales)
    ]
    return torch.tensor(rates, dtype=torch.float64, device=device)


def optimizer_update(optimizer, positions: list[list[int]], kernel: LeanKernel | None = None) -> Update:
    r"""
    The update of ``optimizer`` as a function of the gradients of all the step's parameters, where ``positions[g][i]``
    is the index of parameter ``i`` of group ``g`` among them. Creates the optimizer's state now where it has none
    (exactly as its first ``step()`` would, or as zeros that its first step reads as it reads no state), so that the
    compiled region only reads and updates it. ``kernel`` is the model's lean kernel: the decoupled step of a
    :class:`~gpytorch_decoupled.optim.MeanBasisAdam` evaluates its kernel blocks with it.

    The update reads the optimizer's ``param_groups`` and ``state`` through references taken here, never through the
    optimizer object: Dynamo guards every entry of the groups of an optimizer it traces, the learning rates too, which
    would recompile the step at every change of a rate. :meth:`torch.optim.Optimizer.load_state_dict` replaces both
    objects: :func:`current_update` then builds the update again.
    """
    if type(optimizer) is gpytorch.optim.NGD:
        update = _ngd_update(optimizer.param_groups, optimizer.num_data, positions)
    elif type(optimizer) is MeanBasisAdam:
        update = _mean_basis_adam_update(optimizer, positions, kernel)
    elif type(optimizer) is torch.optim.SGD:
        update = _sgd_update(optimizer.param_groups, optimizer.state, positions)
    else:
        update = _adam_update(optimizer.param_groups, optimizer.state, positions)
    update.sources = (optimizer.param_groups, optimizer.state)
    update.kernel = kernel
    return update


def current_update(update: Update, optimizer, positions: list[list[int]]) -> Update:
    """``update`` (:func:`optimizer_update`) if it still reads ``optimizer``'s groups and state, else the update built
    again from them (after the optimizer's ``load_state_dict``; a compiled step then recompiles once)."""
    groups, state = update.sources
    if groups is optimizer.param_groups and state is optimizer.state:
        return update
    return optimizer_update(optimizer, positions, update.kernel)


def natural_strategies(optimizer) -> dict[int, DecoupledVariationalStrategy]:
    """The decoupled strategies that a :class:`~gpytorch_decoupled.optim.MeanBasisAdam` steps by their curvature, by
    the number of their parameter group (none for other optimizers)."""
    if type(optimizer) is not MeanBasisAdam:
        return {}
    return {
        number: strategy
        for number, strategy in enumerate(optimizer.strategies)
        if isinstance(strategy, DecoupledVariationalStrategy)
    }


def _mean_basis_adam_update(optimizer: MeanBasisAdam, positions: list[list[int]], kernel: LeanKernel | None) -> Update:
    """:class:`~gpytorch_decoupled.optim.MeanBasisAdam`'s step: the decoupled step of each decoupled strategy's
    group (computed before the others change anything, as its ``step()`` does) and Adam on the other groups."""
    natural = natural_strategies(optimizer)
    adam = _adam_update(
        optimizer.param_groups, optimizer.state, positions, [n for n in range(len(positions)) if n not in natural]
    )
    steps = [
        _decoupled_update(
            optimizer.param_groups[number], optimizer.state, positions[number][0], strategy, kernel, number
        )
        for number, strategy in natural.items()
    ]

    def update(
        gradients: Sequence[Tensor | None], rates: Tensor, curvature: DecoupledCurvature | None
    ) -> Tensor | None:
        new_values = [step(gradients, rates, curvature) for step in steps]
        adam(gradients, rates, curvature)
        finite = None
        for store in new_values:
            if store is not None:
                done = store()
                finite = done if finite is None else finite & done
        return finite

    return update


def _decoupled_update(
    group: dict, states: dict, index: int, strategy: DecoupledVariationalStrategy, kernel: LeanKernel, number: int
):
    r"""The decoupled step of one strategy (MeanBasisAdam's, :ref:`derivations-decoupled-step`) as a function of the
    gradients, rates and curvature: it computes the new :math:`\mathbf a`, :math:`\mathbf L_B` and state without
    changing anything, and returns the function that stores them where all are finite (else nothing changes) and
    returns whether they were."""
    parameter = group["params"][0]
    distribution = strategy._variational_distribution
    state = states[parameter]
    if "step" not in state:  # zeros read as no state: the first step's running averages start from zero either way
        f64 = torch.float64
        batch = distribution.precision_factor.shape[:-2]
        size = distribution.precision_factor.size(-1)
        device = parameter.device
        state["step"] = torch.zeros((), dtype=f64, device=device)
        state["mean_precision"] = torch.zeros(*batch, size, size, dtype=f64, device=device)
        state["residual_curvature"] = torch.zeros(parameter.shape, dtype=f64, device=device)
        state["step_size"] = torch.zeros(batch, dtype=f64, device=device)
    sampled_kl = not strategy.mean_basis.exact_in_training()
    if sampled_kl and "kl_residual_gradient" not in state:  # NaN: no average of the sampled KL's gradient yet
        state["kl_residual_gradient"] = torch.full_like(parameter, float("nan"), dtype=torch.float64)
    prior_blocks = functools.partial(JointPrior.of_kernel, kernel)

    def step(gradients: Sequence[Tensor | None], rates: Tensor, curvature: DecoupledCurvature | None):
        gradient = gradients[index]
        if gradient is None:
            return None
        previous = {key: value for key, value in state.items() if key in NATURAL_STATE}
        new_a, new_factor, new_state = MeanBasisAdam.decoupled_step(
            strategy,
            curvature,
            gradient,
            rates[number],
            group["covariance_lr"],
            group["damping"],
            previous,
            prior_blocks,
        )

        def store() -> Tensor:
            finite = torch.isfinite(new_a).all() & torch.isfinite(new_factor).all()
            stored = [(distribution.mean_coefficients, new_a), (distribution.precision_factor, new_factor)]
            stored += [(state[key], value) for key, value in new_state.items()]
            for target, value in stored:
                # through flat views: see _adam_parameter_update
                target.view(-1).copy_(torch.where(finite, value.to(target.dtype), target).reshape(-1))
            return finite

        return store

    return step


def _ngd_update(param_groups: list[dict], num_data: int, positions: list[list[int]]) -> Update:
    def update(gradients: Sequence[Tensor | None], rates: Tensor, curvature=None) -> None:
        for number, indices in enumerate(positions):
            group = param_groups[number]
            step = rates[number] * num_data
            for parameter, index in zip(group["params"], indices):
                if gradients[index] is not None:
                    # through a flat view: see _adam_parameter_update
                    parameter.view(-1).sub_(gradients[index].reshape(-1) * step)

    return update


def _sgd_update(param_groups: list[dict], states: dict, positions: list[list[int]]) -> Update:
    r""":class:`torch.optim.SGD`'s step (its single-tensor loop: L2 weight decay, momentum, Nesterov, ``maximize``).
    The momentum buffer is created here as zeros where the optimizer has none: SGD's first step copies the gradient
    into it, which a zero buffer without dampening (:func:`unsupported_optimizer`) gives as well."""
    for group in param_groups:
        if group["momentum"] != 0:
            for parameter in group["params"]:
                state = states[parameter]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)

    def update(gradients: Sequence[Tensor | None], rates: Tensor, curvature=None) -> None:
        for number, indices in enumerate(positions):
            group = param_groups[number]
            momentum = group["momentum"]
            for parameter, index in zip(group["params"], indices):
                gradient = gradients[index]
                if gradient is None:
                    continue
                # through flat views: see _adam_parameter_update
                gradient = gradient.reshape(-1)
                if group["maximize"]:
                    gradient = -gradient
                if group["weight_decay"] != 0:
                    gradient = gradient.add(parameter.view(-1), alpha=group["weight_decay"])
                if momentum != 0:
                    buffer = states[parameter]["momentum_buffer"].view(-1)
                    buffer.mul_(momentum).add_(gradient, alpha=1 - group["dampening"])
                    gradient = gradient.add(buffer, alpha=momentum) if group["nesterov"] else buffer
                parameter.view(-1).sub_(gradient * rates[number])

    return update


def _adam_update(
    param_groups: list[dict], states: dict, positions: list[list[int]], numbers: list[int] | None = None
) -> Update:
    """Adam's step on the groups ``numbers`` (default: all)."""
    numbers = range(len(param_groups)) if numbers is None else numbers
    for group in (param_groups[number] for number in numbers):
        capturable = group["capturable"] or any(parameter.device.type != "cpu" for parameter in group["params"])
        for parameter in group["params"]:
            state = states[parameter]
            if len(state) == 0:
                # What Adam's _init_group creates on a parameter's first step.
                step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                step_device = parameter.device if capturable else torch.device("cpu")
                state["step"] = torch.zeros((), dtype=step_dtype, device=step_device)
                state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)

    def update(gradients: Sequence[Tensor | None], rates: Tensor, curvature=None) -> None:
        for number in numbers:
            indices = positions[number]
            group = param_groups[number]
            beta1, beta2 = group["betas"]
            lr = rates[number]
            for parameter, index in zip(group["params"], indices):
                gradient = gradients[index]
                if gradient is None:
                    continue
                _adam_parameter_update(parameter, gradient, states[parameter], group, lr, beta1, beta2)

    return update


def _adam_parameter_update(parameter: Tensor, gradient: Tensor, state: dict, group: dict, lr, beta1, beta2) -> None:
    r"""
    :class:`torch.optim.Adam`'s single-tensor step (Kingma & Ba 2015, Algorithm 1, with its L2 weight decay and
    ``maximize``) with the step count kept as a tensor: the bias corrections are computed from it in float64, as the
    eager step computes them from a Python number, so the compiled graph does not depend on the step count.
    (``torch.optim.adam.adam`` itself, traced, returns different values for some parameters under AOTAutograd in
    torch 2.13, so the update is written out here.)
    """
    # In-place updates go through flat views: torch 2.13 under AOTAutograd drops in-place updates of 0-dim graph inputs
    # that are not parameters (here Adam's state of a scalar parameter), but keeps those made through a view.
    gradient = gradient.reshape(-1)
    if group["maximize"]:
        gradient = -gradient
    if group["weight_decay"] != 0:
        gradient = gradient.add(parameter.view(-1), alpha=group["weight_decay"])
    step, exp_avg, exp_avg_sq = state["step"].view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    step.add_(1)
    exp_avg.lerp_(gradient, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient.conj(), value=1 - beta2)
    count = step.to(torch.float64)
    bias_correction1 = 1 - beta1**count
    bias_correction2_sqrt = (1 - beta2**count).sqrt()
    denominator = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
    parameter.view(-1).sub_((lr / bias_correction1) * exp_avg / denominator)
