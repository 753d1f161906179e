"""``bench streaming``: learning hyperparameters on a real stream, evaluated prequentially (issue 19, item 4).

**The stream.** The KUKA LWR robot's ten pick-and-place trajectories (``datasets.load("kuka")``, real 21-dimensional
joint positions, velocities and torques) in recorded order: 20,068 time steps. The target is the change of the first
joint's velocity over one step, :math:`\\dot q_1(t+1) - \\dot q_1(t)` (its acceleration: the forward dynamics), from
the inputs at :math:`t`. The first ``--warmup-rows`` steps are a warm-up; after it the data arrive in batches of
``--batch-size`` steps. Inputs are standardized with the loader's statistics (trajectories 1-9), the target with the
warm-up's mean and standard deviation (so nothing of the future is used for it).

**Prequential evaluation.** Every method predicts each new batch before it learns from it: the test NLL of the
Gaussian predictive of :math:`y` and the squared error, averaged over all batches after the warm-up (in the
warm-up-standardized units).

**The methods** (one model: constant mean, scaled SE-ARD kernel, :math:`M` inducing inputs, float64, one thread):

* ``kalman_refit`` (the recipe): a :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` (VFE) fitted on
  the warm-up by :func:`~gpytorch_decoupled.mlls.fit_collapsed_bound`; each batch is absorbed by ``update`` (closed
  form) after it is predicted; every ``--refit-every`` batches the inducing inputs are redrawn from all steps seen so
  far, the hyperparameters are refitted by ``fit_collapsed_bound(..., initialize=False)`` (warm start, at most
  ``--refit-iter`` L-BFGS iterations) on the last ``--window`` steps, and the state is rebuilt by one pass of
  ``update`` over every step seen so far.
* ``kalman_fixed``: the same warm-up fit, then ``update`` only (hyperparameters and inducing inputs never change).
* ``srgp``: SRGP in one pass, :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation` from the warm-up fit
  (``propagate="hyperparameters"``, the inducing inputs fixed, Adam at ``--lr``): one epoch over the warm-up's
  batches and the whole stream, one step per batch after it is predicted; its bound and drift warnings are counted.
* ``svgp``: GPyTorch's SVGP (whitened ``VariationalStrategy``, ``CholeskyVariationalDistribution``, learned inducing
  inputs, Adam at ``--lr`` on everything), starting from the warm-up fit's hyperparameters and inducing inputs,
  retrained on all data so far: after each batch it takes Adam steps on mini-batches of ``--svgp-batch-size`` drawn
  uniformly from every step seen so far (the ELBO's :math:`N` = the steps seen) until its thread CPU time reaches
  ``kalman_refit``'s (warm-up fit included): the same total compute, in lockstep.
* ``svgp_3x``: the same SVGP with three times that CPU time (how much compute SVGP needs to catch up).

CPU time is ``time.thread_time`` of this thread (other jobs on shared cores do not inflate it); predictions are not
counted for any method. Goals: ``kalman_refit``'s prequential RMSE and NLL no worse than SVGP's at equal compute.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
import warnings
from pathlib import Path

import gpytorch
import torch
from torch import Tensor

from gpytorch_decoupled import datasets
from gpytorch_decoupled.mlls import fit_collapsed_bound
from gpytorch_decoupled.optim import RecursiveGradientPropagation

from .benchmark import Benchmark
from .collapsed_fit_benchmark import ConstantMeanGP
from .common_arguments import DEFAULT_RESULTS_DIR
from .report import benchmark_payload, format_ratios, pyplot, save_figure, write_results

NAME = "streaming"
METHODS = ("kalman_refit", "kalman_fixed", "srgp", "svgp", "svgp_3x")
RMSE_GOAL = "prequential_rmse_kalman_refit_vs_svgp"
NLL_GOAL = "prequential_nll_kalman_refit_minus_svgp"
GOALS = {RMSE_GOAL: 1.0, NLL_GOAL: 0.0}
RATIO_NOTES = {
    RMSE_GOAL: "prequential RMSE (every batch predicted before it is learned) of kalman_refit ÷ SVGP at equal CPU time",
    NLL_GOAL: "prequential mean test NLL of kalman_refit minus SVGP's (nats per point) at equal CPU time",
    "prequential_rmse_kalman_fixed_vs_svgp": "the same for kalman_fixed (its own, smaller compute); no goal",
    "prequential_nll_kalman_fixed_minus_svgp": "the same for kalman_fixed; no goal",
    "cpu_kalman_fixed_vs_kalman_refit": "kalman_fixed's CPU seconds ÷ kalman_refit's; no goal",
    "prequential_rmse_kalman_refit_vs_srgp": "kalman_refit ÷ SRGP in one pass (its own compute); no goal",
    "prequential_nll_kalman_refit_minus_srgp": "the same for the NLL (difference); no goal",
    "prequential_rmse_kalman_refit_vs_svgp_3x": "kalman_refit ÷ an SVGP given three times its CPU time; no goal",
    "prequential_nll_kalman_refit_minus_svgp_3x": "the same for the NLL (difference); no goal",
}
TARGET_COLUMN = 7  # the first joint's velocity (inputs and targets: columns 7-13 are the velocities)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup-rows", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=100, help="time steps per arriving batch")
    parser.add_argument("--max-rows", type=int, default=None, help="stop the stream after this many steps")
    parser.add_argument("--num-inducing", type=int, default=100)
    parser.add_argument("--refit-every", type=int, default=20, help="batches between refits")
    parser.add_argument("--window", type=int, default=4000, help="the refit's window of most recent steps")
    parser.add_argument("--refit-iter", type=int, default=20, help="L-BFGS iterations of a refit")
    parser.add_argument("--warmup-iter", type=int, default=100, help="L-BFGS iterations of the warm-up fit")
    parser.add_argument("--svgp-batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.01, help="SVGP's Adam learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--output-dir", default=str(DEFAULT_RESULTS_DIR))


def kuka_stream(data_dir=None, warmup_rows: int = 1000, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    """The ten KUKA trajectories in recorded order: inputs (standardized by the loader) and the first joint's
    velocity change over one step, standardized by the first ``warmup_rows`` steps."""
    split = datasets.load("kuka", split=9, data_dir=data_dir, dtype=dtype)  # trains on 1-9, tests on 10: in order
    x = torch.cat([split.train_x, split.test_x])
    velocity = x[:, TARGET_COLUMN] * split.x_std[TARGET_COLUMN] + split.x_mean[TARGET_COLUMN]
    after = torch.cat([split.train_y, split.test_y])[:, TARGET_COLUMN]
    change = after * split.y_std[TARGET_COLUMN] + split.y_mean[TARGET_COLUMN] - velocity
    warmup = change[:warmup_rows]
    return x, (change - warmup.mean()) / warmup.std()


def _batches(x: Tensor, y: Tensor, size: int = 2000) -> list[tuple[Tensor, Tensor]]:
    return list(zip(x.split(size), y.split(size)))


def _predict(model, likelihood, x: Tensor, y: Tensor) -> tuple[float, float]:
    """Summed test NLL and squared error of the predictive of ``y`` at ``x`` (eval mode, no graph)."""
    model.eval(), likelihood.eval()
    with torch.no_grad():
        predictive = likelihood(model(x))
    mean, variance = predictive.mean, predictive.variance
    nll = 0.5 * (torch.log(2 * math.pi * variance) + (y - mean).square() / variance)
    return nll.sum().item(), (y - mean).square().sum().item()


class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, inducing_points: Tensor):
        distribution = gpytorch.variational.CholeskyVariationalDistribution(inducing_points.size(0))
        strategy = gpytorch.variational.VariationalStrategy(
            self, inducing_points, distribution, learn_inducing_locations=True
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        kernel = gpytorch.kernels.RBFKernel(ard_num_dims=inducing_points.size(-1))
        self.covar_module = gpytorch.kernels.ScaleKernel(kernel)

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class _RetrainedSVGP:
    """GPyTorch's SVGP from the warm-up fit's hyperparameters and inducing inputs, retrained on all data so far with
    ``factor`` times the recipe's CPU time."""

    def __init__(self, model, likelihood, z: Tensor, args, factor: float):
        self.likelihood = copy.deepcopy(likelihood)
        self.model = _SVGP(z.clone()).double()
        self.model.mean_module.load_state_dict(model.mean_module.state_dict())
        self.model.covar_module.load_state_dict(model.covar_module.state_dict())
        self.adam = torch.optim.Adam([*self.model.parameters(), *self.likelihood.parameters()], lr=args.lr)
        self.elbo = gpytorch.mlls.VariationalELBO(self.likelihood, self.model, num_data=1)
        self.batch_size, self.factor, self.cpu, self.steps = args.svgp_batch_size, factor, 0.0, 0
        # its own draws: how many steps fit the budget varies with the machine, and must not change the others'
        self.generator = torch.Generator().manual_seed(args.seed + 1)

    def train_until(self, x: Tensor, y: Tensor, seen: int, budget: float) -> None:
        """Adam steps on mini-batches drawn from the first ``seen`` rows until the CPU time reaches ``factor x
        budget``."""
        self.model.train(), self.likelihood.train()
        self.elbo.num_data = seen
        while self.cpu < self.factor * budget:
            begin = time.thread_time()
            index = torch.randint(0, seen, (min(self.batch_size, seen),), generator=self.generator)
            self.adam.zero_grad()
            loss = -self.elbo(self.model(x[index]), y[index])
            loss.backward()
            self.adam.step()
            self.cpu += time.thread_time() - begin
            self.steps += 1


def _refit(model, likelihood, x: Tensor, y: Tensor, seen: int, args, generator: torch.Generator) -> list[str]:
    """The recipe's refit: new inducing inputs from every step seen, hyperparameters refitted on the window, and the
    state rebuilt from every step seen. Returns the warnings the fit raised."""
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.inducing_points.copy_(x[torch.randperm(seen, generator=generator)[: args.num_inducing]])
    start = max(0, seen - args.window)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_collapsed_bound(
            model,
            likelihood,
            _batches(x[start:seen], y[start:seen]),
            max_iter=args.refit_iter,
            initialize=False,
            absorb=False,
        )
    strategy.reset()
    for x_part, y_part in _batches(x[:seen], y[:seen]):
        strategy.update(x_part, y_part)
    return [str(w.message) for w in caught]


def _run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x, y = kuka_stream(args.data_dir, args.warmup_rows)
    if args.max_rows is not None:
        x, y = x[: args.max_rows], y[: args.max_rows]
    warm = args.warmup_rows
    generator = torch.Generator().manual_seed(args.seed)
    z = x[:warm][torch.randperm(warm, generator=generator)[: args.num_inducing]].clone()

    # The warm-up fit, shared by every method (its CPU time is charged to the Kalman recipe and given to SVGP).
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ConstantMeanGP(z, likelihood, learn_inducing_locations=False).double()
    start = time.thread_time()
    warm_fit = fit_collapsed_bound(model, likelihood, _batches(x[:warm], y[:warm]), max_iter=args.warmup_iter)
    warmup_seconds = time.thread_time() - start
    print(f"warm-up fit on {warm} steps: noise {likelihood.noise.item():.4f}, {warmup_seconds:.1f} s CPU", flush=True)

    kalman = {name: copy.deepcopy((model, likelihood)) for name in ("kalman_refit", "kalman_fixed", "srgp")}
    for m, lik in kalman.values():
        m.variational_strategy.likelihood = lik  # the deep copy keeps a reference to the original: re-attach
    cpu = {"kalman_refit": warmup_seconds, "kalman_fixed": warmup_seconds, "srgp": warmup_seconds}
    # SRGP in one pass: one epoch over the warm-up and the whole stream, one Adam step per batch
    begin = time.thread_time()
    srgp_model, srgp_likelihood = kalman["srgp"]
    trained = [p for p in (*srgp_model.parameters(), *srgp_likelihood.parameters()) if p.requires_grad]
    srgp = RecursiveGradientPropagation(
        srgp_model, srgp_likelihood, torch.optim.Adam(trained, lr=args.lr), propagate="hyperparameters"
    )
    srgp.start_epoch()
    with warnings.catch_warnings(record=True) as srgp_warnings:
        warnings.simplefilter("always")
        for x_part, y_part in zip(x[:warm].split(args.batch_size), y[:warm].split(args.batch_size)):
            srgp.step(x_part, y_part)
    cpu["srgp"] += time.thread_time() - begin
    svgps = {name: _RetrainedSVGP(model, likelihood, z, args, factor) for name, factor in (("svgp", 1), ("svgp_3x", 3))}
    for svgp in svgps.values():
        svgp.train_until(x, y, warm, cpu["kalman_refit"])
    rows = {name: [] for name in METHODS}
    refit_warnings, refits, noise = [], 0, {name: [] for name in METHODS}
    seen = warm
    num_batches = math.ceil((x.size(0) - warm) / args.batch_size)
    for k in range(num_batches):
        end = min(seen + args.batch_size, x.size(0))
        x_new, y_new = x[seen:end], y[seen:end]
        # predict first (prequential), then learn
        for name in METHODS:
            m, lik = (svgps[name].model, svgps[name].likelihood) if name in svgps else kalman[name]
            nll, squared = _predict(m, lik, x_new, y_new)
            rows[name].append({"rows": end, "nll": nll, "squared_error": squared, "count": end - seen})
        for name in ("kalman_fixed", "kalman_refit"):
            m, lik = kalman[name]
            begin = time.thread_time()
            m.variational_strategy.update(x_new, y_new)
            cpu[name] += time.thread_time() - begin
        begin = time.thread_time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            srgp.step(x_new, y_new)
        srgp_warnings += caught
        cpu["srgp"] += time.thread_time() - begin
        seen = end
        if (k + 1) % args.refit_every == 0 and seen < x.size(0):
            begin = time.thread_time()
            refit_warnings += _refit(*kalman["kalman_refit"], x, y, seen, args, generator)
            cpu["kalman_refit"] += time.thread_time() - begin
            refits += 1
        for name, svgp in svgps.items():
            svgp.train_until(x, y, seen, cpu["kalman_refit"])
            cpu[name] = svgp.cpu
        for name in METHODS:
            noise[name].append((svgps[name].likelihood if name in svgps else kalman[name][1]).noise.item())
            rows[name][-1]["cpu_seconds"] = cpu[name]
        if (k + 1) % 20 == 0 or k + 1 == num_batches:
            print(
                f"{seen:6d} steps: "
                + ", ".join(f"{n} RMSE {_mean_rmse(rows[n]):.4f} NLL {_mean_nll(rows[n]):.4f}" for n in METHODS)
                + f"; CPU {cpu['kalman_refit']:.1f} s (SVGP {svgps['svgp'].steps} steps)"
                + f"; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    summary = {
        name: {
            "prequential_rmse": _mean_rmse(rows[name]),
            "prequential_nll": _mean_nll(rows[name]),
            "second_half_rmse": _mean_rmse(rows[name][len(rows[name]) // 2 :]),
            "second_half_nll": _mean_nll(rows[name][len(rows[name]) // 2 :]),
            "cpu_seconds": cpu[name],
            "final_noise": noise[name][-1],
        }
        for name in METHODS
    }
    for name, svgp in svgps.items():
        summary[name]["adam_steps"] = svgp.steps
    summary["kalman_refit"]["refits"] = refits
    ratios = {
        RMSE_GOAL: summary["kalman_refit"]["prequential_rmse"] / summary["svgp"]["prequential_rmse"],
        NLL_GOAL: summary["kalman_refit"]["prequential_nll"] - summary["svgp"]["prequential_nll"],
        "prequential_rmse_kalman_fixed_vs_svgp": summary["kalman_fixed"]["prequential_rmse"]
        / summary["svgp"]["prequential_rmse"],
        "prequential_nll_kalman_fixed_minus_svgp": summary["kalman_fixed"]["prequential_nll"]
        - summary["svgp"]["prequential_nll"],
        "cpu_kalman_fixed_vs_kalman_refit": cpu["kalman_fixed"] / cpu["kalman_refit"],
        "prequential_rmse_kalman_refit_vs_srgp": summary["kalman_refit"]["prequential_rmse"]
        / summary["srgp"]["prequential_rmse"],
        "prequential_nll_kalman_refit_minus_srgp": summary["kalman_refit"]["prequential_nll"]
        - summary["srgp"]["prequential_nll"],
        "prequential_rmse_kalman_refit_vs_svgp_3x": summary["kalman_refit"]["prequential_rmse"]
        / summary["svgp_3x"]["prequential_rmse"],
        "prequential_nll_kalman_refit_minus_svgp_3x": summary["kalman_refit"]["prequential_nll"]
        - summary["svgp_3x"]["prequential_nll"],
    }
    config = {
        "dataset": "kuka (10 trajectories in order; target: joint 1's velocity change over one step)",
        "rows": x.size(0),
        **{key: value for key, value in vars(args).items() if key not in ("run", "output_dir", "data_dir")},
        "dtype": "float64",
        "clock": "thread CPU time, one thread",
        "load_average_at_end": os.getloadavg(),
        "warmup_fit_noise_only": warm_fit.noise_only,
    }
    payload = benchmark_payload(
        NAME,
        config,
        [],
        ratios,
        GOALS,
        ratio_notes=RATIO_NOTES,
        summary=summary,
        refit_warnings=refit_warnings,
        srgp_warnings=len(srgp_warnings),
        curves={name: rows[name] for name in METHODS},
        noise=noise,
    )
    output = Path(args.output_dir)
    write_results(output / f"{NAME}.json", payload)
    _plot(rows, noise, output / f"{NAME}.png")
    for name in METHODS:
        print(f"{name:13s} " + ", ".join(f"{key} {value:.4f}" for key, value in summary[name].items()))
    print("\n" + format_ratios(payload))
    return payload


def _mean_rmse(rows: list[dict]) -> float:
    return math.sqrt(sum(row["squared_error"] for row in rows) / sum(row["count"] for row in rows))


def _mean_nll(rows: list[dict]) -> float:
    return sum(row["nll"] for row in rows) / sum(row["count"] for row in rows)


LABELS = {
    "kalman_refit": "Kalman + windowed refits (recipe)",
    "kalman_fixed": "Kalman, warm-up hyperparameters",
    "srgp": "SRGP in one pass (Adam step per batch)",
    "svgp": "SVGP retrained on all data, same CPU time",
    "svgp_3x": "SVGP retrained on all data, 3x the CPU time",
}


def _plot(rows: dict, noise: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for name in METHODS:
        steps = [row["rows"] for row in rows[name]]
        counts = torch.tensor([float(row["count"]) for row in rows[name]]).cumsum(0)
        nll = torch.tensor([row["nll"] for row in rows[name]]).cumsum(0) / counts
        rmse = (torch.tensor([row["squared_error"] for row in rows[name]]).cumsum(0) / counts).sqrt()
        axes[0].plot(steps, nll, label=LABELS[name])
        axes[1].plot(steps, rmse, label=LABELS[name])
        axes[2].plot(steps, noise[name], label=LABELS[name])
    axes[0].set_ylabel("prequential test NLL (running mean)")
    axes[1].set_ylabel("prequential RMSE (running)")
    axes[2].set_ylabel("noise variance")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("time steps seen")
    axes[0].legend(fontsize=8)
    fig.suptitle("KUKA stream: each batch of 100 steps predicted before it is learned")
    fig.tight_layout()
    save_figure(fig, path)


STREAMING = Benchmark(
    NAME,
    "learning on a real stream (KUKA): Kalman with windowed collapsed-bound refits vs SVGP retrained on all data at "
    "the same CPU time, prequential NLL and RMSE",
    _add_arguments,
    _run,
)
