from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

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


def timed_call(function: Callable[..., object], *args, device: torch.device, clock: str = "wall") -> float:
    """Seconds of ``function(*args)``: wall-clock (CUDA is synchronized before and after), or with ``clock="thread"``
    the CPU time of the calling thread."""
    now = time.thread_time if clock == "thread" else time.perf_counter
    _synchronize(device)
    start = now()
    function(*args)
    _synchronize(device)
    return now() - start


def random_minibatches(x: Tensor, y: Tensor, batch_size: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless mini-batches of rows drawn uniformly with replacement, from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        index = torch.randint(0, x.size(0), (batch_size,), generator=generator).to(x.device)
        yield x[index], y[index]


def lockstep_step_seconds(
    methods: Sequence[tuple[str, Method]],
    batches: Iterator[tuple[Tensor, Tensor]],
    iterations: int,
    warmup: int,
    clock: str = "thread",
) -> dict[str, float]:
    """Steps the methods in lockstep on the same mini-batches (one step of each in turn, the order alternating each
    iteration, so that a slow moment of the machine slows all alike) and returns each one's median seconds per step
    after ``warmup`` steps, by :func:`timed_call`'s ``clock``: ``"thread"``, the CPU time of this thread, which on a
    busy machine leaves out the time spent waiting for a core; ``"wall"`` on a GPU."""
    times = {name: [] for name, _ in methods}
    for iteration in range(warmup + iterations):
        x, y = next(batches)
        for name, method in methods[:: 1 if iteration % 2 else -1]:
            times[name].append(timed_call(method.step, x, y, device=x.device, clock=clock))
    return {name: statistics.median(values[warmup:]) for name, values in times.items()}


#: Test metrics of a method at test inputs and targets, e.g. ``{"nll": ..., "accuracy": ...}``.
TestMetrics = Callable[[Method, Tensor, Tensor], dict[str, float]]


class _Training:
    """One method's state in a training run: its batch stream, step times and measured result."""

    def __init__(self, name: str, method: Method, train, test, config: RunConfig, metrics: TestMetrics):
        self.method, self.train, self.test, self.metrics = method, train, test, metrics
        self.clock = config.clock
        self.batches = _minibatches(*train, config.batch_size, config.seed)
        self.result = MethodResult(name=name, label=method.label, sizes=method.sizes)
        self.times: list[float] = []
        self.done = False

    def evaluate(self, iteration: int) -> dict:
        point = {"iteration": iteration, "seconds": sum(self.times), **self.metrics(self.method, *self.test)}
        self.result.curve.append(point)
        return point

    def iterate(self) -> None:
        x, y = next(self.batches) if self.method.uses_minibatches else self.train
        self.times.append(timed_call(self.method.step, x, y, device=self.train[0].device, clock=self.clock))

    def finish(self, warmup: int, peak_memory_mb: float) -> MethodResult:
        result = self.result
        if result.curve[-1]["iteration"] != len(self.times):
            self.evaluate(len(self.times))
        result.seconds_per_iteration = statistics.median(self.times[warmup:] or self.times)
        result.peak_memory_mb = peak_memory_mb
        result.iterations = len(self.times)
        result.train_seconds = sum(self.times)
        result.rmse, result.nll = result.curve[-1].get("rmse", math.nan), result.curve[-1]["nll"]
        result.objective = self.method.objective()
        return result


def train_in_lockstep(
    methods: Sequence[tuple[str, Method]],
    train: tuple[Tensor, Tensor],
    test: tuple[Tensor, Tensor],
    y_std,
    config: RunConfig,
    test_metrics: TestMetrics | None = None,
) -> list[MethodResult]:
    r"""Train several methods as ``config`` says, one iteration of each in turn, and measure them.

    Each method draws the same mini-batches (same seed); the order within an iteration alternates, so that a change of
    load on a shared machine slows every method alike. Per-iteration times are taken around :meth:`Method.step` alone
    (synchronizing CUDA); their median after ``config.warmup`` iterations is the headline. Peak memory is measured over
    the warm-up iterations when a single method trains (NaN otherwise: the methods' allocations would mix). Test metrics
    are evaluated every ``config.eval_every`` iterations outside the timed region, giving test NLL against training
    wall-clock; a method whose training time reaches ``config.time_budget`` stops while the others go on.

    :param methods: ``(name stored in the result, freshly built method)`` pairs.
    :param train: Training inputs and targets (standardized), on the config's device.
    :param test: Test inputs and targets (standardized), on the config's device.
    :param y_std: Training standard deviation of the targets, to report metrics in original units.
    :param config: The shared run configuration.
    :param test_metrics: The test metrics (they must include ``nll``; default: RMSE and NLL of the Gaussian
        predictive in original units).
    """

    def gaussian_metrics(method: Method, x: Tensor, y: Tensor) -> dict[str, float]:
        return gaussian_test_metrics(*method.predict(x), y, y_std)

    runs = [_Training(name, method, train, test, config, test_metrics or gaussian_metrics) for name, method in methods]
    for run in runs:
        run.evaluate(0)
    warmup = min(config.warmup, config.iterations)
    label = ", ".join(run.method.label for run in runs)
    meter = PeakMemoryMeter(train[0].device)
    with tqdm(total=config.iterations * len(runs), desc=label, disable=not config.progress, leave=False) as progress:
        with meter if len(runs) == 1 else contextlib.nullcontext():
            for iteration in range(1, warmup + 1):
                for run in runs[:: 1 if iteration % 2 else -1]:
                    run.iterate()
                    progress.update()
        for iteration in range(warmup + 1, config.iterations + 1):
            for run in [run for run in runs if not run.done][:: 1 if iteration % 2 else -1]:
                run.iterate()
                progress.update()
                run.done = config.time_budget is not None and sum(run.times) >= config.time_budget
                if iteration % config.eval_every == 0 or iteration == config.iterations or run.done:
                    progress.set_postfix(nll=f"{run.evaluate(iteration)['nll']:.3f}")
    return [run.finish(warmup, meter.peak_mb if len(runs) == 1 else math.nan) for run in runs]


def train_and_evaluate(
    method: Method,
    train: tuple[Tensor, Tensor],
    test: tuple[Tensor, Tensor],
    y_std,
    config: RunConfig,
    name: str = "",
    test_metrics: TestMetrics | None = None,
) -> MethodResult:
    r"""Train ``method`` as ``config`` says and measure it (:func:`train_in_lockstep` with one method).

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
    :param test_metrics: The test metrics (they must include ``nll``; default: RMSE and NLL of the Gaussian
        predictive in original units).
    """
    (result,) = train_in_lockstep([(name, method)], train, test, y_std, config, test_metrics)
    return result


def split_tensors(split, config: RunConfig) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``(train_x, train_y), (test_x, test_y)`` of a split on the run's device and in its dtype."""
    device = torch.device(config.device)
    train = (split.train_x.to(device, config.dtype), split.train_y.to(device, config.dtype))
    test = (split.test_x.to(device, config.dtype), split.test_y.to(device, config.dtype))
    return train, test


def compare(
    methods: Sequence[tuple[str, dict]], split, config: RunConfig, lockstep: bool = False
) -> list[MethodResult]:
    r"""Train and measure several methods in this process, on the same data, seed and mini-batch order.

    By default the methods train one after the other (:func:`train_and_evaluate`). With ``lockstep`` they train
    together (:func:`train_in_lockstep`: one iteration of each in turn), so that a change of machine load during the
    run slows every method alike and their time ratios stay meaningful; each method's peak memory is then measured
    beforehand, over ``config.warmup`` iterations of a separately built copy on the same mini-batches.

    :param methods: ``(registry name, method options)`` pairs. A name may carry a tag after ``@`` (``"svgp@M=500"``)
        to run one method several times with different options.
    :param split: A :class:`gpytorch_decoupled.datasets.Split` (regression).
    :param config: The shared run configuration.
    :param lockstep: Train the methods in lockstep.
    :return: One :class:`MethodResult` per method, in order; a method that refuses the data (e.g. the exact GP on too
        many rows) is returned with ``skipped`` set to its reason.
    """
    train, test = split_tensors(split, config)

    def build(name: str, options: dict) -> Method:
        return build_method(name.split("@")[0], *train, **{"seed": config.seed, **options})

    results, trained = {}, []
    for name, options in methods:
        try:
            method = build(name, options)
        except MethodNotApplicable as error:
            results[name] = MethodResult(name=name, label=name.split("@")[0], skipped=str(error))
            continue
        if not lockstep:
            results[name] = train_and_evaluate(method, train, test, split.y_std, config, name=name)
        else:
            trained.append((name, method, warmup_peak_memory(build(name, options), train, config)))
    if trained:
        named = [(name, method) for name, method, _ in trained]
        for result, (_, _, peak_mb) in zip(train_in_lockstep(named, train, test, split.y_std, config), trained):
            result.peak_memory_mb = peak_mb
            results[result.name] = result
    return [results[name] for name, _ in methods]


def warmup_peak_memory(method: Method, train: tuple[Tensor, Tensor], config: RunConfig) -> float:
    """Peak memory (MB) of ``method`` over ``config.warmup`` training iterations on the run's first mini-batches."""
    batches = _minibatches(*train, config.batch_size, config.seed)
    with PeakMemoryMeter(train[0].device) as meter:
        for _ in range(max(config.warmup, 1)):
            method.step(*(next(batches) if method.uses_minibatches else train))
    return meter.peak_mb
