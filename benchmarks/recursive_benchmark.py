"""``bench recursive``: the Kalman-recursive sparse GP and SRGP (this package) against GPyTorch's SVGP.

Three parts, one process, float64, mini-batches of 1,000, :math:`M = 100` inducing points everywhere. SRGP is
:class:`~benchmarks.methods.RecursiveMethod` (VFE, one Adam step per mini-batch with the gradient of
:class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation`, the Jacobians of every hyperparameter and of the
inducing inputs propagated, an epoch restarted every :math:`\\lceil N/B\\rceil` steps, a clean ``update`` pass at the
current hyperparameters before every prediction); SVGP is GPyTorch's whitened ``VariationalStrategy`` with a
``CholeskyVariationalDistribution`` and Adam on everything. Both start from the same inducing inputs (a seeded draw of
training rows) and GPyTorch's default hyperparameters, see the same mini-batches (trained in lockstep, one step of each
in turn, so that a change of load on the shared cores slows both alike) and use the same learning rate.

1. **Streaming** (fixed hyperparameters). One pass of ``KalmanVariationalStrategy.update`` over
   :math:`N = 10^4, 10^5, 10^6` synthetic points (:math:`D = 2`): :math:`\\mathbf x` uniform on :math:`[-1, 1]^2`,
   :math:`y` a random-Fourier-feature draw of an SE GP (:math:`\\ell = 0.5`, :math:`\\sigma_0 = 1`, 512 features)
   plus noise :math:`\\sigma_n = 0.1`, each mini-batch generated when it is absorbed (the data are never held), at the
   generating hyperparameters. The time of the updates must grow linearly in :math:`N` and the peak memory stay flat.
   Each size is run twice from one seed: a timed pass and a pass under the peak-memory meter (whose sampling thread
   would otherwise share the cores). On a CPU the time is the CPU time of the updates (``time.thread_time``), which
   jobs sharing the cores do not inflate; the wall-clock ratio is recorded too. The smallest size's bound is checked
   against GPyTorch's collapsed SGPR.
2. **CSTR** (Schürch et al. 2020, Sec. 5.3, Fig. 9). The paper's plant, MATLAB's ``predcstr`` example, is simulated
   (:mod:`~benchmarks.cstr_plant`: RK4, 4 substeps per 0.2 s hold interval, from the steady state for
   :math:`w_1 = 1`, 1,000 s burn-in, :math:`\\sigma_n = 0.1`) for :math:`10^6 + 2\\cdot10^5` NARX rows
   :math:`\\mathbf x_t = [y_{t-1}, y_{t-2}, w_t, w_{t-1}, w_{t-2}]`; the training sets are the :math:`N` rows just
   before row :math:`10^6` and the test set the last :math:`2\\cdot10^5` rows. SRGP and SVGP are trained for the same
   number of epochs: enough for :math:`S = 600` steps, and at least 2 (so 600 epochs at :math:`N = 10^3`, 60 at
   :math:`10^4`, 6 at :math:`10^5`, 2 at :math:`10^6`; SRGP restarts its recursion at the start of an epoch only, and
   in a single epoch at :math:`10^6` its hyperparameters, after converging, drifted off again as the statistics of
   hundreds of mini-batches absorbed at older hyperparameters piled up); collapsed
   SGPR (batch VFE, :math:`M = 100`) up to :math:`5\\cdot10^4` rows and the exact GP up to 5,000 rows, each with 300
   full-batch Adam steps. Test RMSE (and median absolute error, NLL, 95% coverage) against the noisy targets in
   :math:`C_b` units.
3. **Epochs** (Sec. 5.1 and 5.2). Synthetic GP data in :math:`D = 1, 2, 5` (2,048 random Fourier features,
   :math:`\\ell = 0.1, 0.2, 0.5`, :math:`\\sigma_0 = 1`, :math:`\\sigma_n = 0.1`, 20,000 training and 10,000 test
   points uniform on :math:`[-1, 1]^D`) and kin40k and protein (split 0): the training objective (SRGP: the collapsed
   bound / N at the current hyperparameters; SVGP: the ELBO / N), test RMSE and 95% coverage after every epoch. Per
   data set, each method's epochs to convergence is the first epoch whose test RMSE is within 1% of SVGP's final
   RMSE (:math:`\\le 1.01\\times`); SRGP never reaching it counts as one epoch more than were run.

The shared run options apply as follows: ``--batch-size``, ``--seed``, ``--dtype``, ``--device``, ``--warmup`` and
``--no-progress`` to every part, ``--split``, ``--data-dir`` and ``--max-train-rows`` to the real data sets of part 3;
``--iterations``, ``--eval-every`` and ``--time-budget`` are not used (each part counts epochs).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled import datasets
from gpytorch_decoupled.mlls import StreamingCollapsedBound
from gpytorch_decoupled.variational import KalmanVariationalStrategy

from .benchmark import Benchmark
from .benchmark_parts import PartRunner, publish_parts, run_parts
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .cstr_plant import cstr_dataset
from .method_result import MethodResult
from .methods import ApproximateRegressionModel, ExactRegressionModel, Method, build_method
from .metrics import gaussian_test_metrics
from .orthogonal_speed_benchmark import _size_label
from .peak_memory_meter import PeakMemoryMeter
from .random_fourier_gp import RandomFourierGP, synthetic_batches, synthetic_rows
from .report import format_table, pyplot, save_figure
from .run_config import RunConfig
from .runner import split_tensors, timed_call, train_in_lockstep

NAME = "recursive"
PARTS = ("streaming", "cstr", "epochs")
OURS, BASELINE = "recursive", "svgp"
FULL_BATCH = ("sgpr", "exact")

STREAMING_TIME_GOAL = "streaming_time_growth_1e5_to_1e6"
STREAMING_MEMORY_GOAL = "streaming_peak_memory_1e6_vs_1e4"
CSTR_GOAL = "cstr_srgp_rmse_vs_svgp_max"
EPOCHS_GOAL = "epochs_to_converge_srgp_vs_svgp"

GOALS = {
    STREAMING_TIME_GOAL: 12.0,
    STREAMING_MEMORY_GOAL: 1.5,
    CSTR_GOAL: 1.0,
    EPOCHS_GOAL: 1.0,
}

RATIO_NOTES = {
    STREAMING_TIME_GOAL: (
        "streaming: CPU seconds (this thread; wall-clock on a GPU) of the updates of one pass at the largest ÷ the "
        "second largest N (10^6 ÷ 10^5 by default), fixed hyperparameters; linear growth gives their size ratio (10)"
    ),
    "streaming_time_growth_1e4_to_1e5": "the same for 10^5 ÷ 10^4; no goal",
    "streaming_wall_time_growth_1e5_to_1e6": (
        "the same as the goal in wall-clock seconds, which other jobs on shared cores inflate by whatever they run "
        "during each pass; no goal"
    ),
    STREAMING_MEMORY_GOAL: (
        "streaming: peak memory above the starting level over a whole pass at the largest ÷ the smallest N "
        "(10^6 ÷ 10^4 by default; the denominator is floored at 1 MB); flat memory gives 1"
    ),
    CSTR_GOAL: (
        "CSTR: the largest over the training sizes of SRGP's ÷ GPyTorch SVGP's test RMSE (same M, epochs, "
        "mini-batches and learning rate); the goal holds at every size (the paper's Fig. 9)"
    ),
    "cstr_srgp_rmse_vs_svgp_at_N": "the same ratio at one training size (key suffix); no goal",
    "cstr_srgp_median_error_vs_svgp_max": "the same for the median absolute test error; no goal",
    "cstr_srgp_rmse_vs_sgpr_max": (
        "CSTR: the largest over the sizes where batch VFE runs of SRGP's ÷ collapsed SGPR's test RMSE; no goal (the "
        "paper: SRGP equals VFE where VFE is feasible)"
    ),
    EPOCHS_GOAL: (
        "epochs: the largest over the data sets of SRGP's ÷ SVGP's epochs until the test RMSE is first within 1% of "
        "SVGP's final test RMSE; the goal holds on every data set"
    ),
    "epochs_to_converge_srgp_vs_svgp_on": "the same ratio on one data set (key suffix); no goal",
    "epochs_final_rmse_srgp_vs_svgp_max": (
        "epochs: the largest over the data sets of SRGP's ÷ SVGP's test RMSE after the last epoch; no goal"
    ),
}

#: What the CSTR part records of each method's final evaluation.
CSTR_METRICS = ("rmse", "median_abs_error", "nll", "coverage", "rmse_inside", "rmse_outside", "hyperparameters")

#: Length-scales of the synthetic GP data per input dimension (Schürch et al. 2020, Sec. 5.1).
SYNTHETIC_LENGTHSCALES = {1: 0.1, 2: 0.2, 5: 0.5}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=0, eval_every=1)
    parser.set_defaults(batch_size=1000, dtype="float64", warmup=1)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--num-inducing", type=int, default=100, help="M of every method")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate of SRGP and SVGP")
    parser.add_argument("--inducing-lr", type=float, default=None, help="SRGP's learning rate of Z (default: --lr)")
    parser.add_argument(
        "--propagate",
        choices=("full", "hyperparameters", "none"),
        default="full",
        help="SRGP's propagated Jacobians (hyperparameters: not of Z, which then gets the naive gradient)",
    )
    streaming = parser.add_argument_group("streaming (part 1)")
    streaming.add_argument("--stream-sizes", type=int, nargs="+", default=[10**4, 10**5, 10**6])
    streaming.add_argument("--stream-dims", type=int, default=2)
    streaming.add_argument("--stream-lengthscale", type=float, default=0.5)
    streaming.add_argument("--noise-std", type=float, default=0.1, help="noise of the synthetic data (parts 1, 3)")
    streaming.add_argument("--stream-features", type=int, default=512, help="random Fourier features of the stream")
    cstr = parser.add_argument_group("CSTR (part 2)")
    cstr.add_argument("--cstr-sizes", type=int, nargs="+", default=[10**3, 10**4, 10**5, 10**6])
    cstr.add_argument("--cstr-test-rows", type=int, default=200_000)
    cstr.add_argument("--cstr-noise-std", type=float, default=0.1)
    cstr.add_argument("--cstr-burn-in", type=float, default=1000.0, help="seconds of simulation discarded")
    cstr.add_argument("--cstr-min-steps", type=int, default=600, help="at least this many steps per size")
    cstr.add_argument("--cstr-max-epochs", type=int, default=600)
    cstr.add_argument(
        "--cstr-min-epochs",
        type=int,
        default=2,
        help="at least this many epochs per size (SRGP restarts its recursion only at an epoch's start)",
    )
    cstr.add_argument("--sgpr-max-rows", type=int, default=50_000, help="collapsed SGPR (batch VFE) up to this N")
    cstr.add_argument("--exact-max-rows", type=int, default=5_000, help="the exact GP up to this N")
    cstr.add_argument("--full-batch-iterations", type=int, default=300, help="Adam steps of SGPR and the exact GP")
    epochs = parser.add_argument_group("epochs (part 3)")
    epochs.add_argument("--epochs", type=int, default=25)
    epochs.add_argument("--fourier-features", type=int, default=2048, help="features of the synthetic GP draws")
    epochs.add_argument("--synthetic-dims", type=int, nargs="+", default=[1, 2, 5])
    epochs.add_argument("--synthetic-rows", type=int, default=20_000)
    epochs.add_argument("--synthetic-test-rows", type=int, default=10_000)
    epochs.add_argument("--datasets", nargs="+", default=["kin40k", "protein"])
    epochs.add_argument("--tolerance", type=float, default=0.01, help="within this fraction of SVGP's final RMSE")


def _method_options(args: argparse.Namespace) -> dict[str, dict]:
    return {
        OURS: {
            "num_inducing": args.num_inducing,
            "lr": args.lr,
            "inducing_lr": args.inducing_lr,
            "propagate": args.propagate,
        },
        BASELINE: {"num_inducing": args.num_inducing, "lr": args.lr},
        "sgpr": {"num_inducing": args.num_inducing},
        "exact": {},
    }


def regression_metrics(method: Method, x: Tensor, y: Tensor, y_std: float) -> dict[str, float]:
    """Test RMSE and NLL (original units), the 95% coverage of the predictive intervals of :math:`y` and the median
    absolute error (original units)."""
    mean, variance = method.predict(x)
    metrics = gaussian_test_metrics(mean, variance, y, y_std)
    residual = (y - mean).abs()
    metrics["coverage"] = residual.le(1.959963984540054 * variance.sqrt()).to(y.dtype).mean().item()
    metrics["median_abs_error"] = residual.median().item() * float(y_std)
    return metrics


def standardized_split(name: str, x: Tensor, y: Tensor, num_train: int, source: str) -> datasets.Split:
    """A :class:`~gpytorch_decoupled.datasets.Split` of the first ``num_train`` rows (training) and the rest (test),
    standardized with the training rows' mean and population standard deviation (as the data loaders do)."""
    train_x, train_y = x[:num_train], y[:num_train]
    x_mean, x_std = train_x.mean(0), train_x.std(0, unbiased=False)
    x_std = torch.where(x_std > 0, x_std, torch.ones_like(x_std))
    y_mean, y_std = train_y.mean(), train_y.std(unbiased=False)
    return datasets.Split(
        train_x=(train_x - x_mean) / x_std,
        train_y=(train_y - y_mean) / y_std,
        test_x=(x[num_train:] - x_mean) / x_std,
        test_y=(y[num_train:] - y_mean) / y_std,
        name=name,
        task="regression",
        split=0,
        source=source,
        x_mean=x_mean,
        x_std=x_std,
        y_mean=y_mean,
        y_std=y_std,
    )


def learned_hyperparameters(method: Method) -> dict:
    """The noise variance, the output scale and the length-scales of a method's scaled SE kernel (standardized
    units)."""
    kernel = next(module for module in method.model.modules() if isinstance(module, gpytorch.kernels.ScaleKernel))
    return {
        "noise": method.likelihood.noise.item(),
        "outputscale": kernel.outputscale.item(),
        "lengthscales": kernel.base_kernel.lengthscale.flatten().tolist(),
    }


def _train(
    names: list[str],
    split: datasets.Split,
    config: RunConfig,
    options: dict[str, dict],
    tag: str,
    with_objective: bool = False,
    extrapolation: bool = False,
) -> list[MethodResult]:
    """Build the registry methods ``names`` on the split and train them as ``config`` says, in lockstep (the same
    mini-batches, one step of each in turn), with every test evaluation by :func:`regression_metrics` and, where
    ``with_objective``, the training objective; with ``extrapolation``, also the test RMSE of the rows inside and
    outside the box of the training inputs, and the learned hyperparameters."""
    train, test = split_tensors(split, config)
    methods = [(f"{name}@{tag}", build_method(name, *train, seed=config.seed, **options[name])) for name in names]
    y_std = split.y_std.item()
    inside = ((test[0] >= train[0].amin(0)) & (test[0] <= train[0].amax(0))).all(-1)

    def metrics(method: Method, x: Tensor, y: Tensor) -> dict[str, float]:
        values = regression_metrics(method, x, y, y_std)
        if with_objective:
            values["objective"] = method.objective()
        if extrapolation:
            squared = (method.predict(x)[0] - y).square() * y_std**2
            values["inside_fraction"] = inside.to(y.dtype).mean().item()
            values["rmse_inside"] = squared[inside].mean().sqrt().item()
            values["rmse_outside"] = squared[~inside].mean().sqrt().item() if (~inside).any() else math.nan
            values["hyperparameters"] = learned_hyperparameters(method)
        return values

    return train_in_lockstep(methods, train, test, y_std, config, test_metrics=metrics)


# ---------------------------------------------------------------------------------------------- part 1
def _fixed_kalman_model(inducing_points: Tensor, lengthscale: float, noise_std: float) -> ApproximateRegressionModel:
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(inducing_points)
    model = ApproximateRegressionModel(
        lambda model: KalmanVariationalStrategy(model, inducing_points, likelihood=likelihood), inducing_points.size(-1)
    ).to(inducing_points)
    model.covar_module.base_kernel.lengthscale = lengthscale
    model.covar_module.outputscale = 1.0
    likelihood.noise = noise_std**2
    return model


def _stream_pass(model, batches, device: torch.device) -> tuple[float, float]:
    """Absorbs every mini-batch from the prior on; the wall-clock and the CPU seconds (of this thread) of the updates
    alone."""
    strategy = model.variational_strategy
    strategy.reset()
    wall = cpu = 0.0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        start = time.thread_time()
        wall += timed_call(strategy.update, x, y, device=device)
        cpu += time.thread_time() - start
    return wall, cpu


def _sgpr_bound(model, x: Tensor, y: Tensor) -> float:
    """GPyTorch's collapsed SGPR bound :math:`N \\times` ``ExactMarginalLogLikelihood`` at the same hyperparameters
    and inducing inputs (an external oracle)."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
    likelihood.noise = model.variational_strategy.likelihood.noise.detach()
    inducing_points = model.variational_strategy.inducing_points.detach().clone()
    sgpr = ExactRegressionModel(x, y, likelihood, inducing_points).to(x)
    sgpr.covar_module.base_kernel.load_state_dict(model.covar_module.state_dict())
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, sgpr)
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(2**62):
        return (mll(sgpr(x), y) * y.size(0)).item()


def _streaming_part(args: argparse.Namespace, config: RunConfig, output: Path) -> tuple[dict, list, dict]:
    device, dims, batch = torch.device(config.device), args.stream_dims, config.batch_size
    function = RandomFourierGP(dims, args.stream_lengthscale, 1.0, args.stream_features, config.seed, config.dtype)
    generator = torch.Generator().manual_seed(config.seed + 1)
    inducing_points = (2 * torch.rand(args.num_inducing, dims, generator=generator, dtype=config.dtype) - 1).to(device)
    model = _fixed_kalman_model(inducing_points, args.stream_lengthscale, args.noise_std)
    data_seed = config.seed + 2

    def batches(size: int):
        return synthetic_batches(function, size, batch, args.noise_std, data_seed)

    sizes, rows, results = sorted(args.stream_sizes), [], []
    for size in sizes:
        seconds, cpu_seconds = _stream_pass(model, batches(size), device)
        bound = model.variational_strategy.recursive_bound.item()
        with PeakMemoryMeter(device) as meter:
            _stream_pass(model, batches(size), device)
        rows.append(
            {
                "num_points": size,
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "microseconds_per_point": 1e6 * seconds / size,
                "cpu_microseconds_per_point": 1e6 * cpu_seconds / size,
                "peak_memory_mb": meter.peak_mb,
                "bound_per_point": bound / size,
                "num_observed": model.variational_strategy.num_observed,
            }
        )
        result = MethodResult(name=f"update@N={size}", label="Kalman update pass (VFE)", sizes=f"M={args.num_inducing}")
        result.iterations = math.ceil(size / batch)
        result.seconds_per_iteration, result.train_seconds = seconds / result.iterations, seconds
        result.peak_memory_mb, result.objective = meter.peak_mb, bound / size
        results.append(result)

    first = [(x.to(device), y.to(device)) for x, y in batches(sizes[0])]
    streamed = rows[0]["bound_per_point"] * sizes[0]
    two_pass = -StreamingCollapsedBound(model, model.variational_strategy.likelihood).value_and_backward(first).item()
    reference = _sgpr_bound(model, *(torch.cat(parts) for parts in zip(*first)))
    # On a CPU the goal takes the CPU time of the updates, which other jobs on shared cores do not inflate; a GPU's
    # work is only seen by the wall clock.
    timing = "seconds" if device.type == "cuda" else "cpu_seconds"
    ratios = {}
    for small, large in zip(rows, rows[1:]):
        key = f"streaming_time_growth_{_size_label(small['num_points'])}_to_{_size_label(large['num_points'])}"
        ratios[key] = large[timing] / small[timing]
    if len(rows) >= 2:
        ratios[STREAMING_TIME_GOAL] = rows[-1][timing] / rows[-2][timing]
        ratios["streaming_wall_time_growth_1e5_to_1e6"] = rows[-1]["seconds"] / rows[-2]["seconds"]
    ratios[STREAMING_MEMORY_GOAL] = rows[-1]["peak_memory_mb"] / max(rows[0]["peak_memory_mb"], 1.0)
    summary = {
        "sizes": rows,
        "num_inducing": args.num_inducing,
        "batch_size": batch,
        "hyperparameters": {
            "kernel": "scaled SE-ARD",
            "lengthscale": args.stream_lengthscale,
            "outputscale": 1.0,
            "noise_std": args.noise_std,
        },
        "inducing_points": f"{args.num_inducing} points uniform on [-1, 1]^{dims} (seed {config.seed + 1})",
        "data": (
            f"generated mini-batch by mini-batch while streaming (never held in full), from one torch.Generator "
            f"(seed {data_seed}): x uniform on [-1, 1]^{dims}, y = f(x) + N(0, {args.noise_std}^2), f one draw of a "
            f"zero-mean SE GP (lengthscale {args.stream_lengthscale}, outputscale 1) by {args.stream_features} "
            "random Fourier features (seed "
            f"{config.seed}), evaluated in blocks of {function.block_rows} rows; the same stream at every N (the "
            "first N points)"
        ),
        "timing": (
            f"sum over the update calls alone (data generation excluded) of the wall-clock and of this thread's CPU "
            f"time; the goal uses {timing}. A second pass of the same stream measures the peak memory, of the updates "
            "and of generating the mini-batches"
        ),
        "bound_check": {
            "num_points": sizes[0],
            "streamed_bound": streamed,
            "two_pass_bound": two_pass,
            "relative_difference": abs(streamed - two_pass) / abs(two_pass),
            "gpytorch_sgpr_bound": reference,
            "relative_difference_to_gpytorch": abs(streamed - reference) / abs(reference),
            "note": (
                "the recursive bound after one pass of updates against the same model's collapsed bound from the sums "
                "of all mini-batches (StreamingCollapsedBound), and against GPyTorch's collapsed SGPR "
                "(InducingPointKernel, N x ExactMarginalLogLikelihood) at the same hyperparameters and inducing "
                "inputs. GPyTorch factorizes K_uu without the strategy's jitter (1e-6 in float64); with 100 "
                "inducing inputs in 2-D at length-scale 0.5, K_uu is so ill-conditioned (condition number ~1e14) "
                "that the jitter changes the Nystrom trace term "
                "tr(K_ff - Q_ff) / (2 sigma^2) visibly"
            ),
        },
    }
    print(f"\nstreaming: one update pass at fixed hyperparameters, D={dims}, M={args.num_inducing}, batch {batch}\n")
    print(f"{'N':>9s} {'s / pass':>9s} {'CPU s':>7s} {'CPU µs / point':>14s} {'peak MB':>8s} {'bound / N':>10s}")
    for row in rows:
        print(
            f"{row['num_points']:9d} {row['seconds']:9.2f} {row['cpu_seconds']:7.2f} "
            f"{row['cpu_microseconds_per_point']:14.2f} {row['peak_memory_mb']:8.1f} {row['bound_per_point']:10.4f}"
        )
    check = summary["bound_check"]
    print(
        f"bound at N={sizes[0]}: streamed {streamed:.6f}, from the summed mini-batches {two_pass:.6f} (relative "
        f"difference {check['relative_difference']:.1e}), GPyTorch SGPR without jitter {reference:.6f}"
    )
    _plot_streaming(rows, output / f"{NAME}-streaming.png")
    return summary, results, ratios


def _label_axes(ylabels: dict, xlabel: str) -> None:
    """Log-scaled x axes with labels, a grid and a legend."""
    for axis, ylabel in ylabels.items():
        axis.set_xscale("log")
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)


def _plot_streaming(rows: list[dict], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    sizes = [row["num_points"] for row in rows]
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    time_axis.plot(sizes, [row["cpu_seconds"] for row in rows], marker="o", label="CPU time of the updates")
    time_axis.plot(sizes, [row["seconds"] for row in rows], marker="o", label="wall-clock time of the updates")
    first = rows[0]["cpu_seconds"]
    time_axis.plot(sizes, [first * size / sizes[0] for size in sizes], "k:", label="linear growth")
    time_axis.set_yscale("log")
    memory_axis.plot(sizes, [row["peak_memory_mb"] for row in rows], marker="o", label="updates and data generation")
    memory_axis.set_ylim(bottom=0)
    _label_axes({time_axis: "seconds of one pass", memory_axis: "peak memory above start (MB)"}, "streamed points N")
    figure.suptitle("Kalman update (VFE, M=100, batch 1000) at fixed hyperparameters: time and memory against N")
    return save_figure(figure, path)


# ---------------------------------------------------------------------------------------------- part 2
def cstr_epochs(num_rows: int, batch_size: int, min_steps: int, max_epochs: int, min_epochs: int = 1) -> int:
    """Epochs of SRGP and SVGP at one CSTR training size: enough for ``min_steps`` steps, at most ``max_epochs``, at
    least ``min_epochs``."""
    return max(min_epochs, min(max_epochs, math.ceil(min_steps / math.ceil(num_rows / batch_size))))


def _cstr_part(args: argparse.Namespace, config: RunConfig, output: Path) -> tuple[dict, list, dict]:
    sizes = sorted(args.cstr_sizes)
    start = time.perf_counter()
    data = cstr_dataset(sizes[-1] + args.cstr_test_rows, config.seed, noise_std=args.cstr_noise_std,
                        burn_in=args.cstr_burn_in)  # fmt: skip
    simulation_seconds = time.perf_counter() - start
    x, y = torch.as_tensor(data.x, dtype=config.dtype), torch.as_tensor(data.y, dtype=config.dtype)
    options, results, rows = _method_options(args), [], []
    for size in sizes:
        rows_used = slice(sizes[-1] - size, None)
        split = standardized_split("cstr", x[rows_used], y[rows_used], size, "simulated")
        epochs = cstr_epochs(size, config.batch_size, args.cstr_min_steps, args.cstr_max_epochs, args.cstr_min_epochs)
        steps = epochs * math.ceil(size / config.batch_size)
        minibatch = replace(config, iterations=steps, eval_every=steps)
        full_batch = replace(config, iterations=args.full_batch_iterations, eval_every=args.full_batch_iterations)
        row = {"num_train": size, "epochs": epochs, "steps": steps, "methods": {}}
        size_results = _train([OURS, BASELINE], split, minibatch, options, f"N={size}", extrapolation=True)
        for name, limit in (("sgpr", args.sgpr_max_rows), ("exact", args.exact_max_rows)):
            if size <= limit:
                size_results += _train([name], split, full_batch, options, f"N={size}", extrapolation=True)
        for result in size_results:
            name, final = result.name.split("@")[0], result.curve[-1]
            row["methods"][name] = {
                "label": result.label,
                **{key: final[key] for key in CSTR_METRICS},
                "objective": result.objective,
                "train_seconds": result.train_seconds,
                "iterations": result.iterations,
            }
        row["test_inside_training_box"] = final["inside_fraction"]
        results += size_results
        rows.append(row)
        print(f"  CSTR N={size}: " + ", ".join(f"{n} RMSE {m['rmse']:.4f}" for n, m in row["methods"].items()))

    ratios = {}
    for row in rows:
        ours, theirs = row["methods"][OURS], row["methods"][BASELINE]
        row["srgp_rmse_vs_svgp"] = ours["rmse"] / theirs["rmse"]
        row["srgp_median_error_vs_svgp"] = ours["median_abs_error"] / theirs["median_abs_error"]
        ratios[f"cstr_srgp_rmse_vs_svgp_at_N{_size_label(row['num_train'])}"] = row["srgp_rmse_vs_svgp"]
        if "sgpr" in row["methods"]:
            row["srgp_rmse_vs_sgpr"] = ours["rmse"] / row["methods"]["sgpr"]["rmse"]
    ratios[CSTR_GOAL] = max(row["srgp_rmse_vs_svgp"] for row in rows)
    ratios["cstr_srgp_median_error_vs_svgp_max"] = max(row["srgp_median_error_vs_svgp"] for row in rows)
    versus_sgpr = [row["srgp_rmse_vs_sgpr"] for row in rows if "srgp_rmse_vs_sgpr" in row]
    if versus_sgpr:
        ratios["cstr_srgp_rmse_vs_sgpr_max"] = max(versus_sgpr)
    summary = {
        "sizes": rows,
        "test_rows": args.cstr_test_rows,
        "simulation": {
            "plant": "Schürch et al. 2020, Sec. 5.3 (MATLAB predcstr): Cb1=24.9, Cb2=0.1, k1=k2=1, w2=0.1",
            "input": "w1 piecewise constant: heights U[0, 4], durations U[5, 20] s, switched on the sampling grid",
            "sampling_period_s": 0.2,
            "integrator": (
                "classical RK4, 4 fixed substeps of 0.05 s per hold interval, numpy; the record is integrated in "
                "chunks of 5,000 intervals side by side, re-integrated from each predecessor's end until all agree to "
                "1e-10 (relative), i.e. the sequential RK4 solution; agrees with scipy's LSODA (rtol 1e-10) to "
                "< 1e-6 (tests)"
            ),
            "sweeps": data.sweeps,
            "initial_state": "steady state for w1 = 1 (h = 30.25, Cb = 21.476)",
            "burn_in_s": args.cstr_burn_in,
            "noise_std": args.cstr_noise_std,
            "regressors": "x_t = [y_(t-1), y_(t-2), w_t, w_(t-1), w_(t-2)], target y_t; w_t is the feed held over the "
            "interval that ends at sample t",
            "rows": int(data.y.size),
            "train_rows": "the N rows just before row 10^6 (the largest size), the most recent ones",
            "test": f"the last {args.cstr_test_rows} rows, against the noisy targets, in Cb units",
            "cb_range": [float(data.f.min()), float(data.f.max())],
            "cb_mean": float(data.f.mean()),
            "cb_std": float(data.f.std()),
            "level_range": [float(data.level.min()), float(data.level.max())],
            "seconds": simulation_seconds,
            "seed": config.seed,
        },
        "metrics": (
            "against the noisy test targets, in Cb units: RMSE, median absolute error, NLL, 95% coverage; rmse_inside "
            "and rmse_outside split the test rows by whether every input lies within the range of the training inputs "
            "(test_inside_training_box: the fraction inside); objective: SRGP and SGPR the collapsed bound / N, the "
            "exact GP the log marginal likelihood / N, SVGP the ELBO / N (standardized targets); hyperparameters in "
            "standardized units"
        ),
        "schedule": (
            f"SRGP and SVGP: max({args.cstr_min_epochs}, min({args.cstr_max_epochs}, ceil({args.cstr_min_steps} / "
            f"ceil(N / {config.batch_size})))) epochs of mini-batches of {config.batch_size}; SGPR "
            f"(N <= {args.sgpr_max_rows}) and the exact GP (N <= {args.exact_max_rows}): "
            f"{args.full_batch_iterations} full-batch Adam steps (lr 0.05)"
        ),
    }
    print(f"\nCSTR: test RMSE ({args.cstr_test_rows} test rows, Cb units; noise std {args.cstr_noise_std})\n")
    print(f"{'N':>9s} {'epochs':>6s} " + " ".join(f"{name:>10s}" for name in (OURS, BASELINE, *FULL_BATCH)))
    for row in rows:
        cells = [f"{row['methods'][name]['rmse']:10.4f}" if name in row["methods"] else f"{'':>10s}"
                 for name in (OURS, BASELINE, *FULL_BATCH)]  # fmt: skip
        print(f"{row['num_train']:9d} {row['epochs']:6d} " + " ".join(cells))
        ours, theirs = row["methods"][OURS], row["methods"][BASELINE]
        print(
            f"{'':16s} SRGP / SVGP RMSE on the {row['test_inside_training_box']:.1%} of test rows inside the box of "
            f"the training inputs {ours['rmse_inside']:.4f} / {theirs['rmse_inside']:.4f}, outside "
            f"{ours['rmse_outside']:.4f} / {theirs['rmse_outside']:.4f}; objective {ours['objective']:.4f} / "
            f"{theirs['objective']:.4f}"
        )
    print(f"(simulation: {simulation_seconds:.1f} s, {data.sweeps} sweeps)")
    _plot_cstr(rows, output / f"{NAME}-cstr.png")
    return summary, results, ratios


def _plot_cstr(rows: list[dict], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in (OURS, BASELINE, *FULL_BATCH):
        present = [row for row in rows if name in row["methods"]]
        if not present:
            continue
        label = present[0]["methods"][name]["label"]
        for axis, key in zip(axes, ("rmse", "median_abs_error")):
            axis.plot([row["num_train"] for row in present], [row["methods"][name][key] for row in present],
                      marker="o", label=label)  # fmt: skip
    _label_axes(dict(zip(axes, ("test RMSE (Cb)", "median absolute test error (Cb)"))), "training samples N")
    figure.suptitle("CSTR (NARX, M=100, batch 1000): test error against the training horizon")
    return save_figure(figure, path)


# ---------------------------------------------------------------------------------------------- part 3
def epochs_to_reach(values: list[float], level: float) -> int | None:
    """The first epoch (1-based; ``values[0]`` is before training) whose value is at most ``level``."""
    return next((epoch for epoch, value in enumerate(values) if epoch >= 1 and value <= level), None)


def _epoch_splits(args: argparse.Namespace, config: RunConfig) -> list[tuple[str, datasets.Split, dict]]:
    splits = []
    for dims in args.synthetic_dims:
        lengthscale = SYNTHETIC_LENGTHSCALES.get(dims, 0.5)
        function = RandomFourierGP(dims, lengthscale, 1.0, args.fourier_features, config.seed + dims, config.dtype)
        rows = args.synthetic_rows + args.synthetic_test_rows
        x, y = synthetic_rows(function, rows, args.noise_std, config.seed + 100 + dims)
        name = f"synthetic-{dims}d"
        description = {
            "lengthscale": lengthscale,
            "outputscale": 1.0,
            "noise_std": args.noise_std,
            "train_rows": args.synthetic_rows,
            "test_rows": args.synthetic_test_rows,
            "generation": (
                f"x uniform on [-1, 1]^{dims}; f one draw of a zero-mean SE GP by {args.fourier_features} random "
                f"Fourier features (seed {config.seed + dims}); y = f(x) + N(0, {args.noise_std}^2); rows from seed "
                f"{config.seed + 100 + dims}, the first {args.synthetic_rows} train"
            ),
        }
        splits.append(
            (name, standardized_split(name, x, y, args.synthetic_rows, "random Fourier features"), description)
        )
    for name in args.datasets:
        split = load_split(args, name)
        splits.append((name, split, split_config(split)))
    return splits


def _epochs_part(args: argparse.Namespace, config: RunConfig, output: Path) -> tuple[dict, list, dict]:
    options, results, per_dataset = _method_options(args), [], {}
    for name, split, description in _epoch_splits(args, config):
        steps_per_epoch = math.ceil(split.train_x.size(0) / config.batch_size)
        run = replace(config, iterations=args.epochs * steps_per_epoch, eval_every=steps_per_epoch)
        curves = {}
        for method_name, result in zip((OURS, BASELINE), _train([OURS, BASELINE], split, run, options, name, True)):
            for point in result.curve:
                point["epoch"] = point["iteration"] / steps_per_epoch
            results.append(result)
            curves[method_name] = {
                key: [point[key] for point in result.curve] for key in ("rmse", "objective", "coverage", "nll")
            }
            curves[method_name]["seconds"] = [point["seconds"] for point in result.curve]
        level = (1 + args.tolerance) * curves[BASELINE]["rmse"][-1]
        reached = {method_name: epochs_to_reach(curve["rmse"], level) for method_name, curve in curves.items()}
        censored = {method_name: args.epochs + 1 if value is None else value for method_name, value in reached.items()}
        per_dataset[name] = {
            "data": description,
            "train_rows": split.train_x.size(0),
            "steps_per_epoch": steps_per_epoch,
            "target_rmse": level,
            "epochs_to_target": reached,
            "ratio": censored[OURS] / censored[BASELINE],
            "curves": curves,
        }
        finals = {method_name: {key: curve[-1] for key, curve in curves[method_name].items()} for method_name in curves}
        print(
            f"  {name}: after {args.epochs} epochs SRGP / SVGP: test RMSE {finals[OURS]['rmse']:.4f} / "
            f"{finals[BASELINE]['rmse']:.4f}, objective {finals[OURS]['objective']:.4f} / "
            f"{finals[BASELINE]['objective']:.4f}, 95% coverage {finals[OURS]['coverage']:.3f} / "
            f"{finals[BASELINE]['coverage']:.3f}; epochs to within {args.tolerance:.0%} of SVGP's final RMSE: "
            f"{reached[OURS]} / {reached[BASELINE]}"
        )
    ratios = {f"epochs_to_converge_srgp_vs_svgp_on_{name}": entry["ratio"] for name, entry in per_dataset.items()}
    ratios[EPOCHS_GOAL] = max(entry["ratio"] for entry in per_dataset.values())
    ratios["epochs_final_rmse_srgp_vs_svgp_max"] = max(
        entry["curves"][OURS]["rmse"][-1] / entry["curves"][BASELINE]["rmse"][-1] for entry in per_dataset.values()
    )
    summary = {
        "datasets": per_dataset,
        "epochs": args.epochs,
        "tolerance": args.tolerance,
        "definition": (
            "per data set, each method's epochs to convergence is the first epoch (>= 1) at which its test RMSE is at "
            f"most (1 + {args.tolerance}) x SVGP's final test RMSE; a method that never gets there counts "
            f"{args.epochs + 1}; the ratio is SRGP's ÷ SVGP's"
        ),
        "objective": "SRGP: collapsed VFE bound / N at the current hyperparameters (clean pass); SVGP: ELBO / N",
    }
    _plot_epochs(per_dataset, output / f"{NAME}.png")
    return summary, results, ratios


def _plot_epochs(per_dataset: dict, path: Path) -> Path | None:
    """Test RMSE, objective and coverage per epoch, one column per data set."""
    plt = pyplot()
    if plt is None:
        return None
    names = list(per_dataset)
    figure, axes = plt.subplots(3, len(names), figsize=(3.3 * len(names), 8), squeeze=False)
    labels = {OURS: "SRGP (Kalman, VFE)", BASELINE: "GPyTorch SVGP (Adam)"}
    for column, name in enumerate(names):
        entry = per_dataset[name]
        for method_name, label in labels.items():
            curves = entry["curves"][method_name]
            epochs = range(len(curves["rmse"]))
            for row, key in enumerate(("rmse", "objective", "coverage")):
                axes[row][column].plot(epochs, curves[key], marker=".", label=label)
        axes[0][column].axhline(entry["target_rmse"], color="grey", linestyle="--", linewidth=1)
        axes[0][column].set_title(name)
        axes[2][column].axhline(0.95, color="grey", linestyle=":", linewidth=1)
        axes[2][column].set_xlabel("epoch")
    for row, ylabel in enumerate(("test RMSE", "objective / N", "95% coverage")):
        axes[row][0].set_ylabel(ylabel)
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle("SRGP vs SVGP per epoch (M=100, batch 1000; dashed: within 1% of SVGP's final RMSE)")
    return save_figure(figure, path, dpi=110)


# ---------------------------------------------------------------------------------------------- the benchmark
PART_RUNNERS: dict[str, PartRunner] = {"streaming": _streaming_part, "cstr": _cstr_part, "epochs": _epochs_part}


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    output = Path(args.output_dir)
    outcome = run_parts(PART_RUNNERS, args.parts, args, config, output)
    print("\n" + format_table(outcome[1]))
    run = {
        **config.to_json(),
        "parts": args.parts,
        "methods": {"ours": OURS, "baseline": BASELINE},
        "method_options": _method_options(args),
    }
    goals = {name: bound for name, bound in GOALS.items() if _goal_part(name) in args.parts}
    return publish_parts(NAME, run, outcome, goals, RATIO_NOTES, args.device, output)


def _goal_part(goal: str) -> str:
    return {STREAMING_TIME_GOAL: "streaming", STREAMING_MEMORY_GOAL: "streaming", CSTR_GOAL: "cstr"}.get(goal, "epochs")


RECURSIVE = Benchmark(
    NAME,
    "SRGP (Kalman-recursive sparse GP) vs GPyTorch's SVGP: streaming time and memory at N = 10^4 ... 10^6; the CSTR "
    "plant at N = 10^3 ... 10^6; RMSE, bound and coverage per epoch on synthetic GP data and kin40k, protein",
    _add_arguments,
    _run,
)
