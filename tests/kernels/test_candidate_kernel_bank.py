from __future__ import annotations

import math
import pickle
import random

import gpytorch
import pytest
import torch

from gpytorch_decoupled.kernels import CandidateKernelBank, KernelExpression, KernelSpace

pytestmark = pytest.mark.usefixtures("single_thread")
DTYPE = torch.float64


def _randomized(bank: CandidateKernelBank, seed: int = 0) -> CandidateKernelBank:
    """The bank in float64 with every raw hyperparameter drawn at random (values roughly in [0.3, 1.6])."""
    bank = bank.to(DTYPE)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in bank.parameters():
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=DTYPE))
    return bank


def _inputs(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _linear_product(expression: KernelExpression) -> bool:
    """Whether a product term has two LIN leaves: GPyTorch multiplies those through jittered root decompositions on
    symmetric inputs (x1 == x2), which is inexact when a factor is low-rank, so it is no reference there."""
    return any([expression.leaves[j] for j in term].count("LIN") > 1 for term in expression.sum_of_products())


def _assert_matches_candidates(bank: CandidateKernelBank, x1: torch.Tensor, x2: torch.Tensor) -> None:
    covariance, symmetric, diagonal = bank(x1, x2).to_dense(), bank(x1).to_dense(), bank(x1, diag=True)
    assert covariance.shape == (bank.num_candidates, len(x1), len(x2))
    torch.testing.assert_close(diagonal, torch.diagonal(symmetric, dim1=-2, dim2=-1), rtol=1e-12, atol=0)
    for c, expression in enumerate(bank.space):
        kernel = bank.candidate(c)
        message = bank.names[c]
        torch.testing.assert_close(covariance[c], kernel(x1, x2).to_dense(), rtol=1e-12, atol=1e-14, msg=message)
        torch.testing.assert_close(diagonal[c], kernel(x1, diag=True), rtol=1e-12, atol=1e-14, msg=message)
        if not _linear_product(expression):
            torch.testing.assert_close(symmetric[c], kernel(x1).to_dense(), rtol=1e-12, atol=1e-14, msg=message)


@pytest.mark.parametrize("ard_num_dims, d", [(None, 1), (3, 3), (None, 2)])
def test_every_candidate_of_the_12_matches_its_standalone_kernel(ard_num_dims, d):
    bank = _randomized(CandidateKernelBank(KernelSpace.paper_12(), ard_num_dims=ard_num_dims))
    _assert_matches_candidates(bank, _inputs(7, d), _inputs(5, d, seed=2))


@pytest.mark.filterwarnings("ignore:A not p.d.")
@pytest.mark.parametrize("left_to_right", [False, True])
def test_a_random_slice_of_the_144_matches_the_standalone_kernels(left_to_right):
    space = KernelSpace.paper(left_to_right=left_to_right)
    chosen = sorted(random.Random(int(left_to_right)).sample(range(len(space)), 30))
    bank = _randomized(CandidateKernelBank([space[i] for i in chosen], ard_num_dims=2), seed=3)
    _assert_matches_candidates(bank, _inputs(6, 2), _inputs(4, 2, seed=2))


@pytest.mark.filterwarnings("ignore:A not p.d.")  # from GPyTorch's products of LIN leaves (see _linear_product)
def test_the_whole_144_in_one_call():
    bank = _randomized(CandidateKernelBank(KernelSpace.paper(left_to_right=True)), seed=4)
    _assert_matches_candidates(bank, _inputs(6, 1), _inputs(3, 1, seed=2))


def test_products_of_linear_leaves_are_exact():
    bank = _randomized(CandidateKernelBank(["LIN×LIN×LIN", "LIN×PER×LIN + LIN"]), seed=13)
    x = _inputs(6, 1)
    v = bank.base_kernels["LIN"].variance.detach().flatten()
    per = bank.base_kernels["PER"]
    outer = x @ x.mT
    periodic = _per(x, x, per.outputscale[0], per.base_kernel.lengthscale[0, 0], per.base_kernel.period_length[0, 0])
    expected = torch.stack([v[0] * v[1] * v[2] * outer**3, v[3] * v[4] * outer.square() * periodic + v[5] * outer])
    torch.testing.assert_close(bank(x).to_dense(), expected.detach(), rtol=1e-12, atol=1e-14)


def _se(x1, x2, scale, lengthscale):
    return scale * torch.exp(-0.5 * ((x1[:, None] - x2[None]) / lengthscale).square().sum(-1))


def _rq(x1, x2, scale, lengthscale, alpha):
    return scale * (1 + ((x1[:, None] - x2[None]) / lengthscale).square().sum(-1) / (2 * alpha)) ** -alpha


def _per(x1, x2, scale, lengthscale, period):
    # GPyTorch's periodic lengthscale is the Duvenaud l^2 (not squared again)
    sines = torch.sin(math.pi * (x1[:, None] - x2[None]).abs() / period).square()
    return scale * torch.exp(-2 * (sines / lengthscale).sum(-1))


def _lin(x1, x2, variance):
    return (x1[:, None] * x2[None] * variance).sum(-1)


def test_hand_written_formulas_with_ard_inputs():
    bank = _randomized(CandidateKernelBank(["SE", "PER", "LIN", "RQ", "(PER + RQ)×LIN"], ard_num_dims=3), seed=5)
    x1, x2 = _inputs(6, 3), _inputs(5, 3, seed=2)
    kernels = bank.base_kernels

    def leaf(kind, slot):
        kernel = kernels[kind]
        if kind == "LIN":
            return _lin(x1, x2, kernel.variance[slot, 0])
        scale, lengthscale = kernel.outputscale[slot], kernel.base_kernel.lengthscale[slot, 0]
        if kind == "SE":
            return _se(x1, x2, scale, lengthscale)
        if kind == "RQ":
            return _rq(x1, x2, scale, lengthscale, kernel.base_kernel.alpha[slot, 0])
        return _per(x1, x2, scale, lengthscale, kernel.base_kernel.period_length[slot, 0])

    expected = torch.stack(
        [
            leaf("SE", 0),
            leaf("PER", 0),
            leaf("LIN", 0),
            leaf("RQ", 0),
            (leaf("PER", 1) + leaf("RQ", 1)) * leaf("LIN", 1),
        ]
    )
    torch.testing.assert_close(bank(x1, x2).to_dense(), expected.detach(), rtol=1e-12, atol=1e-14)
    assert bank.leaf_candidates("PER").tolist() == [1, 4] and bank.leaf_candidates("lin").tolist() == [2, 4]


def test_gradients_reach_every_base_parameter():
    bank = _randomized(CandidateKernelBank(KernelSpace.paper_12(), ard_num_dims=2), seed=6)
    x1, x2 = _inputs(5, 2), _inputs(4, 2, seed=2)
    (bank(x1, x2).to_dense().sum() + bank(x1, diag=True).sum()).backward()
    assert {name for name, _ in bank.named_parameters()} == {
        "base_kernels.SE.raw_outputscale",
        "base_kernels.SE.base_kernel.raw_lengthscale",
        "base_kernels.RQ.raw_outputscale",
        "base_kernels.RQ.base_kernel.raw_lengthscale",
        "base_kernels.RQ.base_kernel.raw_alpha",
        "base_kernels.PER.raw_outputscale",
        "base_kernels.PER.base_kernel.raw_lengthscale",
        "base_kernels.PER.base_kernel.raw_period_length",
        "base_kernels.LIN.raw_variance",
    }
    for name, parameter in bank.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert (parameter.grad != 0).all(), name  # every leaf entry reaches the output


def test_parameter_owners_agree_with_the_candidates():
    bank = _randomized(CandidateKernelBank(KernelSpace.paper_12(), ard_num_dims=2), seed=7)
    x = _inputs(5, 2)
    owners = bank.parameter_owners()
    parameters = dict(bank.named_parameters())
    assert owners.keys() == parameters.keys()
    before = bank(x).to_dense().detach()
    for name, parameter in parameters.items():
        assert owners[name].shape == parameter.shape and owners[name].dtype == torch.long
        for index in range(parameter.numel()):
            with torch.no_grad():
                parameter.view(-1)[index] += 0.3
            after = bank(x).to_dense().detach()
            changed = ((after - before).abs() > 1e-12).flatten(1).any(-1).nonzero().flatten().tolist()
            owner = int(owners[name].view(-1)[index])
            assert changed == [owner], (name, index)
            torch.testing.assert_close(after[owner], bank.candidate(owner)(x).to_dense(), rtol=1e-12, atol=1e-14)
            with torch.no_grad():
                parameter.view(-1)[index] -= 0.3
    # the candidate's own parameters, counted: the 12 kernels have 31 leaves
    counts = torch.zeros(12, dtype=torch.long)
    for owner in owners.values():
        counts += torch.bincount(owner.flatten(), minlength=12)
    expected = [sum(p.numel() for p in bank.candidate(c).parameters()) for c in range(12)]
    assert counts.tolist() == expected


def test_per_candidate_inputs():
    space = ["SE", "PER×LIN", "(PER + RQ)×LIN"]
    bank = _randomized(CandidateKernelBank(space), seed=8)
    x1, x2 = _inputs(3, 5, 1), _inputs(3, 4, 1, seed=2)
    covariance = bank(x1, x2).to_dense()
    assert covariance.shape == (3, 5, 4)
    for c in range(3):
        kernel = bank.candidate(c)
        torch.testing.assert_close(covariance[c], kernel(x1[c], x2[c]).to_dense(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(bank(x1, diag=True)[c], kernel(x1[c], diag=True), rtol=1e-12, atol=1e-14)
    shared = _inputs(5, 1)
    torch.testing.assert_close(bank(shared[None]).to_dense(), bank(shared).to_dense(), rtol=0, atol=0)
    torch.testing.assert_close(bank(x1, shared).to_dense()[1], bank.candidate(1)(x1[1], shared).to_dense())
    batched = torch.stack([x1, x1.flip(0)])  # (2, C, n, d)
    result = bank(batched).to_dense()
    assert result.shape == (2, 3, 5, 5)
    torch.testing.assert_close(result[1, 0], bank.candidate(0)(x1[2]).to_dense(), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="must be 1 or C"):
        bank(_inputs(4, 5, 1))


@pytest.mark.filterwarnings("ignore:A not p.d.")  # GPyTorch's AdditiveKernel adds LIN through a jittered Cholesky
def test_in_a_batched_approximate_gp_equals_separate_models():
    """One ApproximateGP with batch [C] gives each candidate the predictions of its own single-kernel SVGP."""

    class GP(gpytorch.models.ApproximateGP):
        def __init__(self, covar_module, inducing_points, batch_shape):
            distribution = gpytorch.variational.CholeskyVariationalDistribution(len(inducing_points), batch_shape)
            strategy = gpytorch.variational.VariationalStrategy(
                self, inducing_points, distribution, learn_inducing_locations=False
            )
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch_shape)
            self.covar_module = covar_module

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    space = KernelSpace.paper_12()
    C, M = len(space), 5
    bank = _randomized(CandidateKernelBank(space), seed=9)
    with torch.no_grad():
        bank.base_kernels["LIN"].variance = torch.full((1,), 0.5, dtype=DTYPE)
        bank.base_kernels["PER"].base_kernel.period_length = torch.full((1,), 3.0, dtype=DTYPE)
    inducing_points = torch.linspace(-2, 2, M, dtype=DTYPE).unsqueeze(-1)
    model = GP(bank, inducing_points, torch.Size([C])).to(DTYPE)
    generator = torch.Generator().manual_seed(10)
    with torch.no_grad():
        distribution = model.variational_strategy._variational_distribution
        distribution.variational_mean.copy_(torch.randn(C, M, generator=generator, dtype=DTYPE))
        lower = 0.1 * torch.randn(C, M, M, generator=generator, dtype=DTYPE).tril(-1)
        distribution.chol_variational_covar.copy_(lower + torch.diag_embed(0.5 + torch.rand(C, M, dtype=DTYPE)))
        model.mean_module.constant.copy_(torch.randn(C, generator=generator, dtype=DTYPE))
        model.variational_strategy.variational_params_initialized.fill_(1)
    x = _inputs(9, 1, seed=11)
    model.eval()
    with torch.no_grad():
        output = model(x)
        kl = model.variational_strategy.kl_divergence()
    assert output.batch_shape == (C,) and output.event_shape == (9,) and kl.shape == (C,)
    for c in range(C):
        single = GP(bank.candidate(c), inducing_points, torch.Size()).to(DTYPE).eval()
        with torch.no_grad():
            single_distribution = single.variational_strategy._variational_distribution
            single_distribution.variational_mean.copy_(distribution.variational_mean[c])
            single_distribution.chol_variational_covar.copy_(distribution.chol_variational_covar[c])
            single.mean_module.constant.copy_(model.mean_module.constant[c])
            single.variational_strategy.variational_params_initialized.fill_(1)
            expected = single(x)
            expected_kl = single.variational_strategy.kl_divergence()
        torch.testing.assert_close(output.mean[c], expected.mean, rtol=1e-10, atol=1e-12, msg=space.names[c])
        torch.testing.assert_close(output.variance[c], expected.variance, rtol=1e-10, atol=1e-12, msg=space.names[c])
        torch.testing.assert_close(
            output.covariance_matrix[c], expected.covariance_matrix, rtol=1e-10, atol=1e-12, msg=space.names[c]
        )
        torch.testing.assert_close(kl[c], expected_kl, rtol=1e-10, atol=1e-12, msg=space.names[c])


def test_set_base_hyperparameters():
    bank = CandidateKernelBank(["PER", "SE + PER×LIN", "LIN"], ard_num_dims=2).to(DTYPE)
    bank.set_base_hyperparameters("per", period_length=6.28, lengthscale=4.0, outputscale=0.01)
    kernel = bank.base_kernels["PER"]
    expected = torch.full((2, 1, 2), 6.28, dtype=DTYPE)
    torch.testing.assert_close(kernel.base_kernel.period_length, expected, rtol=1e-15, atol=0)
    # float64 throughout (GPyTorch's own setters round Python floats through float32)
    torch.testing.assert_close(kernel.outputscale, torch.full((2,), 0.01, dtype=DTYPE), rtol=1e-15, atol=0)
    torch.testing.assert_close(bank.candidate(1).kernels[1].kernels[0].base_kernel.period_length, expected[0])
    per_leaf = torch.tensor([1.0, 2.0], dtype=DTYPE).view(2, 1, 1)
    bank.set_base_hyperparameters("LIN", variance=per_leaf)
    assert bank.base_kernels["LIN"].variance.tolist() == [[[1.0, 1.0]], [[2.0, 2.0]]]
    before = {name: parameter.clone() for name, parameter in bank.named_parameters()}
    with pytest.raises(ValueError, match="no hyperparameter 'alpha'.*'outputscale', 'lengthscale', 'period_length'"):
        bank.set_base_hyperparameters("PER", period_length=1.0, alpha=1.0)
    with pytest.raises(ValueError, match="positive"):
        bank.set_base_hyperparameters("PER", period_length=1.0, lengthscale=-1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        bank.set_base_hyperparameters("PER", period_length=torch.ones(3))
    with pytest.raises(ValueError, match="No candidate has a RQ leaf"):
        bank.set_base_hyperparameters("RQ", alpha=1.0)
    with pytest.raises(ValueError, match="Unknown base kernel"):
        bank.set_base_hyperparameters("MATERN", lengthscale=1.0)
    for name, parameter in bank.named_parameters():  # a failed call changes nothing
        assert torch.equal(parameter, before[name]), name


@pytest.mark.filterwarnings("ignore:The last_dim_is_batch argument is deprecated")
def test_module_contract():
    bank = _randomized(CandidateKernelBank(KernelSpace.paper_12()), seed=12)
    x = _inputs(4, 1)
    assert bank.batch_shape == (12,) and bank.num_candidates == 12 and bank.names == KernelSpace.paper_12().names
    assert bank[...] is bank and bank[:] is bank
    with pytest.raises(NotImplementedError, match="candidate"):
        bank[0]
    copy = CandidateKernelBank(KernelSpace.paper_12()).to(DTYPE)
    copy.load_state_dict(bank.state_dict())
    torch.testing.assert_close(copy(x).to_dense(), bank(x).to_dense(), rtol=0, atol=0)
    assert not any(key.startswith(("_term", "_leaf")) for key in bank.state_dict())  # derived, not state
    restored = pickle.loads(pickle.dumps(bank))
    torch.testing.assert_close(restored(x).to_dense(), bank(x).to_dense(), rtol=0, atol=0)
    assert bank.float()(x.float()).to_dense().dtype == torch.float32
    with pytest.raises(ValueError, match="at least one"):
        CandidateKernelBank([])
    with pytest.raises(TypeError, match="iterable"):
        CandidateKernelBank("SE + PER")
    with pytest.raises(IndexError):
        bank.candidate(12)
    with pytest.raises(NotImplementedError):
        bank(x, last_dim_is_batch=True).to_dense()
    assert isinstance(KernelExpression("SE").build(), gpytorch.kernels.Kernel)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    bank = _randomized(CandidateKernelBank(KernelSpace.paper_12(), ard_num_dims=2), seed=14)
    x1, x2 = _inputs(6, 2), _inputs(4, 2, seed=2)
    gpu = pickle.loads(pickle.dumps(bank)).cuda()
    torch.testing.assert_close(gpu(x1.cuda(), x2.cuda()).to_dense().cpu(), bank(x1, x2).to_dense(), rtol=1e-12, atol=0)
    torch.testing.assert_close(gpu(x1.cuda(), diag=True).cpu(), bank(x1, diag=True), rtol=1e-12, atol=0)
