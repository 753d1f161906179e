"""``bench mean-basis-adam``: one default rate of :class:`~gpytorch_decoupled.optim.MeanBasisAdam` from
:math:`M_\\gamma = 500` to :math:`10^5`, for Gaussian, Bernoulli and softmax likelihoods, with no per-set tuning
(issue 18, item 2).

Every case trains OrthNat or Hybrid exactly as the benchmark methods build them by default (MeanBasisAdam at its
default rate on the mean coefficients, Adam 0.01 on the hyperparameters and inducing inputs, NGD 0.1 on OrthNat's
covariance block), mini-batches of 256, float32, and evaluates the test NLL (and accuracy) every ``--eval-every``
iterations:

* **regression** on kin40k, protein, elevators, pol, bike, keggdirected and KUKA (split 0; KUKA's ``qd1(t+1)``):
  OrthNat at :math:`M_\\gamma = 500` and :math:`10^4`, Hybrid at :math:`10^4`, with GPyTorch's SVGP (:math:`M = 200`)
  trained by Adam and by NGD 0.1 + Adam as controls (the same criterion applied to them, outside the goal: a
  transient that GPyTorch's own natural-gradient SVGP shows on the same batches is not the mean step's); OrthNat at
  :math:`M_\\gamma = 40{,}000` on protein (the basis drawn from its 41,157 training rows); and OrthNat at
  :math:`M_\\gamma = 10^5` on a synthetic set of 120,000 rows (no real set here has :math:`10^5` rows);
* **binary classification** (Bernoulli likelihood, probit link): pima at :math:`M_\\gamma = 500` and ionosphere at
  :math:`M_\\gamma = 280` (every training row: the real binary sets here are small), OrthNat and Hybrid, with
  GPyTorch's SVGP-Adam (:math:`M = 100`) as the reference accuracy; and a synthetic set of 20,000 rows at
  :math:`M_\\gamma = 500, 2000, 10^4`;
* **softmax** (three classes, one latent GP each): a synthetic set of 10,000 rows, Hybrid at :math:`M_\\gamma = 500`
  and :math:`5000` (OrthNat's NGD step 0.1 on the covariance block, with the softmax's Monte Carlo gradients, leaves
  the natural parameters' precision indefinite within 20 iterations: a matter of the covariance block's step, not of
  the mean coefficients').

A case **diverged** when a test metric is not finite or the final test NLL is above the initial one; it
**oscillates** when, over the second half of training, the test NLL rises more than ``--nll-tolerance`` above its
running minimum, or the accuracy falls more than ``--accuracy-tolerance`` below its running maximum (the issue's
failure: plain Adam at the README's old rates oscillating at 0.675 accuracy where SVGP reached 0.965). The goal is no
case of either kind.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import gpytorch
import torch
from torch import Tensor

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config
from .decoupled_accuracy_benchmark import output_splits
from .method_result import MethodResult
from .methods import Method, build_method
from .metrics import classification_test_metrics
from .report import benchmark_payload, format_ratios, pyplot, save_figure, write_results
from .runner import split_tensors, train_and_evaluate

NAME = "mean-basis-adam"
GOAL = "cases_that_diverge_or_oscillate"
GOALS = {GOAL: 0}
#: GPyTorch's SVGP, the controls: Adam (and the reference accuracy of classification) and NGD 0.1 + Adam.
REFERENCES = ("svgp", "svgp-ngd")
REGRESSION = ("kin40k", "protein", "elevators", "pol", "bike", "keggdirected", "kuka")
RATIO_NOTES = {
    GOAL: "cases (data set, method, Mγ) that diverged or oscillated with MeanBasisAdam's default rate; goal: none",
    "<method>_accuracy_minus_svgp_on_<set>": "final test accuracy minus SVGP-Adam's on the same set; no goal",
    "<control>_cases_that_diverge_or_oscillate": (
        "the same criterion for GPyTorch's SVGP with Adam (svgp) and with NGD 0.1 + Adam (svgp-ngd), M = 200, on the "
        "regression sets; no goal"
    ),
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=400, eval_every=25)
    parser.set_defaults(clock="wall" if torch.cuda.is_available() else "thread")
    parser.add_argument("--datasets", nargs="+", default=list(REGRESSION), help="real regression sets")
    parser.add_argument("--skip", nargs="*", default=[], choices=("regression", "large", "binary", "softmax"))
    parser.add_argument("--nll-tolerance", type=float, default=0.1, help="largest rise of the test NLL (nats)")
    parser.add_argument("--accuracy-tolerance", type=float, default=0.05, help="largest fall of the test accuracy")
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)


def _synthetic_inputs(rows: int, dims: int, generator: torch.Generator) -> Tensor:
    return 4 * torch.rand(rows, dims, generator=generator) - 2


def _latent(x: Tensor, phase: float) -> Tensor:
    """A smooth test function with several length-scales."""
    return torch.sin(2.5 * x[:, 0] + phase) + torch.cos(1.7 * x[:, 1] - phase) + 0.5 * x[:, 0] * x[:, 1]


def _synthetic(kind: str, rows: int, test_rows: int, seed: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Standardized synthetic train and test sets: ``"regression"`` (4 inputs, noise 0.1), ``"binary"`` (2 inputs,
    labels drawn from a probit of a smooth function) or ``"softmax"`` (2 inputs, 3 classes by the largest of three
    smooth functions plus Gumbel noise)."""
    generator = torch.Generator().manual_seed(seed)
    x = _synthetic_inputs(rows + test_rows, 4 if kind == "regression" else 2, generator)
    if kind == "regression":
        f = _latent(x, 0.0) + 0.5 * torch.sin(3 * x[:, 2] * x[:, 3])
        y = f + 0.1 * torch.randn(f.shape, generator=generator)
        y = (y - y[:rows].mean()) / y[:rows].std()
    elif kind == "binary":
        probabilities = torch.distributions.Normal(0.0, 1.0).cdf(2 * _latent(x, 0.0))
        y = torch.bernoulli(probabilities, generator=generator)
    else:
        scores = torch.stack([2 * _latent(x, phase) for phase in (0.0, 2.1, 4.2)], dim=-1)
        gumbel = -torch.log(-torch.log(torch.rand(scores.shape, generator=generator)))
        y = (scores + gumbel).argmax(-1).to(x.dtype)
    return (x[:rows], y[:rows]), (x[rows:], y[rows:])


def _classification_metrics(method: Method, x: Tensor, y: Tensor) -> dict[str, float]:
    return classification_test_metrics(method.predict_probabilities(x), y)


def _verdict(result: MethodResult, args: argparse.Namespace) -> dict:
    """Divergence and oscillation of one training curve (see the module's docstring)."""
    curve = result.curve
    finite = all(math.isfinite(value) for point in curve for key, value in point.items() if key != "iteration")
    rise, fall = 0.0, 0.0
    best_nll, best_accuracy = math.inf, -math.inf
    for point in curve:
        best_nll = min(best_nll, point["nll"])
        best_accuracy = max(best_accuracy, point.get("accuracy", -math.inf))
        if point["iteration"] >= result.iterations / 2:
            rise = max(rise, point["nll"] - best_nll)
            if "accuracy" in point:
                fall = max(fall, best_accuracy - point["accuracy"])
    diverged = not finite or curve[-1]["nll"] > curve[0]["nll"]
    oscillates = rise > args.nll_tolerance or fall > args.accuracy_tolerance
    return {
        "diverged": diverged,
        "oscillates": oscillates,
        "largest_nll_rise_in_second_half": rise,
        "largest_accuracy_fall_in_second_half": fall if "accuracy" in curve[-1] else None,
        "initial_nll": curve[0]["nll"],
        "final_nll": curve[-1]["nll"],
        "final_accuracy": curve[-1].get("accuracy"),
        "final_rmse": curve[-1].get("rmse"),
        "seconds_per_iteration": result.seconds_per_iteration,
        "iterations": result.iterations,
    }


def _cases(args: argparse.Namespace) -> list[dict]:
    """Every case: ``data`` (a real set's name or ``synthetic-<kind>``), ``task``, ``method``, ``size``; the
    classification cases first (they are the cheapest and the likeliest to oscillate)."""
    cases = []
    if "binary" not in args.skip:
        for dataset, size in (("pima", 500), ("ionosphere", 280)):
            for method in ("orthnat", "hybrid", "svgp"):
                cases.append({"data": dataset, "task": "binary", "method": method, "size": size})
        for size in (500, 2000, 10_000):
            cases.append({"data": "synthetic-binary", "task": "binary", "method": "orthnat", "size": size})
        cases.append({"data": "synthetic-binary", "task": "binary", "method": "svgp", "size": 0})
    if "softmax" not in args.skip:
        for size in (500, 5000):
            cases.append({"data": "synthetic-softmax", "task": "softmax", "method": "hybrid", "size": size})
    if "large" not in args.skip:
        cases.append({"data": "protein", "task": "regression", "method": "orthnat", "size": 40_000})
        cases.append({"data": "synthetic-regression", "task": "regression", "method": "orthnat", "size": 100_000})
    if "regression" not in args.skip:
        for dataset in args.datasets:
            for method, size in (
                ("orthnat", 500),
                ("orthnat", 10_000),
                ("hybrid", 10_000),
                ("svgp", 0),
                ("svgp-ngd", 0),
            ):
                cases.append({"data": dataset, "task": "regression", "method": method, "size": size})
    return cases


SYNTHETIC_ROWS = {"regression": (120_000, 4000), "binary": (20_000, 4000), "softmax": (10_000, 4000)}


def _data(case: dict, args: argparse.Namespace, config) -> tuple[tuple, tuple, Tensor | float]:
    if case["data"].startswith("synthetic-"):
        kind = case["data"].removeprefix("synthetic-")
        train, test = _synthetic(kind, *SYNTHETIC_ROWS[kind], seed=config.seed)
        to = {"device": torch.device(config.device), "dtype": config.dtype}
        return tuple(t.to(**to) for t in train), tuple(t.to(**to) for t in test), 1.0
    split = load_split(args, case["data"])
    if split.train_y.dim() > 1:
        ((_, split),) = output_splits(split, [7])
    train, test = split_tensors(split, config)
    return train, test, split.y_std


def _run_case(case: dict, args: argparse.Namespace, config) -> tuple[dict, MethodResult]:
    train, test, y_std = _data(case, args, config)
    options: dict = {"seed": config.seed}
    metrics = None
    options["num_inducing"] = _covariance_size(case["task"])
    if case["method"] not in REFERENCES:
        options["num_mean_inducing"] = case["size"]
    if case["task"] == "binary":
        options["likelihood"] = gpytorch.likelihoods.BernoulliLikelihood()
        metrics = _classification_metrics
    elif case["task"] == "softmax":
        options.update(
            likelihood=gpytorch.likelihoods.SoftmaxLikelihood(num_features=3, num_classes=3, mixing_weights=False),
            num_latents=3,
        )
        metrics = _classification_metrics
    method = build_method(case["method"], *train, **options)
    tag = f"{case['method']}@{case['data']}/Mγ={case['size']}"
    result = train_and_evaluate(method, train, test, y_std, config, name=tag, test_metrics=metrics)
    row = {**case, "train_rows": train[0].size(0), "load_average": os.getloadavg(), **_verdict(result, args)}
    print(
        f"{tag:40s} NLL {row['initial_nll']:8.4f} -> {row['final_nll']:8.4f}"
        + (f" acc {row['final_accuracy']:.3f}" if row["final_accuracy"] is not None else "")
        + f" rise {row['largest_nll_rise_in_second_half']:.3f} {1000 * row['seconds_per_iteration']:.0f} ms/it"
        + (" DIVERGED" if row["diverged"] else "")
        + (" OSCILLATES" if row["oscillates"] else ""),
        flush=True,
    )
    return row, result


def _ratios(rows: list[dict]) -> dict[str, float]:
    ratios = {GOAL: sum(row["diverged"] or row["oscillates"] for row in rows if row["method"] not in REFERENCES)}
    for control in REFERENCES:
        ratios[f"{control}_cases_that_diverge_or_oscillate"] = sum(
            row["diverged"] or row["oscillates"]
            for row in rows
            if row["method"] == control and row["task"] == "regression"
        )
    reference = {
        row["data"]: row["final_accuracy"]
        for row in rows
        if row["method"] == "svgp" and row["final_accuracy"] is not None  # classification sets
    }
    for row in rows:
        if row["method"] not in REFERENCES and row["data"] in reference:
            key = f"{row['method']}_accuracy_minus_svgp_on_{row['data']}_M{row['size']}"
            ratios[key] = row["final_accuracy"] - reference[row["data"]]
    return ratios


def _plot(rows: list[dict], results: list[MethodResult], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None or not rows:
        return None
    datasets = list(dict.fromkeys(row["data"] for row in rows))
    columns = min(4, len(datasets))
    figure, axes = plt.subplots(
        -(-len(datasets) // columns),
        columns,
        figsize=(4.2 * columns, 3.2 * -(-len(datasets) // columns)),
        squeeze=False,
    )
    for axis, dataset in zip(axes.flat, datasets):
        for row, result in zip(rows, results):
            if row["data"] == dataset:
                curve = result.curve
                axis.plot(
                    [p["iteration"] for p in curve],
                    [p["nll"] for p in curve],
                    label=_curve_label(row),
                )
        axis.set_title(dataset)
        axis.set_xlabel("iteration")
        axis.set_ylabel("test NLL")
        axis.legend(fontsize=6)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(datasets) :]:
        axis.axis("off")
    return save_figure(figure, path)


def _covariance_size(task: str) -> int:
    """M of the SVGP controls and M_beta of the decoupled methods: 200 for regression, 100 for classification."""
    return 200 if task == "regression" else 100


def _curve_label(row: dict) -> str:
    if row["method"] in REFERENCES:
        size = _covariance_size(row["task"])
        return f"GPyTorch SVGP-{'NGD' if row['method'] == 'svgp-ngd' else 'Adam'} M={size}"
    return f"{row['method']} Mγ={row['size']}"


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    output = Path(args.output_dir)
    rows, results = [], []
    run = {**config.to_json(), "datasets": args.datasets, "skip": args.skip, "synthetic_rows": SYNTHETIC_ROWS}
    for case in _cases(args):
        row, result = _run_case(case, args, config)
        rows.append(row)
        results.append(result)
        # Written after every case, so that an interrupted run keeps what it measured.
        payload = benchmark_payload(
            NAME, run, results, _ratios(rows), GOALS, device=args.device, ratio_notes=RATIO_NOTES, cases=rows
        )
        write_results(output / f"{NAME}.json", payload)
    _plot(rows, results, output / f"{NAME}.png")
    print("\n" + format_ratios(payload))
    return payload


MEAN_BASIS_ADAM = Benchmark(
    NAME,
    "MeanBasisAdam's default rate from Mγ = 500 to 10^5 for Gaussian, Bernoulli and softmax likelihoods: "
    "divergence and oscillation of the test NLL and accuracy",
    _add_arguments,
    _run,
)
