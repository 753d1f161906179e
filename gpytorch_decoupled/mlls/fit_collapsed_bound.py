from __future__ import annotations

import copy
import math
import warnings
from typing import NamedTuple

import torch
from gpytorch.kernels import ScaleKernel
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.means import ConstantMean
from gpytorch.models import ApproximateGP
from torch import Tensor

from ..kernels import median_lengthscales
from ..validation import check_positive_int, check_positive_number
from .streaming_collapsed_bound import Batches, StreamingCollapsedBound

#: The starts after the first: (length-scale factor, noise fraction of Var(y)), in order, then repeated.
_START_SCHEDULE = ((0.5, 0.01), (2.0, 0.3), (0.25, 0.001), (4.0, 0.1), (0.5, 0.1), (2.0, 0.01))


class CollapsedBoundFit(NamedTuple):
    r"""What :func:`fit_collapsed_bound` returns (bounds in nats, summed over the data, one value per latent)."""

    bound: Tensor  #: the collapsed bound at the kept (best) start
    start_bounds: list[float]  #: the final bound of every start (summed over latents; -inf where a start failed)
    best_start: int  #: the index of the kept start
    noise_only_bound: Tensor  #: the log likelihood of the noise-only model (constant mean, noise = Var(y))
    noise_only: bool  #: whether the kept fit explains less than ``noise_only_tolerance`` nats per datum more


class _DataSummary(NamedTuple):
    sample: Tensor  # a uniform random sample of input rows, (S, D)
    mean: Tensor  # of the targets, per latent
    variance: Tensor  # of the targets (unbiased), per latent
    count: int


def fit_collapsed_bound(
    model: ApproximateGP,
    likelihood: GaussianLikelihood,
    batches: Batches,
    num_starts: int = 1,
    max_iter: int = 100,
    initialize: bool = True,
    noise_fraction: float = 0.1,
    noise_only_tolerance: float = 0.01,
    absorb: bool = True,
    seed: int = 0,
) -> CollapsedBoundFit:
    r"""
    Fits the hyperparameters (and inducing inputs, where they are learned) of a model with a
    :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` by L-BFGS on the exact collapsed bound
    (:class:`StreamingCollapsedBound`, two streaming passes per evaluation), from a data-driven initialization, with
    optional restarts, and warns when the result is the noise-only solution.

    **Initialization** (``initialize=True``), from one pass over ``batches``: every kernel with a length-scale gets
    the median heuristic of a uniform random sample of up to 1,000 input rows (:func:`~gpytorch_decoupled.kernels.
    median_lengthscales`, per dimension for ARD kernels; constant columns are replaced, with a warning); the noise is
    a fraction :math:`f` of the target variance, :math:`\sigma^2 = f\,\mathrm{Var}(y)`, the
    :class:`~gpytorch.kernels.ScaleKernel`\ s share the rest, :math:`\sigma_f^2 = (1 - f)\,\mathrm{Var}(y)`, and a
    :class:`~gpytorch.means.ConstantMean` starts at the targets' mean. GPyTorch's defaults (unit length-scales,
    signal and noise variance) ignore the data's scale: on standardized data with many inputs every pair of rows is
    then many length-scales apart, the kernel matrix is nearly diagonal, and the bound's gradient leads straight to
    the **noise-only optimum**, where :math:`\sigma^2 \approx \mathrm{Var}(y)` and the latent function explains
    nothing.

    **Detection.** The fitted bound :math:`\mathcal L` is compared with the log likelihood of the noise-only model,
    :math:`\mathcal L_0 = -\frac N2\big(\log 2\pi s^2 + 1\big)` with :math:`s^2` the targets' variance about their
    mean (its maximum). The collapsed bound of any model whose latent function vanishes is at most
    :math:`\mathcal L_0`, so :math:`(\mathcal L - \mathcal L_0)/N` is what the latent function adds, in nats per
    datum. Below ``noise_only_tolerance`` the fit warns, saying what to try: for data with structure this is a
    stalled fit; for data without it (pure noise), the right answer.

    **Restarts** (``num_starts > 1``): start :math:`k` scales the initial length-scales and sets the noise fraction
    by a fixed schedule ((1, f), (1/2, 0.01), (2, 0.3), (1/4, 0.001), (4, 0.1), ...), runs L-BFGS, and the start with
    the highest bound is kept.

    **Failures.** Where the line search steps to parameters at which the bound fails (a matrix not positive definite
    even with the maximum jitter, NaN), the start ends, with a warning, at the best point it evaluated before; a start
    whose initialization cannot be evaluated is skipped with a warning.

    :param model: An :class:`~gpytorch.models.ApproximateGP` with a
        :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` (its ``approximation`` chooses the bound).
    :param likelihood: The strategy's :class:`~gpytorch.likelihoods.GaussianLikelihood`.
    :param batches: The mini-batches ``(x, y)`` of the whole data set: a re-iterable collection or a function
        returning a fresh iterable (read ``2 + 2 x evaluations`` times per start).
    :param num_starts: How many initializations to try (default 1).
    :param max_iter: L-BFGS iterations per start (default 100).
    :param initialize: Set the data-driven initialization (default). ``False`` starts from the model's current
        values (restarts then scale those).
    :param noise_fraction: :math:`f`, the initial noise as a fraction of :math:`\mathrm{Var}(y)` (default 0.1).
    :param noise_only_tolerance: Nats per datum above :math:`\mathcal L_0` below which the fit counts as noise-only
        (default 0.01).
    :param absorb: Afterwards, reset the strategy and absorb ``batches`` at the fitted hyperparameters, so that the
        model predicts from the exact posterior (default). The strategy's state is otherwise not touched.
    :param seed: Seeds the sample of input rows for the median heuristic.
    :return: A :class:`CollapsedBoundFit`; the model and likelihood hold the kept start's values.
    :raises ValueError: On bad arguments or no mini-batches, before anything changes.
    :raises RuntimeError: If every start fails.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.mlls import fit_collapsed_bound
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points, likelihood):
        ...         super().__init__(KalmanVariationalStrategy(self, inducing_points, likelihood=likelihood))
        ...         self.mean_module = gpytorch.means.ConstantMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> _ = torch.manual_seed(0)
        >>> x = torch.linspace(-3, 3, 1000).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(1000)
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = RecursiveGP(torch.linspace(-3, 3, 10).unsqueeze(-1), likelihood)
        >>> fit = fit_collapsed_bound(model, likelihood, list(zip(x.split(250), y.split(250))), max_iter=30)
        >>> fit.noise_only, bool(likelihood.noise < 0.05), model.variational_strategy.num_observed
        (False, True, 1000)
    """
    check_positive_int(num_starts, "num_starts")
    check_positive_int(max_iter, "max_iter")
    check_positive_number(noise_fraction, "noise_fraction")
    check_positive_number(noise_only_tolerance, "noise_only_tolerance")
    if noise_fraction >= 1:
        raise ValueError(f"noise_fraction must be below 1 (the noise is a part of Var(y)), got {noise_fraction}.")
    objective = StreamingCollapsedBound(model, likelihood)
    summary = _summarize(objective, batches, seed)
    noise_only_bound = -0.5 * summary.count * (torch.log(2 * math.pi * _maximum_likelihood_variance(summary)) + 1)
    parameters = list({id(p): p for p in (*model.parameters(), *likelihood.parameters()) if p.requires_grad}.values())
    if initialize:
        medians = _median_lengthscales(model, summary.sample)
    start_state = _state(model, likelihood)
    best, best_state, start_bounds = None, None, []
    for start in range(num_starts):
        factor, fraction = (1.0, noise_fraction) if start == 0 else _START_SCHEDULE[(start - 1) % len(_START_SCHEDULE)]
        _load(model, likelihood, start_state)
        if initialize:
            _initialize(model, likelihood, medians, summary, factor, fraction)
        elif start > 0:
            _perturb(model, likelihood, factor, fraction / noise_fraction)
        try:
            bound, problem = _run_lbfgs(objective, parameters, batches, max_iter)
        except (RuntimeError, ValueError) as error:  # not even the initialization could be evaluated
            warnings.warn(
                f"fit_collapsed_bound: start {start} failed ({error}); it is skipped.", RuntimeWarning, stacklevel=2
            )
            bound = None
        else:
            if problem is not None:
                warnings.warn(
                    f"fit_collapsed_bound: in start {start} L-BFGS stepped to parameters where the bound fails "
                    f"({problem}); the start ends at its best point before that.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        total = bound.sum().item() if bound is not None else -math.inf
        total = total if math.isfinite(total) else -math.inf
        start_bounds.append(total)
        if math.isfinite(total) and (best is None or total > best[1].sum().item()):
            best, best_state = (start, bound), _state(model, likelihood)
    if best is None:
        _load(model, likelihood, start_state)
        raise RuntimeError(f"fit_collapsed_bound: every start failed ({num_starts}); the model is as before.")
    _load(model, likelihood, best_state)
    gain = (best[1] - noise_only_bound) / summary.count
    noise_only = bool((gain < noise_only_tolerance).any())
    if noise_only:
        ratio = (likelihood.noise.detach().double().mean() / summary.variance.mean()).item()
        warnings.warn(
            "fit_collapsed_bound: the fit is the noise-only solution: its collapsed bound is less than "
            f"{noise_only_tolerance:g} nats per datum above pure noise's ({gain.min().item():+.3g}; noise variance = "
            f"{ratio:.3g} x Var(y)), so the latent function explains almost nothing. If the data have structure, try "
            "num_starts=5 (other length-scales and noise levels), more inducing points or inducing points spread "
            "over the data, or standardized inputs; if they have none, this is the right answer.",
            RuntimeWarning,
            stacklevel=2,
        )
    if absorb:
        strategy = objective.strategy
        strategy.reset()
        for x, y in StreamingCollapsedBound._iterate(batches):
            strategy.update(x, y)
    return CollapsedBoundFit(best[1], start_bounds, best[0], noise_only_bound.to(best[1]), noise_only)


def _summarize(objective: StreamingCollapsedBound, batches: Batches, seed: int, max_rows: int = 1000) -> _DataSummary:
    """One pass: a uniform sample of input rows (the ``max_rows`` smallest of random keys) and the targets' mean and
    variance (shifted by the first batch's mean, in float64)."""
    generator = torch.Generator().manual_seed(seed)
    sample = keys = shift = total = squares = None
    count = 0
    with torch.no_grad():
        for x, y in StreamingCollapsedBound._iterate(batches):
            x, y = objective.strategy.checked_data(x, y)
            rows = x.reshape(-1, x.size(-1))
            y = y.double()
            if shift is None:
                shift = y.mean(-1, keepdim=True)
                total, squares = torch.zeros_like(shift[..., 0]), torch.zeros_like(shift[..., 0])
                sample, keys = rows[:0], torch.empty(0, dtype=torch.float64)
            total = total + (y - shift).sum(-1)
            squares = squares + (y - shift).square().sum(-1)
            count += y.size(-1)
            keys = torch.cat([keys, torch.rand(rows.size(0), generator=generator, dtype=torch.float64)])
            sample = torch.cat([sample, rows])
            if keys.numel() > max_rows:
                kept = keys.topk(max_rows, largest=False).indices
                keys, sample = keys[kept], sample[kept.to(sample.device)]
    if count == 0:
        raise ValueError("fit_collapsed_bound: no mini-batches were given.")
    if count < 2:
        raise ValueError("fit_collapsed_bound needs at least two data points.")
    mean = total / count
    variance = (squares - count * mean.square()) / (count - 1)
    if (variance <= 0).any():
        warnings.warn(
            "fit_collapsed_bound: the targets are constant; their variance is taken as 1 for the initialization.",
            RuntimeWarning,
            stacklevel=3,
        )
        variance = torch.where(variance > 0, variance, torch.ones_like(variance))
    return _DataSummary(sample, shift[..., 0] + mean, variance, count)


def _maximum_likelihood_variance(summary: _DataSummary) -> Tensor:
    return summary.variance * (summary.count - 1) / summary.count


def _median_lengthscales(model: ApproximateGP, sample: Tensor) -> dict[torch.nn.Module, Tensor]:
    """The median heuristic for every kernel of ``model`` with a length-scale (on its ``active_dims``)."""
    medians = {}
    for kernel in model.modules():
        if not getattr(kernel, "has_lengthscale", False):
            continue
        columns = sample if kernel.active_dims is None else sample[..., kernel.active_dims]
        size = kernel.lengthscale.size(-1)
        if size > 1 and size != columns.size(-1):
            raise ValueError(
                f"fit_collapsed_bound: {type(kernel).__name__} has {size} length-scales but the inputs it sees have "
                f"{columns.size(-1)} columns."
            )
        medians[kernel] = median_lengthscales(columns, ard=size > 1)
    if not medians:
        raise ValueError("fit_collapsed_bound: initialize=True needs a kernel with a length-scale in the model.")
    return medians


@torch.no_grad()
def _initialize(
    model: ApproximateGP,
    likelihood: GaussianLikelihood,
    medians: dict[torch.nn.Module, Tensor],
    summary: _DataSummary,
    factor: float,
    fraction: float,
) -> None:
    variance = summary.variance.mean()
    for kernel, median in medians.items():
        kernel.lengthscale = (factor * median).to(kernel.lengthscale).expand_as(kernel.lengthscale)
    scale_kernels = [m for m in model.modules() if isinstance(m, ScaleKernel)]
    for m in scale_kernels:
        m.outputscale = ((1 - fraction) * variance / len(scale_kernels)).to(m.outputscale).expand_as(m.outputscale)
    for m in model.modules():
        if isinstance(m, ConstantMean):
            m.constant = summary.mean.to(m.constant).expand_as(m.constant)
    _set_noise(likelihood, fraction * variance)


@torch.no_grad()
def _perturb(model: ApproximateGP, likelihood: GaussianLikelihood, factor: float, noise_factor: float) -> None:
    for kernel in model.modules():
        if getattr(kernel, "has_lengthscale", False):
            kernel.lengthscale = kernel.lengthscale * factor
    _set_noise(likelihood, likelihood.noise * noise_factor)


def _set_noise(likelihood: GaussianLikelihood, noise: Tensor) -> None:
    current = likelihood.noise
    floor = likelihood.noise_covar.raw_noise_constraint.lower_bound.to(current) + torch.finfo(current.dtype).eps ** 0.5
    likelihood.noise = torch.maximum(torch.as_tensor(noise).to(current), floor).expand_as(current)


def _run_lbfgs(
    objective: StreamingCollapsedBound, parameters: list[Tensor], batches: Batches, max_iter: int
) -> tuple[Tensor, str | None]:
    """L-BFGS (strong Wolfe) on the exact bound. Returns the bound (per latent) at the final parameters and
    ``None``; or, where the line search stepped to parameters at which the bound fails (a matrix not positive definite,
    NaN), the bound at the best point evaluated before and what failed."""
    best = {"loss": math.inf, "values": None}
    problem = None
    if parameters:  # all may be frozen: then the bound at the initialization
        optimizer = torch.optim.LBFGS(parameters, max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = objective.value_and_backward(batches)
            if math.isfinite(loss.item()) and loss.item() < best["loss"]:
                best["loss"], best["values"] = loss.item(), [p.detach().clone() for p in parameters]
            return loss

        try:
            optimizer.step(closure)
        except (RuntimeError, ValueError) as error:  # NotPSDError is a RuntimeError
            problem = str(error)
        for parameter in parameters:
            parameter.grad = None
    if problem is None:
        try:
            bound = objective.value(batches)
        except (RuntimeError, ValueError) as error:
            problem = str(error)
        else:
            if torch.isfinite(bound).all():
                return bound, None
            problem = "a non-finite bound"
    if best["values"] is None:
        raise RuntimeError(problem)
    with torch.no_grad():
        for parameter, value in zip(parameters, best["values"], strict=True):
            parameter.copy_(value)
    return objective.value(batches), problem


def _state(model: ApproximateGP, likelihood: GaussianLikelihood) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(likelihood.state_dict())


def _load(model: ApproximateGP, likelihood: GaussianLikelihood, state: tuple[dict, dict]) -> None:
    model.load_state_dict(state[0])
    likelihood.load_state_dict(state[1])
