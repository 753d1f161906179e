"""Benchmark harness: ``python -m benchmarks <name>``.

Every comparison trains our methods and GPyTorch's baselines in one process, on the same data, seed and mini-batch
order, and reports ratios to the baseline of the same run (absolute times are not comparable between machines). Each
benchmark prints a table and writes ``benchmarks/results/<name>.json`` (and a PNG where a curve says more).
It lives beside its results, outside the package: the library never imports it, and the wheel does not ship it.
"""

from .baselines_benchmark import BASELINES
from .benchmark import Benchmark
from .collapsed_fit_benchmark import COLLAPSED_FIT
from .compiled_recursive_step_benchmark import COMPILED_RECURSIVE_STEP
from .compiled_step_benchmark import COMPILED_STEP
from .cuda_step_benchmark import CUDA_STEP
from .decoupled_accuracy_benchmark import DECOUPLED_ACCURACY
from .decoupled_equal_time_benchmark import DECOUPLED_EQUAL_TIME
from .decoupled_speed_benchmark import DECOUPLED_SPEED
from .decoupled_step_benchmark import DECOUPLED_STEP
from .distributed_benchmark import DISTRIBUTED
from .dual_benchmark import DUAL
from .kernel_selection_benchmark import KERNEL_SELECTION
from .mean_basis_adam_benchmark import MEAN_BASIS_ADAM
from .method_result import MethodResult
from .methods import METHODS, Method, build_method
from .orthogonal_accuracy_benchmark import ORTHOGONAL_ACCURACY
from .orthogonal_speed_benchmark import ORTHOGONAL_SPEED
from .recursive_benchmark import RECURSIVE
from .run_config import RunConfig
from .runner import compare, train_and_evaluate
from .srgp_step_benchmark import SRGP_STEP
from .streaming_benchmark import STREAMING
from .tsvgp_benchmark import TSVGP

BENCHMARKS: dict[str, Benchmark] = {
    benchmark.name: benchmark
    for benchmark in (
        BASELINES,
        ORTHOGONAL_SPEED,
        ORTHOGONAL_ACCURACY,
        DECOUPLED_SPEED,
        DECOUPLED_ACCURACY,
        DECOUPLED_EQUAL_TIME,
        DECOUPLED_STEP,
        MEAN_BASIS_ADAM,
        DUAL,
        TSVGP,
        RECURSIVE,
        SRGP_STEP,
        COLLAPSED_FIT,
        STREAMING,
        KERNEL_SELECTION,
        DISTRIBUTED,
        COMPILED_STEP,
        COMPILED_RECURSIVE_STEP,
        CUDA_STEP,
    )
}

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "METHODS",
    "Method",
    "MethodResult",
    "RunConfig",
    "build_method",
    "compare",
    "train_and_evaluate",
]
