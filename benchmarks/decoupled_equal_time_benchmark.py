"""``bench decoupled-equal-time``: OrthNat and Hybrid against GPyTorch's scalable GPs at equal iterations and at
SVGP-Adam's training time, with package defaults and no per-set tuning (issue 18, item 4).

On kin40k, protein, elevators, pol, bike, keggdirected and KUKA (split 0 of each; KUKA fits one output, by default
``qd1(t+1)``, column 7), six methods train in lockstep on the same mini-batches of 256, float32, Adam 0.01 and NGD 0.1
where a method has them, a scaled ARD squared-exponential kernel for all:

* OrthNat (ours): :math:`M_\\gamma = 1000`, :math:`M_\\beta = 200`, natural gradients on the covariance block, the
  mean coefficients by :class:`~gpytorch_decoupled.optim.MeanBasisAdam` at its default rate, exact KL (the default at
  this :math:`M_\\gamma`);
* Hybrid (ours): the same sizes, Adam on the covariance block, MeanBasisAdam on the mean coefficients;
* with ``--variants orth``, Orth (ours): OrthNat's bases and sizes with Adam on the covariance block instead of
  natural gradients, reported with its wins but without a goal;
* GPyTorch SVGP with Adam (the reference) and with NGD + Adam, :math:`M = 200`;
* GPyTorch's ``LargeBatchVariationalStrategy`` (SVGP whose predictive terms are grouped in float64), Adam,
  :math:`M = 200`;
* GPyTorch's VNNGP (``NNVariationalStrategy``): an inducing point at every training input as in its tutorial, with
  ``--vnngp-k`` neighbours (64: the tutorial's 256 costs 0.9 s per step on one core, 64 times an SVGP step, and
  could not take more than a few dozen steps in SVGP's time); it steps on its own batches of 256 inducing points,
  which are the observations of the step (the tutorial's recommended option).

Every method runs ``--iterations`` iterations (test NLL and RMSE every ``--eval-every``, outside the timed region).
The clock is the CPU time of the training thread (``--clock thread``, one torch thread): the machine is shared, and
other processes' load does not count against a method. SVGP-Adam's total training time :math:`T` is the equal-time
budget; each method's test metrics at :math:`T` are read from its metric-against-time curve (linear interpolation
between evaluations; a method that finished sooner is held at its final value). A data set counts for OrthNat (or
Hybrid) when its test NLL at :math:`T` is at most both SVGP-Adam's and SVGP-NGD's at :math:`T`; the goals are at least
5 of the 7 sets. Every method's wins and losses against every other are in the JSON. ``--checkpoints`` reads shorter
trainings off the same run (SVGP-Adam's time after that many iterations as the budget): the goal is judged on the
full run, and the counts of the shorter ones are reported beside it.

The methods above take ordinary eager steps on GPyTorch's general path (what a user's own loop does). ``--lean``
methods run a second time, as ``<method>-lean``, through the package's training step
(:class:`~gpytorch_decoupled.training.TrainingStep` with ``compile=False``: the same update on tensors, no
compilation; ``svgp-ngd-lean`` holds q(u) in the package's ``FastNaturalVariationalDistribution``, the same
parameters and NGD step as GPyTorch's natural distribution, which the lean step does not take). ``orthnat-lean`` and
``hybrid-lean`` are counted like OrthNat and Hybrid against GPyTorch's own SVGP-Adam and SVGP-NGD (SVGP-Adam's time
the budget); where ``svgp-lean`` and ``svgp-ngd-lean`` ran too, the same count with every method on the lean step
(``svgp-lean``'s time the budget, both lean SVGPs the rivals) is reported beside it, without a goal: the training
step speeds up GPyTorch's SVGP as well.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config
from .decoupled_accuracy_benchmark import output_splits, value_at_time
from .method_result import MethodResult
from .methods import build_method
from .report import benchmark_payload, format_ratios, pyplot, save_figure, write_results
from .runner import split_tensors, train_in_lockstep

NAME = "decoupled-equal-time"
REFERENCE = "svgp"
OURS = ("orthnat", "hybrid")
#: Our methods with another training recipe (``--variants``), reported beside OURS, wins included, without a goal.
VARIANTS = ("orth",)
BASELINES = ("svgp", "svgp-ngd", "svgp-large-batch", "vnngp")
GOAL_RIVALS = ("svgp", "svgp-ngd")
#: Methods that can also run through the package's lean training step (``--lean``), named ``<method>-lean``.
LEAN = ("orthnat", "hybrid", "orth", "svgp", "svgp-ngd")
#: The budget and the rivals of the comparison with every method on the lean step.
LEAN_REFERENCE = "svgp-lean"
LEAN_RIVALS = ("svgp-lean", "svgp-ngd-lean")
DEFAULT_DATASETS = ["kin40k", "protein", "elevators", "pol", "bike", "keggdirected", "kuka"]

GOALS = {f"{ours}{lean}_nll_wins_at_svgp_time_higher_is_better": 5 for ours in OURS for lean in ("", "-lean")}
RATIO_NOTES = {
    **{
        f"{ours}_nll_wins_at_svgp_time_higher_is_better": (
            f"data sets on which {ours}'s test NLL at SVGP-Adam's training time is at most both SVGP-Adam's and "
            "SVGP-NGD's at that time (thread CPU time); goal: at least 5 of 7"
        )
        for ours in OURS
    },
    "<method>_nll_wins_at_equal_iterations": "the same after equal iterations; no goal",
    "<variant>_nll_wins_at_svgp_time_higher_is_better": (
        "the same count for a recipe of --variants (orth: Adam on OrthNat's covariance block); no goal"
    ),
    "<method>_nll_wins_at_svgp_time_after_<n>_iterations": (
        "the same at SVGP-Adam's time after n iterations (a shorter training read off the same run); no goal"
    ),
    "<method>-lean_nll_wins_at_svgp_time_higher_is_better": (
        "the same count for our method through the package's lean training step (TrainingStep, compile=False), "
        "against GPyTorch's own SVGP-Adam and SVGP-NGD at SVGP-Adam's time; goal: at least 5 of 7"
    ),
    "<method>-lean_nll_wins_all_lean": (
        "the same with every method on the lean step: test NLL at svgp-lean's training time at most both "
        "svgp-lean's and svgp-ngd-lean's; no goal"
    ),
    "<method>_seconds_per_iteration_vs_svgp_on_<set>": "median step time ÷ SVGP-Adam's in the same run; no goal",
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=2000, eval_every=100)
    parser.set_defaults(clock="wall" if torch.cuda.is_available() else "thread")
    parser.add_argument("--datasets", nargs="+", default=DEFAULT_DATASETS)
    parser.add_argument("--kuka-output", type=int, default=7, help="KUKA's target column fitted (7: qd1(t+1))")
    parser.add_argument("--num-inducing", type=int, default=200, help="M of the SVGPs and Mβ of ours")
    parser.add_argument("--num-mean-inducing", type=int, default=1000, help="Mγ of OrthNat and Hybrid")
    parser.add_argument("--vnngp-k", type=int, default=64, help="VNNGP's nearest neighbours")
    parser.add_argument(
        "--variants",
        nargs="*",
        choices=VARIANTS,
        default=[],
        help="our methods with another training recipe, reported without a goal (orth: OrthNat's bases with Adam "
        "instead of natural gradients on the covariance block)",
    )
    parser.add_argument(
        "--other-baselines",
        nargs="*",
        choices=[method for method in BASELINES if method not in GOAL_RIVALS],
        default=[method for method in BASELINES if method not in GOAL_RIVALS],
        help="baselines beside SVGP-Adam and SVGP-NGD (which the goal needs and always run)",
    )
    parser.add_argument(
        "--lean",
        nargs="*",
        choices=LEAN,
        default=["orthnat", "hybrid", "svgp", "svgp-ngd"],
        help="methods that also run through the package's lean training step (TrainingStep, compile=False), as "
        "<method>-lean",
    )
    parser.add_argument(
        "--checkpoints",
        type=int,
        nargs="*",
        default=[600, 1200],
        help="shorter trainings read off the same run: SVGP-Adam's time after these iterations (multiples of "
        "--eval-every, below --iterations) is also an equal-time budget",
    )
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)


def _methods(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """``(name, registered method, options)`` of every method of the run."""
    sizes = {"num_inducing": args.num_inducing}
    ours = {**sizes, "num_mean_inducing": args.num_mean_inducing}
    options = {
        "orthnat": ours,
        "hybrid": ours,
        "orth": ours,
        "svgp": sizes,
        "svgp-ngd": sizes,
        "svgp-large-batch": sizes,
        "vnngp": {"k": args.vnngp_k, "training_batch_size": args.batch_size},
    }
    eager = [
        (method, method, options[method]) for method in (*OURS, *args.variants, *GOAL_RIVALS, *args.other_baselines)
    ]
    # GPyTorch's NaturalVariationalDistribution has no lean step; the package's FastNatural one is the same q and NGD.
    fast = {"svgp-ngd": {"fast_natural": True}}
    lean = [
        (f"{method}-lean", method, {**options[method], **fast.get(method, {}), "step": "lean"}) for method in args.lean
    ]
    return eager + lean


def _ours(args: argparse.Namespace) -> tuple[str, ...]:
    """Our methods of the run, eager and lean: the ones whose wins are counted."""
    ours = (*OURS, *args.variants)
    return (*ours, *(f"{method}-lean" for method in args.lean if method in ours))


def _fit(args, config, name: str) -> tuple[dict, list[MethodResult]]:
    split = load_split(args, name)
    column = None
    if split.train_y.dim() > 1:
        ((column, split),) = output_splits(split, [args.kuka_output])
    train, test = split_tensors(split, config)
    load_before = os.getloadavg()
    methods = [
        (f"{label}@{name}", build_method(method, *train, seed=config.seed, **options))
        for label, method, options in _methods(args)
    ]
    results = train_in_lockstep(methods, train, test, split.y_std, config)
    by_method = {result.name.split("@")[0]: result for result in results}
    budget = by_method[REFERENCE].train_seconds
    lean_budget = by_method[LEAN_REFERENCE].train_seconds if LEAN_REFERENCE in by_method else None
    reference_step = by_method[REFERENCE].seconds_per_iteration
    rows = {
        method: {
            "label": result.label,
            "sizes": result.sizes,
            "iterations": result.iterations,
            "train_seconds": result.train_seconds,
            "seconds_per_iteration": result.seconds_per_iteration,
            "step_vs_svgp": result.seconds_per_iteration / reference_step,
            "nll": result.nll,
            "rmse": result.rmse,
            "nll_at_svgp_time": value_at_time(result.curve, budget, "nll"),
            "rmse_at_svgp_time": value_at_time(result.curve, budget, "rmse"),
            **(
                {"nll_at_lean_svgp_time": value_at_time(result.curve, lean_budget, "nll")}
                if lean_budget is not None
                else {}
            ),
        }
        for method, result in by_method.items()
    }
    ours = _ours(args)
    checkpoints = {
        iterations: _checkpoint(by_method, iterations, ours)
        for iterations in args.checkpoints
        if iterations < config.iterations
    }
    record = {
        "dataset": name,
        "output": column,
        "train_rows": train[0].size(0),
        "test_rows": test[0].size(0),
        "dims": train[0].size(-1),
        "svgp_seconds": budget,
        "lean_svgp_seconds": lean_budget,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "methods": rows,
        "wins": {method: _wins(rows, method) for method in ours},
        "wins_all_lean": _wins_all_lean(rows, ours),
        "checkpoints": checkpoints,
    }
    return record, results


def _checkpoint(by_method: dict[str, MethodResult], iterations: int, ours: tuple[str, ...]) -> dict:
    """The equal-time comparison of a shorter training, read off the run: SVGP-Adam's training time after
    ``iterations`` (its curve's evaluation there) is the budget, every method's test NLL at that time. The step sizes
    do not depend on the run's length, so this is what a run of ``iterations`` would have measured."""
    (point,) = (point for point in by_method[REFERENCE].curve if point["iteration"] == iterations)
    nll = {method: value_at_time(result.curve, point["seconds"], "nll") for method, result in by_method.items()}
    return {
        "svgp_seconds": point["seconds"],
        "nll_at_svgp_time": nll,
        "wins": {method: all(nll[method] <= nll[rival] for rival in GOAL_RIVALS) for method in ours},
    }


def _wins(rows: dict, ours: str) -> dict:
    """Whether ``ours`` is at least as good as each other method, by test NLL and RMSE, at SVGP-Adam's time and after
    equal iterations."""
    return {
        f"{metric}{suffix}": {
            rival: rows[ours][f"{metric}{suffix}"] <= rows[rival][f"{metric}{suffix}"]
            for rival in rows
            if rival != ours
        }
        for metric in ("nll", "rmse")
        for suffix in ("_at_svgp_time", "")
    }


def _wins_all_lean(rows: dict, ours: tuple[str, ...]) -> dict[str, bool]:
    """With every method on the lean step: whether each lean method of ours has a test NLL at ``svgp-lean``'s training
    time at most that of every lean SVGP of the run (empty where ``svgp-lean`` did not run)."""
    rivals = [rival for rival in LEAN_RIVALS if rival in rows]
    if LEAN_REFERENCE not in rows:
        return {}
    return {
        method: all(rows[method]["nll_at_lean_svgp_time"] <= rows[rival]["nll_at_lean_svgp_time"] for rival in rivals)
        for method in ours
        if method.endswith("-lean")
    }


def _ratios(records: list[dict]) -> dict[str, float]:
    ratios = {}
    for ours in records[0]["wins"] if records else ():
        for suffix, key in (("_at_svgp_time_higher_is_better", "nll_at_svgp_time"), ("_at_equal_iterations", "nll")):
            ratios[f"{ours}_nll_wins{suffix}"] = sum(
                all(record["wins"][ours][key][rival] for rival in GOAL_RIVALS) for record in records
            )
        if ours in records[0]["wins_all_lean"]:
            ratios[f"{ours}_nll_wins_all_lean"] = sum(record["wins_all_lean"][ours] for record in records)
        for iterations in records[0]["checkpoints"] if records else ():
            ratios[f"{ours}_nll_wins_at_svgp_time_after_{iterations}_iterations"] = sum(
                record["checkpoints"][iterations]["wins"][ours] for record in records
            )
    for record in records:
        for method, row in record["methods"].items():
            if method != REFERENCE:
                ratios[f"{method}_seconds_per_iteration_vs_svgp_on_{record['dataset']}"] = row["step_vs_svgp"]
    return ratios


def _print_table(record: dict) -> None:
    print(f"\n{record['dataset']}: {record['train_rows']} rows, SVGP-Adam's time {record['svgp_seconds']:.1f} s CPU")
    print(f"  {'method':34s} {'NLL@T':>8s} {'RMSE@T':>9s} {'NLL':>8s} {'RMSE':>9s} {'step/SVGP':>9s}")
    for row in record["methods"].values():
        print(
            f"  {row['label'] + ' ' + row['sizes']:34.34s} {row['nll_at_svgp_time']:8.4f}"
            f" {row['rmse_at_svgp_time']:9.4f} {row['nll']:8.4f} {row['rmse']:9.4f} {row['step_vs_svgp']:9.2f}"
        )


def _plot(records: list[dict], results: list[MethodResult], path: Path) -> Path | None:
    """Test NLL against training CPU time, one panel per data set, SVGP-Adam's training time marked."""
    plt = pyplot()
    if plt is None or not records:
        return None
    columns = min(4, len(records))
    rows = -(-len(records) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.6 * rows), squeeze=False)
    for axis, record in zip(axes.flat, records):
        for result in (r for r in results if r.name.endswith(f"@{record['dataset']}")):
            curve = result.curve[1:]
            axis.plot([p["seconds"] for p in curve], [p["nll"] for p in curve], label=result.label, linewidth=1.2)
        axis.axvline(record["svgp_seconds"], color="grey", linestyle="--", linewidth=1)
        axis.set_title(record["dataset"])
        axis.set_xlabel("training thread CPU time (s)")
        axis.set_ylabel("test NLL")
        finals = [row["nll"] for row in record["methods"].values()]
        axis.set_ylim(
            min(finals) - 0.1 * abs(min(finals)) - 0.05, max(finals) + 0.5 * (max(finals) - min(finals)) + 0.1
        )
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(records) :]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=7)
    return save_figure(figure, path)


def _run(args: argparse.Namespace) -> dict:
    config = run_config(args)
    output = Path(args.output_dir)
    records, results = [], []
    run = {
        **config.to_json(),
        "datasets": args.datasets,
        "split": args.split,
        "max_train_rows": args.max_train_rows,
        "kuka_output": args.kuka_output,
        "methods": _methods(args),
        "lean": args.lean,
        "reference": REFERENCE,
        "torch_threads": torch.get_num_threads(),
    }
    for name in args.datasets:
        record, fitted = _fit(args, config, name)
        records.append(record)
        results += fitted
        _print_table(record)
        # Written after every data set, so that an interrupted run keeps what it measured.
        payload = benchmark_payload(
            NAME,
            run,
            results,
            _ratios(records),
            {name: goal for name, goal in GOALS.items() if name.split("_nll_")[0] in _ours(args)},
            device=args.device,
            ratio_notes=RATIO_NOTES,
            complete=len(records) == len(args.datasets),
            datasets=records,
        )
        write_results(output / f"{NAME}.json", payload)
        _plot(records, results, output / f"{NAME}.png")
    print("\n" + format_ratios(payload))
    return payload


DECOUPLED_EQUAL_TIME = Benchmark(
    NAME,
    "OrthNat and Hybrid (package defaults) vs GPyTorch SVGP-Adam, SVGP-NGD, LargeBatch SVGP and VNNGP on 7 regression "
    "sets: test NLL and RMSE at equal iterations and at SVGP-Adam's thread CPU time",
    _add_arguments,
    _run,
)
