"""One configuration of ``bench compiled-step`` in its own process: ``python -m benchmarks.compiled_step_worker
CONFIG DATA SECONDS WARMUP``. Builds the model from the shared data file (the same inputs, inducing inputs and batch
order for every configuration and framework), times the first step (the compilation, for compiled steps), takes
``WARMUP`` more steps, then steps for ``SECONDS`` and prints one JSON line: the first step's seconds and the median,
10th and 90th percentile step times (ms) of the timed steps."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

TORCH_CONFIGS = (
    "gpytorch-svgp-adam",
    "ours-svgp-natural-eager",
    "ours-svgp-natural-compiled",
    "ours-orthnat-eager",
    "ours-orthnat-compiled",
    "ours-tsvgp-eager",
)


def _svgp(train_x, train_y, inducing, natural: bool, lr: float = 0.01, ngd_lr: float = 0.1):
    import gpytorch

    from benchmarks.methods.approximate_regression_model import ApproximateRegressionModel
    from gpytorch_decoupled.variational import FastNaturalVariationalDistribution

    distribution_cls = (
        FastNaturalVariationalDistribution if natural else gpytorch.variational.CholeskyVariationalDistribution
    )

    def make_strategy(model):
        return gpytorch.variational.VariationalStrategy(model, inducing, distribution_cls(inducing.size(0)))

    model = ApproximateRegressionModel(make_strategy, train_x.size(-1)).to(train_x)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(train_x)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=train_y.size(0))
    if natural:
        optimizers = [
            gpytorch.optim.NGD(model.variational_parameters(), num_data=train_y.size(0), lr=ngd_lr),
            torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=lr),
        ]
    else:
        optimizers = [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)]
    return mll, optimizers


def make_step(config: str, train_x, train_y, inducing, mean_inducing):
    """The step function ``step(x, y)`` of a configuration."""
    from gpytorch_decoupled.training import TrainingStep, compile_training_step

    family, _, mode = config.rpartition("-")
    if family == "gpytorch-svgp":
        mll, optimizers = _svgp(train_x, train_y, inducing, natural=False)
        return TrainingStep(mll, optimizers, lean=False)
    if family == "ours-svgp-natural":
        mll, optimizers = _svgp(train_x, train_y, inducing, natural=True)
    elif family == "ours-orthnat":
        from benchmarks.methods.orthogonal_method import OrthogonalMethod

        method = OrthogonalMethod(
            train_x, train_y, num_inducing=inducing.size(0), num_mean_inducing=mean_inducing.size(0)
        )
        strategy = method.model.variational_strategy
        with torch.no_grad():  # the shared inducing inputs (the method draws its own with the same seed)
            strategy.inducing_points.copy_(inducing)
            strategy.mean_inducing_points.copy_(mean_inducing)
        mll, optimizers = method.mll, method.optimizers
    elif family == "ours-tsvgp":
        from benchmarks.methods.dual_method import DualMethod

        method = DualMethod(train_x, train_y, num_inducing=inducing.size(0), inducing_points=inducing)
        return method.step  # no lean path: DualEStep is not an optimizer of the ELBO (falls back to eager)
    else:
        raise ValueError(f"unknown configuration {config!r}")
    if mode == "eager":
        return TrainingStep(mll, optimizers, lean=False)
    step = compile_training_step(mll, optimizers)
    if step.fallback_reason is not None:  # it would time the eager step under the compiled name
        raise RuntimeError(f"{config} is not compiled: {step.fallback_reason}")
    return step


def run(config: str, data_path: str, seconds: float, warmup: int) -> dict:
    torch.set_num_threads(1)
    data = np.load(data_path)
    dtype = torch.float32
    train_x, train_y = torch.as_tensor(data["train_x"], dtype=dtype), torch.as_tensor(data["train_y"], dtype=dtype)
    inducing = torch.as_tensor(data["inducing"], dtype=dtype)
    mean_inducing = torch.as_tensor(data["mean_inducing"], dtype=dtype)
    order = torch.as_tensor(data["batches"])
    step = make_step(config, train_x, train_y, inducing, mean_inducing)
    batches = [(train_x[index], train_y[index]) for index in order]

    def batch(i: int):
        return batches[i % len(batches)]

    start = time.perf_counter()
    step(*batch(0))
    first = time.perf_counter() - start
    for i in range(1, warmup + 1):
        step(*batch(i))
    times = []
    i = warmup + 1
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        step(*batch(i))
        times.append(time.perf_counter() - start)
        i += 1
    ms = np.array(times) * 1e3
    return {
        "config": config,
        "first_step_s": first,
        "step_ms": float(np.median(ms)),
        "step_ms_p10": float(np.percentile(ms, 10)),
        "step_ms_p90": float(np.percentile(ms, 90)),
        "steps": len(times),
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config, data_path, seconds, warmup = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run(config, data_path, seconds, warmup)))
