from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..optim import DualEStep


def eager_training_step(mll, optimizers: Sequence[torch.optim.Optimizer], x: Tensor, y: Tensor) -> Tensor:
    r"""
    One ordinary eager training step at the mini-batch ``(x, y)``: every optimizer's ``zero_grad``, the loss
    ``-mll(model(x), y)``, ``backward``, then the steps, an E-step of t-SVGP
    (:class:`~gpytorch_decoupled.optim.DualEStep`, which takes the batch) first, at the marginals of this forward pass,
    then every other optimizer's ``step()`` (t-SVGP's default schedule, `Adam et al. (2021)`_, Algorithm 2, as
    :class:`~gpytorch_decoupled.optim.DualEStep` describes). It is what a compiled
    :class:`~gpytorch_decoupled.training.TrainingStep` computes, and what it runs where the lean path does not apply.

    :param mll: The objective, with its model.
    :param optimizers: The optimizers (and E-steps) to step.
    :param x: Mini-batch inputs.
    :param y: Mini-batch targets.
    :return: The loss before the step, detached.

    Example:
        >>> import gpytorch, torch
        >>> class SVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z):
        ...         q = gpytorch.variational.CholeskyVariationalDistribution(z.size(0))
        ...         super().__init__(gpytorch.variational.VariationalStrategy(self, z, q))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-2, 2, 40).unsqueeze(-1)
        >>> y = torch.sin(3 * x.squeeze(-1))
        >>> model, likelihood = SVGP(x[::5].clone()), gpytorch.likelihoods.GaussianLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=40)
        >>> adam = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.1)
        >>> losses = [eager_training_step(mll, [adam], x, y) for _ in range(30)]
        >>> bool(losses[-1] < losses[0])
        True

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    loss = -mll(mll.model(x), y)
    loss.backward()
    for optimizer in optimizers:
        if isinstance(optimizer, DualEStep):
            optimizer.step(x, y)
    for optimizer in optimizers:
        if not isinstance(optimizer, DualEStep):
            optimizer.step()
    return loss.detach()
