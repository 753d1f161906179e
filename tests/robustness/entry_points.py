"""The public entry points of the package, each as a fresh small float64 problem with valid arguments, for the
property-based bad-input tests (issue 20). Strategies are called directly: ``model(x)`` runs GPyTorch's
``ApproximateGP.__call__`` first, which reads ``x.dim()`` before any check of ours.

An :class:`EntryPoint` builds a :class:`Case`: a call, its valid arguments, the role of each tensor argument (which
kinds of bad value apply to it) and a snapshot of every piece of state the call could change (the state dicts of the
model and likelihood, parameters' gradients, the optimizers' and update objects' state dicts, generator states).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gpytorch
import torch

from gpytorch_decoupled.kernels import KernelSpace
from gpytorch_decoupled.mlls import (
    DualVariationalELBO,
    GammaRobustVariationalELBO,
    PredictiveLogLikelihood,
    StreamingCollapsedBound,
    VariationalELBO,
)
from gpytorch_decoupled.models import KernelSelectionGP
from gpytorch_decoupled.optim import (
    DualEStep,
    OnlineBasisGrowth,
    OrthogonalMeanNaturalGradient,
    RecursiveGradientPropagation,
)
from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from tests import dual_problems, recursive_problems
from tests.float64_problems import bernoulli_likelihood, gaussian_likelihood

F64 = torch.float64
N, D = 12, 2

# Roles of tensor arguments: which bad values apply, and whether the argument shares its rows with the others.
INPUTS, POINTS, TARGETS, LABELS, GRADIENT = "inputs", "points", "targets", "labels", "gradient"


@dataclass
class Case:
    """One call of an entry point on fresh objects."""

    call: Callable[..., Any]
    arguments: dict[str, Any]
    roles: dict[str, str]
    objects: list[Any] = field(default_factory=list)  # modules, optimizers, update objects, generators

    def state(self) -> list[Any]:
        return [_state_of(thing) for thing in self.objects]


@dataclass(frozen=True)
class EntryPoint:
    name: str
    build: Callable[[], Case]

    def __repr__(self) -> str:
        return self.name


def _state_of(thing: Any) -> Any:
    if isinstance(thing, torch.Generator):
        return thing.get_state()
    if isinstance(thing, torch.nn.Module):
        gradients = {name: p.grad for name, p in thing.named_parameters()}
        return copy.deepcopy({"state": thing.state_dict(), "grad": gradients})
    return copy.deepcopy(thing.state_dict())


def same_state(before: Any, after: Any) -> bool:
    """Bit-identical nested state (tensors by value, dtype, device and shape)."""
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        return (
            isinstance(before, torch.Tensor)
            and isinstance(after, torch.Tensor)
            and before.dtype == after.dtype
            and before.device == after.device
            and torch.equal(before, after)
        )
    if isinstance(before, dict):
        return (
            isinstance(after, dict)
            and before.keys() == after.keys()
            and all(same_state(before[key], after[key]) for key in before)
        )
    if isinstance(before, list | tuple):
        return (
            type(before) is type(after)
            and len(before) == len(after)
            and all(same_state(a, b) for a, b in zip(before, after, strict=True))
        )
    return before == after


# ---------------------------------------------------------------------------------------------------- data and models
def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(N, D, generator=generator, dtype=F64) * 4 - 2
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(N, generator=generator, dtype=F64)
    labels = (torch.arange(N) % 2).to(F64)  # both classes present
    return x, y, labels


def points(count: int, seed: int) -> torch.Tensor:
    return torch.rand(count, D, generator=torch.Generator().manual_seed(seed), dtype=F64) * 4 - 2


class SmallGP(gpytorch.models.ApproximateGP):
    def __init__(self, make_strategy):
        super().__init__(make_strategy(self))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=D))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _residual(strategy_cls, distribution_cls=gpytorch.variational.CholeskyVariationalDistribution):
    def make(model):
        # fewer sampled KL rows than mean points: a call draws from the mean basis's own generator
        return strategy_cls(model, points(4, 1), distribution_cls(4), points(7, 2), num_kl_columns=3, exact_kl_size=0)

    return SmallGP(make).double()


def _decoupled():
    def make(model):
        q = DecoupledVariationalDistribution(7, 4)
        return DecoupledVariationalStrategy(model, points(4, 1), q, points(7, 2), num_kl_columns=3, exact_kl_size=0)

    return SmallGP(make).double()


MODELS = {
    "ODVGP": lambda: _residual(OrthogonallyDecoupledVariationalStrategy),
    "Hybrid": lambda: _residual(HybridVariationalStrategy),
    "Decoupled": _decoupled,
}


def _trained(model: torch.nn.Module, likelihood: torch.nn.Module) -> torch.optim.Optimizer:
    """An Adam optimizer with state, after one step on the data (so that optimizer state exists to be compared)."""
    x, y, _ = data()
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=N)
    optimizer.zero_grad()
    (-mll(model(x), y)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


# ------------------------------------------------------------------------------------------------------ the cases
def regression_case(call: Callable[..., Any], objects: list[Any]) -> Case:
    """A call on the regression data ``(x, y)``."""
    x, y, _ = data()
    return Case(call, {"x": x, "y": y}, {"x": INPUTS, "y": TARGETS}, objects)


def _strategy_call(family: str) -> Callable[[], Case]:
    def build() -> Case:
        x, _, _ = data()
        model = MODELS[family]()
        likelihood = gaussian_likelihood()
        optimizer = _trained(model, likelihood)
        strategy = model.variational_strategy
        return Case(lambda x: strategy(x), {"x": x}, {"x": INPUTS}, [model, likelihood, optimizer])

    return build


def _grow_bases(family: str) -> Callable[[], Case]:
    def build() -> Case:
        model = MODELS[family]()
        likelihood = gaussian_likelihood()
        optimizer = _trained(model, likelihood)
        strategy = model.variational_strategy
        return Case(
            lambda mean_points, inducing_points: strategy.grow_bases(mean_points, inducing_points),
            {"mean_points": points(3, 5), "inducing_points": points(2, 6)},
            {"mean_points": POINTS, "inducing_points": POINTS},
            [model, likelihood, optimizer],
        )

    return build


def dual_model(labels: bool):
    Z, _, _ = dual_problems.problem(0)
    model = dual_problems.DualGP(Z[:, :D].contiguous())
    likelihood = bernoulli_likelihood(10) if labels else gaussian_likelihood()
    return model, likelihood


def _dual_call() -> Case:
    x, y, _ = data()
    model, likelihood = dual_model(False)
    DualEStep(model, likelihood, num_data=N).step(x, y)
    return Case(lambda x: model.variational_strategy(x), {"x": x}, {"x": INPUTS}, [model, likelihood])


def _dual_e_step(labels: bool) -> Callable[[], Case]:
    def build() -> Case:
        x, y, classes = data()
        model, likelihood = dual_model(labels)
        e_step = DualEStep(model, likelihood, num_data=N, lr=0.5)
        targets = classes if labels else y
        e_step.step(x, targets)
        return Case(
            lambda x, y: e_step.step(x, y),
            {"x": x, "y": targets},
            {"x": INPUTS, "y": LABELS if labels else TARGETS},
            [model, likelihood, e_step],
        )

    return build


def _objective_case(objective, model: torch.nn.Module, labels: bool, objects: list[Any]) -> Case:
    """A call of an objective at the model's output on ``x``, with the targets (labels) as the argument."""
    x, y, classes = data()
    output = model(x)
    return Case(
        lambda target: objective(output, target),
        {"target": classes if labels else y},
        {"target": LABELS if labels else TARGETS},
        objects,
    )


def _dual_elbo(labels: bool) -> Callable[[], Case]:
    def build() -> Case:
        x, y, classes = data()
        model, likelihood = dual_model(labels)
        DualEStep(model, likelihood, num_data=N).step(x, classes if labels else y)
        return _objective_case(DualVariationalELBO(likelihood, model, num_data=N), model, labels, [model, likelihood])

    return build


def _checked_objective(family: str, objective_cls, labels: bool) -> Callable[[], Case]:
    """One of GPyTorch's approximate objectives with checked targets, on a model of a family trained one step."""

    def build() -> Case:
        model = MODELS[family]()
        likelihood = bernoulli_likelihood(10) if labels else gaussian_likelihood()
        objects = [model, likelihood] if labels else [model, likelihood, _trained(model, likelihood)]
        return _objective_case(objective_cls(likelihood, model, num_data=N), model, labels, objects)

    return build


def kalman_model():
    x, y, _ = data()
    model, likelihood = recursive_problems.make_model(points(5, 3))
    model.variational_strategy.update(x[:6], y[:6])
    return model, likelihood


def _kalman_call() -> Case:
    x, _, _ = data()
    model, likelihood = kalman_model()
    model.eval()
    return Case(lambda x: model.variational_strategy(x), {"x": x}, {"x": INPUTS}, [model, likelihood])


def _kalman_update() -> Case:
    model, likelihood = kalman_model()
    strategy = model.variational_strategy
    return regression_case(lambda x, y: strategy.update(x, y), [model, likelihood])


def _srgp_step() -> Case:
    x, y, _ = data()
    model, likelihood = recursive_problems.make_model(points(5, 3))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
    srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
    srgp.step(x[:6], y[:6])
    return regression_case(lambda x, y: srgp.step(x, y), [model, likelihood, optimizer, srgp])


def _collapsed_bound() -> Case:
    x, y, _ = data()
    model, likelihood = recursive_problems.make_model(points(5, 3))
    bound = StreamingCollapsedBound(model, likelihood)

    def call(x, y):
        # the bad batch comes second: the first, valid one must not leave gradients behind either
        return bound.value_and_backward([(x_good, y_good), (x, y)])

    x_good, y_good = x[:4], y[:4]
    return regression_case(call, [model, likelihood])


def _online_growth() -> Case:
    model = MODELS["Decoupled"]()
    likelihood = gaussian_likelihood()
    optimizer = _trained(model, likelihood)
    growth = OnlineBasisGrowth(
        model, 12, 8, 2, optimizers=[optimizer], likelihood=likelihood, generator=torch.Generator().manual_seed(0)
    )
    return regression_case(lambda x, y: growth.step(x, y), [model, likelihood, optimizer, growth])


def _orthogonal_natural_gradient() -> Case:
    model = MODELS["ODVGP"]()
    likelihood = gaussian_likelihood()
    optimizer = _trained(model, likelihood)
    step = OrthogonalMeanNaturalGradient(model, num_data=N, lr=0.01)
    coefficients = model.variational_strategy.mean_coefficients

    def call(gradient):
        coefficients.grad = gradient
        try:
            return step.step()
        finally:
            coefficients.grad = None

    return Case(
        call, {"gradient": torch.ones_like(coefficients)}, {"gradient": GRADIENT}, [model, likelihood, optimizer, step]
    )


def _kernel_selection_model() -> KernelSelectionGP:
    x, y, _ = data()
    model = KernelSelectionGP(KernelSpace(["SE", "PER"]), points(4, 4), num_belief_samples=50).double()
    model.fit(x, y, num_iterations=1, batch_size=N, progress=False)
    return model


def _kernel_selection_fit() -> Case:
    x, y, _ = data()
    model = _kernel_selection_model()
    call = lambda x, y: model.fit(x, y, num_iterations=1, batch_size=4, progress=False)  # noqa: E731
    return regression_case(call, [model])


def _kernel_selection_predict() -> Case:
    x, _, _ = data()
    model = _kernel_selection_model()
    return Case(lambda x: model.predict(x), {"x": x}, {"x": INPUTS}, [model])


ENTRY_POINTS = [
    *(EntryPoint(f"{family}.__call__", _strategy_call(family)) for family in MODELS),
    EntryPoint("Dual.__call__", _dual_call),
    EntryPoint("Kalman.__call__", _kalman_call),
    EntryPoint("Kalman.update", _kalman_update),
    *(EntryPoint(f"{family}.grow_bases", _grow_bases(family)) for family in MODELS),
    EntryPoint("DualEStep.step[Gaussian]", _dual_e_step(False)),
    EntryPoint("DualEStep.step[Bernoulli]", _dual_e_step(True)),
    EntryPoint("DualVariationalELBO[Gaussian]", _dual_elbo(False)),
    EntryPoint("DualVariationalELBO[Bernoulli]", _dual_elbo(True)),
    *(
        EntryPoint(f"VariationalELBO[{family}]", _checked_objective(family, VariationalELBO, False))
        for family in MODELS
    ),
    EntryPoint(
        "PredictiveLogLikelihood[Hybrid, Bernoulli]", _checked_objective("Hybrid", PredictiveLogLikelihood, True)
    ),
    EntryPoint("GammaRobustVariationalELBO[ODVGP]", _checked_objective("ODVGP", GammaRobustVariationalELBO, False)),
    EntryPoint("OnlineBasisGrowth.step", _online_growth),
    EntryPoint("OrthogonalMeanNaturalGradient.step", _orthogonal_natural_gradient),
    EntryPoint("RecursiveGradientPropagation.step", _srgp_step),
    EntryPoint("StreamingCollapsedBound.value_and_backward", _collapsed_bound),
    EntryPoint("KernelSelectionGP.fit", _kernel_selection_fit),
    EntryPoint("KernelSelectionGP.predict", _kernel_selection_predict),
]
