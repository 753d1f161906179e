"""joint_prior: one evaluation of the model's prior at stacked input sets, its blocks addressed by set, batch shapes
broadcast and keyword arguments passed to ``model.forward``, as every strategy uses it (the dual strategy's forward
used to drop them)."""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy, joint_prior

F64 = torch.float64


class ShiftedPrior(gpytorch.models.ApproximateGP):
    """A prior whose mean takes a keyword argument of ``forward``, so that a dropped argument shows."""

    def __init__(self, strategy=None):
        super().__init__(None)
        if strategy is not None:
            self.variational_strategy = strategy(self)
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()

    def forward(self, x, shift: float = 0.0):
        mean = torch.full_like(x[..., 0], shift)
        return gpytorch.distributions.MultivariateNormal(mean, self.covar_module(x))


def test_blocks_are_the_kernel_between_the_input_sets() -> None:
    gen = torch.Generator().manual_seed(0)
    z, x, w = (torch.randn(n, 2, generator=gen, dtype=F64) for n in (4, 3, 5))
    model = ShiftedPrior()
    prior = joint_prior(model, z, x, w, shift=0.5)
    kernel = model.covar_module
    assert prior.sizes == (4, 3, 5)
    torch.testing.assert_close(prior.covariance(0, 1).to_dense(), kernel(z, x).to_dense(), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(prior.covariance(2, 2).to_dense(), kernel(w, w).to_dense(), rtol=1e-14, atol=1e-14)
    stacked = torch.cat([z, x])
    torch.testing.assert_close(
        prior.covariance(slice(0, 2), 2).to_dense(), kernel(stacked, w).to_dense(), rtol=1e-14, atol=1e-14
    )
    assert torch.equal(prior.mean(1), torch.full((3,), 0.5, dtype=F64))  # the keyword reached model.forward
    assert prior.mean(slice(1, 3)).shape == (8,)


def test_batch_dimensions_broadcast() -> None:
    gen = torch.Generator().manual_seed(1)
    z, x = torch.randn(4, 2, generator=gen, dtype=F64), torch.randn(3, 6, 2, generator=gen, dtype=F64)
    prior = joint_prior(ShiftedPrior(), z, x)
    assert prior.covariance(0, 1).shape == (3, 4, 6)
    assert prior.mean(1).shape == (3, 6)


def test_the_dual_strategy_passes_keyword_arguments_to_the_prior() -> None:
    gen = torch.Generator().manual_seed(2)
    z, x = torch.randn(4, 2, generator=gen, dtype=F64), torch.randn(6, 2, generator=gen, dtype=F64)

    def strategy(model):
        return DualVariationalStrategy(model, z, DualVariationalDistribution(4).double(), jitter_val=1e-10)

    model = ShiftedPrior(strategy)
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            shifted, plain = model(x, shift=2.0), model(x)
        torch.testing.assert_close(shifted.mean - plain.mean, torch.full((6,), 2.0, dtype=F64), rtol=0, atol=1e-12)
