"""``bench dual``: t-SVGP (this package's dual parameterization) against GPyTorch's q-SVGP.

Three parts, one process. t-SVGP is :class:`~benchmarks.methods.DualMethod` (closed-form E-step
:class:`~gpytorch_decoupled.optim.DualEStep`, M-step on :class:`~gpytorch_decoupled.mlls.DualVariationalELBO`); q-SVGP
is :class:`~benchmarks.methods.QSVGPMethod` (GPyTorch's whitened ``VariationalStrategy`` with a
``NaturalVariationalDistribution``: E-step = one ``gpytorch.optim.NGD`` step on the ``VariationalELBO`` with the
hyperparameters fixed, M-step = Adam on the same ELBO with :math:`q` fixed). Both start from the same inducing inputs
and initial hyperparameters.

1. **E-step cost** (Adam et al. 2021, supplement Fig. 5: the constant-factor saving comes from the E-step). On kin40k
   split 0 (Gaussian likelihood, scaled ARD squared-exponential kernel, hyperparameters fixed at their initial values),
   mini-batches of 200, :math:`M = 100, 250, 500`: seconds of one t-SVGP E-step (``DualEStep.step``) against one
   q-SVGP E-step (forward and backward of the ELBO with respect to the natural parameters, then the NGD step), both of
   the same size on the same batch sequence, interleaved (alternating which goes first) in one process; the ratio is
   the median over ``--estep-repeats`` repeats after ``--warmup`` of the two times measured back to back (robust to the
   load of a shared machine, which moves both between a fast and a slow mode). Both are the same natural-gradient step
   (Adam et al. 2021; docs/derivations.md, "The E-step is one natural-gradient step"); the largest difference of their
   test predictive means at the end is recorded as a check.
2. **EM convergence** (supplement F.1, Fig. 3). Airfoil, Boston housing and concrete (Gaussian likelihood) and sonar,
   ionosphere and Pima diabetes (Bernoulli, probit), 5-fold cross-validation: :math:`M = 50` inducing inputs from
   K-means (scikit-learn, fixed seed), learned in the M-step; Matérn-5/2 ARD kernel with length-scales, variance and
   noise initialized at 1; full batch, float64; 20 EM iterations, each an E-step (one step of size 1 for Gaussian
   data, 8 steps of size 0.7 otherwise) and an M-step (15 Adam steps at 0.2). The ELBO / N on the training fold and
   the test NLPD (and accuracy) are recorded after each E-step, as the paper's scripts do. Per data set, the goal
   counts the first EM iteration at which each method's fold-mean ELBO reaches q-SVGP's final fold-mean ELBO.
   The classification sets use the registry's 5-fold protocol; the regression sets (published 90/10 splits in the
   registry) are pooled and split by the same protocol here (plain 5-fold over ``numpy.random.default_rng(0)``'s
   permutation, standardized with training-fold statistics).
3. **Multiclass** (supplement F.2 on a small set). scikit-learn's bundled digits (1,797 × 64, pixels / 16; a seeded
   20% test split), softmax likelihood with one latent GP per class (batch of 10 inside
   :class:`~gpytorch_decoupled.variational.IndependentMultitaskVariationalStrategy`), Matérn-5/2 ARD at 1,
   :math:`M = 100`, mini-batches of 200, one E-step (size 0.03) and one Adam M-step (0.02) per iteration as in the
   paper's MNIST notebook: test accuracy against training wall-clock (evaluations excluded), and the time each
   method needs to first reach the target accuracies. The two train in lockstep (one iteration each in turn, on the
   same mini-batches), so that load from other jobs on a shared machine slows both alike.

The run options ``--iterations``, ``--eval-every``, ``--time-budget`` and ``--dtype`` apply to part 3 (and ``--dtype``
to part 1); ``--batch-size`` and ``--seed`` to parts 1 and 3; ``--warmup``, ``--split`` and ``--max-train-rows`` to part
1 (part 3 has ``--digits-warmup``). Part 2 always runs in float64.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import gpytorch
import numpy as np
import torch
from torch import Tensor

from gpytorch_decoupled import datasets
from gpytorch_decoupled.datasets.readers import KFOLD_SEED

from .benchmark import Benchmark
from .benchmark_parts import PartRunner, publish_parts, run_parts
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .method_result import MethodResult
from .methods import EMMethod, Method, build_method
from .metrics import classification_test_metrics, gaussian_test_metrics
from .report import format_table, plot_curves, pyplot, save_figure
from .run_config import RunConfig
from .runner import _minibatches, split_tensors, timed_call, train_in_lockstep

NAME = "dual"
PARTS = ("estep", "em", "digits")
OURS, BASELINE = "dual", "q-svgp"
#: The keyword of each method's E-step size.
E_STEP_LR = {OURS: "e_step_lr", BASELINE: "ngd_lr"}

ESTEP_GOAL = "estep_time_vs_ngd"
EM_GOAL = "datasets_where_tsvgp_reaches_qsvgp_final_elbo_sooner_fraction_higher_is_better"
DIGITS_RATIO = "digits_time_to_accuracy_vs_qsvgp"

GOALS = {
    ESTEP_GOAL: 0.5,
    # "Most" data sets: strictly more than half (4 of 6); the payload compares with >=, so the bound is just above 1/2.
    EM_GOAL: 0.51,
}

RATIO_NOTES = {
    ESTEP_GOAL: (
        "the largest over M = 100, 250, 500 of the median over repeats of t-SVGP's ÷ q-SVGP's seconds per E-step, "
        "the two timed back to back on the same batch (batch 200, hyperparameters fixed); the goal holds at every M. "
        "estep.sizes[].ratio_of_medians is the ratio of the two medians"
    ),
    "estep_time_vs_ngd_at_M": "the same ratio at one M (key suffix); no goal",
    EM_GOAL: (
        "fraction of the UCI data sets on which t-SVGP's fold-mean ELBO reaches q-SVGP's final (EM iteration 20) "
        "fold-mean ELBO at an earlier EM iteration than q-SVGP itself does; goal: more than half"
    ),
    "datasets_where_tsvgp_final_nlpd_is_lower_fraction_higher_is_better": (
        "fraction of the UCI data sets on which t-SVGP's fold-mean test NLPD after the last E-step is below "
        "q-SVGP's; no goal"
    ),
    DIGITS_RATIO: (
        "digits: t-SVGP's ÷ q-SVGP's training wall-clock until the test accuracy first reaches the target "
        "(digits.target_accuracy); no goal (the issue sets none)"
    ),
    "digits_seconds_per_iteration_vs_qsvgp": "digits: median seconds per iteration (E-step + M-step); no goal",
    "digits_training_time_vs_qsvgp": "digits: total training seconds of all iterations (same number each); no goal",
}

UCI_DATASETS = ("airfoil", "housing", "concrete", "sonar", "ionosphere", "pima")
DIGITS_CLASSES = 10


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=150, eval_every=1)
    parser.set_defaults(batch_size=200)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)
    estep = parser.add_argument_group("E-step cost (part 1)")
    estep.add_argument("--dataset", default="kin40k", help="regression data set (Gaussian likelihood)")
    estep.add_argument("--estep-sizes", type=int, nargs="+", default=[100, 250, 500], help="inducing points M")
    estep.add_argument("--estep-repeats", type=int, default=300, help="timed E-steps per method and M after warm-up")
    estep.add_argument("--estep-lr", type=float, default=0.1, help="E-step size of both methods")
    em = parser.add_argument_group("EM convergence (part 2, supplement F.1)")
    em.add_argument("--uci-datasets", nargs="+", default=list(UCI_DATASETS))
    em.add_argument("--folds", type=int, default=5, help="cross-validation folds")
    em.add_argument("--max-folds", type=int, default=None, help="run only the first folds (quick runs)")
    em.add_argument("--em-iterations", type=int, default=20)
    em.add_argument("--em-inducing", type=int, default=50, help="M, initialized by K-means")
    em.add_argument("--m-steps", type=int, default=15, help="Adam steps per M-step")
    em.add_argument("--m-lr", type=float, default=0.2, help="Adam learning rate of the M-step")
    em.add_argument("--gaussian-e-steps", type=int, default=1, help="E-step iterations, Gaussian likelihood")
    em.add_argument("--gaussian-e-lr", type=float, default=1.0)
    em.add_argument("--bernoulli-e-steps", type=int, default=8, help="E-step iterations, Bernoulli likelihood")
    em.add_argument("--bernoulli-e-lr", type=float, default=0.7)
    digits = parser.add_argument_group("multiclass (part 3, scikit-learn digits)")
    digits.add_argument("--digits-inducing", type=int, default=100)
    digits.add_argument("--digits-e-lr", type=float, default=0.03, help="E-step size of both methods")
    digits.add_argument("--digits-m-lr", type=float, default=0.02, help="Adam learning rate of the M-step")
    digits.add_argument("--digits-test-fraction", type=float, default=0.2)
    digits.add_argument(
        "--digits-targets",
        type=float,
        nargs="+",
        default=[0.9, 0.95],
        help="test accuracies to time; the first one gives the ratio",
    )
    digits.add_argument("--digits-samples", type=int, default=64, help="Monte Carlo draws per test prediction")
    digits.add_argument(
        "--digits-warmup",
        type=int,
        default=1,
        help="iterations left out of the median time (the test accuracy is evaluated from the next one on)",
    )


# ---------------------------------------------------------------------------------------------- shared pieces
def matern52_kernel(num_dims: int, batch_shape: torch.Size = torch.Size([])) -> gpytorch.kernels.ScaleKernel:
    """The paper's kernel: Matérn-5/2 with one length-scale per input, length-scales and variance initialized at 1."""
    kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=num_dims, batch_shape=batch_shape), batch_shape=batch_shape
    )
    kernel.outputscale = 1.0
    kernel.base_kernel.lengthscale = 1.0
    return kernel


def _build_pair(
    train_x: Tensor,
    train_y: Tensor,
    e_step_lr: float,
    seed: int,
    make_modules: Callable[[], dict] | None = None,
    **options,
) -> dict[str, EMMethod]:
    """t-SVGP and q-SVGP with the same options; ``make_modules()`` gives each its own fresh kernel and likelihood."""
    return {
        name: build_method(
            name, train_x, train_y, seed=seed, **{E_STEP_LR[name]: e_step_lr}, **options, **(make_modules or dict)()
        )
        for name in (OURS, BASELINE)
    }


def _uci_modules(task: str, num_dims: int) -> dict:
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    if task == "regression":
        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        likelihood.noise = 1.0
    return {"covar_module": matern52_kernel(num_dims), "likelihood": likelihood}


def _digits_modules(num_dims: int) -> dict:
    return {
        "covar_module": matern52_kernel(num_dims, torch.Size([DIGITS_CLASSES])),
        "likelihood": gpytorch.likelihoods.SoftmaxLikelihood(
            num_features=DIGITS_CLASSES, num_classes=DIGITS_CLASSES, mixing_weights=False
        ),
    }


# ---------------------------------------------------------------------------------------------- part 1
ESTEP_COLUMNS = (
    ("method", "label", "{}"),
    ("inducing sizes", "sizes", "{}"),
    ("s / E-step", "seconds_per_iteration", "{:.5f}"),
    ("timed E-steps", "iterations", "{}"),
)


def _estep_cost(args: argparse.Namespace, config: RunConfig) -> tuple[dict, list[MethodResult]]:
    split = load_split(args, args.dataset)
    (train_x, train_y), (test_x, _) = split_tensors(split, config)
    device = train_x.device
    sizes, rows, results = sorted(args.estep_sizes), [], []
    for size in sizes:
        methods = _build_pair(train_x, train_y, args.estep_lr, config.seed, num_inducing=size)
        for method in methods.values():
            for parameter in method.m_parameters:
                parameter.requires_grad_(False)
        times = {name: [] for name in methods}
        batches = _minibatches(train_x, train_y, config.batch_size, config.seed)
        for repeat in range(config.warmup + args.estep_repeats):
            x, y = next(batches)
            # Alternate which method goes first, so that neither always runs on a warmer cache.
            for name in list(methods)[:: 1 if repeat % 2 == 0 else -1]:
                times[name].append(timed_call(methods[name].e_step, x, y, device=device))
        timed = {name: values[config.warmup :] for name, values in times.items()}
        medians = {name: statistics.median(values) for name, values in timed.items()}
        # Each pair ran back to back on the same batch: its ratio is robust to the load of a shared machine, which
        # switches both methods' times between a fast and a slow mode.
        paired = statistics.median(ours / theirs for ours, theirs in zip(timed[OURS], timed[BASELINE]))
        means = {name: method.predict(test_x[:1000])[0] for name, method in methods.items()}
        for name, method in methods.items():
            result = MethodResult(name=f"{name}@estep/M={size}", label=method.label, sizes=f"M={size}")
            result.seconds_per_iteration = medians[name]
            result.iterations = args.estep_repeats
            results.append(result)
        rows.append(
            {
                "num_inducing": size,
                "seconds_per_estep": medians,
                "ratio": paired,
                "ratio_of_medians": medians[OURS] / medians[BASELINE],
                "max_test_mean_difference": (means[OURS] - means[BASELINE]).abs().max().item(),
            }
        )
    summary = {
        **split_config(split),
        "likelihood": "Gaussian",
        "kernel": "scaled ARD squared exponential (initial hyperparameters, fixed)",
        "batch_size": config.batch_size,
        "e_step_lr": args.estep_lr,
        "warmup": config.warmup,
        "repeats": args.estep_repeats,
        "sizes": rows,
        "max_test_mean_difference_note": (
            "largest |t-SVGP − q-SVGP| predictive mean (standardized units) on 1,000 test rows after the same "
            "E-steps: both are one natural-gradient step (identity T5), so this is rounding (and GPyTorch's random "
            "initial mean of scale 1e-3, decayed by (1 − r) per step)"
        ),
    }
    return summary, results


# ---------------------------------------------------------------------------------------------- part 2
def cross_validation_split(name: str, fold: int, num_folds: int, data_dir: str | None = None) -> datasets.Split:
    """
    Fold ``fold`` of the t-SVGP paper's K-fold protocol for any registry data set, in float64: the registry's own
    split where its splits are these folds (sonar, ionosphere, Pima); otherwise every row of the set, split into a
    plain K-fold over the permutation drawn by ``numpy.random.default_rng(0)`` and standardized with the training
    fold's statistics (the registry's regression splits are 90/10 hold-outs).
    """
    entry = datasets.info(name)
    if entry.source == "tsvgp" and entry.num_splits == num_folds:
        return datasets.load(name, split=fold, data_dir=data_dir, dtype=torch.float64)
    whole = datasets.load(name, split=0, data_dir=data_dir, dtype=torch.float64)
    x = torch.cat([whole.train_x, whole.test_x]) * whole.x_std + whole.x_mean
    y = torch.cat([whole.train_y, whole.test_y]) * whole.y_std + whole.y_mean
    folds = np.array_split(np.random.default_rng(KFOLD_SEED).permutation(x.size(0)), num_folds)
    is_test = torch.zeros(x.size(0), dtype=torch.bool)
    is_test[torch.as_tensor(folds[fold])] = True
    x_mean, x_std = x[~is_test].mean(0), x[~is_test].std(0, unbiased=False)
    x_std = torch.where(x_std > 0, x_std, torch.ones_like(x_std))
    y_mean, y_std = torch.zeros(()), torch.ones(())
    if entry.task == "regression":
        y_mean, y_std = y[~is_test].mean(), y[~is_test].std(unbiased=False)
    return datasets.Split(
        train_x=(x[~is_test] - x_mean) / x_std,
        train_y=(y[~is_test] - y_mean) / y_std,
        test_x=(x[is_test] - x_mean) / x_std,
        test_y=(y[is_test] - y_mean) / y_std,
        name=whole.name,
        task=entry.task,
        split=fold,
        source=f"{whole.source}, pooled {num_folds}-fold",
        x_mean=x_mean,
        x_std=x_std,
        y_mean=y_mean.to(x),
        y_std=y_std.to(x),
    )


def kmeans_inducing_points(x: Tensor, num_inducing: int, seed: int) -> Tensor:
    """K-means cluster centres of the inputs (scikit-learn, ``random_state=seed``), as the paper initializes Z."""
    from sklearn.cluster import KMeans

    centres = KMeans(n_clusters=num_inducing, random_state=seed, n_init=10).fit(x.cpu().numpy()).cluster_centers_
    return torch.as_tensor(centres).to(x)


def _test_metrics(method: Method, split: datasets.Split, num_samples: int = 64) -> dict[str, float]:
    if split.task == "regression":
        return gaussian_test_metrics(*method.predict(split.test_x), split.test_y, split.y_std)
    return classification_test_metrics(method.predict_probabilities(split.test_x, num_samples), split.test_y)


def _em_trace(method: EMMethod, split: datasets.Split, e_steps: int, args: argparse.Namespace) -> list[dict]:
    """The paper's EM loop on the full training fold; ELBO / N and test metrics after each E-step."""
    x, y, device = split.train_x, split.train_y, split.train_x.device
    trace = []
    for iteration in range(1, args.em_iterations + 1):
        e_seconds = sum(timed_call(method.e_step, x, y, device=device) for _ in range(e_steps))
        point = {"iteration": iteration, "elbo": method.objective(), **_test_metrics(method, split)}
        m_seconds = sum(timed_call(method.m_step, x, y, device=device) for _ in range(args.m_steps))
        trace.append({**point, "e_seconds": e_seconds, "m_seconds": m_seconds})
    return trace


def _first_reaching(curve: list[float], level: float) -> int | None:
    """The first EM iteration (1-based) whose value is at least ``level``."""
    return next((iteration for iteration, value in enumerate(curve, 1) if value >= level), None)


def _em_dataset(name: str, args: argparse.Namespace) -> tuple[dict, list[MethodResult]]:
    """Both methods on every fold of one data set: fold-mean curves, and when each reaches q-SVGP's final ELBO."""
    task = datasets.info(name).task
    if task == "regression":
        e_steps, e_lr = args.gaussian_e_steps, args.gaussian_e_lr
    else:
        e_steps, e_lr = args.bernoulli_e_steps, args.bernoulli_e_lr
    num_folds = args.folds if args.max_folds is None else min(args.max_folds, args.folds)
    traces, train_rows, labels = {OURS: [], BASELINE: []}, [], {}
    for fold in range(num_folds):
        split = cross_validation_split(name, fold, args.folds, args.data_dir)
        train_rows.append(split.train_x.size(0))
        methods = _build_pair(
            split.train_x,
            split.train_y,
            e_lr,
            args.seed,
            partial(_uci_modules, task, split.train_x.size(-1)),
            num_inducing=args.em_inducing,
            inducing_points=kmeans_inducing_points(split.train_x, args.em_inducing, args.seed),
            lr=args.m_lr,
        )
        for method_name, method in methods.items():
            labels[method_name] = method.label
            traces[method_name].append(_em_trace(method, split, e_steps, args))

    keys = [key for key in traces[OURS][0][0] if key != "iteration"]
    means = {
        method_name: {
            key: [statistics.fmean(trace[t][key] for trace in runs) for t in range(args.em_iterations)] for key in keys
        }
        for method_name, runs in traces.items()
    }
    target = means[BASELINE]["elbo"][-1]
    reached = {method_name: _first_reaching(curves["elbo"], target) for method_name, curves in means.items()}
    fold_targets = [trace[-1]["elbo"] for trace in traces[BASELINE]]
    per_fold = {
        method_name: [
            _first_reaching([point["elbo"] for point in trace], level) for trace, level in zip(runs, fold_targets)
        ]
        for method_name, runs in traces.items()
    }
    summary = {
        "task": task,
        "folds": num_folds,
        "train_rows": train_rows,
        "e_steps": e_steps,
        "e_step_lr": e_lr,
        "qsvgp_final_elbo": target,
        "em_iterations_to_qsvgp_final_elbo": reached,
        "tsvgp_sooner": reached[OURS] is not None and reached[OURS] < reached[BASELINE],
        "per_fold_em_iterations_to_qsvgp_final_elbo": per_fold,
        "fold_means": means,
        "per_fold": traces,
    }
    results = []
    for method_name, curves in means.items():
        result = MethodResult(name=f"{method_name}@{name}", label=labels[method_name], sizes=f"M={args.em_inducing}")
        seconds = [point["e_seconds"] + point["m_seconds"] for trace in traces[method_name] for point in trace]
        result.seconds_per_iteration, result.train_seconds = statistics.median(seconds), sum(seconds)
        result.iterations = args.em_iterations
        result.rmse = curves["rmse"][-1] if "rmse" in curves else math.nan
        result.nll, result.objective = curves["nll"][-1], curves["elbo"][-1]
        result.curve = [
            {"iteration": t + 1, **{key: curves[key][t] for key in keys}} for t in range(args.em_iterations)
        ]
        results.append(result)
    return summary, results


def _em(args: argparse.Namespace) -> tuple[dict, list[MethodResult]]:
    per_dataset, results = {}, []
    for name in args.uci_datasets:
        per_dataset[name], dataset_results = _em_dataset(name, args)
        results += dataset_results
    sooner = [summary["tsvgp_sooner"] for summary in per_dataset.values()]
    lower_nlpd = [
        summary["fold_means"][OURS]["nll"][-1] < summary["fold_means"][BASELINE]["nll"][-1]
        for summary in per_dataset.values()
    ]
    summary = {
        "datasets": per_dataset,
        "sooner_fraction": statistics.fmean(sooner),
        "lower_nlpd_fraction": statistics.fmean(lower_nlpd),
        "schedule": {
            "em_iterations": args.em_iterations,
            "m_steps": args.m_steps,
            "m_lr": args.m_lr,
            "gaussian_e_steps": args.gaussian_e_steps,
            "gaussian_e_lr": args.gaussian_e_lr,
            "bernoulli_e_steps": args.bernoulli_e_steps,
            "bernoulli_e_lr": args.bernoulli_e_lr,
            "num_inducing": args.em_inducing,
            "inducing_init": f"sklearn KMeans(n_clusters={args.em_inducing}, random_state={args.seed}, n_init=10)",
            "kernel": "Matérn-5/2 ARD, length-scales and variance 1; Gaussian noise 1",
            "dtype": "float64",
            "full_batch": True,
            "recorded": "ELBO / N (training fold) and test metrics after each E-step, before the M-step",
        },
    }
    return summary, results


def _print_em(summary: dict) -> None:
    print(
        f"{'data set':11s} {'method':30s} {'ELBO/N':>9s} {'NLPD':>8s} {'accuracy':>8s} {'reaches q-SVGP final':>20s} "
        f"{'s / EM it':>9s}"
    )
    for name, dataset in summary["datasets"].items():
        for method_name in (OURS, BASELINE):
            curves = dataset["fold_means"][method_name]
            reached = dataset["em_iterations_to_qsvgp_final_elbo"][method_name]
            accuracy = f"{curves['accuracy'][-1]:8.3f}" if "accuracy" in curves else f"{'':8s}"
            seconds = statistics.fmean(curves["e_seconds"]) + statistics.fmean(curves["m_seconds"])
            print(
                f"{name:11s} {method_name:30s} {curves['elbo'][-1]:9.4f} {curves['nll'][-1]:8.4f} {accuracy} "
                f"{'never' if reached is None else reached:>20} {seconds:9.4f}"
            )
    print("(fold means after the last E-step; NLPD of regression sets in original units)")


def _plot_em(summary: dict, path: Path) -> Path | None:
    """Fold-mean ELBO / N and test NLPD per EM iteration, one column per data set (the paper's Fig. 3)."""
    plt = pyplot()
    if plt is None:
        return None
    names = list(summary["datasets"])
    figure, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 5.5), squeeze=False)
    for column, name in enumerate(names):
        dataset = summary["datasets"][name]
        for method_name, label in ((OURS, "t-SVGP (ours)"), (BASELINE, "q-SVGP (GPyTorch)")):
            curves = dataset["fold_means"][method_name]
            iterations = range(1, len(curves["elbo"]) + 1)
            for row, key in enumerate(("elbo", "nll")):
                axes[row][column].plot(iterations, curves[key], marker=".", label=label)
        axes[0][column].set_title(name)
        axes[1][column].set_xlabel("EM iteration")
    axes[0][0].set_ylabel("ELBO / N (training fold)")
    axes[1][0].set_ylabel("test NLPD")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle("EM with a full batch, M=50, fold means over 5-fold CV (after each E-step)")
    return save_figure(figure, path, dpi=110)


# ---------------------------------------------------------------------------------------------- part 3
def digits_split(seed: int, test_fraction: float, dtype: torch.dtype, device: str) -> tuple[tuple, tuple]:
    """scikit-learn's bundled digits (no download): pixels / 16, labels 0..9, a seeded random test fraction."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=dtype) / 16
    y = torch.as_tensor(digits.target, dtype=torch.long)
    order = torch.randperm(x.size(0), generator=torch.Generator().manual_seed(seed))
    num_test = round(test_fraction * x.size(0))
    test, train = order[:num_test], order[num_test:]
    return (x[train].to(device), y[train].to(device)), (x[test].to(device), y[test].to(device))


def time_to_accuracy(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation whose test accuracy is at least ``target``."""
    return next((point["seconds"] for point in curve if point["accuracy"] >= target), None)


def _digits(args: argparse.Namespace, config: RunConfig) -> tuple[dict, list[MethodResult]]:
    train, test = digits_split(config.seed, args.digits_test_fraction, config.dtype, config.device)
    # The runner evaluates nothing during warm-up, and the accuracy crosses 0.9 within about ten iterations.
    config = replace(config, warmup=args.digits_warmup)

    def metrics(method: Method, x: Tensor, y: Tensor) -> dict[str, float]:
        return classification_test_metrics(method.predict_probabilities(x, args.digits_samples), y)

    methods = _build_pair(
        *train,
        args.digits_e_lr,
        config.seed,
        partial(_digits_modules, train[0].size(-1)),
        num_inducing=args.digits_inducing,
        num_latents=DIGITS_CLASSES,
        lr=args.digits_m_lr,
    )
    # In lockstep: on a shared machine, load changes then slow both methods alike.
    named = [(f"{name}@digits", method) for name, method in methods.items()]
    results = train_in_lockstep(named, train, test, 1.0, config, test_metrics=metrics)
    times = {
        f"{target:g}": {result.name.split("@")[0]: time_to_accuracy(result.curve, target) for result in results}
        for target in args.digits_targets
    }
    summary = {
        "train_rows": train[0].size(0),
        "test_rows": test[0].size(0),
        "target_accuracy": args.digits_targets[0],
        "seconds_to_accuracy": times,
        "final_accuracy": {result.name.split("@")[0]: result.curve[-1]["accuracy"] for result in results},
        "best_accuracy": {result.name.split("@")[0]: max(p["accuracy"] for p in result.curve) for result in results},
        "e_step_lr": args.digits_e_lr,
        "m_lr": args.digits_m_lr,
        "num_inducing": args.digits_inducing,
        "likelihood": "SoftmaxLikelihood(num_features=10, num_classes=10, mixing_weights=False), 10 latent GPs",
        "kernel": "Matérn-5/2 ARD per latent, length-scales and variance 1",
        "prediction_samples": args.digits_samples,
    }
    return summary, results


def _print_digits(summary: dict, results: list[MethodResult]) -> None:
    print(
        f"{'method':30s} {'s / iteration':>13s} {'iterations':>10s} {'training s':>10s} {'final accuracy':>14s} "
        f"{'final NLPD':>10s}"
    )
    for result in results:
        print(
            f"{result.label:30s} {result.seconds_per_iteration:13.4f} {result.iterations:10d} "
            f"{result.train_seconds:10.2f} {result.curve[-1]['accuracy']:14.3f} {result.nll:10.4f}"
        )
    for target, seconds in summary["seconds_to_accuracy"].items():
        text = ", ".join(f"{name} {'never' if value is None else f'{value:.2f} s'}" for name, value in seconds.items())
        print(f"training time to test accuracy {target}: {text}")


# ---------------------------------------------------------------------------------------------- the benchmark
def _ratio(ours: float | None, theirs: float | None) -> float:
    return math.nan if ours is None or not theirs else ours / theirs


def _estep_part(args: argparse.Namespace, config: RunConfig, output: Path) -> tuple[dict, list, dict]:
    estep, results = _estep_cost(args, config)
    ratios = {f"estep_time_vs_ngd_at_M{row['num_inducing']}": row["ratio"] for row in estep["sizes"]}
    ratios[ESTEP_GOAL] = max(ratios.values())
    print(f"\nE-step cost on {estep['dataset']} ({estep['train_rows']} training rows), batch {config.batch_size}\n")
    print(format_table(results, ESTEP_COLUMNS).rsplit("\n", 1)[0])
    for row in estep["sizes"]:
        print(
            f"  M={row['num_inducing']}: t-SVGP ÷ NGD = {row['ratio']:.3f} (median of back-to-back pairs; ratio of "
            f"medians {row['ratio_of_medians']:.3f}); largest test-mean difference "
            f"{row['max_test_mean_difference']:.1e}"
        )
    return estep, results, ratios


def _em_part(args: argparse.Namespace, config: RunConfig, output: Path) -> tuple[dict, list, dict]:
    em, results = _em(args)
    ratios = {
        EM_GOAL: em["sooner_fraction"],
        "datasets_where_tsvgp_final_nlpd_is_lower_fraction_higher_is_better": em["lower_nlpd_fraction"],
    }
    print(f"\nEM convergence, {args.em_iterations} EM iterations, {args.folds}-fold CV\n")
    _print_em(em)
    _plot_em(em, output / f"{NAME}.png")
    return em, results, ratios


def _digits_part(args: argparse.Namespace, config: RunConfig, output: Path) -> tuple[dict, list, dict]:
    digits, results = _digits(args, config)
    by_method = {result.name.split("@")[0]: result for result in results}
    seconds = digits["seconds_to_accuracy"][f"{digits['target_accuracy']:g}"]
    ratios = {
        DIGITS_RATIO: _ratio(seconds[OURS], seconds[BASELINE]),
        "digits_seconds_per_iteration_vs_qsvgp": (
            by_method[OURS].seconds_per_iteration / by_method[BASELINE].seconds_per_iteration
        ),
        "digits_training_time_vs_qsvgp": by_method[OURS].train_seconds / by_method[BASELINE].train_seconds,
    }
    print(f"\ndigits: {digits['train_rows']} training, {digits['test_rows']} test rows, batch {config.batch_size}\n")
    _print_digits(digits, results)
    plot_curves(
        results,
        output / f"{NAME}-digits.png",
        metric="accuracy",
        title="digits, softmax, M=100, batch 200: test accuracy over training time",
        ylabel="test accuracy",
        reference=(digits["target_accuracy"], f"target {digits['target_accuracy']:g}"),
    )
    return digits, results, ratios


PART_RUNNERS: dict[str, PartRunner] = {"estep": _estep_part, "em": _em_part, "digits": _digits_part}


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    output = Path(args.output_dir)
    outcome = run_parts(PART_RUNNERS, args.parts, args, config, output)
    run = {**config.to_json(), "parts": args.parts, "methods": {"ours": OURS, "baseline": BASELINE}}
    return publish_parts(NAME, run, outcome, GOALS, RATIO_NOTES, args.device, output)


DUAL = Benchmark(
    NAME,
    "t-SVGP vs GPyTorch's q-SVGP: E-step time vs NGD at M = 100, 250, 500; EM convergence on six UCI sets (5-fold); "
    "time to accuracy on digits (softmax)",
    _add_arguments,
    _run,
)
