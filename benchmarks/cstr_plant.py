"""The continuous stirred-tank reactor of Schürch et al. (2020), Sec. 5.3, simulated for ``python -m benchmarks
recursive``.

The plant is MATLAB's ``predcstr`` example: the liquid level :math:`h` and the concentration :math:`C_b` of the
product, driven by the feed :math:`w_1` (the control input) and a constant second feed :math:`w_2`,

.. math::

    \\frac{dh}{dt} = w_1 + w_2 - 0.2\\sqrt h, \\qquad
    \\frac{dC_b}{dt} = (C_{b1} - C_b)\\frac{w_1}{h} + (C_{b2} - C_b)\\frac{w_2}{h} - \\frac{k_1 C_b}{(1 + k_2 C_b)^2}.

The input is piecewise constant (zero-order hold on the sampling grid); the sampled output, plus Gaussian noise, is
turned into NARX regressors :math:`\\mathbf x_t = [y_{t-1}, y_{t-2}, w_t, w_{t-1}, w_{t-2}]` with target :math:`y_t`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

#: Feed concentrations, rate constants and the constant feed of the ``predcstr`` plant (Schürch et al. 2020, Sec. 5.3).
CB1, CB2, K1, K2, W2 = 24.9, 0.1, 1.0, 1.0, 0.1


def cstr_derivatives(level: np.ndarray, concentration: np.ndarray, feed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:math:`(dh/dt, dC_b/dt)` at the states and feeds :math:`w_1` (arrays of one shape)."""
    inflow = feed + W2
    level_rate = inflow - 0.2 * np.sqrt(np.maximum(level, 0.0))
    dilution = (CB1 - concentration) * feed + (CB2 - concentration) * W2
    reaction = K1 * concentration / (1.0 + K2 * concentration) ** 2
    return level_rate, dilution / level - reaction


def steady_state(feed: float) -> tuple[float, float]:
    """The equilibrium :math:`(h, C_b)` under a constant feed :math:`w_1` (:math:`h = (5(w_1 + w_2))^2`; the
    concentration is the single root of :math:`dC_b/dt = 0` in :math:`[0, C_{b1}]`)."""
    level = (5.0 * (feed + W2)) ** 2

    def rate(concentration: float) -> float:
        return float(cstr_derivatives(np.asarray(level), np.asarray(concentration), np.asarray(feed))[1])

    return level, brentq(rate, 0.0, CB1, xtol=1e-14)


def rk4_intervals(
    level: np.ndarray, concentration: np.ndarray, feeds: np.ndarray, dt: float, substeps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Classical fixed-step RK4 over consecutive hold intervals, for a batch of independent trajectories.

    :param level: Initial levels, ``(C,)``.
    :param concentration: Initial concentrations, ``(C,)``.
    :param feeds: The feed of each trajectory over each interval, ``(L, C)``.
    :return: Levels and concentrations at the end of every interval, ``(L, C)`` each.
    """
    step = dt / substeps
    levels, concentrations = np.empty_like(feeds), np.empty_like(feeds)
    h, c = level.astype(float, copy=True), concentration.astype(float, copy=True)
    for interval, feed in enumerate(feeds):
        for _ in range(substeps):
            h1, c1 = cstr_derivatives(h, c, feed)
            h2, c2 = cstr_derivatives(h + 0.5 * step * h1, c + 0.5 * step * c1, feed)
            h3, c3 = cstr_derivatives(h + 0.5 * step * h2, c + 0.5 * step * c2, feed)
            h4, c4 = cstr_derivatives(h + step * h3, c + step * c3, feed)
            h = h + step / 6.0 * (h1 + 2.0 * (h2 + h3) + h4)
            c = c + step / 6.0 * (c1 + 2.0 * (c2 + c3) + c4)
        levels[interval], concentrations[interval] = h, c
    return levels, concentrations


def piecewise_constant_input(
    num_samples: int, dt: float, rng: np.random.Generator, heights=(0.0, 4.0), durations=(5.0, 20.0)
) -> np.ndarray:
    """The feed :math:`w_1` held over each of ``num_samples`` sampling intervals: i.i.d. uniform step heights that
    last i.i.d. uniform durations (seconds); a step starts at the first sampling instant at or after its switching
    time (the input is held on the sampling grid)."""
    horizon = num_samples * dt
    count = int(horizon / durations[0]) + 2
    switch_times = np.cumsum(rng.uniform(*durations, size=count))
    levels = rng.uniform(*heights, size=count + 1)
    starts = np.ceil(switch_times / dt - 1e-9).astype(np.int64)
    return levels[np.searchsorted(starts, np.arange(num_samples), side="right")]


def simulate_cstr(
    feeds: np.ndarray,
    initial: tuple[float, float],
    dt: float = 0.2,
    substeps: int = 4,
    chunk: int = 5000,
    tolerance: float = 1e-10,
    max_sweeps: int = 100,
) -> tuple[np.ndarray, np.ndarray, int]:
    r"""
    :math:`(h, C_b)` at the end of every hold interval, from ``initial``, integrated with RK4 (``substeps`` per
    interval of ``dt`` seconds).

    The trajectory is one long sequential recursion; to integrate it with array operations it is cut into chunks of
    ``chunk`` intervals that are integrated side by side, each from a guess of its initial state (the steady state of
    its first feed), and re-integrated, each chunk from the end of the one before, until every chunk starts where its
    predecessor ended (to ``tolerance``, relative to the state's scale). After sweep :math:`s` the first :math:`s`
    chunks are exact; the plant forgets its initial state within a few hundred seconds, so a few sweeps make every
    chunk agree with the sequential integration to rounding (the result is checked, not assumed).

    :return: Levels, concentrations (``feeds``' length each) and the number of sweeps used.
    :raises RuntimeError: If the chunks do not agree after ``max_sweeps`` sweeps.
    """
    num = feeds.size
    num_chunks = -(-num // chunk)
    padded = np.concatenate([feeds, np.full(num_chunks * chunk - num, feeds[-1])]).reshape(num_chunks, chunk).T
    starts = np.array([steady_state(feed) for feed in padded[0]])
    starts[0] = initial
    for sweep in range(1, max_sweeps + 1):
        levels, concentrations = rk4_intervals(starts[:, 0], starts[:, 1], padded, dt, substeps)
        ends = np.stack([levels[-1], concentrations[-1]], axis=-1)
        mismatch = np.abs(ends[:-1] - starts[1:]) / np.maximum(np.abs(ends[:-1]), 1.0)
        if mismatch.size == 0 or mismatch.max() <= tolerance:
            return levels.T.reshape(-1)[:num], concentrations.T.reshape(-1)[:num], sweep
        starts[1:] = ends[:-1]
    raise RuntimeError(f"the chunked CSTR integration did not converge in {max_sweeps} sweeps.")


def narx_regressors(outputs: np.ndarray, inputs: np.ndarray, lags: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Rows :math:`[y_{t-1}, \\dots, y_{t-p}, w_t, w_{t-1}, \\dots, w_{t-p}]` and targets :math:`y_t`, for
    :math:`t = p, \\dots, n - 1`."""
    num = outputs.size
    past_outputs = [outputs[lags - lag : num - lag] for lag in range(1, lags + 1)]
    past_inputs = [inputs[lags - lag : num - lag] for lag in range(lags + 1)]
    return np.stack([*past_outputs, *past_inputs], axis=-1), outputs[lags:]


@dataclass
class CSTRData:
    """A simulated CSTR record and its NARX regression problem.

    :param x: Regressors :math:`[y_{t-1}, y_{t-2}, w_t, w_{t-1}, w_{t-2}]`, ``(n, 5)``.
    :param y: Noisy targets :math:`y_t = C_b(t\\Delta t) + \\varepsilon_t`, ``(n,)``.
    :param f: Noise-free targets :math:`C_b(t\\Delta t)`, ``(n,)``.
    :param level: The level :math:`h(t\\Delta t)` at the targets, ``(n,)``.
    :param sweeps: Sweeps of the chunked integration.
    """

    x: np.ndarray
    y: np.ndarray
    f: np.ndarray
    level: np.ndarray
    sweeps: int


def cstr_dataset(
    num_rows: int,
    seed: int = 0,
    dt: float = 0.2,
    noise_std: float = 0.1,
    burn_in: float = 1000.0,
    substeps: int = 4,
    initial_feed: float = 1.0,
) -> CSTRData:
    """``num_rows`` NARX rows of one simulated run: from the steady state under ``initial_feed``, a burn-in of
    ``burn_in`` seconds is discarded; :math:`w_t` is the feed held over the interval that ends at sample :math:`t`
    (so it has acted on :math:`C_b(t\\Delta t)`)."""
    rng = np.random.default_rng(seed)
    skip = round(burn_in / dt)
    feeds = piecewise_constant_input(skip + num_rows + 2, dt, rng)
    levels, concentrations, sweeps = simulate_cstr(feeds, steady_state(initial_feed), dt, substeps)
    noisy = concentrations + noise_std * rng.standard_normal(concentrations.size)
    x, y = narx_regressors(noisy[skip:], feeds[skip:])
    return CSTRData(x=x, y=y, f=concentrations[skip + 2 :], level=levels[skip + 2 :], sweeps=sweeps)
