"""Data-parallel training of three families on the embedded elevators data set.

Run it with 2 processes (gloo on CPU, NCCL on GPUs), or with plain ``python`` as a single process::

    torchrun --nproc_per_node=2 -m gpytorch_decoupled.distributed.example --family tsvgp
    torchrun --nproc_per_node=2 -m gpytorch_decoupled.distributed.example --family odvgp --checkpoint run.pt
    torchrun --nproc_per_node=2 -m gpytorch_decoupled.distributed.example --family kalman

``tsvgp``: the t-SVGP E-step (:class:`DistributedEStep`) and its M-step (:class:`GradientAllReduce`); ``odvgp``: the
orthogonally decoupled GP with natural gradients for its covariance block and Adam for the rest
(:class:`GradientAllReduce`); ``kalman``: the hyperparameters by the exact gradient of the collapsed bound over all
shards (:class:`DistributedCollapsedBound`), then one pass of Kalman updates (:class:`DistributedKalmanUpdate`). Every
rank reads its shard of each global batch (:class:`ShardedBatches`); rank 0 prints the test RMSE. With
``--checkpoint`` rank 0 saves the ``state_dict`` of everything after every epoch, and a rerun with the same command
resumes after the last saved epoch, as if it had not stopped.
"""

from __future__ import annotations

import argparse
import os
import time

import gpytorch
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from .. import datasets
from ..mlls import DualVariationalELBO
from ..variational import (
    DualVariationalDistribution,
    DualVariationalStrategy,
    FastNaturalVariationalDistribution,
    KalmanVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from .distributed_collapsed_bound import DistributedCollapsedBound
from .distributed_e_step import DistributedEStep
from .distributed_kalman_update import DistributedKalmanUpdate
from .gradient_all_reduce import GradientAllReduce
from .process_group import init_process_group
from .sharded_batches import ShardedBatches


class _ExampleGP(gpytorch.models.ApproximateGP):
    """A constant mean and an SE-ARD kernel around any variational strategy, built by ``strategy(self)``."""

    def __init__(self, strategy, dims: int):
        super().__init__(strategy(self))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=dims))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _build(family: str, points: torch.Tensor, num_inducing: int, likelihood) -> _ExampleGP:
    """The model of ``family`` with inducing inputs from ``points`` (ODVGP: a mean basis of all of them)."""
    z, dims = points[:num_inducing], points.size(1)
    if family == "tsvgp":
        return _ExampleGP(lambda gp: DualVariationalStrategy(gp, z, DualVariationalDistribution(num_inducing)), dims)
    if family == "odvgp":
        q = FastNaturalVariationalDistribution(num_inducing)
        return _ExampleGP(lambda gp: OrthogonallyDecoupledVariationalStrategy(gp, z, q, points), dims)
    return _ExampleGP(lambda gp: KalmanVariationalStrategy(gp, z, likelihood=likelihood), dims)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=2 -m gpytorch_decoupled.distributed.example")
    parser.add_argument("--family", choices=("tsvgp", "odvgp", "kalman"), default="tsvgp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1000, help="the global batch size (all ranks together)")
    parser.add_argument("--num-inducing", type=int, default=100)
    parser.add_argument("--checkpoint", default=None, help="save after every epoch; resume from it when it exists")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    """Trains one family as rank ``RANK`` of ``WORLD_SIZE`` and returns the test RMSE (original units)."""
    args = _arguments(argv)
    device = init_process_group()
    try:
        return _train(args, device)
    finally:  # also after an error, so that the process exits cleanly and torchrun reports the error
        dist.destroy_process_group()


def _train(args: argparse.Namespace, device: torch.device) -> float:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same on every rank (rank 0's initial state is broadcast anyway)
    split = datasets.load("elevators", split=0)
    train = TensorDataset(split.train_x.to(device), split.train_y.to(device))
    num_data = len(train)
    points = split.train_x[torch.randperm(num_data)[: 4 * args.num_inducing]].to(device)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device)
    model = _build(args.family, points, args.num_inducing, likelihood).to(device)
    batches = ShardedBatches(train, batch_size=args.batch_size, seed=args.seed)

    parts: dict[str, object] = {"model": model, "likelihood": likelihood}
    if args.family == "tsvgp":
        e_step = DistributedEStep(model, likelihood, num_data=num_data, lr=0.9)
        objective = DualVariationalELBO(likelihood, model, num_data=num_data)
        gradients = GradientAllReduce(model, likelihood)
        optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.02)
        parts.update(e_step=e_step, optimizer=optimizer)
    elif args.family == "odvgp":
        gradients = GradientAllReduce(model, likelihood)
        objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=num_data)
        ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=0.1)
        optimizer = torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.01)
        parts.update(ngd=ngd, optimizer=optimizer)
    else:
        bound = DistributedCollapsedBound(model, likelihood)
        optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
        parts.update(optimizer=optimizer)

    first_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, map_location=device)
        for name, part in parts.items():
            part.load_state_dict(saved[name])
        torch.set_rng_state(saved["rng"])  # ODVGP's column-sampled KL draws from it, alike on every rank
        first_epoch = saved["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {saved['epoch']}")

    def train_epoch() -> float:
        """One epoch on this rank's shard; the last loss."""
        if args.family == "kalman":  # one exact full-data gradient step per epoch, all shards together
            optimizer.zero_grad()
            loss = bound.value_and_backward(batches)
            optimizer.step()
            return loss.item() / num_data
        for x, y in batches:
            if args.family == "tsvgp":
                e_step.step(x, y)
            model.zero_grad()  # every optimizer's gradients (NGD's too)
            likelihood.zero_grad()
            with gradients.synchronize(batch_size=x.size(0)):
                loss = -objective(model(x), y)
                loss.backward()
            if args.family == "odvgp":
                ngd.step()
            optimizer.step()
        return loss.item()

    start = time.perf_counter()
    for epoch in range(first_epoch, args.epochs):
        batches.set_epoch(epoch)
        model.train()
        likelihood.train()
        loss = train_epoch()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss:.4f} ({world_size} process(es), {time.perf_counter() - start:.1f} s)")
            if args.checkpoint:
                state = {name: part.state_dict() for name, part in parts.items()}
                torch.save({**state, "epoch": epoch, "rng": torch.get_rng_state()}, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)  # a crash mid-save keeps the last checkpoint

    if args.family == "kalman":  # the posterior at the learned hyperparameters: one pass over all shards
        model.variational_strategy.reset()
        kalman = DistributedKalmanUpdate(model, likelihood)
        for x, y in batches:
            kalman.update(x, y)
    model.eval()
    with torch.no_grad():
        mean = likelihood(model(split.test_x.to(device))).mean.cpu()
    rmse = (split.unstandardize_y(mean) - split.unstandardize_y(split.test_y)).square().mean().sqrt().item()
    if rank == 0:
        print(f"{args.family}: test RMSE {rmse:.4f} on {world_size} process(es)")
    return rmse


if __name__ == "__main__":
    main()
