"""R10 of issue 20: eval-mode predictions always reflect the current parameters, whatever changed them (in place,
through a setter, ``load_state_dict``, a conversion), for every strategy of the package. GPyTorch's own strategies
keep their eval-mode factors until ``train()``/``eval()`` (the defect this guards against)."""

from __future__ import annotations

import copy

import pytest
import torch

from gpytorch_decoupled.optim import DualEStep
from tests.robustness.entry_points import MODELS, data, dual_model, gaussian_likelihood, kalman_model


def _model(family: str):
    x, y, _ = data()
    if family == "Dual":
        model, likelihood = dual_model(labels=False)
        DualEStep(model, likelihood, num_data=x.size(0)).step(x, y)
    elif family == "Kalman":
        model, likelihood = kalman_model()
    else:
        model, likelihood = MODELS[family](), gaussian_likelihood()
        model(x)  # GPyTorch initializes q at the first call
        # away from q = p, where the predictive is the prior's whatever the length-scales
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter in [*model.variational_parameters(), model.variational_strategy.mean_coefficients]:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model.eval(), likelihood.eval()


def _lengthscale_in_place(model, likelihood):
    with torch.no_grad():
        model.covar_module.base_kernel.raw_lengthscale.add_(0.4)


def _lengthscale_setter(model, likelihood):
    model.covar_module.base_kernel.lengthscale = model.covar_module.base_kernel.lengthscale * 1.7


def _outputscale_initialize(model, likelihood):
    model.covar_module.initialize(outputscale=2.5)


def _lengthscale_through_data(model, likelihood):
    # .data has a version counter of its own: the caches compare small tensors by value too
    model.covar_module.base_kernel.raw_lengthscale.data.add_(0.5)


def _load_state_dict(model, likelihood):
    state = copy.deepcopy(model.state_dict())
    key = next(name for name in state if name.endswith("raw_lengthscale"))
    state[key] = state[key] - 0.3
    model.load_state_dict(state)


CHANGES = [
    _lengthscale_in_place,
    _lengthscale_setter,
    _outputscale_initialize,
    _lengthscale_through_data,
    _load_state_dict,
]
FAMILIES = [*MODELS, "Dual", "Kalman"]


def _prediction(model, likelihood, x):
    output = model(x)
    return output.mean.detach().clone(), output.variance.detach().clone()


@pytest.mark.parametrize("change", CHANGES, ids=lambda change: change.__name__.strip("_"))
@pytest.mark.parametrize("family", FAMILIES)
def test_eval_predictions_follow_the_parameters(family: str, change) -> None:
    model, likelihood = _model(family)
    x = data(seed=1)[0]
    before = _prediction(model, likelihood, x)  # fills the eval caches
    change(model, likelihood)
    after = _prediction(model, likelihood, x)
    fresh = copy.deepcopy(model).eval()  # a copy carries no caches
    expected = _prediction(fresh, likelihood, x)
    for value, reference, old in zip(after, expected, before, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(value, old, rtol=1e-6, atol=1e-9), "the change does not show in the prediction"


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_after_an_eval_pass(family: str) -> None:
    model, likelihood = _model(family)
    x = data(seed=1)[0]
    _prediction(model, likelihood, x)
    model.float()
    mean, variance = _prediction(model, likelihood, x.float())
    assert mean.dtype == variance.dtype == torch.float32
