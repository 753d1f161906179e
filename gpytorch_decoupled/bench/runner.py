from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .method_result import MethodResult
from .methods import Method, MethodNotApplicable, build_method
from .metrics import gaussian_test_metrics
from .peak_memory_meter import PeakMemoryMeter
from .run_config import RunConfig


def _minibatches(x: Tensor, y: Tensor, batch_size: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless shuffled mini-batches, reshuffled every epoch; the same seed gives every method the same order."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(x.size(0), generator=generator).to(x.device)
        for index in order.split(batch_size):
            yield x[index], y[index]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_and_evaluate(
    method: Method, train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], y_std, config: RunConfig, name: str = ""
) -> MethodResult:
    r"""Train ``method`` as ``config`` says and measure it.

    Per-iteration times are taken around :meth:`Method.step` alone (synchronizing CUDA); their median after
    ``config.warmup`` iterations is the headline. Peak memory is measured over the warm-up iterations. Test metrics
    are evaluated every ``config.eval_every`` iterations outside the timed region, giving test NLL against training
    wall-clock.

    :param method: A freshly built method.
    :param train: Training inputs and targets (standardized), on the config's device.
    :param test: Test inputs and targets (standardized), on the config's device.
    :param y_std: Training standard deviation of the targets, to report metrics in original units.
    :param config: The shared run configuration.
    :param name: Registry name stored in the result.
    """
    device = train[0].device
    batches = _minibatches(*train, config.batch_size, config.seed)
    result = MethodResult(name=name, label=method.label, sizes=method.sizes)
    times: list[float] = []

    def evaluate(iteration: int) -> dict:
        point = {
            "iteration": iteration,
            "seconds": sum(times),
            **gaussian_test_metrics(*method.predict(test[0]), test[1], y_std),
        }
        result.curve.append(point)
        return point

    def iterate() -> None:
        x, y = next(batches) if method.uses_minibatches else train
        _synchronize(device)
        start = time.perf_counter()
        method.step(x, y)
        _synchronize(device)
        times.append(time.perf_counter() - start)

    evaluate(0)
    warmup = min(config.warmup, config.iterations)
    with tqdm(total=config.iterations, desc=method.label, disable=not config.progress, leave=False) as progress:
        meter = PeakMemoryMeter(device)
        with meter:
            for _ in range(warmup):
                iterate()
                progress.update()
        for iteration in range(warmup + 1, config.iterations + 1):
            iterate()
            progress.update()
            out_of_time = config.time_budget is not None and sum(times) >= config.time_budget
            if iteration % config.eval_every == 0 or iteration == config.iterations or out_of_time:
                progress.set_postfix(nll=f"{evaluate(iteration)['nll']:.3f}")
            if out_of_time:
                break
    if result.curve[-1]["iteration"] != len(times):
        evaluate(len(times))

    timed = times[warmup:] or times
    result.seconds_per_iteration = statistics.median(timed)
    result.peak_memory_mb = meter.peak_mb
    result.iterations = len(times)
    result.train_seconds = sum(times)
    result.rmse, result.nll = result.curve[-1]["rmse"], result.curve[-1]["nll"]
    result.objective = method.objective()
    return result


def split_tensors(split, config: RunConfig) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``(train_x, train_y), (test_x, test_y)`` of a split on the run's device and in its dtype."""
    device = torch.device(config.device)
    train = (split.train_x.to(device, config.dtype), split.train_y.to(device, config.dtype))
    test = (split.test_x.to(device, config.dtype), split.test_y.to(device, config.dtype))
    return train, test


def compare(methods: Sequence[tuple[str, dict]], split, config: RunConfig) -> list[MethodResult]:
    r"""Train and measure several methods in this process, on the same data, seed and mini-batch order.

    :param methods: ``(registry name, method options)`` pairs. A name may carry a tag after ``@`` (``"svgp@M=500"``)
        to run one method several times with different options.
    :param split: A :class:`gpytorch_decoupled.datasets.Split` (regression).
    :param config: The shared run configuration.
    :return: One :class:`MethodResult` per method, in order; a method that refuses the data (e.g. the exact GP on too
        many rows) is returned with ``skipped`` set to its reason.
    """
    train, test = split_tensors(split, config)
    results = []
    for name, options in methods:
        registry_name = name.split("@")[0]
        try:
            method = build_method(registry_name, *train, **{"seed": config.seed, **options})
        except MethodNotApplicable as error:
            results.append(MethodResult(name=name, label=registry_name, skipped=str(error)))
            continue
        results.append(train_and_evaluate(method, train, test, split.y_std, config, name=name))
    return results
