"""The helpers in a process group of one, in the test process: their errors, the sharding arithmetic, and that on a
single rank they are the plain single-process steps."""

from __future__ import annotations

import gpytorch
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from gpytorch_decoupled.distributed import (
    DistributedEStep,
    DistributedKalmanUpdate,
    DistributedStepError,
    GradientAllReduce,
    ShardedBatches,
    init_process_group,
)
from gpytorch_decoupled.optim import DualEStep
from tests import dual_problems, recursive_problems
from tests.float64_problems import gaussian_likelihood

pytestmark = pytest.mark.usefixtures("single_thread")


def _no_default_group() -> None:
    # (a doctest that failed half-way in this process may have left its group)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def group_of_one():
    _no_default_group()
    init_process_group(backend="gloo", timeout_seconds=10)
    yield
    dist.destroy_process_group()


def test_helpers_need_a_process_group():
    _no_default_group()
    Z, _, _ = dual_problems.problem(0)
    model, likelihood = dual_problems.DualGP(Z), gaussian_likelihood()
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        GradientAllReduce(model, likelihood)
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        ShardedBatches(TensorDataset(torch.zeros(4)), batch_size=2)


def test_init_process_group_checks_its_arguments(group_of_one):
    assert dist.get_world_size() == 1
    with pytest.raises(RuntimeError, match="initialized already"):
        init_process_group()


def test_sharded_batches_cover_each_single_process_batch_and_resume_mid_epoch():
    data = TensorDataset(torch.arange(26.0))
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        ShardedBatches(data, batch_size=5, num_replicas=2, rank=0)
    # 26 points on 3 ranks: the sampler drops 26 mod 3 = 2 positions of each epoch's permutation.
    one = ShardedBatches(data, batch_size=6, num_replicas=1, rank=0, seed=4)
    ranks = [ShardedBatches(data, batch_size=6, num_replicas=3, rank=r, seed=4) for r in range(3)]
    for epoch in range(2):
        for batches in (one, *ranks):
            batches.set_epoch(epoch)
        single = [batch for (batch,) in one]
        union = [torch.cat(parts).sort().values for parts in zip(*([b for (b,) in r] for r in ranks), strict=True)]
        assert len(union) == len(ranks[0]) == 4 and [len(part) for part in union] == [6, 6, 6, 6]
        for expected, actual in zip(single, union, strict=False):
            assert torch.equal(expected.sort().values, actual)
    ranks[1].set_epoch(1, start_batch=2)
    assert len(ranks[1]) == 2
    resumed = [batch for (batch,) in ranks[1]]
    ranks[1].set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(resumed, [batch for (batch,) in ranks[1]][2:], strict=True))


def test_on_one_rank_the_gradients_are_the_single_process_ones(group_of_one):
    Z, X, y = dual_problems.problem(0)
    model, likelihood = dual_problems.DualGP(Z), gaussian_likelihood()
    gradients = GradientAllReduce(model, likelihood)
    DualEStep(model, likelihood, num_data=60).step(X, y)  # sites away from the prior, as in training
    objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=60)
    (-objective(model(X[:20]), y[:20])).backward()
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    gradients.all_reduce(batch_size=20)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-15, atol=0)
    assert gradients.message_size == 1 + len(gradients.parameters) + sum(p.numel() for p in gradients.parameters)

    # Without any gradient on any rank, a parameter keeps None (Adam skips it).
    model.zero_grad()
    likelihood.zero_grad()
    gradients.all_reduce()
    assert all(parameter.grad is None for parameter in gradients.parameters)

    likelihood.noise_covar.raw_noise.grad = torch.full_like(likelihood.noise_covar.raw_noise, float("nan"))
    with pytest.raises(DistributedStepError, match=r"failed on rank\(s\) \[0\].*NaN or inf") as error:
        gradients.all_reduce(batch_size=20)
    assert error.value.ranks == [0] and isinstance(error.value.__cause__, FloatingPointError)
    with pytest.raises(DistributedStepError, match="batch_size must be a positive integer"):
        gradients.all_reduce(batch_size=0)


def test_on_one_rank_the_e_step_is_the_single_process_one(group_of_one):
    Z, X, y = dual_problems.problem(0)
    models = [dual_problems.DualGP(Z) for _ in range(2)]
    steps = [
        DualEStep(models[0], gaussian_likelihood(), num_data=60, lr=0.5),
        DistributedEStep(models[1], gaussian_likelihood(), num_data=60, lr=0.5),
    ]
    for start in (0, 5, 15):  # batches of 5 < M = 10 and of 10
        for step in steps:
            step.step(X[start : start + 5 + start // 3], y[start : start + 5 + start // 3])
    for expected, actual in zip(*(dual_problems.site_values(model) for model in models), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    before = dual_problems.site_values(models[1])
    with pytest.raises(DistributedStepError, match=r"rank 0: ValueError: x must have shape \(n, D\)"):
        steps[1].step(X[:5, :1].squeeze(-1), y[:5])
    assert all(torch.equal(a, b) for a, b in zip(before, dual_problems.site_values(models[1]), strict=True))


def test_on_one_rank_the_kalman_update_is_the_single_process_one(group_of_one):
    X, y, Z = recursive_problems.problem(seed=2)
    (plain, plain_likelihood), (ours, ours_likelihood) = (recursive_problems.make_model(Z) for _ in range(2))
    update = DistributedKalmanUpdate(ours, ours_likelihood)
    for block in recursive_problems.blocks_of(60, 25):
        torch.testing.assert_close(
            update.update(X[block], y[block]), plain.variational_strategy.update(X[block], y[block]), rtol=1e-13, atol=0
        )
    for (name, expected), actual in zip(plain.state_dict().items(), ours.state_dict().values(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-13, msg=name)
