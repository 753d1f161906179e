"""Resume means resume (issue 20): a run checkpointed mid-epoch (mid-stream), saved with ``torch.save``, loaded with
``torch.load`` into freshly built objects (built under another global seed) and continued with the global random
generator scrambled, ends bit-identical to the uninterrupted run, for every family of the package.

Each family is a :class:`Run`: ``build()`` makes the objects (modules, optimizers, update objects) and returns them
by name with a ``step(i)`` that takes the i-th training step; the state of every named object is its
``state_dict()``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import gpytorch
import pytest
import torch

from gpytorch_decoupled.kernels import KernelSpace
from gpytorch_decoupled.mlls import DualVariationalELBO
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
from tests.float64_problems import gaussian_likelihood
from tests.robustness.entry_points import ENTRY_POINTS, SmallGP, points, same_state

N, BATCH, STEPS, CHECKPOINT = 48, 12, 10, 5  # four batches an epoch: the checkpoint is in the middle of the second


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.rand(N, 2, generator=generator, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1]) + 0.1 * torch.randn(N, generator=generator, dtype=torch.float64)
    return x, y


def _batch(step: int) -> torch.Tensor:
    """The rows of a step: a permutation per epoch from a seeded generator, as a resumable data loader draws them."""
    epoch, position = divmod(step, N // BATCH)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(100 + epoch))
    return order[position * BATCH : (position + 1) * BATCH]


@dataclass
class Objects:
    stateful: dict[str, object]  # everything with a state_dict, by name
    step: Callable[[int], None]
    steps: int = STEPS
    checkpoint: int = CHECKPOINT


def _residual(strategy_cls, natural: bool) -> Callable[[], Objects]:
    def build() -> Objects:
        x, y = _data()
        distribution = (
            gpytorch.variational.NaturalVariationalDistribution
            if natural
            else gpytorch.variational.CholeskyVariationalDistribution
        )

        def make(model):
            # fewer sampled KL rows than mean points: every training step draws from the strategy's generator
            return strategy_cls(model, points(5, 1), distribution(5), points(16, 2), num_kl_columns=6, exact_kl_size=0)

        model, likelihood = SmallGP(make).double(), gaussian_likelihood()
        mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=N)
        variational = set(model.variational_parameters())
        mean = model.variational_strategy.mean_coefficients
        others = [p for p in [*model.parameters(), *likelihood.parameters()] if p not in variational and p is not mean]
        optimizers = {"adam": torch.optim.Adam(others, lr=0.02)}
        if natural:
            optimizers["ngd"] = gpytorch.optim.NGD(list(variational), num_data=N, lr=0.1)
            optimizers["mean_step"] = OrthogonalMeanNaturalGradient(model, num_data=N, lr=0.01)
        else:
            optimizers["adam_q"] = torch.optim.Adam([*variational, mean], lr=0.02)

        def step(i: int) -> None:
            rows = _batch(i)
            for optimizer in optimizers.values():
                optimizer.zero_grad()
            (-mll(model(x[rows]), y[rows])).backward()
            for optimizer in optimizers.values():
                optimizer.step()

        return Objects({"model": model, "likelihood": likelihood, **optimizers}, step)

    return build


def _dual() -> Objects:
    x, y = _data()
    Z = points(6, 3)
    model, likelihood = dual_problems.DualGP(Z), gaussian_likelihood()
    model.covar_module.base_kernel.raw_lengthscale.requires_grad_(True)
    e_step = DualEStep(model, likelihood, num_data=N, lr=0.7)
    objective = DualVariationalELBO(likelihood, model, num_data=N)
    adam = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.02)

    def step(i: int) -> None:
        rows = _batch(i)
        e_step.step(x[rows], y[rows])
        adam.zero_grad()
        (-objective(model(x[rows]), y[rows])).backward()
        adam.step()

    return Objects({"model": model, "likelihood": likelihood, "e_step": e_step, "adam": adam}, step)


def _kalman() -> Objects:
    x, y = _data()
    model, likelihood = recursive_problems.make_model(points(6, 3))

    def step(i: int) -> None:  # one pass over the stream: mid-stream is mid-epoch
        rows = torch.arange(N)[i * (N // STEPS) : (i + 1) * (N // STEPS)]
        model.variational_strategy.update(x[rows], y[rows])

    return Objects({"model": model, "likelihood": likelihood}, step)


def _srgp() -> Objects:
    x, y = _data()
    model, likelihood = recursive_problems.make_model(points(6, 3))
    adam = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
    srgp = RecursiveGradientPropagation(model, likelihood, adam)

    def step(i: int) -> None:
        if i % (N // BATCH) == 0:
            model.variational_strategy.reset()
            srgp.start_epoch()
        rows = _batch(i)
        srgp.step(x[rows], y[rows])

    return Objects({"model": model, "likelihood": likelihood, "adam": adam, "srgp": srgp}, step)


def _decoupled_growth() -> Objects:
    x, y = _data()

    def make(model):  # one point of the data to start from, grown by OnlineBasisGrowth
        q = DecoupledVariationalDistribution(1, 1)
        return DecoupledVariationalStrategy(model, x[:1], q, x[:1], num_kl_columns=4, exact_kl_size=0)

    model, likelihood = SmallGP(make).double(), gaussian_likelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=N)
    adam = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.02)
    growth = OnlineBasisGrowth(
        model, 20, 8, 3, optimizers=[adam], likelihood=likelihood, generator=torch.Generator().manual_seed(0)
    )

    def step(i: int) -> None:
        rows = _batch(i)
        growth.step(x[rows], y[rows])
        adam.zero_grad()
        (-mll(model(x[rows]), y[rows])).backward()
        adam.step()

    # the growth first: loading it grows a fresh model to the checkpoint's bases (without the median trick)
    return Objects({"growth": growth, "model": model, "likelihood": likelihood, "adam": adam}, step)


class _GeneratorState:
    """The user's generator of mini-batches, saved with the checkpoint."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["state"])


def _kernel_selection() -> Objects:
    x, y = _data()
    model = KernelSelectionGP(KernelSpace(["SE", "PER"]), points(6, 4), num_belief_samples=20).double()
    batches = _GeneratorState(5)

    def step(i: int) -> None:  # the paper's incremental protocol: fit again on more data, warm-started
        rows = torch.arange(N)[: 24 + 8 * i]
        model.fit(x[rows], y[rows], num_iterations=2, batch_size=8, generator=batches.generator, progress=False)

    return Objects({"model": model, "batches": batches}, step, steps=3, checkpoint=1)


RUNS = {
    "KernelSelectionGP": _kernel_selection,
    "Decoupled-OnlineBasisGrowth": _decoupled_growth,
    "ODVGP-OrthNat": _residual(OrthogonallyDecoupledVariationalStrategy, natural=True),
    "Hybrid": _residual(HybridVariationalStrategy, natural=False),
    "t-SVGP-DualEStep": _dual,
    "Kalman-streaming": _kalman,
    "SRGP": _srgp,
}


def _state(objects: Objects) -> dict:
    return {name: thing.state_dict() for name, thing in objects.stateful.items()}


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("family", RUNS)
def test_a_run_resumed_from_a_checkpoint_ends_where_the_uninterrupted_run_ends(family: str) -> None:
    build = RUNS[family]
    torch.manual_seed(0)
    uninterrupted = build()
    for i in range(uninterrupted.steps):
        uninterrupted.step(i)

    torch.manual_seed(0)
    first = build()
    for i in range(first.checkpoint):
        first.step(i)
    checkpoint = _round_trip(_state(first))
    del first

    torch.manual_seed(12345)  # fresh objects start elsewhere, and the global generator is not where it was
    resumed = build()
    for name, thing in resumed.stateful.items():
        thing.load_state_dict(checkpoint[name])
    torch.manual_seed(999)
    for i in range(resumed.checkpoint, resumed.steps):
        resumed.step(i)

    for name in uninterrupted.stateful:
        assert same_state(_state(uninterrupted)[name], _state(resumed)[name]), name


def test_a_bad_call_draws_nothing_from_the_sampled_kl_generator() -> None:
    """The KL rows come from the mean basis's own generator; a refused call must not advance it (resume)."""
    case = ENTRY_POINTS[0].build()  # ODVGP
    basis = case.objects[0].variational_strategy.mean_basis
    state = basis.get_extra_state().clone()
    with pytest.raises(ValueError, match="x contains NaN or inf"):
        case.call(x=torch.full_like(case.arguments["x"], float("nan")))
    assert torch.equal(basis.get_extra_state(), state)
