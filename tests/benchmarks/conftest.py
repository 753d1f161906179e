"""The benchmarks' tests run on a fresh clone: every data set the package does not embed loads as a small synthetic
split of the registered shape, so that the tiny runs go through the same code paths without the data."""

import math

import pytest
import torch

from gpytorch_decoupled import datasets

#: Rows of a synthetic stand-in (fewer when the real set is smaller).
SYNTHETIC_ROWS = 1000


def synthetic_split(name: str, split: int = 0, dtype=None, device=None, source=None) -> datasets.Split:
    """A synthetic stand-in for ``datasets.load(name, split)``: the registered input dimension, number of outputs and
    task, standardized with its training statistics as the loader does. The Mauna Loa series keeps its monthly time
    axis and chronological split (629 training and 158 test months from March 1958), with a trend, a yearly cycle
    and noise in ppm; other sets draw inputs uniformly on :math:`[-2, 2]^d` with smooth targets (noisy labels for
    classification sets) and test on a seeded 20% of the rows."""
    entry = datasets.info(name, source)
    if not 0 <= split < entry.num_splits:
        raise ValueError(f"split must be in 0..{entry.num_splits - 1} for {entry.name!r}, got {split}.")
    generator = torch.Generator().manual_seed(1000 + split)
    n = min(entry.n, SYNTHETIC_ROWS)
    f64 = torch.float64
    if entry.name == "co2":
        x = (1958 + (2 + torch.arange(n, dtype=f64)) / 12).unsqueeze(-1)
        years = x.squeeze(-1) - 1958
        y = 315 + 0.8 * years + 0.013 * years**2 + 3 * torch.sin(2 * math.pi * years)
        y = y + 0.3 * torch.randn(n, generator=generator, dtype=f64)
        train = torch.arange(n) < int(0.8 * n)
    else:
        x = 4 * torch.rand(n, entry.d, generator=generator, dtype=f64) - 2
        weights = torch.randn(entry.d, entry.num_outputs, generator=generator, dtype=f64) / math.sqrt(entry.d)
        f = torch.sin(2 * x @ weights) + 0.1 * torch.randn(n, entry.num_outputs, generator=generator, dtype=f64)
        y = f.squeeze(-1) if entry.num_outputs == 1 else f
        if entry.task == "classification":
            y = y.gt(0).to(f64)
        train = torch.ones(n, dtype=torch.bool)
        train[torch.randperm(n, generator=generator)[: n // 5]] = False

    def statistics(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return values[train].mean(0), values[train].std(0, unbiased=False)

    x_mean, x_std = statistics(x)
    if entry.task == "regression":
        y_mean, y_std = statistics(y)
    else:
        y_mean, y_std = torch.zeros(y.shape[1:], dtype=f64), torch.ones(y.shape[1:], dtype=f64)
    options = {"dtype": torch.get_default_dtype() if dtype is None else dtype, "device": device}
    x, y = (x - x_mean) / x_std, (y - y_mean) / y_std
    return datasets.Split(
        *(tensor.to(**options) for tensor in (x[train], y[train], x[~train], y[~train])),
        name=entry.name,
        task=entry.task,
        split=split,
        source=entry.source,
        **{
            key: value.to(**options)
            for key, value in dict(x_mean=x_mean, x_std=x_std, y_mean=y_mean, y_std=y_std).items()
        },
    )


@pytest.fixture(autouse=True)
def synthetic_data_sets(monkeypatch):
    """Within the benchmarks' tests, ``datasets.load`` gives the embedded sets as they are and a
    :func:`synthetic_split` for every other set, whether or not its files are present."""
    real_load = datasets.load

    def load(name: str, split: int = 0, data_dir=None, dtype=None, device=None, source=None, **kwargs):
        if datasets.info(name, source).embedded:
            return real_load(name, split, data_dir, dtype, device, source, **kwargs)
        return synthetic_split(name, split, dtype=dtype, device=device, source=source)

    monkeypatch.setattr(datasets, "load", load)
