"""Spec A.5 identities T6 and T7 for the t-SVGP strategy (DualVariationalStrategy): q(u), the site summaries, log Z,
the KL and the predictive, against dense float64 oracles (``tests/oracles/dual.py``). The set-up is that of
``tests/dual_problems.py`` (spec A.5: n = 60, M = 10, jitter 1e-10 on K_uu); every Cholesky that had to add jitter
warns, and this module turns those warnings into errors.
"""

from __future__ import annotations

import pytest
import torch

from gpytorch_decoupled.mlls import DualVariationalELBO
from tests.dual_problems import (
    CONSTANT_MEAN,
    DualGP,
    M,
    N,
    assert_relative,
    oracle_blocks,
    problem,
    q_of,
    random_sites,
    set_sites,
)
from tests.float64_problems import (
    F64,
    gaussian_likelihood,
)
from tests.oracles import (
    gaussian_kl,
)
from tests.oracles.dual import (
    datum_sites_to_summaries,
    dual_kl,
    dual_log_normalizer,
    dual_predictive,
    dual_qu_from_sites,
    dual_qu_from_summaries,
    sites_to_summaries,
)

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("error::gpytorch.utils.warnings.NumericalWarning"),
]


@pytest.mark.parametrize("per_datum", [False, True])
@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([2])])
def test_variational_distribution_matches_the_oracle(batch_shape: torch.Size, per_datum: bool) -> None:
    Z, X, _ = problem()
    model = DualGP(Z, batch_shape=batch_shape, datum_inputs=X if per_datum else None)
    site_mean, site_precision = random_sites(model, 1)
    if batch_shape:  # different sites per latent
        site_precision = site_precision * torch.tensor([1.0, 3.0], dtype=F64).view(2, *[1] * (2 - per_datum))
        set_sites(model, site_mean, site_precision)
    K_uu, K_uf, _ = (block.detach() for block in oracle_blocks(model, X))
    m, S = q_of(model)
    assert m.shape == torch.Size([*batch_shape, M])
    for b in range(batch_shape.numel()):
        index = (b,) if batch_shape else ()
        if per_datum:  # variant C: summaries from the per-datum sites at the current theta
            summaries = datum_sites_to_summaries(K_uf, site_mean[index], site_precision[index])
            m_ref, S_ref = dual_qu_from_summaries(K_uu, *summaries)
        else:
            summaries = sites_to_summaries(K_uu, site_mean[index], site_precision[index])
            m_ref, S_ref = dual_qu_from_sites(K_uu, site_mean[index], site_precision[index])
        for actual, expected in zip(model.variational_strategy.site_summaries(), summaries):
            assert_relative(actual[index], expected, 1e-10, "summaries (eq. 44)")
        assert_relative(m[index], m_ref, 1e-10, "m")
        assert_relative(S[index], S_ref, 1e-10, "S")
    prior = model.variational_strategy.prior_distribution
    assert_relative(prior.covariance_matrix, K_uu, 1e-14, "prior covariance: K_uu + jitter")
    assert torch.equal(prior.mean, torch.zeros(M, dtype=F64))


@pytest.mark.parametrize("batch_shape", [torch.Size([]), torch.Size([2])])
def test_t6_kl_is_eq51_and_the_generic_gaussian_kl(batch_shape: torch.Size) -> None:
    Z, X, _ = problem()
    model = DualGP(Z, batch_shape=batch_shape)
    ell1, L2 = random_sites(model, 2)
    K_uu = oracle_blocks(model, X)[0].detach()
    with torch.no_grad():
        kl = model.variational_strategy.kl_divergence()
    assert kl.shape == batch_shape
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    generic = gaussian_kl(m, S, torch.zeros_like(m), K_uu)
    assert_relative(kl, generic, 1e-10, "KL vs generic")
    assert_relative(kl, dual_kl(K_uu, *sites_to_summaries(K_uu, ell1, L2)), 1e-10, "KL vs eq. 51")
    assert (kl > 0.1).all()


def test_site_log_normalizer_matches_the_oracle() -> None:
    Z, X, y = problem()
    model = DualGP(Z, batch_shape=torch.Size([2]))
    ell1, L2 = random_sites(model, 3)
    K_uu = oracle_blocks(model, X)[0].detach()
    with torch.no_grad():
        log_z = model.variational_strategy.site_log_normalizer()
        objective = DualVariationalELBO(gaussian_likelihood(), model, num_data=N)
        assert_relative(log_z, dual_log_normalizer(K_uu, *sites_to_summaries(K_uu, ell1, L2)), 1e-10, "log Z")
        assert_relative(objective.site_log_normalizer(), log_z.sum() / N, 1e-14, "mll log Z")
    set_sites(model, torch.zeros_like(ell1), torch.zeros_like(L2))  # the prior: Z = 1
    assert model.variational_strategy.site_log_normalizer().abs().max() < 1e-14


def test_t7_predictive_is_eq49_and_the_generic_predictive() -> None:
    Z, X, _ = problem()
    model = DualGP(Z, constant_mean=CONSTANT_MEAN)
    ell1, L2 = random_sites(model, 4)
    X_test = X[:25]
    K_uu, K_us, _ = (block.detach() for block in oracle_blocks(model, X_test))
    with torch.no_grad():
        K_ss = model.covar_module(X_test).to_dense()
    prior_mean = torch.full((25,), CONSTANT_MEAN, dtype=F64)
    lam1bar, Lam2bar = sites_to_summaries(K_uu, ell1, L2)
    mean49, cov49 = dual_predictive(K_uu, K_us, K_ss, lam1bar, Lam2bar, prior_mean_s=prior_mean)
    m, S = dual_qu_from_sites(K_uu, ell1, L2)
    V = torch.linalg.solve(K_uu, K_us)
    generic_mean, generic_cov = prior_mean + V.mT @ m, K_ss - V.mT @ (K_uu - S) @ V  # spec §0
    model.eval()
    with torch.no_grad():
        output = model(X_test)
    for reference in ((mean49, cov49), (generic_mean, generic_cov)):
        assert_relative(output.mean, reference[0], 1e-10, "mean")
        assert_relative(output.covariance_matrix, reference[1], 1e-10, "covariance")
    model.train()
    with torch.no_grad():
        output = model(X_test)
    assert_relative(output.mean, mean49, 1e-10, "train mean")
    assert_relative(output.variance, cov49.diagonal(), 1e-10, "train variance")
