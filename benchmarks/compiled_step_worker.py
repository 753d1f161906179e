"""One configuration of ``bench compiled-step`` in its own process: ``python -m benchmarks.compiled_step_worker
CONFIG DATA SECONDS WARMUP``. Builds the model from the shared data file (the same inputs, inducing inputs and batch
order for every configuration and framework), times the first step (the compilation, for compiled steps), takes
``WARMUP`` more steps, then steps for ``SECONDS`` and prints one JSON line (``benchmarks/peers/timing.py``: step times
in process CPU time and wall-clock time)."""

from __future__ import annotations

import functools
import json
import os
import sys

import numpy as np
import torch

from benchmarks.peers.timing import time_steps

#: Modes: ``eager`` (GPyTorch's general path, as a user's loop runs it), ``lean`` (the lean step of
#: :class:`~gpytorch_decoupled.training.TrainingStep` without compiling: ``compile=False``) and ``compiled``.
TORCH_CONFIGS = (
    "gpytorch-svgp-adam",
    "gpytorch-svgp-adam-lean",
    "gpytorch-svgp-adam-compiled",
    "ours-svgp-natural-eager",
    "ours-svgp-natural-lean",
    "ours-svgp-natural-compiled",
    "ours-orthnat-eager",
    "ours-orthnat-lean",
    "ours-orthnat-compiled",
    "ours-tsvgp-eager",
    "ours-tsvgp-lean",
    "ours-tsvgp-compiled",
    "ours-decoupled-eager",
    "ours-decoupled-lean",
    "ours-decoupled-compiled",
    "ours-vbks-eager",
    "ours-vbks-lean",
    "ours-vbks-compiled",
)


def make_step(config: str, train_x, train_y, inducing, mean_inducing, likelihood: str = "gaussian"):
    """The step function ``step(x, y)`` of a configuration: ``FAMILY-MODE`` with the modes above and ``graphs``
    (compiled with ``mode="reduce-overhead"``: CUDA graphs on a GPU), or ``gpytorch-svgp-adam`` /
    ``gpytorch-largebatch-adam`` (GPyTorch's own eager step with its ``VariationalStrategy`` /
    ``LargeBatchVariationalStrategy``). ``likelihood="bernoulli"`` gives the SVGP, OrthNat and t-SVGP configurations
    GPyTorch's probit ``BernoulliLikelihood`` (the targets are labels), and refuses the others."""
    import gpytorch

    from benchmarks.methods.svgp_method import SVGPMethod
    from gpytorch_decoupled.training import TrainingStep

    family, _, mode = config.rpartition("-")
    if config in ("gpytorch-svgp-adam", "gpytorch-largebatch-adam"):  # GPyTorch's own eager step
        family, mode = config, "general"
    classes = {}  # the likelihood of the methods that take one
    if likelihood == "bernoulli":
        if family not in (
            "gpytorch-svgp-adam",
            "gpytorch-largebatch-adam",
            "ours-svgp-natural",
            "ours-orthnat",
            "ours-tsvgp",
        ):
            raise ValueError(f"{config} is not measured with a Bernoulli likelihood")
        classes = {"likelihood": gpytorch.likelihoods.BernoulliLikelihood()}
    if family in ("gpytorch-svgp-adam", "gpytorch-largebatch-adam", "ours-svgp-natural"):
        # GPyTorch's SVGP (Cholesky q(u), Adam on everything: GPflow's SVGP-Adam model) or FastNatural + NGD + Adam
        natural = family == "ours-svgp-natural"
        strategy = gpytorch.variational.VariationalStrategy
        if family == "gpytorch-largebatch-adam":
            strategy = gpytorch.variational.LargeBatchVariationalStrategy
        method = SVGPMethod(
            train_x,
            train_y,
            num_inducing=inducing.size(0),
            natural=natural,
            fast_natural=natural,
            strategy_cls=strategy,
            **classes,
        )
        with torch.no_grad():  # the shared inducing inputs (the method draws its own with the same seed)
            method.model.variational_strategy.inducing_points.copy_(inducing)
        mll, optimizers = method.mll, method.optimizers
        if mode == "general":
            return TrainingStep(mll, optimizers, lean=False)
    elif family == "ours-orthnat":
        from benchmarks.methods.orthogonal_method import OrthogonalMethod

        # Plain Adam on a_gamma in eager and compiled form alike (the configuration compiled-step.json measured).
        method = OrthogonalMethod(
            train_x,
            train_y,
            num_inducing=inducing.size(0),
            num_mean_inducing=mean_inducing.size(0),
            mean_rule="adam",
            **classes,
        )
        strategy = method.model.variational_strategy
        with torch.no_grad():  # the shared inducing inputs (the method draws its own with the same seed)
            strategy.inducing_points.copy_(inducing)
            strategy.mean_inducing_points.copy_(mean_inducing)
        mll, optimizers = method.mll, method.optimizers
    elif family == "ours-decoupled":
        from benchmarks.methods.decoupled_method import DecoupledMethod

        # MeanBasisAdam's curvature step on (a, L_B) and Adam on the rest; the mean basis alpha is OrthNat's gamma.
        method = DecoupledMethod(
            train_x, train_y, num_inducing=inducing.size(0), num_mean_inducing=mean_inducing.size(0)
        )
        strategy = method.model.variational_strategy
        with torch.no_grad():  # the shared inducing inputs (the method draws its own with the same seed)
            strategy.inducing_points.copy_(inducing)
            strategy.mean_inducing_points.copy_(mean_inducing)
        mll, optimizers = method.mll, method.optimizers
    elif family == "ours-vbks":
        return _kernel_selection_step(config, train_x, train_y, inducing, mode)
    elif family == "ours-tsvgp":
        from benchmarks.methods.dual_method import DualMethod

        method = DualMethod(train_x, train_y, num_inducing=inducing.size(0), inducing_points=inducing, **classes)
        if mode == "eager":
            return method.step
        lean = _lean_step(config, method.mll, method.step_optimizers, mode)

        def iteration(x, y):  # the default schedule's E-step size, then the lean (compiled) E-step + M-step
            method.advance_schedule()
            return lean(x, y)

        return iteration
    else:
        raise ValueError(f"unknown configuration {config!r}")
    if mode == "eager":
        return TrainingStep(mll, optimizers, lean=False)
    return _lean_step(config, mll, optimizers, mode)


def _lean_step(config: str, mll, optimizers, mode: str):
    from gpytorch_decoupled.training import TrainingStep

    return _checked_step(config, mode, functools.partial(TrainingStep, mll, optimizers))


def _checked_step(config: str, mode: str, make_step):
    """``make_step(compile=..., **options)`` for ``mode`` (CUDA graphs for ``graphs``), refused where a lean or
    compiled mode would fall back: it would time the eager step under the lean or compiled name."""
    options = {"mode": "reduce-overhead"} if mode == "graphs" else {}
    step = make_step(compile=mode in ("compiled", "graphs"), **options)
    if mode != "eager" and step.fallback_reason is not None:
        raise RuntimeError(f"{config} does not take the lean path: {step.fallback_reason}")
    return step


def _kernel_selection_step(config: str, train_x, train_y, inducing, mode: str):
    """VBKS's step (:class:`~gpytorch_decoupled.training.KernelSelectionStep`) over the 15 kernels of at most one
    operator over SE, RQ and LIN with ARD (``bench kernel-selection``'s elevators space), all at the shared inducing
    inputs (fixed, as VBKS keeps them), Adam at 0.01 on every candidate's parameters."""
    from gpytorch_decoupled.kernels import KernelSpace
    from gpytorch_decoupled.models import KernelSelectionGP
    from gpytorch_decoupled.training import KernelSelectionStep

    space = KernelSpace.enumerate(base=("SE", "RQ", "LIN"), max_operators=1)
    model = KernelSelectionGP(space, inducing.clone(), ard_num_dims=train_x.size(-1)).to(train_x)
    parameters = [p for name, p in model.named_parameters() if not name.startswith("kernel_belief.")]
    adam = torch.optim.Adam(parameters, lr=0.01)
    make_step = functools.partial(KernelSelectionStep, model, adam, train_y.numel(), lean=mode != "eager")
    return _checked_step(config, mode, make_step)


def run(config: str, data_path: str, seconds: float, warmup: int) -> dict:
    torch.set_num_threads(1)
    data = np.load(data_path)
    dtype = torch.float32
    train_x, train_y = torch.as_tensor(data["train_x"], dtype=dtype), torch.as_tensor(data["train_y"], dtype=dtype)
    inducing = torch.as_tensor(data["inducing"], dtype=dtype)
    mean_inducing = torch.as_tensor(data["mean_inducing"], dtype=dtype)
    order = torch.as_tensor(data["batches"])
    likelihood = str(data["likelihood"]) if "likelihood" in data else "gaussian"
    step = make_step(config, train_x, train_y, inducing, mean_inducing, likelihood)
    batches = [(train_x[index], train_y[index]) for index in order]

    def batch(i: int):
        return batches[i % len(batches)]

    return time_steps(config, lambda i: step(*batch(i)), seconds, warmup)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config, data_path, seconds, warmup = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run(config, data_path, seconds, warmup)))
