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


def test_the_block_of_every_input_set_is_the_model_covariance_itself() -> None:
    # Unsliced (the exact KL's quadratic form sweeps it): the same lazy block, with identical inputs.
    gen = torch.Generator().manual_seed(3)
    z, x = torch.randn(4, 2, generator=gen, dtype=F64), torch.randn(3, 2, generator=gen, dtype=F64)
    single = joint_prior(ShiftedPrior(), z)
    block = single.covariance(0, 0)
    assert block is single.distribution.lazy_covariance_matrix and block.x1 is block.x2
    stacked = joint_prior(ShiftedPrior(), z, x)
    assert stacked.covariance(slice(0, 2), slice(0, 2)) is stacked.distribution.lazy_covariance_matrix
    assert stacked.covariance(0, 0).shape == (4, 4)  # a part is still sliced


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


def _kernels() -> dict[str, gpytorch.kernels.Kernel]:
    rbf, matern = gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel
    return {
        "scaled RBF ARD": gpytorch.kernels.ScaleKernel(rbf(ard_num_dims=3)),
        "RBF": rbf(),
        "scaled Matern 5/2": gpytorch.kernels.ScaleKernel(matern(nu=2.5, ard_num_dims=3)),
        "Matern 3/2": matern(nu=1.5),
        "Matern 1/2": matern(nu=0.5, ard_num_dims=3),
    }


class KernelPrior(gpytorch.models.ApproximateGP):
    def __init__(self, kernel, extra=None):
        super().__init__(None)
        self.covar_module = kernel
        self.extra = extra

    def forward(self, x):
        covariance = self.covar_module(x)
        if self.extra is not None:
            covariance = covariance + self.extra(x)
        return gpytorch.distributions.MultivariateNormal(torch.zeros_like(x[..., 0]), covariance)


def test_dense_blocks_and_diagonals_equal_gpytorch_in_values_and_gradients() -> None:
    # The lean evaluation (plain tensor operations) against the lazy kernel block GPyTorch evaluates, for every
    # supported kernel, with and without gradients of the inputs (GPyTorch zeroes the diagonal's rounding residual only
    # without), float32 and float64.
    for name, kernel in _kernels().items():
        for dtype in (torch.float32, F64):
            gen = torch.Generator().manual_seed(3)
            model = KernelPrior(kernel).to(dtype)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.copy_(torch.randn(parameter.shape, generator=gen, dtype=dtype))
            for inputs_grad in (False, True):
                z, x = (torch.randn(n, 3, generator=gen, dtype=dtype).requires_grad_(inputs_grad) for n in (5, 7))
                prior = joint_prior(model, z, x)
                assert prior.lean is not None, name
                blocks = {
                    "zz": (prior.dense(0, 0), prior.covariance(0, 0).to_dense()),
                    "z[zx]": (prior.dense(0, slice(0, 2)), prior.covariance(0, slice(0, 2)).to_dense()),
                    "xz": (prior.dense(1, 0), prior.covariance(1, 0).to_dense()),
                    "diag x": (prior.diagonal(1), prior.covariance(1, 1).diagonal(dim1=-2, dim2=-1)),
                }
                tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == F64 else {"rtol": 1e-6, "atol": 1e-6}
                for block, (lean, general) in blocks.items():
                    torch.testing.assert_close(lean, general, **tolerance, msg=f"{name} {dtype} {block}")
                    assert lean.requires_grad == general.requires_grad, (name, block)
                    if not lean.requires_grad:  # an unscaled kernel's diagonal is constant
                        continue
                    weights = torch.randn(lean.shape, generator=gen, dtype=dtype)
                    wrt = [p for p in (*model.parameters(), z, x) if p.requires_grad]
                    ours = torch.autograd.grad((lean * weights).sum(), wrt, allow_unused=True, retain_graph=True)
                    theirs = torch.autograd.grad((general * weights).sum(), wrt, allow_unused=True, retain_graph=True)
                    for a, b in zip(ours, theirs):
                        a = torch.zeros_like(b) if a is None and b is not None else a
                        b = torch.zeros_like(a) if b is None and a is not None else b
                        if a is not None:
                            torch.testing.assert_close(a, b, **tolerance, msg=f"{name} {dtype} {block} gradient")


def test_batched_inputs_take_the_lean_path() -> None:
    gen = torch.Generator().manual_seed(4)
    model = KernelPrior(gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2))).double()
    z, x = torch.randn(4, 2, generator=gen, dtype=F64), torch.randn(3, 6, 2, generator=gen, dtype=F64)
    prior = joint_prior(model, z, x)
    assert prior.lean is not None
    torch.testing.assert_close(prior.dense(0, 1), prior.covariance(0, 1).to_dense(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(
        prior.diagonal(1), prior.covariance(1, 1).diagonal(dim1=-2, dim2=-1), rtol=1e-13, atol=1e-13
    )
    assert prior.diagonal(1).shape == (3, 6)


def test_other_covariances_keep_the_general_path() -> None:
    # Kernels the lean form does not cover, kernels restricted to some input dimensions, batched kernels and a forward
    # that adds a term to the kernel block are all evaluated by GPyTorch, with the same blocks.
    gen = torch.Generator().manual_seed(5)
    z, x = torch.randn(4, 2, generator=gen, dtype=F64), torch.randn(6, 2, generator=gen, dtype=F64)
    rbf = gpytorch.kernels.RBFKernel
    models = {
        "linear": KernelPrior(gpytorch.kernels.LinearKernel()),
        "active dims": KernelPrior(gpytorch.kernels.ScaleKernel(rbf(active_dims=[0]))),
        "batched": KernelPrior(rbf(batch_shape=torch.Size([3]))),
        "sum": KernelPrior(rbf() + gpytorch.kernels.LinearKernel()),
        "forward adds a term": KernelPrior(rbf(), extra=gpytorch.kernels.LinearKernel()),
    }
    for name, model in models.items():
        prior = joint_prior(model.double(), z, x)
        assert prior.lean is None, name
        torch.testing.assert_close(prior.dense(0, 1), prior.covariance(0, 1).to_dense(), rtol=0, atol=0)
        torch.testing.assert_close(
            prior.diagonal(1), prior.covariance(1, 1).diagonal(dim1=-2, dim2=-1), rtol=0, atol=0, msg=name
        )


def test_of_kernel_gives_the_models_blocks_without_its_forward_pass() -> None:
    # The lean training step's prior blocks: the same dense blocks and variances as joint_prior of the model (the same
    # lean kernel on the same stacked inputs), bit for bit, and no distribution (nothing of the model was called).
    from gpytorch_decoupled.linalg import LeanKernel
    from gpytorch_decoupled.variational import JointPrior

    gen = torch.Generator().manual_seed(4)
    z, x, w = (torch.randn(n, 2, generator=gen, dtype=F64) for n in (4, 3, 5))
    model = ShiftedPrior()
    model.covar_module.base_kernel.lengthscale = 0.6
    expected = joint_prior(model, z, x, w)
    prior = JointPrior.of_kernel(LeanKernel.of(model.covar_module), z, x, w)
    assert prior.distribution is None and prior.sizes == (4, 3, 5)
    for rows, columns in [(0, 0), (0, 1), (2, 1), (0, 2), (slice(0, 2), 2)]:
        assert torch.equal(prior.dense(rows, columns), expected.dense(rows, columns))
    for rows in range(3):
        assert torch.equal(prior.diagonal(rows), expected.diagonal(rows))
