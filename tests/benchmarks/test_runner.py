import math

import pytest
import torch

from benchmarks import METHODS, RunConfig, build_method, compare
from benchmarks.runner import _minibatches, train_in_lockstep
from gpytorch_decoupled import datasets


def _synthetic_split(n_train=300, n_test=100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n_train + n_test, 2, generator=generator) * 4 - 2
    y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1]) + 0.05 * torch.randn(n_train + n_test, generator=generator)
    stats = dict(x_mean=torch.zeros(2), x_std=torch.ones(2), y_mean=torch.tensor(0.0), y_std=torch.tensor(2.0))
    return datasets.Split(
        x[:n_train], y[:n_train], x[n_train:], y[n_train:], "synthetic", "regression", 0, "test", **stats
    )


def test_minibatches_cover_each_epoch_once_in_a_seeded_order():
    x = torch.arange(10.0).unsqueeze(-1)
    first = _minibatches(x, x.squeeze(-1), 4, seed=3)
    second = _minibatches(x, x.squeeze(-1), 4, seed=3)
    epoch = [next(first)[1] for _ in range(3)]
    assert sorted(torch.cat(epoch).tolist()) == list(range(10))
    assert all(torch.equal(a, next(second)[1]) for a in epoch)


def test_compare_measures_every_method_on_the_same_data():
    split = _synthetic_split()
    config = RunConfig(iterations=30, batch_size=64, eval_every=10, warmup=5, progress=False)
    methods = [
        ("svgp", {"num_inducing": 20, "lr": 0.05}),
        ("svgp-ngd", {"num_inducing": 20, "lr": 0.05}),
        ("gpytorch-odvgp", {"num_inducing": 10, "num_mean_inducing": 30, "lr": 0.05}),
        ("sgpr", {"num_inducing": 20}),
        ("exact", {"max_exact_rows": 500}),
        ("exact@refused", {"max_exact_rows": 100}),
    ]
    results = compare(methods, split, config)
    assert [result.name for result in results] == [name for name, _ in methods]
    for result in results[:-1]:
        assert result.skipped is None
        assert result.iterations == 30
        assert [point["iteration"] for point in result.curve] == [0, 10, 20, 30]
        assert result.curve[0]["seconds"] == 0.0
        assert all(b["seconds"] > a["seconds"] for a, b in zip(result.curve, result.curve[1:]))
        assert result.seconds_per_iteration > 0 and math.isfinite(result.objective)
        # Thirty steps must already improve the test density clearly (each method drops it by 0.6 or more here).
        assert result.nll < result.curve[0]["nll"] - 0.3
    assert "100" in results[-1].skipped


def test_compare_in_lockstep_gives_the_sequential_results_and_measures_memory():
    split = _synthetic_split()
    config = RunConfig(iterations=20, batch_size=64, eval_every=10, warmup=3, progress=False)
    methods = [
        ("svgp", {"num_inducing": 20, "lr": 0.05}),
        ("orthnat", {"num_inducing": 10, "num_mean_inducing": 30}),
        ("exact@refused", {"max_exact_rows": 100}),
    ]
    sequential = compare(methods, split, config)
    together = compare(methods, split, config, lockstep=True)
    assert [result.name for result in together] == [name for name, _ in methods]
    assert "100" in together[-1].skipped
    for one, result in zip(sequential[:-1], together[:-1]):
        # Same seeds and mini-batches; only the global random stream (initial q(u) noise, sampled KL rows) differs.
        assert result.nll == pytest.approx(one.nll, abs=0.05)
        assert result.iterations == 20 and result.seconds_per_iteration > 0
        assert result.nll < result.curve[0]["nll"] - 0.2
        assert result.peak_memory_mb >= 0 or math.isnan(result.peak_memory_mb)


def test_time_budget_stops_a_method_early():
    config = RunConfig(iterations=10_000, batch_size=64, eval_every=1000, warmup=2, time_budget=0.5, progress=False)
    (result,) = compare([("svgp", {"num_inducing": 10})], _synthetic_split(), config)
    assert 2 < result.iterations < 10_000
    assert result.curve[-1]["iteration"] == result.iterations
    assert result.train_seconds >= 0.5


def test_exact_gp_reaches_the_optimum_it_is_told_to():
    # The exact GP's objective is the log marginal likelihood per datum: with more steps it must not decrease much.
    split = _synthetic_split(n_train=200)
    method = build_method("exact", split.train_x, split.train_y)
    before = method.objective()
    for _ in range(50):
        method.step(split.train_x, split.train_y)
    assert method.objective() > before


def test_unknown_method_names_the_registry():
    with pytest.raises(ValueError, match="svgp"):
        build_method("nope", torch.zeros(3, 1), torch.zeros(3))
    assert {"svgp", "svgp-ngd", "gpytorch-odvgp", "sgpr", "exact"} <= METHODS.keys()


def test_svgp_fits_real_data_to_a_useful_accuracy():
    # Integration: GPyTorch's SVGP through the harness on the embedded elevators set.
    split = datasets.load("elevators", split=0)
    config = RunConfig(iterations=300, batch_size=256, eval_every=300, warmup=5, progress=False)
    (result,) = compare([("svgp", {"num_inducing": 50, "lr": 0.03})], split, config)
    y_scale = split.y_std.item()
    # Predicting the training mean gives an RMSE of about one standard deviation.
    assert result.rmse < 0.55 * y_scale
    assert result.objective > -1.0


def test_lockstep_training_gives_each_method_the_same_batches_and_its_own_budget():
    split = _synthetic_split()
    train, test = (split.train_x, split.train_y), (split.test_x, split.test_y)
    config = RunConfig(iterations=12, batch_size=64, eval_every=4, warmup=2, progress=False)
    # t-SVGP starts from zero sites, with no random draw on the first call (GPyTorch's distributions draw one).
    twins = [(f"dual@{tag}", build_method("dual", *train, num_inducing=10, lr=0.05)) for tag in ("a", "b")]
    first, second = train_in_lockstep(twins, train, test, split.y_std, config)
    assert [first.name, second.name] == ["dual@a", "dual@b"]
    # Identically built methods trained in turns on the same batch stream stay identical.
    assert [point["nll"] for point in first.curve] == [point["nll"] for point in second.curve]
    assert first.iterations == second.iterations == 12
    assert math.isnan(first.peak_memory_mb)  # memory is only measured for a method training alone

    budget = RunConfig(iterations=10_000, batch_size=64, eval_every=1000, warmup=2, time_budget=0.3, progress=False)
    pair = [("svgp", build_method("svgp", *train, num_inducing=10)), ("sgpr", build_method("sgpr", *train))]
    fast, slow = train_in_lockstep(pair, train, test, split.y_std, budget)
    assert fast.train_seconds >= 0.3 and slow.train_seconds >= 0.3
    assert fast.curve[-1]["iteration"] == fast.iterations and slow.curve[-1]["iteration"] == slow.iterations
