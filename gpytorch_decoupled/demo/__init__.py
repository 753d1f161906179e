"""``python -m gpytorch_decoupled demo``: every method family of this package against GPyTorch's SVGP on embedded
real data (elevators).

Each method is set up as the README shows it and trained on the same data, seed and mini-batch order for the same
number of iterations or seconds; the demo prints test RMSE, test NLL and seconds per iteration, writes them to
``demo.json`` and, when matplotlib is installed, plots test NLL against training time. It needs only the package's
runtime dependencies. The benchmark harness of the source repository (``benchmarks/``) measures with more care:
methods trained in lockstep, peak memory, ratios to the same-run baseline.
"""

from .demo_method import DemoMethod
from .demo_methods import DEMO_METHODS
from .regression_model import RegressionModel
from .run_demo import add_demo_arguments, format_table, gaussian_metrics, run_demo, train_and_score

__all__ = [
    "DEMO_METHODS",
    "DemoMethod",
    "RegressionModel",
    "add_demo_arguments",
    "format_table",
    "gaussian_metrics",
    "run_demo",
    "train_and_score",
]
