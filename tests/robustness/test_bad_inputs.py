"""Property-based tests of issue 20: every public entry point refuses every kind of bad argument with a clear
exception that names the argument, and leaves every piece of state (model, likelihood, gradients, optimizers, update
objects, random generators) bit-identical.

Hypothesis draws the argument, the kind of damage and where it is done (which entry, which value, how many rows or
columns); the ``ci`` profile (``tests/conftest.py``) derandomizes the draws and bounds their number.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gpytorch_decoupled import datasets
from gpytorch_decoupled.distributed import DistributedEStep, DistributedKalmanUpdate, init_process_group
from gpytorch_decoupled.variational import (
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
    convert_mean_basis,
)
from tests.robustness import entry_points
from tests.robustness.entry_points import (
    ENTRY_POINTS,
    GRADIENT,
    INPUTS,
    LABELS,
    POINTS,
    TARGETS,
    Case,
    EntryPoint,
    SmallGP,
    points,
    same_state,
)

# Examples per property: 24 entry points, the 2 distributed steps, convert_mean_basis and datasets.load, 700 in all.
EXAMPLES = 25

ERRORS = (TypeError, ValueError, RuntimeError)
ROW_ALIGNED = (INPUTS, TARGETS, LABELS)


def _nonfinite(draw, value: torch.Tensor) -> torch.Tensor:
    value = value.clone()
    index = draw(st.integers(0, value.numel() - 1))
    value.view(-1)[index] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return value


def _damage(draw, role: str, value: torch.Tensor) -> tuple[str, object]:
    """A kind of damage that applies to an argument of this role, and the damaged value."""
    kinds = ["not a tensor", "meta device", "non-finite"]
    if role in (INPUTS, POINTS):
        kinds += ["float32", "int64", "1-D", "width"]
    if role == POINTS:
        kinds += ["overflowing"]
    if role == TARGETS:
        kinds += ["float32", "int64", "column", "scalar"]
    if role == LABELS:
        kinds += ["bad labels", "column", "scalar"]
    if role == GRADIENT:
        kinds = ["non-finite"]
    kind = draw(st.sampled_from(kinds))
    if kind == "not a tensor":
        # (None means "no points" to grow_bases)
        return kind, draw(st.sampled_from([value.tolist(), value.numpy(), *([None] if role != POINTS else [])]))
    if kind == "meta device":
        return kind, torch.empty_like(value, device="meta")
    if kind == "non-finite":
        return kind, _nonfinite(draw, value)
    if kind == "float32":
        return kind, value.float()
    if kind == "int64":
        return kind, value.round().long()
    if kind == "1-D":
        return kind, value[..., 0]
    if kind == "width":
        extra = draw(st.integers(-value.size(-1) + 1, 3).filter(lambda k: k != 0))
        return kind, value[..., : value.size(-1) + extra] if extra < 0 else torch.cat([value, value[..., :extra]], -1)
    if kind == "overflowing":
        return kind, value * draw(st.sampled_from([1e200, 1e300]))
    if kind == "column":
        return kind, value.unsqueeze(-1)
    if kind == "scalar":
        return kind, value[0]
    # bad labels: values Bernoulli does not take (or -1 among 0/1 labels: two conventions at once)
    value = value.clone()
    index = draw(st.integers(0, value.numel() - 1))
    value[index] = draw(st.sampled_from([2.0, 0.5, -1.0, -2.0, 3.0]))
    return kind, value


@st.composite
def bad_arguments(draw, entry_point: EntryPoint) -> tuple[object, dict, str, list[str]]:
    """A fresh case, its arguments with one kind of damage, what was done, and the names an error may name."""
    case = entry_point.build()
    arguments = dict(case.arguments)
    aligned = [name for name, role in case.roles.items() if role in ROW_ALIGNED]
    rows = {name: arguments[name].size(-2 if case.roles[name] == INPUTS else -1) for name in aligned}
    whole = ["empty batch", "length mismatch"] if len(aligned) > 1 else ["empty batch"] if aligned else []
    kind = draw(st.sampled_from(["one argument", "one argument", *whole]))
    if kind == "empty batch":
        for name in aligned:
            arguments[name] = arguments[name][..., :0, :] if case.roles[name] == INPUTS else arguments[name][..., :0]
        return case, arguments, kind, aligned
    if kind == "length mismatch":
        name = draw(st.sampled_from(aligned))
        keep = draw(st.integers(0, rows[name] - 1))
        value = arguments[name]
        arguments[name] = value[..., :keep, :] if case.roles[name] == INPUTS else value[..., :keep]
        return case, arguments, f"{name} shortened to {keep} rows", aligned
    name = draw(st.sampled_from(sorted(case.roles)))
    what, arguments[name] = _damage(draw, case.roles[name], arguments[name])
    names = [name] if case.roles[name] != GRADIENT else ["mean_coefficients"]
    return case, arguments, f"{name}: {what}", names


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=repr)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_bad_input_is_refused_by_name_and_changes_nothing(entry_point: EntryPoint, data) -> None:
    case, arguments, what, names = data.draw(bad_arguments(entry_point), label="damage")
    data.draw(st.just(what), label="what")
    before = case.state()
    with pytest.raises(ERRORS) as caught:
        case.call(**arguments)
    message = str(caught.value)
    assert any(name in message for name in names), f"{what}: the error does not name {names}: {message!r}"
    assert same_state(before, case.state()), f"{what}: the state changed although the call raised"
    case.call(**case.arguments)  # and the objects still work


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=repr)
def test_valid_arguments_are_accepted(entry_point: EntryPoint) -> None:
    """The cases' own arguments are valid: the damage above is what the errors are about."""
    case = entry_point.build()
    case.call(**case.arguments)


# ------------------------------------------------------------------------------------ conversion between strategies
def _conversion_pair(draw) -> tuple[object, object, str]:
    """A hybrid source and an orthogonally decoupled target that differ in one way convert_mean_basis cannot map."""
    source_sizes, what = (4, 7), draw(st.sampled_from(["covariance basis", "mean basis", "dtype", "structure"]))
    target_sizes = source_sizes
    if what == "covariance basis":
        target_sizes = (draw(st.integers(1, 8).filter(lambda m: m != 4)), 7)
    elif what == "mean basis":
        target_sizes = (4, draw(st.integers(1, 12).filter(lambda m: m != 7)))

    def model(strategy_cls, sizes, seed):
        def make(gp):
            q = gpytorch.variational.CholeskyVariationalDistribution(sizes[0])
            return strategy_cls(gp, points(sizes[0], seed), q, points(sizes[1], seed + 1))

        return SmallGP(make).double()

    source = model(HybridVariationalStrategy, source_sizes, 1)
    target = model(OrthogonallyDecoupledVariationalStrategy, target_sizes, 3)
    if what == "dtype":
        target = target.float()
    elif what == "structure":
        target.mean_module = gpytorch.means.ZeroMean()
    return source, target, what


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_convert_mean_basis_refuses_a_target_it_cannot_fill_and_changes_nothing(data) -> None:
    """R4 of issue 20: a target with another M_beta got a partial state dict before the shapes were checked."""
    source, target, what = _conversion_pair(data.draw)
    data.draw(st.just(what), label="what")
    before = [_state(source), _state(target)]
    with pytest.raises(ValueError, match="in the source but|differ in structure"):
        convert_mean_basis(source.variational_strategy, target.variational_strategy)
    assert same_state(before, [_state(source), _state(target)])


def _state(module: torch.nn.Module) -> dict:
    return {name: value.clone() for name, value in module.state_dict().items()}


# ------------------------------------------------------------------------------------------------------- data sets
BAD_LOAD_ARGUMENTS = {
    "name": (
        st.one_of(st.integers(), st.text(min_size=1, max_size=8).filter(lambda s: s.lower() != s.upper())),
        ("name", "data set"),
    ),
    "split": (st.one_of(st.integers(max_value=-1), st.integers(min_value=10), st.floats(), st.booleans()), ("split",)),
    "dtype": (st.sampled_from([torch.int64, torch.int32, torch.bool, torch.uint8, "float64", 64]), ("dtype",)),
    "device": (st.sampled_from(["nodevice", "cuda:99", 3.5, torch.float64]), ("device",)),
    "source": (st.text(min_size=1, max_size=8).filter(lambda s: s != "evans"), ("source",)),
    "download": (st.sampled_from(["yes", 1, 0.0]), ("download",)),
}


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_datasets_load_refuses_bad_arguments_by_name(data) -> None:
    """R7 of issue 20 (fixed with the data sets): every argument is checked before a file is read."""
    argument = data.draw(st.sampled_from(sorted(BAD_LOAD_ARGUMENTS)), label="argument")
    values, names = BAD_LOAD_ARGUMENTS[argument]
    value = data.draw(values, label="value")
    if argument == "device" and value == "cuda:99" and torch.cuda.device_count() > 99:
        return
    arguments = {"name": "elevators", argument: value}
    with pytest.raises((TypeError, ValueError)) as caught:
        datasets.load(**arguments)
    assert any(name in str(caught.value) for name in names), str(caught.value)


# ------------------------------------------------------------------------------- distributed steps, in a group of one
@pytest.fixture(scope="module")
def group_of_one():
    if dist.is_initialized():
        dist.destroy_process_group()
    init_process_group(backend="gloo", timeout_seconds=30)
    yield
    dist.destroy_process_group()


def _distributed_e_step() -> Case:
    model, likelihood = entry_points.dual_model(labels=True)
    x, _, labels = entry_points.data()
    e_step = DistributedEStep(model, likelihood, num_data=entry_points.N, lr=0.5)
    e_step.step(x, labels)
    return Case(
        lambda x, y: e_step.step(x, y), {"x": x, "y": labels}, {"x": INPUTS, "y": LABELS}, [model, likelihood, e_step]
    )


def _distributed_kalman_update() -> Case:
    model, likelihood = entry_points.kalman_model()
    update = DistributedKalmanUpdate(model, likelihood)
    return entry_points.regression_case(lambda x, y: update.update(x, y), [model, likelihood])


DISTRIBUTED = [
    EntryPoint("DistributedEStep.step[Bernoulli]", _distributed_e_step),
    EntryPoint("DistributedKalmanUpdate.update", _distributed_kalman_update),
]


@pytest.mark.parametrize("entry_point", DISTRIBUTED, ids=repr)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_distributed_steps_refuse_bad_input_on_every_rank_and_change_nothing(
    group_of_one, entry_point: EntryPoint, data
) -> None:
    """The local check fails on the rank that got the bad batch; every rank raises DistributedStepError naming it."""
    test_bad_input_is_refused_by_name_and_changes_nothing.hypothesis.inner_test(entry_point, data)
