"""The input contract the three mean-basis strategies (Decoupled, Hybrid, orthogonally decoupled) share, parametrized
over the strategies: bad mean-basis points are refused at construction, and bad inputs raise a clear error before
anything changes (parameters, buffers, eval and training caches, predictions)."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from tests.float64_problems import (
    F64,
    gaussian_likelihood,
    generator,
    randn,
    random_factor,
    random_spd,
    regression_problem,
)
from tests.variational.mean_basis_cases import (
    KINDS,
    MeanBasisGP,
    assert_same_caches,
    assert_same_process,
    cache_snapshot,
    eval_process,
    mean_basis_strategy,
    set_decoupled_state,
    set_residual_state,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "mean_inducing_points, message",
    [
        (torch.zeros(5, 3, dtype=F64), "mean_inducing_points must have shape"),
        (torch.zeros(2, 5, 2, dtype=F64), "mean_inducing_points must have shape"),
        (torch.full((5, 2), float("nan"), dtype=F64), "NaN"),
    ],
)
def test_bad_mean_inducing_points_are_refused(kind: str, mean_inducing_points: torch.Tensor, message: str) -> None:
    beta = torch.zeros(4, 2, dtype=F64)
    with pytest.raises(ValueError, match=message):
        mean_basis_strategy(kind, gpytorch.models.ApproximateGP(None), beta, mean_inducing_points)


BAD_INPUT_CASES = [
    ("decoupled", None, {"jacobi_preconditioning": True}),
    ("hybrid", gpytorch.variational.CholeskyVariationalDistribution, {}),
    ("hybrid", gpytorch.variational.NaturalVariationalDistribution, {}),
    ("orthogonal", gpytorch.variational.CholeskyVariationalDistribution, {}),
]


@pytest.mark.parametrize("kind, distribution_cls, strategy_kwargs", BAD_INPUT_CASES)
def test_bad_inputs_raise_and_change_nothing(kind: str, distribution_cls, strategy_kwargs: dict) -> None:
    beta, gamma, X, y = regression_problem(12)
    model = MeanBasisGP(
        kind,
        beta,
        gamma,
        constant_mean=0.25,
        distribution_cls=distribution_cls or gpytorch.variational.CholeskyVariationalDistribution,
        num_kl_columns=6,
        **strategy_kwargs,
    )
    gen = generator(100)
    if kind == "decoupled":
        set_decoupled_state(model, randn(10, gen=gen), random_factor(6, gen, scale=0.7))
    else:
        set_residual_state(model, randn(10, gen=gen), randn(6, gen=gen), random_spd(6, gen))
    likelihood = gaussian_likelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.size(0))
    reference = eval_process(model, X[:5])  # leaves the eval caches filled (and marks q as initialized)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with_nan = X.clone()
    with_nan[3, 1] = float("nan")
    with_inf = X.clone()
    with_inf[0, 0] = -float("inf")
    bad_inputs = [
        (X[:, :1], "x has 1 columns"),
        (X[:0], "x is empty"),
        (with_nan, "NaN"),
        (with_inf, "inf"),
        (X.float(), "float32"),
    ]
    for training in (False, True):
        model.train(training)
        if training:  # a training step leaves its own caches; a refused call must not clear them
            mll(model(X), y)
        snapshot = cache_snapshot(model)
        assert snapshot["variational_strategy"]
        for x, message in bad_inputs:
            with pytest.raises(ValueError, match=message):
                model(x)
            with pytest.raises(ValueError, match=message):
                model(x, prior=True)
            if training:
                with pytest.raises(ValueError, match=message):
                    mll(model(x), y)
        assert_same_caches(model, snapshot)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert_same_process(eval_process(model, X[:5]), reference, tol=0.0)


# Keys of the strategies' state before the mean basis became a component (checkpoints of release 0.1.0).
OLD_STRATEGY_KEYS = {
    "decoupled": {
        "_variational_distribution.mean_coefficients",
        "_variational_distribution.precision_factor",
        "inducing_points",
        "mean_inducing_points",
        "variational_params_initialized",
    },
    "hybrid": {
        "_variational_distribution.chol_variational_covar",
        "_variational_distribution.variational_mean",
        "inducing_points",
        "mean_coefficients",
        "mean_inducing_points",
        "updated_strategy",
        "variational_params_initialized",
    },
}
OLD_STRATEGY_KEYS["orthogonal"] = OLD_STRATEGY_KEYS["hybrid"]


def _old_format(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as release 0.1.0 saved it: the mean basis's tensors directly on the strategy, and GPyTorch's
    whitening flag on the hybrid and orthogonal strategies, and no state of the mean basis's random generator (which
    then loads as it is)."""
    renamed = {
        name.replace("mean_basis.inducing_points", "mean_inducing_points").replace(
            "mean_basis.coefficients", "mean_coefficients"
        ): value
        for name, value in state.items()
        if not name.endswith("mean_basis._extra_state")
    }
    if "variational_strategy.mean_coefficients" in renamed:
        renamed["variational_strategy.updated_strategy"] = torch.tensor(True)
    return renamed


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_dict_of_the_previous_release_loads(kind: str) -> None:
    beta, gamma, X, _ = regression_problem(13)
    model = MeanBasisGP(kind, beta, gamma, constant_mean=0.25)
    gen = generator(101)
    if kind == "decoupled":
        set_decoupled_state(model, randn(10, gen=gen), random_factor(6, gen, scale=0.7))
    else:
        set_residual_state(model, randn(10, gen=gen), randn(6, gen=gen), random_spd(6, gen))
    expected = eval_process(model, X[:7])
    old = _old_format(model.state_dict())
    strategy_keys = {name.removeprefix("variational_strategy.") for name in old if "variational_strategy." in name}
    assert strategy_keys == OLD_STRATEGY_KEYS[kind]

    fresh = MeanBasisGP(kind, beta + 0.5, gamma - 0.5, constant_mean=0.0)
    fresh.load_state_dict(old)  # strict: every old key is placed, none is missing
    assert_same_process(eval_process(fresh, X[:7]), expected, tol=0.0)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
