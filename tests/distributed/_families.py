"""One small float64 training run per family, written once and run two ways: by a single process with the plain
classes (``distributed=False``: the reference), and by every rank of a 2-process gloo job with the helpers of
:mod:`gpytorch_decoupled.distributed` on its shard of every batch (``distributed=True``). Each returns the final
state (a ``state_dict`` and what else the family's steps return), which must agree to float64 roundoff.

To cover a new family, write ``train_<family>(distributed: bool) -> dict`` here and add it to :data:`FAMILIES`: the
2-process job runs every entry, and ``test_families.py`` compares each with its single-process run.
"""

from __future__ import annotations

import gpytorch
import torch
from torch.utils.data import TensorDataset

from gpytorch_decoupled.distributed import (
    DistributedCollapsedBound,
    DistributedEStep,
    DistributedKalmanUpdate,
    GradientAllReduce,
    ShardedBatches,
    all_reduce_local_elbos,
)
from gpytorch_decoupled.mlls import DualVariationalELBO, StreamingCollapsedBound
from gpytorch_decoupled.models import KernelSelectionGP
from gpytorch_decoupled.optim import DualEStep, OrthogonalMeanNaturalGradient
from gpytorch_decoupled.variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from tests import dual_problems, recursive_problems
from tests.float64_problems import (
    JITTER,
    bernoulli_likelihood,
    fix_hyperparameters,
    gaussian_likelihood,
    regression_problem,
)

EPOCHS = 2
BATCH_SIZE = 20  # global: 10 points per rank on 2 ranks; n = 60 gives 3 steps per epoch


def batches_of(dataset: TensorDataset, distributed: bool, batch_size: int = BATCH_SIZE) -> ShardedBatches:
    """This rank's shard of every global batch, or all of it for the single process (the same permutations)."""
    if distributed:
        return ShardedBatches(dataset, batch_size=batch_size, seed=3)
    return ShardedBatches(dataset, batch_size=batch_size, seed=3, num_replicas=1, rank=0)


def state_of(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{index}.{name}": value.detach().clone()
        for index, module in enumerate(modules)
        for name, value in module.state_dict().items()
    }


class MeanBasisGP(gpytorch.models.ApproximateGP):
    """A float64 GP with the fixed SE kernel around a strategy built by ``strategy(self)``."""

    def __init__(self, strategy):
        super().__init__(strategy(self))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        fix_hyperparameters(self, constant_mean=0.1)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _gradient_training(modules, optimizers, loss, distributed: bool) -> dict:
    """Minimizes ``loss(x, y)`` (a data mean plus a KL, as GPyTorch's ELBO) on mini-batches of the regression problem
    with ``optimizers``, all stepped after every backward pass; with ``distributed``, through
    :class:`GradientAllReduce`."""
    _, _, X, y = regression_problem(0)
    gradients = GradientAllReduce(*modules) if distributed else None
    batches, losses = batches_of(TensorDataset(X, y), distributed), []
    for epoch in range(EPOCHS):
        batches.set_epoch(epoch)
        for x_batch, y_batch in batches:
            for module in modules:
                module.zero_grad()
            value = loss(x_batch, y_batch)
            value.backward()
            if distributed:
                gradients.all_reduce(batch_size=x_batch.size(0))
            for optimizer in optimizers:
                optimizer.step()
            losses.append(value.detach())
    return {"state": state_of(*modules)}


def _elbo_training(model, likelihood, optimizers, distributed: bool) -> dict:
    """:func:`_gradient_training` on GPyTorch's negative ELBO."""
    objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=60)
    return _gradient_training([model, likelihood], optimizers, lambda x, y: -objective(model(x), y), distributed)


def train_odvgp(distributed: bool) -> dict:
    """OrthNat on ODVGP: NGD on the covariance block, the diagonal natural-gradient rule on the mean coefficients
    (column-sampled KL: every rank seeds its generator alike; without the batch as landmarks, which would give each
    rank its own unbiased estimate), Adam on the hyperparameters and inducing inputs."""
    beta, gamma, _, _ = regression_problem(0)
    torch.manual_seed(11)
    q = gpytorch.variational.NaturalVariationalDistribution(beta.size(0))
    model = MeanBasisGP(
        lambda gp: OrthogonallyDecoupledVariationalStrategy(
            gp, beta, q, gamma, num_kl_columns=4, exact_kl_size=0, jitter_val=JITTER, kl_data_landmarks=False
        )
    ).double()
    likelihood = gaussian_likelihood()
    strategy = model.variational_strategy
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=60, lr=0.2)
    mean_step = OrthogonalMeanNaturalGradient(model, num_data=60, lr=0.01)
    rest = [p for p in (*model.hyperparameters(), *likelihood.parameters()) if p is not strategy.mean_coefficients]
    return _elbo_training(model, likelihood, [ngd, mean_step, torch.optim.Adam(rest, lr=0.05)], distributed)


def train_decoupled(distributed: bool) -> dict:
    """The decoupled basis (Cheng & Boots) with Adam on everything."""
    beta, alpha, _, _ = regression_problem(0)
    torch.manual_seed(12)
    q = DecoupledVariationalDistribution(alpha.size(0), beta.size(0))
    model = MeanBasisGP(lambda gp: DecoupledVariationalStrategy(gp, beta, q, alpha)).double()
    likelihood = gaussian_likelihood()
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
    return _elbo_training(model, likelihood, [optimizer], distributed)


class TSVGPRun:
    """t-SVGP EM on the regression problem: per mini-batch, an E-step on the sites, then an Adam M-step on the
    DualVariationalELBO. Its parts are attributes, so that a run can be checkpointed and resumed."""

    def __init__(self, distributed: bool):
        Z, X, y = dual_problems.problem(0)
        self.distributed = distributed
        self.model, self.likelihood = dual_problems.DualGP(Z), gaussian_likelihood()
        e_step_class = DistributedEStep if distributed else DualEStep
        self.e_step = e_step_class(self.model, self.likelihood, num_data=X.size(0), lr=0.7)
        self.objective = DualVariationalELBO(self.likelihood, self.model, num_data=X.size(0))
        self.optimizer = torch.optim.Adam([*self.model.parameters(), *self.likelihood.parameters()], lr=0.05)
        self.gradients = GradientAllReduce(self.model, self.likelihood) if distributed else None
        self.batches = batches_of(TensorDataset(X, y), distributed)

    def train(self, start: int = 0, stop: int | None = None) -> None:
        """Global steps ``start`` to ``stop`` (default: the end) of :data:`EPOCHS` epochs."""
        per_epoch = len(self.batches)
        stop = EPOCHS * per_epoch if stop is None else stop
        for step in range(start, stop):
            epoch, position = divmod(step, per_epoch)
            if step == start or position == 0:
                self.batches.set_epoch(epoch, start_batch=position)
                batches = iter(self.batches)
            x_batch, y_batch = next(batches)
            self.e_step.step(x_batch, y_batch)
            self.optimizer.zero_grad()
            (-self.objective(self.model(x_batch), y_batch)).backward()
            if self.distributed:
                self.gradients.all_reduce(batch_size=x_batch.size(0))
            self.optimizer.step()

    def parts(self) -> dict:
        return {"model": self.model, "likelihood": self.likelihood, "e_step": self.e_step, "optimizer": self.optimizer}


def train_tsvgp(distributed: bool) -> dict:
    """t-SVGP EM (:class:`TSVGPRun`)."""
    run = TSVGPRun(distributed)
    run.train()
    return {"state": state_of(run.model, run.likelihood)}


def train_tsvgp_per_datum(distributed: bool) -> dict:
    """t-SVGP with per-datum sites (variant C), Bernoulli likelihood: E-steps only, each datum's targets set by the
    rank that holds it and exchanged."""
    Z, X, y = dual_problems.problem(1)
    model = dual_problems.DualGP(Z, datum_inputs=X)
    likelihood = bernoulli_likelihood()
    e_step_class = DistributedEStep if distributed else DualEStep
    e_step = e_step_class(model, likelihood, num_data=X.size(0), lr=0.8)
    batches = batches_of(TensorDataset(X, dual_problems.binary_labels(y), torch.arange(X.size(0))), distributed)
    for epoch in range(EPOCHS):
        batches.set_epoch(epoch)
        for x_batch, y_batch, indices in batches:
            e_step.step(x_batch, y_batch, indices)
    return {"state": state_of(model)}


def _kalman_model(approximation: str):
    X, y, Z = recursive_problems.problem(seed=2)
    model, likelihood = recursive_problems.make_model(Z, approximation)
    return model, likelihood, X, y


def train_kalman(distributed: bool) -> dict:
    """One pass of Kalman updates (VFE and FITC): the information-form state and the bound terms."""
    results = {}
    for approximation in ("vfe", "fitc"):
        model, likelihood, X, y = _kalman_model(approximation)
        update = DistributedKalmanUpdate(model, likelihood).update if distributed else model.variational_strategy.update
        batches = batches_of(TensorDataset(X, y), distributed, batch_size=12)
        terms = torch.stack([update(x_batch, y_batch) for x_batch, y_batch in batches])
        results[approximation] = {"state": state_of(model, likelihood), "terms": terms}
    return results


def train_collapsed_bound(distributed: bool) -> dict:
    """Three Adam steps on the exact full-data gradient of the collapsed bound (VFE), each shard streamed in
    mini-batches; the loss and gradient of the first step."""
    model, likelihood, X, y = _kalman_model("vfe")
    objective = (DistributedCollapsedBound if distributed else StreamingCollapsedBound)(model, likelihood)
    parameters = [*model.parameters(), *likelihood.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=0.05)
    batches = batches_of(TensorDataset(X, y), distributed, batch_size=10)
    losses, first_gradients = [], None
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(objective.value_and_backward(batches))
        if first_gradients is None:
            first_gradients = [parameter.grad.clone() for parameter in parameters]
        optimizer.step()
    return {
        "state": state_of(model, likelihood),
        "losses": torch.stack(losses),
        "gradients": first_gradients,
        "value": objective.value(batches),  # the whole data set's bound on every rank
    }


def train_kernel_selection(distributed: bool) -> dict:
    """VBKS: Adam on the summed local ELBOs of two candidate kernels (their documented training loss), then the
    local ELBOs over the data (each rank its shard, all-reduced) and the kernel belief fitted to them."""
    Z, _, X, y = regression_problem(0)
    torch.manual_seed(13)
    model = KernelSelectionGP(["SE", "SE + LIN"], inducing_points=Z, num_belief_samples=200).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    _gradient_training([model], [optimizer], lambda x, y: -model.local_elbos(x, y, 60).sum() / 60, distributed)
    if distributed:
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        all_reduce_local_elbos(model, X[rank::world_size], y[rank::world_size], batch_size=7)
    else:
        model.estimate_local_elbos(X, y, batch_size=7)
    model.fit_kernel_belief(elbo_scale=0.1)
    return {"state": state_of(model)}


#: Every family's training run; the 2-process job runs them all.
FAMILIES = {
    "odvgp": train_odvgp,
    "decoupled": train_decoupled,
    "tsvgp": train_tsvgp,
    "tsvgp_per_datum": train_tsvgp_per_datum,
    "kalman": train_kalman,
    "collapsed_bound": train_collapsed_bound,
    "kernel_selection": train_kernel_selection,
}


def run_all_families(rank: int, world_size: int, directory) -> dict:
    """The 2-process job: every family, distributed."""
    return {name: train(distributed=True) for name, train in FAMILIES.items()}
