"""``bench orthogonal-speed``: cost of one OrthNat iteration against GPyTorch's SVGP, and how it grows with Mγ.

Two parts, one process, one data set (kin40k split 0 by default), mini-batches of 256:

1. **Speed.** GPyTorch's SVGP (Adam, :math:`M=200`), GPyTorch's own ODVGP (Adam, :math:`M_\\gamma=1000`,
   :math:`M_\\beta=200`) and this package's OrthNat (:math:`M_\\gamma=1000`, :math:`M_\\beta=200`, 64 sampled KL
   rows) are trained in lockstep on the same mini-batches (one iteration of each in turn, so that a change of
   machine load slows all three alike); the median seconds per iteration after warm-up are compared with SVGP's.
   Peak memory is measured separately, over the warm-up iterations of a fresh copy of each method.
2. **Scale.** OrthNat at :math:`M_\\gamma = 10^3, 10^4, 10^5` (:math:`M_\\beta=200`, 64 sampled KL rows): the time
   of an iteration must grow at most linearly in :math:`M_\\gamma` and the peak memory at :math:`10^5` stay small.
   kin40k has 36,000 training rows, fewer than :math:`10^5`, so a mean basis larger than the training set is drawn
   from the training rows *with replacement* plus a small Gaussian jitter (distinct points, the same input
   distribution). The method is built with a basis it can draw itself (at most one point per row) and its
   :math:`\\gamma` and :math:`\\mathbf a_\\gamma` parameters are then given the larger tensors before any step, so that
   the optimizers, which hold the same parameter objects, train the enlarged basis.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch

from .benchmark import Benchmark
from .common_arguments import DEFAULT_RESULTS_DIR, add_run_arguments, load_split, run_config, split_config
from .method_result import MethodResult
from .methods import Method, build_method
from .report import benchmark_payload, format_ratios, format_table, write_results
from .run_config import RunConfig
from .runner import compare, split_tensors, train_and_evaluate

NAME = "orthogonal-speed"
REFERENCE = "svgp"

GOALS = {
    "orthnat_time_per_iteration": 1.5,
    "time_ratio_1e4_to_1e5": 12.0,
    "peak_memory_gb_at_1e5": 1.5,
}

RATIO_NOTES = {
    "orthnat_time_per_iteration": "OrthNat (Mγ=1000, Mβ=200) ÷ GPyTorch SVGP (M=200), median s / iteration, same run",
    "gpytorch_odvgp_time_per_iteration": "GPyTorch ODVGP (Mγ=1000, Mβ=200) ÷ GPyTorch SVGP (M=200); no goal",
    "orthnat_peak_memory": "OrthNat (Mγ=1000) ÷ GPyTorch SVGP peak memory over warm-up; no goal",
    "time_ratio_1e4_to_1e5": (
        "OrthNat s / iteration at the largest ÷ the second largest Mγ of the scale series (10^5 ÷ 10^4 by default); "
        "linear growth gives their size ratio (10)"
    ),
    "peak_memory_gb_at_1e5": (
        "absolute value, not a ratio: peak memory (GB, above the level before training) of OrthNat over the warm-up "
        "iterations at the largest Mγ of the scale series (10^5 by default)"
    ),
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iterations=500, eval_every=10**9)
    parser.add_argument("--dataset", default="kin40k")
    parser.add_argument("--num-inducing", type=int, default=200, help="M of SVGP and Mβ of both ODVGPs")
    parser.add_argument("--num-mean-inducing", type=int, default=1000, help="Mγ of the speed comparison")
    parser.add_argument("--num-kl-columns", type=int, default=64, help="sampled KL rows of OrthNat")
    parser.add_argument(
        "--mean-sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000], help="Mγ of the scale series"
    )
    parser.add_argument("--scale-iterations", type=int, default=200, help="training iterations per scale run")
    parser.add_argument(
        "--mean-jitter",
        type=float,
        default=1e-2,
        help="standard deviation (standardized input units) of the jitter on mean-basis points drawn with replacement",
    )
    parser.add_argument("--output-dir", default=DEFAULT_RESULTS_DIR)


def mean_basis_with_replacement(train_x: torch.Tensor, size: int, jitter: float, seed: int) -> torch.Tensor:
    """``size`` training rows drawn uniformly with replacement, each moved by :math:`\\mathcal N(0, \\text{jitter}^2)`
    per coordinate so that no two points coincide."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(train_x.size(0), (size,), generator=generator)
    noise = torch.randn(size, train_x.size(-1), generator=generator, dtype=train_x.dtype) * jitter
    return train_x[index.to(train_x.device)] + noise.to(train_x.device)


def enlarge_mean_basis(method: Method, points: torch.Tensor, seed: int, init_std: float = 1e-3) -> None:
    """Give a mean-basis method (OrthNat/Orth, Decoupled, Hybrid) new mean-basis points and fresh near-zero
    coefficients before training.

    The tensors are swapped inside the existing parameters, so every optimizer built with them trains the new basis
    (their state is created on the first step, after this call).
    """
    strategy = method.model.variational_strategy
    basis = strategy.mean_basis
    generator = torch.Generator().manual_seed(seed)
    coefficients = torch.randn(points.size(0), generator=generator, dtype=points.dtype) * init_std
    with torch.no_grad():
        basis.inducing_points.data = points.to(basis.inducing_points)
        basis.coefficients.data = coefficients.to(basis.coefficients)
    distribution = strategy._variational_distribution
    if hasattr(distribution, "num_mean_points"):  # the decoupled distribution records its basis size
        distribution.num_mean_points = points.size(0)
    strategy._clear_cache()


def scale_run(name: str, train, test, y_std, args: argparse.Namespace, config: RunConfig, size: int) -> MethodResult:
    """
    One timing run of the mean-basis method ``name`` (``orthnat``, ``hybrid`` or ``decoupled``) with a mean basis of
    ``size`` points (for Decoupled, α = γ ∪ β: ``size`` includes the covariance points), enlarged beyond the training
    rows by :func:`mean_basis_with_replacement` where needed.
    """
    train_x, m = train[0], args.num_inducing
    method = build_method(
        name,
        *train,
        num_inducing=m,
        num_mean_inducing=min(size, train_x.size(0)),
        num_kl_columns=args.num_kl_columns,
        seed=config.seed,
    )
    symbol = "Mα" if name == "decoupled" else "Mγ"
    if size > train_x.size(0):
        if name == "decoupled":
            extra = mean_basis_with_replacement(train_x, size - m, args.mean_jitter, config.seed + 1)
            points = torch.cat([extra, method.model.variational_strategy.inducing_points.detach()])
        else:
            points = mean_basis_with_replacement(train_x, size, args.mean_jitter, config.seed + 1)
        enlarge_mean_basis(method, points, config.seed)
        method.sizes = f"{symbol}={size}, Mβ={m}"
    # The final full-data ELBO needs the exact KL, O(M²) kernel entries (10^10 at 10^5): a timing run skips it.
    method.objective = lambda: float("nan")
    # Predictions outside the timed region evaluate k(x, mean basis) per batch; smaller batches keep that small.
    method.batch_size = 256
    return train_and_evaluate(method, train, test, y_std, config, name=f"{name}@{symbol}={size}")


def _size_label(size: int) -> str:
    exponent = math.log10(size)
    return f"1e{round(exponent)}" if exponent.is_integer() else str(size)


def _run(args: argparse.Namespace) -> dict:
    split = load_split(args, args.dataset)
    config = run_config(args)
    m, m_gamma = args.num_inducing, args.num_mean_inducing
    methods = [
        ("svgp", {"num_inducing": m}),
        ("gpytorch-odvgp", {"num_inducing": m, "num_mean_inducing": m_gamma}),
        ("orthnat", {"num_inducing": m, "num_mean_inducing": m_gamma, "num_kl_columns": args.num_kl_columns}),
    ]
    results = compare(methods, split, config, lockstep=True)
    by_name = {result.name: result for result in results}
    reference = by_name[REFERENCE]

    train, test = split_tensors(split, config)
    scale_config = replace(config, iterations=args.scale_iterations, eval_every=10**9)
    sizes = sorted(args.mean_sizes)
    scale_results = [scale_run("orthnat", train, test, split.y_std, args, scale_config, size) for size in sizes]

    print(f"\n{NAME} on {split.name} (split {split.split}, {split.train_x.size(0)} training rows)\n")
    print("speed: same mini-batches, median seconds per iteration after warm-up\n")
    print(format_table(results))
    print(f"\nscale: OrthNat, Mβ={m}, {args.num_kl_columns} sampled KL rows, {args.scale_iterations} iterations each\n")
    print(format_table(scale_results))

    ratios = {
        "orthnat_time_per_iteration": by_name["orthnat"].seconds_per_iteration / reference.seconds_per_iteration,
        "gpytorch_odvgp_time_per_iteration": (
            by_name["gpytorch-odvgp"].seconds_per_iteration / reference.seconds_per_iteration
        ),
        "orthnat_peak_memory": by_name["orthnat"].peak_memory_mb / max(reference.peak_memory_mb, 1.0),
    }
    for smaller, larger in zip(scale_results, scale_results[1:]):
        small_size, large_size = (int(result.name.split("=")[1]) for result in (smaller, larger))
        key = f"time_ratio_{_size_label(small_size)}_to_{_size_label(large_size)}"
        ratios[key] = larger.seconds_per_iteration / smaller.seconds_per_iteration
    if len(scale_results) >= 2:
        ratios["time_ratio_1e4_to_1e5"] = scale_results[-1].seconds_per_iteration / (
            scale_results[-2].seconds_per_iteration
        )
    ratios["peak_memory_gb_at_1e5"] = scale_results[-1].peak_memory_mb / 1024

    scale_table = [
        {
            "mean_size": size,
            "seconds_per_iteration": result.seconds_per_iteration,
            "peak_memory_mb": result.peak_memory_mb,
            "drawn_with_replacement": size > split.train_x.size(0),
        }
        for size, result in zip(sizes, scale_results)
    ]
    notes = dict(RATIO_NOTES)
    if len(sizes) >= 2 and sizes[-2:] != [10_000, 100_000]:
        notes["time_ratio_1e4_to_1e5"] += f" (this run: {sizes[-1]} ÷ {sizes[-2]})"
    if sizes[-1] != 100_000:
        notes["peak_memory_gb_at_1e5"] += f" (this run: Mγ={sizes[-1]})"
    payload = benchmark_payload(
        NAME,
        {
            **config.to_json(),
            **split_config(split),
            "methods": methods,
            "reference": REFERENCE,
            "scale_method": "orthnat",
            "scale_num_inducing": m,
            "scale_mean_sizes": sizes,
            "scale_iterations": args.scale_iterations,
            "num_kl_columns": args.num_kl_columns,
            "mean_jitter": args.mean_jitter,
        },
        [*results, *scale_results],
        ratios,
        GOALS,
        device=args.device,
        ratio_notes=notes,
        scale=scale_table,
    )
    write_results(Path(args.output_dir) / f"{NAME}.json", payload)
    print("\n" + format_ratios(payload) + "\n(peak_memory_gb_at_1e5 is an absolute value; see ratio_notes in the JSON)")
    return payload


ORTHOGONAL_SPEED = Benchmark(
    NAME,
    "OrthNat's time per iteration vs GPyTorch's SVGP and ODVGP, and its time and memory at Mγ = 10^3 ... 10^5",
    _add_arguments,
    _run,
)
