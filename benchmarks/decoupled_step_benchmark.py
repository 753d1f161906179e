"""``bench decoupled-step``: the step time of the decoupled family against GPyTorch's SVGP, the spread of the
training-mode KL, and how fast the mean basis's kernel block runs against this CPU's cache-resident ``exp``.

One process, one thread (``--threads``), float32, kin40k split 0 by default, mini-batches of 256:

1. **Step time.** GPyTorch's SVGP (Adam, :math:`M=200`), OrthNat (:math:`M_\\gamma=1000`, :math:`M_\\beta=200`),
   Decoupled (:math:`M_\\alpha=1000`, :math:`M_\\beta=200`) and OrthNat at :math:`M_\\gamma=10^5` (a basis drawn from
   the training rows with replacement plus a small jitter, as in ``orthogonal-speed``) train in lockstep on the same
   mini-batches (one step of each in turn, the order alternating), ``--repeats`` times in a row (the same models go
   on training); each repeat gives each method's median CPU seconds per step (of this thread, which does all the
   work: on a busy machine the wall clock mostly measures the wait for a core) divided by SVGP's of the same repeat,
   and the headline is the median over repeats, with the range beside it. Peak memory at :math:`10^5` is taken over
   the warm-up of a separately built copy.
2. **KL spread.** After the step-time runs, the training-mode KL of the OrthNat models is drawn ``--kl-draws`` times
   on one mini-batch (a training forward pass, then the KL, as a training step computes it) and compared with the
   exact value (eval mode); a model at the largest basis with the exact KL by default (4,096 points, trained for
   ``--iterations`` steps) shows the zero variance. For comparison, the same draws with the previous estimator (rows
   of :math:`\\mathbf K_\\gamma` sampled uniformly, no control variate) are reported without a goal.
3. **Kernel block.** :func:`benchmarks.kernel_block_throughput.kernel_block_throughput` on the step's block
   (256 + 200 + 64 rows against the mean basis): entries per second as a fraction of ``torch.exp``'s rate on a
   cache-resident array, measured in the same process, interleaved, in CPU time.

OrthNat at :math:`M_\\gamma = 1000` and Decoupled also run a second time through the package's training step
(:class:`~gpytorch_decoupled.training.TrainingStep` with ``compile=False``, ``orthnat-lean`` and ``decoupled-lean``;
``--no-lean`` leaves them out): the same updates on plain tensors, no compilation. Their ratios to the same eager
GPyTorch SVGP step carry the same goals, reported beside the eager ones. (The :math:`10^5` basis runs eagerly
only: the goal is the eager step's.)

With ``--device cuda`` the step times are wall-clock (the GPU synchronized around each step), the kernel block (a
measure of this CPU's ``exp``) is not measured, and the results go to ``decoupled-step-cuda.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .kernel_block_throughput import kernel_block_throughput
from .method_result import MethodResult
from .methods import Method, build_method
from .metrics import gaussian_test_metrics
from .orthogonal_speed_benchmark import enlarge_mean_basis, mean_basis_with_replacement
from .report import benchmark_payload, format_ratios, format_table, write_results
from .runner import _minibatches, lockstep_step_seconds, split_tensors, warmup_peak_memory

NAME = "decoupled-step"
REFERENCE = "svgp"

GOALS = {
    "orthnat_time_per_iteration": 1.15,
    "orthnat_lean_time_per_iteration": 1.15,
    "decoupled_time_per_iteration": 1.25,
    "decoupled_lean_time_per_iteration": 1.25,
    "orthnat_1e5_time_per_iteration": 6.0,
    "peak_memory_gb_at_1e5": 0.3,
    "kernel_block_fraction_of_exp_higher_is_better": 0.5,
    "kl_relative_std_at_4096": 0.0,
    "kl_relative_std_at_1e5": 0.05,
}

RATIO_NOTES = {
    "orthnat_time_per_iteration": (
        "OrthNat (Mγ=1000, Mβ=200) ÷ GPyTorch SVGP (M=200), median CPU s / step in lockstep; median over repeats"
    ),
    "orthnat_lean_time_per_iteration": (
        "the same OrthNat stepped by the package's TrainingStep (compile=False) ÷ GPyTorch SVGP's eager step, as above"
    ),
    "decoupled_time_per_iteration": "Decoupled (Mα=1000, Mβ=200) ÷ GPyTorch SVGP (M=200), as above",
    "decoupled_lean_time_per_iteration": (
        "the same Decoupled stepped by the package's TrainingStep (compile=False) ÷ GPyTorch SVGP's eager step, as "
        "above"
    ),
    "orthnat_1e5_time_per_iteration": "OrthNat (Mγ=10^5, Mβ=200) ÷ GPyTorch SVGP (M=200), as above",
    "peak_memory_gb_at_1e5": (
        "absolute value, not a ratio: peak memory (GB, above the level before training) of OrthNat at Mγ=10^5 over "
        "the warm-up iterations of a separately built copy"
    ),
    "kernel_block_fraction_of_exp_higher_is_better": (
        "entries per second of the fused product K(rows, γ)·a forward (rows = batch + Mβ + KL rows, Mγ=10^5) ÷ "
        "torch.exp elements per second on a cache-resident array, same process, 1 thread; median over rounds"
    ),
    "kernel_block_fraction_of_exp2": (
        "the forward product's entries per second ÷ torch.exp2's cache-resident rate (the RBF tiles evaluate exp2, "
        "faster than exp on this CPU, so this is the tighter bound); no goal"
    ),
    "kernel_block_forward_backward_fraction_of_exp": (
        "as above for forward + backward (entries counted once; the backward pass evaluates the tiles again); no goal"
    ),
    "kl_relative_std_at_4096": (
        "standard deviation ÷ |exact| of the training-mode KL of OrthNat at Mγ=4096 (exact by default), over draws"
    ),
    "kl_relative_std_at_1000": "the same at Mγ=1000 (exact by default); no goal",
    "kl_relative_std_at_1e5": (
        "standard deviation ÷ |exact| of the training-mode KL of OrthNat at Mγ=10^5 (64 rows drawn by |a|, "
        "stratified by coefficient; β and the mini-batch as landmarks of the control variate), over draws on one "
        "mini-batch after the step-time runs"
    ),
    "kl_relative_std_at_1e5_uniform_rows": (
        "the same with the previous estimator (64 rows of K_γ sampled uniformly, no control variate); no goal"
    ),
    "kl_relative_std_at_1e5_triple_rows": (
        "the same with the landmark control variate and three times the rows (192); no goal: what more rows buy"
    ),
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=60, eval_every=10**9)
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the goals are for one)")
    parser.add_argument("--repeats", type=int, default=3, help="lockstep runs in a row; ratios are their median")
    parser.add_argument("--num-inducing", type=int, default=200, help="M of SVGP and Mβ of the decoupled methods")
    parser.add_argument("--num-mean-inducing", type=int, default=1000, help="Mγ (Mα) of the 1x comparison")
    parser.add_argument("--large-mean-size", type=int, default=100_000, help="Mγ of the large OrthNat")
    parser.add_argument("--exact-size", type=int, default=4096, help="Mγ of the exact-KL spread check")
    parser.add_argument("--num-kl-columns", type=int, default=64)
    parser.add_argument("--kl-draws", type=int, default=100, help="training-mode KL draws per spread")
    parser.add_argument("--block-rounds", type=int, default=3, help="rounds of the kernel block measurement")
    parser.add_argument("--mean-jitter", type=float, default=1e-2)
    parser.add_argument(
        "--no-lean",
        dest="lean",
        action="store_false",
        help="leave out the OrthNat steps through the package's TrainingStep (compile=False)",
    )
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)


def _orthnat(train, args: argparse.Namespace, size: int, seed: int, step: str = "eager") -> Method:
    """OrthNat with ``size`` mean-basis points, drawn with replacement beyond the training rows, its steps taken as
    ``step`` says (:data:`~benchmarks.methods.STEP_KINDS`; the training step is built on the enlarged basis)."""
    train_x = train[0]
    method = build_method(
        "orthnat",
        *train,
        num_inducing=args.num_inducing,
        num_mean_inducing=min(size, train_x.size(0)),
        num_kl_columns=args.num_kl_columns,
        seed=seed,
    )
    if size > train_x.size(0):
        enlarge_mean_basis(method, mean_basis_with_replacement(train_x, size, args.mean_jitter, seed + 1), seed)
        method.sizes = f"Mγ={size}, Mβ={args.num_inducing}"
    method.use_training_step(step)
    method.objective = lambda: float("nan")  # the exact ELBO at 10^5 costs 10^10 kernel entries; not timed here
    return method


def _decoupled(train, args: argparse.Namespace, seed: int, step: str = "eager") -> Method:
    """Decoupled with the mean basis of OrthNat's (:math:`M_\\alpha` = ``num_mean_inducing``), its steps taken as
    ``step`` says."""
    return build_method(
        "decoupled",
        *train,
        step=step,
        num_inducing=args.num_inducing,
        num_mean_inducing=args.num_mean_inducing,
        num_kl_columns=args.num_kl_columns,
        seed=seed,
    )


def kl_spread(method: Method, batch: torch.Tensor, draws: int, exact: float | None = None) -> dict:
    """Training-mode KL draws of a mean-basis method on one mini-batch against its exact (eval-mode) value (computed
    here unless given: at 10^5 points it costs 10^10 kernel entries)."""
    model, strategy = method.model, method.model.variational_strategy
    values = []
    with torch.no_grad():
        model.train()
        for _ in range(draws):
            strategy._clear_cache()
            model(batch)
            values.append(float(strategy.kl_divergence()))
        if exact is None:
            model.eval()
            strategy._clear_cache()
            exact = float(strategy.kl_divergence())
            model.train()
        strategy._clear_cache()
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return {
        "mean_size": strategy.mean_inducing_points.size(-2),
        "draws": draws,
        "exact": exact,
        "mean": mean,
        "std": std,
        "relative_std": std / abs(exact),
        "bias_in_standard_errors": (mean - exact) / (std / math.sqrt(draws)) if std > 0 else 0.0,
        "negative_fraction": sum(value < 0 for value in values) / draws,
    }


def _uniform_rows_spread(method: Method, batch: torch.Tensor, draws: int, exact: float) -> dict:
    """:func:`kl_spread` with the previous estimator: uniformly sampled rows of K_γ, no control variate."""
    basis = method.model.variational_strategy.mean_basis
    basis.importance_sampling = False
    try:
        return kl_spread(method, batch, draws)
    finally:
        basis.importance_sampling = True


def _more_rows_spread(method: Method, batch: torch.Tensor, draws: int, exact: float, num_kl_columns: int) -> dict:
    """:func:`kl_spread` with ``num_kl_columns`` drawn rows instead of the default."""
    basis = method.model.variational_strategy.mean_basis
    default, basis.num_kl_columns = basis.num_kl_columns, num_kl_columns
    try:
        return kl_spread(method, batch, draws, exact)
    finally:
        basis.num_kl_columns = default


def _run(args: argparse.Namespace) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace) -> dict:
    split = load_split(args, args.dataset)
    config = run_config(args)
    train, test = split_tensors(split, config)
    m, large, kl = args.num_inducing, args.large_mean_size, args.num_kl_columns
    large_name = f"orthnat@Mγ={large}"
    methods = [
        ("svgp", build_method("svgp", *train, num_inducing=m, seed=config.seed)),
        ("orthnat", _orthnat(train, args, args.num_mean_inducing, config.seed)),
        ("decoupled", _decoupled(train, args, config.seed)),
        (large_name, _orthnat(train, args, large, config.seed)),
    ]
    if args.lean:
        methods.append(("orthnat-lean", _orthnat(train, args, args.num_mean_inducing, config.seed, "lean")))
        methods.append(("decoupled-lean", _decoupled(train, args, config.seed, "lean")))
    peak_mb = warmup_peak_memory(_orthnat(train, args, large, config.seed), train, config)

    batches = _minibatches(*train, config.batch_size, config.seed)
    # On a GPU the host thread's CPU time does not count the device's work: wall-clock, synchronized.
    clock = "wall" if train[0].device.type == "cuda" else "thread"
    repeats = [
        lockstep_step_seconds(methods, batches, config.iterations, config.warmup, clock=clock)
        for _ in range(args.repeats)
    ]
    per_repeat = {name: [run[name] / run[REFERENCE] for run in repeats] for name, _ in methods}
    results = []
    for name, method in methods:
        metrics = gaussian_test_metrics(*method.predict(test[0]), test[1], split.y_std)
        result = MethodResult(name=name, label=method.label, sizes=method.sizes, rmse=metrics["rmse"])
        result.nll, result.iterations = metrics["nll"], args.repeats * config.iterations
        result.seconds_per_iteration = statistics.median(run[name] for run in repeats)
        results.append(result)
    next(result for result in results if result.name == large_name).peak_memory_mb = peak_mb

    batch = next(_minibatches(*train, config.batch_size, config.seed + 1))[0]
    exact_method = _orthnat(train, args, args.exact_size, config.seed)
    lockstep_step_seconds([("exact", exact_method)], batches, config.iterations, 0)
    spreads = {
        str(args.num_mean_inducing): kl_spread(methods[1][1], batch, args.kl_draws),
        str(args.exact_size): kl_spread(exact_method, batch, args.kl_draws),
        str(large): kl_spread(methods[3][1], batch, args.kl_draws),
    }
    exact = spreads[str(large)]["exact"]
    spreads[f"{large}_uniform_rows"] = _uniform_rows_spread(methods[3][1], batch, args.kl_draws, exact)
    spreads[f"{large}_{3 * kl}_rows"] = _more_rows_spread(methods[3][1], batch, args.kl_draws, exact, 3 * kl)

    rows = args.batch_size + m + kl
    # The kernel block is measured against this CPU's exp (not measured on a GPU, where it has no goal).
    block = []
    if clock == "thread":
        mean_sizes = sorted({args.num_mean_inducing, large})
        block = kernel_block_throughput(mean_sizes, rows, train[0].size(-1), config.dtype, rounds=args.block_rounds)

    def headline(name: str) -> float:
        return statistics.median(per_repeat[name])

    ratios = {
        "orthnat_time_per_iteration": headline("orthnat"),
        "decoupled_time_per_iteration": headline("decoupled"),
        "orthnat_1e5_time_per_iteration": headline(large_name),
        "peak_memory_gb_at_1e5": peak_mb / 1024,
        "kl_relative_std_at_4096": spreads[str(args.exact_size)]["relative_std"],
        f"kl_relative_std_at_{args.num_mean_inducing}": spreads[str(args.num_mean_inducing)]["relative_std"],
        "kl_relative_std_at_1e5": spreads[str(large)]["relative_std"],
        "kl_relative_std_at_1e5_uniform_rows": spreads[f"{large}_uniform_rows"]["relative_std"],
        "kl_relative_std_at_1e5_triple_rows": spreads[f"{large}_{3 * kl}_rows"]["relative_std"],
    }
    if args.lean:
        ratios["orthnat_lean_time_per_iteration"] = headline("orthnat-lean")
        ratios["decoupled_lean_time_per_iteration"] = headline("decoupled-lean")
    goals = {name: goal for name, goal in GOALS.items() if args.lean or "_lean_" not in name}
    if block:
        largest = block[-1].to_json()
        ratios["kernel_block_fraction_of_exp_higher_is_better"] = largest["forward_fraction_of_exp"]
        ratios["kernel_block_forward_backward_fraction_of_exp"] = largest["forward_backward_fraction_of_exp"]
        ratios["kernel_block_fraction_of_exp2"] = largest["forward_fraction_of_exp2"]
    else:
        del goals["kernel_block_fraction_of_exp_higher_is_better"]
    notes = dict(RATIO_NOTES)
    if clock == "wall":
        for name in notes:
            if name.endswith("_time_per_iteration"):
                notes[name] = notes[name].replace("CPU s", "wall-clock s (GPU synchronized)")
    if large != 100_000:
        for name in ("orthnat_1e5_time_per_iteration", "peak_memory_gb_at_1e5", "kl_relative_std_at_1e5"):
            notes[name] += f" (this run: Mγ={large})"
    if args.exact_size != 4096:
        notes["kl_relative_std_at_4096"] += f" (this run: Mγ={args.exact_size})"
    if args.num_mean_inducing != 1000:
        notes[f"kl_relative_std_at_{args.num_mean_inducing}"] = notes.pop("kl_relative_std_at_1000")

    print(f"\n{NAME} on {split.name} (split {split.split}), {args.threads} thread(s), {config.dtype}\n")
    print(format_table(results))
    print("\nstep time ÷ SVGP per repeat:")
    for name, values in per_repeat.items():
        print(f"  {name:24s} " + "  ".join(f"{value:.3f}" for value in values))
    print("\ntraining-mode KL over draws:")
    for name, spread in spreads.items():
        print(f"  Mγ={name:20s} exact {spread['exact']:.2f}  mean {spread['mean']:.2f}  std {spread['std']:.3f}")
    payload = benchmark_payload(
        NAME,
        {
            **config.to_json(),
            **split_config(split),
            "threads": args.threads,
            "repeats": args.repeats,
            "methods": [[name, method.sizes] for name, method in methods],
            "reference": REFERENCE,
            "num_kl_columns": kl,
            "kl_draws": args.kl_draws,
            "exact_size": args.exact_size,
            "mean_jitter": args.mean_jitter,
        },
        results,
        ratios,
        goals,
        device=args.device,
        ratio_notes=notes,
        ratio_ranges={name: [min(values), max(values)] for name, values in per_repeat.items()},
        per_repeat=per_repeat,
        kl_spread=spreads,
        kernel_block=[entry.to_json() for entry in block],
    )
    suffix = "-cuda" if clock == "wall" else ""
    write_results(Path(args.output_dir) / f"{NAME}{suffix}.json", payload)
    print("\n" + format_ratios(payload))
    return payload


DECOUPLED_STEP = Benchmark(
    NAME,
    "Step time of OrthNat/Decoupled vs GPyTorch SVGP (1 thread), spread of the training KL, kernel block vs exp",
    _add_arguments,
    _run,
)
