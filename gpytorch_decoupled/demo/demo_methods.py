"""How the demo builds and trains each method: GPyTorch's SVGP baselines and each family of this package, set up as
the README shows them, on the same seeded inducing inputs (one permutation of the training rows)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import gpytorch
import torch
from torch import Tensor

from ..mlls import DualVariationalELBO
from ..optim import DualEStep, RecursiveGradientPropagation
from ..variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    DualVariationalDistribution,
    DualVariationalStrategy,
    FastNaturalVariationalDistribution,
    KalmanVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from .demo_method import DemoMethod
from .regression_model import RegressionModel

#: Adam's learning rate for everything Adam trains (SRGP takes larger steps, see :func:`srgp`).
LEARNING_RATE = 0.01
#: Sampled rows of the mean basis's KL term per step (decoupled families), which keeps a step linear in the basis.
NUM_KL_COLUMNS = 64


def _training_points(train_x: Tensor, sizes: Sequence[int], seed: int) -> list[Tensor]:
    """Consecutive slices of one seeded permutation of the training inputs, one per size (no point twice), so that
    every method of a run starts from the same inducing inputs."""
    if sum(sizes) > train_x.size(0):
        raise ValueError(
            f"the demo needs at least {sum(sizes)} training rows for its inducing inputs, got {train_x.size(0)}"
        )
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(train_x.size(0), generator=generator).to(train_x.device)
    return [train_x[index].clone() for index in order[: sum(sizes)].split(list(sizes))]


def _gradient_step(
    model: gpytorch.models.ApproximateGP, objective: gpytorch.mlls.MarginalLogLikelihood, optimizers: Sequence
) -> Callable[[Tensor, Tensor], None]:
    """One step of every optimizer on the gradient of ``-objective`` at a mini-batch."""

    def step(x: Tensor, y: Tensor) -> None:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        (-objective(model(x), y)).backward()
        for optimizer in optimizers:
            optimizer.step()

    return step


def _model(make_strategy, train_x: Tensor) -> tuple[RegressionModel, gpytorch.likelihoods.GaussianLikelihood]:
    model = RegressionModel(make_strategy, train_x.size(-1)).to(train_x)
    return model, gpytorch.likelihoods.GaussianLikelihood().to(train_x)


def svgp(train_x: Tensor, train_y: Tensor, natural: bool = False, seed: int = 0) -> DemoMethod:
    """GPyTorch's SVGP (Hensman et al., 2015), M = 200: Adam on everything, or (``natural``) NGD on q(u) and Adam on
    the rest, as in GPyTorch's natural-gradient tutorial."""
    (z,) = _training_points(train_x, [200], seed)
    distribution_cls = (
        gpytorch.variational.NaturalVariationalDistribution
        if natural
        else gpytorch.variational.CholeskyVariationalDistribution
    )
    model, likelihood = _model(
        lambda model: gpytorch.variational.VariationalStrategy(
            model, z, distribution_cls(z.size(0)), learn_inducing_locations=True
        ),
        train_x,
    )
    num_data = train_y.size(0)
    if natural:
        optimizers = [
            gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=0.1),
            torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=LEARNING_RATE),
        ]
    else:
        optimizers = [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=LEARNING_RATE)]
    step = _gradient_step(model, gpytorch.mlls.VariationalELBO(likelihood, model, num_data=num_data), optimizers)
    label = f"GPyTorch SVGP ({'NGD' if natural else 'Adam'})"
    return DemoMethod(label, "M=200", model, likelihood, step)


def orthnat(train_x: Tensor, train_y: Tensor, seed: int = 0) -> DemoMethod:
    r"""OrthNat (Salimbeni et al., 2018), :math:`M_\beta = 200`, :math:`M_\gamma = 1000`: natural gradients on the
    covariance block, Adam on the mean coefficients and the hyperparameters."""
    beta, gamma = _training_points(train_x, [200, 1000], seed)
    model, likelihood = _model(
        lambda model: OrthogonallyDecoupledVariationalStrategy(
            model, beta, FastNaturalVariationalDistribution(beta.size(0)), gamma, num_kl_columns=NUM_KL_COLUMNS
        ),
        train_x,
    )
    num_data = train_y.size(0)
    optimizers = [
        gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=0.1),
        torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=LEARNING_RATE),
    ]
    step = _gradient_step(model, gpytorch.mlls.VariationalELBO(likelihood, model, num_data=num_data), optimizers)
    return DemoMethod("OrthNat (ours)", "Mγ=1000, Mβ=200", model, likelihood, step)


def decoupled(train_x: Tensor, train_y: Tensor, seed: int = 0) -> DemoMethod:
    r"""The decoupled basis (Cheng & Boots, 2017), :math:`M_\alpha = 1200` (covariance points included),
    :math:`M_\beta = 200`: Adam on everything, as both papers train it."""
    beta, gamma = _training_points(train_x, [200, 1000], seed)
    alpha = torch.cat([gamma, beta])
    model, likelihood = _model(
        lambda model: DecoupledVariationalStrategy(
            model,
            beta,
            DecoupledVariationalDistribution(alpha.size(0), beta.size(0)),
            alpha,
            num_kl_columns=NUM_KL_COLUMNS,
        ),
        train_x,
    )
    optimizers = [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=LEARNING_RATE)]
    objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=train_y.size(0))
    return DemoMethod(
        "Decoupled (ours)", "Mα=1200, Mβ=200", model, likelihood, _gradient_step(model, objective, optimizers)
    )


def t_svgp(train_x: Tensor, train_y: Tensor, seed: int = 0) -> DemoMethod:
    r"""t-SVGP (Adam et al., 2021), M = 200, the package's default mini-batch schedule: per mini-batch the M-step's
    forward and backward pass on :class:`~gpytorch_decoupled.mlls.DualVariationalELBO`, the closed-form E-step from
    that pass's marginals (size :math:`\max(1/t, 0.1)`), then the M-step's Adam step."""
    (z,) = _training_points(train_x, [200], seed)
    model, likelihood = _model(
        lambda model: DualVariationalStrategy(
            model, z, DualVariationalDistribution(z.size(0)), learn_inducing_locations=True
        ),
        train_x,
    )
    num_data = train_y.size(0)
    e_step = DualEStep(model, likelihood, num_data=num_data, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(e_step, lambda t: max(1 / (t + 1), 0.1))
    objective = DualVariationalELBO(likelihood, model, num_data=num_data)
    m_step = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=LEARNING_RATE)

    def step(x: Tensor, y: Tensor) -> None:
        m_step.zero_grad()
        (-objective(model(x), y)).backward()
        e_step.step(x, y)  # from the marginals of this forward pass
        m_step.step()
        schedule.step()

    return DemoMethod("t-SVGP (dual, ours)", "M=200", model, likelihood, step)


def srgp(train_x: Tensor, train_y: Tensor, seed: int = 0) -> DemoMethod:
    r"""SRGP (Schürch et al., 2020), M = 100, VFE: the posterior in closed form mini-batch by mini-batch, one Adam step
    (rate 0.05) per mini-batch with the propagated gradient. A step costs some 40 forward-mode passes on elevators, so
    only a few hundred fit the demo's time; at rate 0.01 the length-scales would still be far from their optimum."""
    (z,) = _training_points(train_x, [100], seed)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(train_x)
    model = RegressionModel(
        lambda model: KalmanVariationalStrategy(model, z, likelihood=likelihood, approximation="vfe"), train_x.size(-1)
    ).to(train_x)
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    recursion = RecursiveGradientPropagation(model, likelihood, optimizer)
    strategy = model.variational_strategy

    @contextlib.contextmanager
    def posterior_of_all_rows() -> Iterator[None]:
        # Within an epoch the posterior mixes mini-batches absorbed at different hyperparameters: predict from one
        # clean pass of `update` over every training row, then put SRGP's epoch state back so training goes on.
        epoch_state = {name: value.clone() for name, value in strategy.state_dict().items()}
        try:
            strategy.reset()
            for x, y in zip(train_x.split(1024), train_y.split(1024)):
                strategy.update(x, y)
            yield
        finally:
            strategy.load_state_dict(epoch_state)

    return DemoMethod(
        "SRGP (Kalman, VFE, ours)",
        "M=100",
        model,
        likelihood,
        recursion.step,
        start_epoch=recursion.start_epoch,
        posterior=posterior_of_all_rows,
    )


#: The demo's line-up, by short name: GPyTorch's baselines first, then each method family of this package.
DEMO_METHODS: dict[str, Callable[..., DemoMethod]] = {
    "svgp": svgp,
    "svgp-ngd": partial(svgp, natural=True),
    "orthnat": orthnat,
    "decoupled": decoupled,
    "t-svgp": t_svgp,
    "srgp": srgp,
}
