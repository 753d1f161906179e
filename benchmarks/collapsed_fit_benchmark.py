"""``bench collapsed-fit``: fitting the collapsed bound from defaults on every regression set (issue 19, item 3).

On each regression set the benchmarks use (split 0, a seeded subset of ``--max-train-rows`` training rows, all test
rows; KUKA: the first joint's velocity at :math:`t+1`, target column 7), one model, :math:`M = 100` inducing inputs
drawn from the training rows and learned, a constant mean and a scaled SE-ARD kernel, VFE, float64, is fitted twice by
L-BFGS (at most ``--max-iter`` iterations) on the exact collapsed bound:

* ``gpytorch_default``: from GPyTorch's default hyperparameters (the recipe of notebook 05 before this benchmark:
  ``StreamingCollapsedBound`` + L-BFGS), i.e. ``fit_collapsed_bound(..., initialize=False)``;
* ``fit_collapsed_bound``: :func:`~gpytorch_decoupled.mlls.fit_collapsed_bound` with its defaults (the data-driven
  initialization, one start).

Each records the fitted noise variance (standardized units: a fraction of the training targets' variance), the bound
per datum, the noise-only bound per datum, whether the noise-only warning fired, the test RMSE in units of the test
targets' standard deviation (1 = predicting the mean), the test NLL and the fit's CPU seconds. The goal: from defaults
``fit_collapsed_bound`` never ends at the noise-only solution (the number of such sets is 0).
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from pathlib import Path

import gpytorch
import torch

from gpytorch_decoupled.mlls import fit_collapsed_bound
from gpytorch_decoupled.variational import KalmanVariationalStrategy

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .report import benchmark_payload, format_ratios, write_results

NAME = "collapsed-fit"
DATASETS = (
    "kin40k",
    "protein",
    "elevators",
    "pol",
    "bike",
    "keggdirected",
    "kuka",
    "power",
    "airfoil",
    "concrete",
    "housing",
)
KUKA_TARGET = 7  # the first joint's velocity at t+1 (columns 0-6 are positions, near-linear in the inputs)
GOAL = "noise_only_fits_from_defaults"
GOALS = {GOAL: 0.0}
RATIO_NOTES = {
    GOAL: "the number of data sets on which fit_collapsed_bound with its defaults ends at the noise-only solution",
    "noise_only_fits_from_gpytorch_defaults": "the same for L-BFGS from GPyTorch's default hyperparameters; no goal",
    "worst_rmse_vs_std": "the largest test RMSE ÷ test-target standard deviation of fit_collapsed_bound; no goal",
}
METHODS = ("gpytorch_default", "fit_collapsed_bound")


class ConstantMeanGP(gpytorch.models.ApproximateGP):
    """A Kalman model with a constant mean and a scaled SE-ARD kernel (VFE)."""

    def __init__(
        self,
        inducing_points: torch.Tensor,
        likelihood: gpytorch.likelihoods.GaussianLikelihood,
        learn_inducing_locations: bool = True,
    ):
        strategy = KalmanVariationalStrategy(
            self, inducing_points, likelihood=likelihood, learn_inducing_locations=learn_inducing_locations
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        kernel = gpytorch.kernels.RBFKernel(ard_num_dims=inducing_points.size(-1))
        self.covar_module = gpytorch.kernels.ScaleKernel(kernel)

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=100, eval_every=1)
    parser.set_defaults(batch_size=2000, dtype="float64", max_train_rows=5000)
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--num-inducing", type=int, default=100)
    parser.add_argument("--max-iter", type=int, default=100, help="L-BFGS iterations of each fit")
    parser.add_argument("--output-dir", default=str(DEFAULT_RESULTS_DIR))


def _fit(name: str, train, test, args, seed: int) -> dict:
    """One fit of a fresh model: its noise, bounds, warning, test metrics and CPU seconds."""
    x, y = train
    generator = torch.Generator().manual_seed(seed)
    z = x[torch.randperm(x.size(0), generator=generator)[: args.num_inducing]].clone()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
    model = ConstantMeanGP(z, likelihood).to(x)
    batches = list(zip(x.split(args.batch_size), y.split(args.batch_size)))
    start = time.thread_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = fit_collapsed_bound(
            model, likelihood, batches, max_iter=args.max_iter, initialize=name == "fit_collapsed_bound"
        )
    seconds = time.thread_time() - start
    model.eval(), likelihood.eval()
    test_x, test_y = test
    with torch.no_grad():
        predictive = [likelihood(model(chunk)) for chunk in test_x.split(2000)]
    mean = torch.cat([p.mean for p in predictive])
    variance = torch.cat([p.variance for p in predictive])
    rmse = (mean - test_y).square().mean().sqrt().item()
    nll = (0.5 * (torch.log(2 * math.pi * variance) + (mean - test_y).square() / variance)).mean().item()
    return {
        "method": name,
        "noise_variance": likelihood.noise.item(),
        "bound_per_datum": fit.bound.item() / y.numel(),
        "noise_only_bound_per_datum": fit.noise_only_bound.item() / y.numel(),
        "noise_only": fit.noise_only,
        "warnings": [str(w.message) for w in caught if "noise-only" in str(w.message)],
        "test_rmse_vs_std": rmse / test_y.std().item(),
        "test_nll_standardized": nll,
        "cpu_seconds": seconds,
    }


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    torch.manual_seed(config.seed)
    rows = []
    for dataset in args.datasets:
        split = load_split(args, dataset)
        train_y, test_y = split.train_y, split.test_y
        if train_y.dim() > 1:
            train_y, test_y = train_y[:, KUKA_TARGET], test_y[:, KUKA_TARGET]
        train = split.train_x.to(config.device, config.dtype), train_y.to(config.device, config.dtype)
        test = split.test_x.to(config.device, config.dtype), test_y.to(config.device, config.dtype)
        for method in METHODS:
            row = {**split_config(split), **_fit(method, train, test, args, config.seed), "load": os.getloadavg()[0]}
            rows.append(row)
            print(
                f"{dataset:13s} {method:20s} noise {row['noise_variance']:8.4f}  bound/N "
                f"{row['bound_per_datum']:8.4f} (noise-only {row['noise_only_bound_per_datum']:8.4f})  "
                f"noise-only {str(row['noise_only']):5s}  test RMSE/std {row['test_rmse_vs_std']:.4f}  "
                f"NLL {row['test_nll_standardized']:8.4f}  {row['cpu_seconds']:6.1f} s  (load {row['load']:.1f})",
                flush=True,
            )
    ours = [row for row in rows if row["method"] == "fit_collapsed_bound"]
    ratios = {
        GOAL: float(sum(row["noise_only"] for row in ours)),
        "noise_only_fits_from_gpytorch_defaults": float(
            sum(row["noise_only"] for row in rows if row["method"] == "gpytorch_default")
        ),
        "worst_rmse_vs_std": max(row["test_rmse_vs_std"] for row in ours),
    }
    run = {
        **config.to_json(),
        "datasets": args.datasets,
        "max_train_rows": args.max_train_rows,
        "num_inducing": args.num_inducing,
        "max_iter": args.max_iter,
        "kuka_target_column": KUKA_TARGET,
        "clock": "thread CPU time",
    }
    payload = benchmark_payload(NAME, run, [], ratios, GOALS, device=args.device, ratio_notes=RATIO_NOTES, fits=rows)
    write_results(Path(args.output_dir) / f"{NAME}.json", payload)
    print("\n" + format_ratios(payload))
    return payload


COLLAPSED_FIT = Benchmark(
    NAME,
    "fit_collapsed_bound from its defaults vs L-BFGS from GPyTorch's defaults on every regression set: noise, "
    "bound, noise-only warning, test RMSE vs one standard deviation",
    _add_arguments,
    _run,
)
