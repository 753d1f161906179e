"""Trainable methods for the benchmarks: GPyTorch's baselines and this package's strategies.

:data:`METHODS` maps a short name to a factory ``(train_x, train_y, **options) -> Method``; each method family of the
package adds its entry here when it lands.
"""

from collections.abc import Callable
from functools import partial

import gpytorch
from torch import Tensor

from gpytorch_decoupled.variational import HybridVariationalStrategy

from .approximate_gp_method import STEP_KINDS, ApproximateGPMethod
from .approximate_regression_model import ApproximateRegressionModel
from .decoupled_method import DecoupledMethod
from .dual_method import DualMethod
from .em_method import EMMethod
from .exact_gp_method import ExactGPMethod
from .exact_regression_model import ExactRegressionModel
from .gpytorch_orthogonal_method import GPyTorchOrthogonalMethod
from .inducing_points import initial_inducing_points
from .method import Method, MethodNotApplicable
from .nearest_neighbor_method import NearestNeighborMethod
from .orthogonal_method import OrthogonalMethod
from .qsvgp_method import QSVGPMethod
from .recursive_method import RecursiveMethod
from .svgp_method import SVGPMethod

MethodFactory = Callable[..., Method]

METHODS: dict[str, MethodFactory] = {
    "svgp": SVGPMethod,
    "svgp-ngd": partial(SVGPMethod, natural=True),
    "svgp-large-batch": partial(SVGPMethod, strategy_cls=gpytorch.variational.LargeBatchVariationalStrategy),
    "vnngp": NearestNeighborMethod,
    "gpytorch-odvgp": GPyTorchOrthogonalMethod,
    "sgpr": partial(ExactGPMethod, num_inducing=200),
    "exact": partial(ExactGPMethod, num_inducing=None),
    "orthnat": partial(OrthogonalMethod, natural=True),
    "orth": partial(OrthogonalMethod, natural=False),
    "decoupled": DecoupledMethod,
    "hybrid": partial(OrthogonalMethod, natural=False, strategy_cls=HybridVariationalStrategy),
    "dual": DualMethod,
    "q-svgp": QSVGPMethod,
    "recursive": RecursiveMethod,
}


def build_method(name: str, train_x: Tensor, train_y: Tensor, step: str = "eager", **options) -> Method:
    """Build the method registered as ``name`` on the training data, with method-specific ``options``; ``step``
    (one of :data:`STEP_KINDS`) other than ``eager`` runs a variational method's steps through the package's
    :class:`~gpytorch_decoupled.training.TrainingStep`."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    method = METHODS[name](train_x, train_y, **options)
    if step != "eager":
        if not isinstance(method, ApproximateGPMethod):
            raise MethodNotApplicable(f"{name} has no {step} step (it is not trained by a TrainingStep).")
        method.use_training_step(step)
    return method


__all__ = [
    "ApproximateGPMethod",
    "ApproximateRegressionModel",
    "DecoupledMethod",
    "DualMethod",
    "EMMethod",
    "ExactGPMethod",
    "ExactRegressionModel",
    "GPyTorchOrthogonalMethod",
    "METHODS",
    "Method",
    "MethodFactory",
    "MethodNotApplicable",
    "NearestNeighborMethod",
    "OrthogonalMethod",
    "QSVGPMethod",
    "RecursiveMethod",
    "STEP_KINDS",
    "SVGPMethod",
    "build_method",
    "initial_inducing_points",
]
