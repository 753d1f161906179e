"""The kernel belief q(g) of VBKS: spec C.5 identities V1-V3 on the belief, its KL, and its gradients."""

import math

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from gpytorch_decoupled.models.kernel_belief import KernelBelief


def _belief(num_kernels, **kwargs):
    return KernelBelief(num_kernels, **kwargs).double()


def _randomize(belief, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        belief.mean.copy_(torch.randn(belief.mean.shape, generator=generator, dtype=torch.float64))
        belief.raw_scale_tril.copy_(
            0.3 * torch.randn(belief.raw_scale_tril.shape, generator=generator, dtype=torch.float64)
        )


def test_kl_matches_torch_distributions():
    belief = _belief(5, prior_variance=0.3, prior_mean=torch.linspace(-1, 1, 5))
    _randomize(belief)
    prior = MultivariateNormal(belief.prior_mean, 0.3 * torch.eye(5, dtype=torch.float64))
    expected = kl_divergence(MultivariateNormal(belief.mean, scale_tril=belief.scale_tril), prior)
    assert torch.allclose(belief.kl_divergence(), expected, rtol=1e-12, atol=1e-12)


def test_objective_gradients_match_finite_differences():
    belief = _belief(4, num_samples=200)
    _randomize(belief, seed=1)
    local_elbos = torch.tensor([-3.0, -1.0, -2.5, 0.5], dtype=torch.float64)
    belief.objective(local_elbos, elbo_scale=0.7).backward()
    for parameter in (belief.mean, belief.raw_scale_tril):
        analytic = parameter.grad.clone()
        numeric = torch.zeros_like(parameter)
        for index in range(parameter.numel()):
            flat = parameter.data.view(-1)
            original = flat[index].item()
            values = []
            for step in (1e-6, -1e-6):
                flat[index] = original + step
                values.append(belief.objective(local_elbos, elbo_scale=0.7).item())
            flat[index] = original
            numeric.view(-1)[index] = (values[0] - values[1]) / 2e-6
        assert torch.allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_v1_single_kernel_belief_is_the_prior():
    belief = _belief(1, prior_variance=0.5)
    belief.fit(torch.tensor([-1234.5], dtype=torch.float64))
    assert belief.mean.abs().item() < 1e-6
    assert belief.scale_tril.item() == pytest.approx(math.sqrt(0.5), rel=1e-6)
    assert belief.probabilities().item() == 1.0


def test_v2_equal_local_elbos_give_the_uniform_posterior():
    belief = _belief(6, prior_variance=0.5)
    belief.fit(torch.full((6,), -50.0, dtype=torch.float64))
    assert belief.mean.abs().max().item() < 1e-6
    assert torch.allclose(belief.scale_tril, math.sqrt(0.5) * torch.eye(6, dtype=torch.float64), atol=1e-6)
    # q(g) = p(g) exactly; q*(kappa) = 1/C up to the Monte Carlo error of 2000 draws (about 0.002)
    assert torch.allclose(belief.probabilities(), torch.full((6,), 1 / 6, dtype=torch.float64), atol=0.01)


def test_v3_monotone_in_the_elbo_difference_and_tends_to_one():
    probabilities = []
    for difference in (-4.0, -1.0, 0.0, 0.5, 2.0, 8.0, 50.0, 1000.0, 1e6):
        belief = _belief(2)
        belief.fit(torch.tensor([difference, 0.0], dtype=torch.float64))
        probabilities.append(belief.probabilities()[0].item())
    assert all(b > a for a, b in zip(probabilities, probabilities[1:])), probabilities
    assert probabilities[2] == pytest.approx(0.5, abs=0.01)
    assert probabilities[-1] > 0.9999


def test_v3_permuting_kernels_permutes_the_posterior():
    local_elbos = torch.tensor([-3.0, -1.0, -2.0, -1.5], dtype=torch.float64)
    permutation = torch.tensor([2, 0, 3, 1])
    belief = _belief(4)
    belief.fit(local_elbos)
    permuted = _belief(4)
    permuted.fit(local_elbos[permutation])
    assert torch.allclose(permuted.probabilities(), belief.probabilities()[permutation], atol=0.01)


def test_fit_maximizes_the_objective():
    local_elbos = torch.tensor([-3.0, -1.0, -2.0], dtype=torch.float64)
    belief = _belief(3)
    belief.fit(local_elbos)
    optimum = belief.objective(local_elbos).item()
    belief.objective(local_elbos).backward()
    assert belief.mean.grad.abs().max() < 1e-5
    with torch.no_grad():
        belief.mean.add_(0.05)
    assert belief.objective(local_elbos).item() < optimum


def test_tempering_flattens_the_posterior():
    local_elbos = torch.tensor([-1000.0, -2000.0], dtype=torch.float64)
    sharp, tempered = _belief(2), _belief(2)
    sharp.fit(local_elbos)
    tempered.fit(local_elbos, elbo_scale=0.002)
    assert sharp.probabilities()[0] > 0.99
    assert 0.5 < tempered.probabilities()[0] < 0.9


@pytest.mark.parametrize(
    "local_elbos, match",
    [(torch.zeros(2), "shape"), (torch.tensor([0.0, float("nan"), 1.0]), "NaN")],
)
def test_bad_local_elbos_raise_and_leave_the_belief_unchanged(local_elbos, match):
    belief = _belief(3)
    _randomize(belief)
    before = {k: v.clone() for k, v in belief.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        belief.fit(local_elbos.double())
    assert all(torch.equal(before[k], v) for k, v in belief.state_dict().items())


def test_invalid_construction():
    with pytest.raises(ValueError, match="even"):
        KernelBelief(3, num_samples=5)
    with pytest.raises(ValueError, match="positive"):
        KernelBelief(3, prior_variance=0.0)


def test_multiple_starts_find_the_better_mode_among_near_tied_leaders():
    # local ELBOs of 14 kernels on elevators (near-tied leaders at 0, 4 and 10): from the reference start alone,
    # L-BFGS settles on the mode of kernel 0; the leader starts find the higher objective, on the best kernel 10
    local_elbos = torch.tensor(
        [-8093.36, -8282.17, -13230.37, -8130.75, -8092.24, -18201.64, -8398.29, -16634.66, -16156.58, -8283.84,
         -8081.80, -10678.27, -8752.78, -11089.75],
        dtype=torch.float64,
    )  # fmt: skip
    objectives = {}
    for num_starts in (1, 4):
        belief = _belief(14)
        belief.fit(local_elbos, elbo_scale=0.03427, num_starts=num_starts)
        objectives[num_starts] = belief.objective(local_elbos, elbo_scale=0.03427).item()
    assert objectives[4] > objectives[1] + 0.1
    assert belief.probabilities().argmax().item() == 10
