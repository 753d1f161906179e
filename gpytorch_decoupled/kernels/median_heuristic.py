from __future__ import annotations

import warnings

import torch
from gpytorch.kernels import Kernel, ScaleKernel
from gpytorch.likelihoods import GaussianLikelihood, Likelihood
from torch import Tensor

from ..validation import check_finite, check_positive_int, check_tensor


@torch.no_grad()
def median_lengthscales(x: Tensor, ard: bool = True, max_rows: int = 1000) -> Tensor:
    r"""
    The median heuristic for length-scales (`Cheng & Boots (2017)`_, Algorithm 1): the median of the pairwise
    distances between the rows of `x`, per input dimension (`ard=True`) or Euclidean (`ard=False`).

    Only the first `max_rows` rows are used, which bounds the cost at :math:`O(\text{max\_rows}^2 D)`. Each pair
    :math:`i < j` counts once (the diagonal is excluded).

    A median of zero (a column that is constant in these rows, or one whose values mostly coincide, e.g. a binary
    column) would give a length-scale of zero, and a kernel, loss and gradient that are NaN after the first step. It is
    replaced, with a warning naming the columns, by the median of the column's nonzero distances, or for a constant
    column by the median of the other columns' length-scales (1 if there are none).

    :param x: Inputs, `(N, D)` with :math:`N \ge 2`, finite.
    :param ard: One length-scale per dimension, or a single one from Euclidean distances.
    :param max_rows: The number of leading rows used (at most about 5 800: :func:`torch.quantile` takes up to
        :math:`2^{24}` pairs).
    :return: `(D,)` if `ard`, else `(1,)`; positive and finite.
    :raises TypeError: If `x` is not a floating-point tensor.
    :raises ValueError: If it has another shape, fewer than two rows, or NaN/inf.

    Example:
        >>> import torch, warnings
        >>> from gpytorch_decoupled.kernels import median_lengthscales
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     median_lengthscales(torch.tensor([[0.0, 1.0], [1.0, 1.0], [3.0, 1.0]]))
        tensor([2., 2.])
        >>> print(caught[0].message)
        median_lengthscales: column 1 is constant in the rows used; its length-scale is set to 2 instead of 0.

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """
    check_tensor(x, "x")
    if x.dim() != 2 or x.size(0) < 2:
        raise ValueError(f"x must have shape (N, D) with N >= 2 rows, got {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating-point, got {x.dtype}.")
    check_finite(x, "x")
    check_positive_int(max_rows, "max_rows", minimum=2)
    x = x[:max_rows]
    columns = x.split(1, dim=-1) if ard else (x,)
    distances = [torch.pdist(column) for column in columns]
    medians = torch.stack([distance.quantile(0.5) for distance in distances])
    if (medians > 0).all():
        return medians
    # A zero median: fall back on the column's nonzero distances, then on the other columns' length-scales.
    constant, repeated = [], []
    for column, distance in enumerate(distances):
        if medians[column] == 0:
            nonzero = distance[distance > 0]
            if nonzero.numel():
                medians[column] = nonzero.quantile(0.5)
                repeated.append(column)
            else:
                constant.append(column)
    if constant:
        others = medians[medians > 0]
        medians[constant] = others.median() if others.numel() else 1.0
    messages = []
    if repeated:
        subject, plural = _subject(repeated, ard)
        messages.append(
            f"{subject} mostly repeat{'' if plural else 's'} one value in the rows used; the median of the nonzero "
            "distances is used"
        )
    if constant:
        subject, plural = _subject(constant, ard)
        messages.append(
            f"{subject} {'are' if plural else 'is'} constant in the rows used; {'their' if plural else 'its'} "
            f"length-scale is set to {medians[constant[0]].item():g} instead of 0"
        )
    warnings.warn("median_lengthscales: " + "; ".join(messages) + ".", RuntimeWarning, stacklevel=2)
    return medians


def _subject(columns: list[int], ard: bool) -> tuple[str, bool]:
    """How the warning names the columns, and whether that is a plural."""
    if not ard:
        return "the inputs", True
    if len(columns) == 1:
        return f"column {columns[0]}", False
    return "columns " + ", ".join(str(column) for column in columns), True


@torch.no_grad()
def initialize_hyperparameters(
    covar_module: Kernel, x: Tensor, y: Tensor | None = None, likelihood: Likelihood | None = None
) -> None:
    r"""
    Step 1 of `Cheng & Boots (2017)`_'s Algorithm 1, on a first mini-batch: length-scales by the median heuristic,
    :math:`\rho = 1`, and :math:`\sigma^2` = the variance of the outputs.

    * The first kernel with a length-scale in `covar_module.modules()` gets :func:`median_lengthscales` of `x`
      (per dimension when its length-scale is ARD, Euclidean otherwise), broadcast over its batch shape.
    * Every :class:`gpytorch.kernels.ScaleKernel` in `covar_module` gets outputscale 1.
    * If `y` and a :class:`gpytorch.likelihoods.GaussianLikelihood` are given, its noise becomes the variance of `y`,
      kept above the noise constraint's lower bound.

    :param covar_module: The prior kernel.
    :param x: Data inputs of the mini-batch, `(N, D)`.
    :param y: Outputs of the mini-batch (any shape).
    :param likelihood: The likelihood whose noise is set.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.kernels import initialize_hyperparameters
        >>> covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2))
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 2.0], [3.0, 4.0]])
        >>> initialize_hyperparameters(covar_module, x, torch.tensor([0.0, 1.0, 2.0]), likelihood)
        >>> covar_module.base_kernel.lengthscale.tolist(), covar_module.outputscale.item(), likelihood.noise.item()
        ([[2.0, 2.0]], 1.0, 1.0)

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """
    kernel = next((m for m in covar_module.modules() if getattr(m, "has_lengthscale", False)), None)
    if kernel is None:
        raise ValueError(f"{type(covar_module).__name__} contains no kernel with a length-scale.")
    lengthscale = kernel.lengthscale
    ard = lengthscale.size(-1) > 1
    check_tensor(x, "x")
    if ard and x.dim() > 0 and lengthscale.size(-1) != x.size(-1):
        raise ValueError(
            f"x has {x.size(-1)} columns but {type(kernel).__name__} has {lengthscale.size(-1)} length-scales."
        )
    set_noise = y is not None and likelihood is not None
    if set_noise:
        if not isinstance(likelihood, GaussianLikelihood):
            raise TypeError(f"only a GaussianLikelihood's noise can be set from y, got {type(likelihood).__name__}.")
        check_tensor(y, "y")
        if not y.is_floating_point() or y.numel() < 2:
            raise ValueError(f"y must hold at least two real values, got {y.dtype} of shape {tuple(y.shape)}.")
        check_finite(y, "y")
    # Everything is checked (median_lengthscales checks x) before the first hyperparameter changes.
    lengthscales = median_lengthscales(x, ard=ard)
    kernel.lengthscale = lengthscales.to(lengthscale).expand_as(lengthscale)
    for m in covar_module.modules():
        if isinstance(m, ScaleKernel):
            m.outputscale = torch.ones_like(m.outputscale)
    if set_noise:
        noise = likelihood.noise
        floor = likelihood.noise_covar.raw_noise_constraint.lower_bound.to(noise) + torch.finfo(noise.dtype).eps ** 0.5
        likelihood.noise = torch.maximum(y.var().to(noise), floor).expand_as(noise)
