from __future__ import annotations

import torch
from gpytorch.kernels import Kernel, ScaleKernel
from gpytorch.likelihoods import GaussianLikelihood, Likelihood
from torch import Tensor


@torch.no_grad()
def median_lengthscales(x: Tensor, ard: bool = True, max_rows: int = 1000) -> Tensor:
    r"""
    The median heuristic for length-scales (`Cheng & Boots (2017)`_, Algorithm 1): the median of the pairwise
    distances between the rows of `x`, per input dimension (`ard=True`) or Euclidean (`ard=False`).

    Only the first `max_rows` rows are used, which bounds the cost at :math:`O(\text{max\_rows}^2 D)`. Each pair
    :math:`i < j` counts once (the diagonal is excluded). A median of zero (e.g. a constant column) is clamped to the
    machine epsilon of the dtype, so that the length-scale stays finite and positive.

    :param x: Inputs, `(N, D)` with :math:`N \ge 2`, finite.
    :param ard: One length-scale per dimension, or a single one from Euclidean distances.
    :param max_rows: The number of leading rows used (at most about 5 800: :func:`torch.quantile` takes up to
        :math:`2^{24}` pairs).
    :return: `(D,)` if `ard`, else `(1,)`.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.kernels import median_lengthscales
        >>> median_lengthscales(torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]]))
        tensor([2.0000e+00, 1.1921e-07])

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """
    if x.dim() != 2 or x.size(0) < 2:
        raise ValueError(f"median_lengthscales needs an (N, D) tensor with N >= 2 rows, got shape {tuple(x.shape)}.")
    if not torch.isfinite(x).all():
        raise ValueError("median_lengthscales got non-finite inputs (NaN or inf).")
    x = x[:max_rows]
    columns = x.split(1, dim=-1) if ard else (x,)
    medians = torch.stack([torch.pdist(column).quantile(0.5) for column in columns])
    return medians.clamp_min(torch.finfo(x.dtype).eps)


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
    if ard and lengthscale.size(-1) != x.size(-1):
        raise ValueError(
            f"{type(kernel).__name__} has {lengthscale.size(-1)} length-scales but x has width {x.size(-1)}."
        )
    kernel.lengthscale = median_lengthscales(x, ard=ard).to(lengthscale).expand_as(lengthscale)
    for m in covar_module.modules():
        if isinstance(m, ScaleKernel):
            m.outputscale = torch.ones_like(m.outputscale)
    if y is not None and likelihood is not None:
        if not isinstance(likelihood, GaussianLikelihood):
            raise TypeError(f"only a GaussianLikelihood's noise can be set from y, got {type(likelihood).__name__}.")
        if not torch.isfinite(y).all() or y.numel() < 2:
            raise ValueError("initialize_hyperparameters needs at least two finite outputs y.")
        noise = likelihood.noise
        floor = likelihood.noise_covar.raw_noise_constraint.lower_bound.to(noise) + torch.finfo(noise.dtype).eps ** 0.5
        likelihood.noise = torch.maximum(y.var().to(noise), floor).expand_as(noise)
