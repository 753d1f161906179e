"""The 2-process jobs of the fault tests: an error or a NaN on one rank, a checkpoint and resume and a hung rank in
one job (:func:`faults`), and a dead rank (:func:`dead_rank`)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from gpytorch_decoupled.distributed import (
    DistributedCollapsedBound,
    DistributedEStep,
    DistributedKalmanUpdate,
    DistributedStepError,
    GradientAllReduce,
)
from gpytorch_decoupled.mlls import DualVariationalELBO
from gpytorch_decoupled.optim import DualEStep
from tests import dual_problems, recursive_problems
from tests.distributed._families import TSVGPRun, batches_of, state_of
from tests.distributed._spawn import save_result
from tests.float64_problems import gaussian_likelihood


def _failure(step) -> dict:
    """Runs ``step`` and records the DistributedStepError it must raise."""
    try:
        step()
    except DistributedStepError as error:
        return {"message": str(error), "ranks": error.ranks, "cause": type(error.__cause__).__name__}
    return {"message": None}


def _unchanged(before: dict, *modules) -> bool:
    after = state_of(*modules)
    return all(torch.equal(value, after[key]) for key, value in before.items())


def errors_on_one_rank(rank: int, world_size: int, directory) -> dict:
    """Every helper, with bad data on one rank: every rank must raise the same error and keep its state."""
    Z, X, y = dual_problems.problem(0)
    x_batch, y_batch = X[rank::2][:10], y[rank::2][:10].clone()
    if rank == 1:
        y_batch[3] = float("nan")
    model, likelihood = dual_problems.DualGP(Z), gaussian_likelihood()
    e_step = DistributedEStep(model, likelihood, num_data=60)
    gradients = GradientAllReduce(model, likelihood)
    objective = DualVariationalELBO(likelihood, model, num_data=60)
    records = {}
    # A good E-step first: the dual strategy refuses a training forward pass while its sites are at the prior.
    e_step.step(x_batch, y[rank::2][:10])

    before = state_of(model, likelihood)
    records["e_step"] = _failure(lambda: e_step.step(x_batch, y_batch))
    records["e_step_unchanged"] = _unchanged(before, model, likelihood)

    def gradient_step():
        model.zero_grad()
        # (the objective refuses NaN targets itself: the NaN gradient on rank 1 is made after the backward pass)
        (-objective(model(x_batch), y[rank::2][:10])).backward()
        if rank == 1:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        gradients.all_reduce(batch_size=10)

    records["gradients"] = _failure(gradient_step)

    def failing_block():
        model.zero_grad()
        likelihood.zero_grad()
        with gradients.synchronize(batch_size=10):
            if rank == 0:
                raise ValueError("rank 0 could not read its batch")

    records["synchronize"] = _failure(failing_block)

    X_k, y_k, Z_k = recursive_problems.problem(seed=2)
    kalman_model, kalman_likelihood = recursive_problems.make_model(Z_k)
    kalman = DistributedKalmanUpdate(kalman_model, kalman_likelihood)
    x_k = X_k[rank::2][:6] if rank == 0 else X_k[rank::2][:6, :0]  # rank 1: inputs without columns
    kalman_before = state_of(kalman_model)
    records["kalman"] = _failure(lambda: kalman.update(x_k, y_k[rank::2][:6]))
    records["kalman_unchanged"] = _unchanged(kalman_before, kalman_model)

    bound = DistributedCollapsedBound(kalman_model, kalman_likelihood)
    y_bad = y_k.clone()
    if rank == 1:
        y_bad[5] = float("inf")
    shard = batches_of(TensorDataset(X_k, y_bad), distributed=True, batch_size=10)
    parameters = [*kalman_model.parameters(), *kalman_likelihood.parameters()]
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    records["collapsed_bound"] = _failure(lambda: bound.value_and_backward(shard))
    records["gradients_kept"] = all(torch.equal(p.grad, torch.ones_like(p)) for p in parameters)

    # The group survives: a good step afterwards works on every rank.
    e_step.step(x_batch, y[rank::2][:10])
    records["after"] = state_of(model)
    return records


def faults(rank: int, world_size: int, directory) -> dict:
    """One job for the fault tests that leave the group usable, then a hung rank, which breaks it."""
    results = {"errors": errors_on_one_rank(rank, world_size, directory)}
    results["resume"] = checkpoint_and_resume(rank, world_size, directory)
    release = directory / "release"
    if rank == 1:
        save_result(directory, rank, results)

    def hang() -> None:
        """Stops answering until rank 0 has seen its collective time out."""
        deadline = time.monotonic() + 60.0
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)

    results["hung_rank"] = _lose_rank_one(rank, hang)
    release.touch()
    return results


def checkpoint_and_resume(rank: int, world_size: int, directory) -> dict:
    """A t-SVGP run saved by rank 0 after 4 of its 6 steps and resumed by fresh objects on every rank ends where the
    uninterrupted run ends."""
    uninterrupted = TSVGPRun(distributed=True)
    uninterrupted.train()

    first = TSVGPRun(distributed=True)
    first.train(stop=4)
    path = directory / "checkpoint.pt"
    if rank == 0:
        torch.save({name: part.state_dict() for name, part in first.parts().items()}, path)
    dist.barrier()
    torch.manual_seed(100 + rank)  # fresh objects start elsewhere; the checkpoint must bring everything back
    resumed = TSVGPRun(distributed=True)
    saved = torch.load(path, weights_only=False)
    for name, part in resumed.parts().items():
        part.load_state_dict(saved[name])
    resumed.train(start=4)
    return {
        "uninterrupted": state_of(uninterrupted.model, uninterrupted.likelihood),
        "resumed": state_of(resumed.model, resumed.likelihood),
    }


def _lose_rank_one(rank: int, lose) -> dict:
    """One good gradient step on both ranks, then ``lose()`` on rank 1 and another step: rank 0's failure and how
    long it took."""
    Z, X, y = dual_problems.problem(0)
    model, likelihood = dual_problems.DualGP(Z), gaussian_likelihood()
    gradients = GradientAllReduce(model, likelihood)
    objective = DualVariationalELBO(likelihood, model, num_data=60)
    DualEStep(model, likelihood, num_data=60).step(X, y)  # the same sites on both ranks, away from the prior

    def step():
        model.zero_grad()
        (-objective(model(X[rank::2]), y[rank::2])).backward()
        gradients.all_reduce(batch_size=30)

    step()
    if rank == 1:
        lose()
    start = time.perf_counter()
    record = _failure(step)
    return {**record, "seconds": time.perf_counter() - start}


def dead_rank(rank: int, world_size: int, directory) -> dict:
    """Rank 1 exits before the second all-reduce; rank 0 must fail at once with a clear error."""
    return {"dead_rank": _lose_rank_one(rank, lambda: os._exit(0))}
