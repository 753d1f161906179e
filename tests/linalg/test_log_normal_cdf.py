"""The traceable log Phi against GPyTorch's log_normal_cdf: the same values and gradients, bit for bit, in every one of
its three approximations and at their boundaries, and one graph under torch.compile."""

import gpytorch
import pytest
import torch

from gpytorch_decoupled.linalg import log_normal_cdf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_equal_gpytorch(dtype):
    boundaries = torch.tensor([-1.0, -0.2, 0.2, -0.19999, 0.19999, -1.00001, -0.99999], dtype=dtype)
    z = torch.cat([torch.linspace(-60, 9, 3001, dtype=dtype), boundaries]).requires_grad_()
    value, expected = log_normal_cdf(z), gpytorch.functions.log_normal_cdf(z)
    assert torch.equal(value, expected)
    weights = torch.randn_like(z)
    (gradient,) = torch.autograd.grad((value * weights).sum(), z)
    (expected_gradient,) = torch.autograd.grad((expected * weights).sum(), z)
    assert torch.equal(gradient, expected_gradient)
    assert torch.isfinite(gradient).all() and torch.isfinite(value).all()


def test_one_graph_without_a_break():
    z = torch.linspace(-8, 4, 50, dtype=torch.float64, requires_grad=True)

    def value_and_gradient(z):
        value = log_normal_cdf(z)
        return value.detach(), torch.autograd.grad(value.sum(), z)[0]

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        explanation = torch._dynamo.explain(value_and_gradient)(z)
        compiled = torch.compile(value_and_gradient, backend="aot_eager", fullgraph=True)
        value, gradient = compiled(z)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    expected = gpytorch.functions.log_normal_cdf(z)
    torch.testing.assert_close(value, expected, rtol=1e-15, atol=0)
    torch.testing.assert_close(gradient, torch.autograd.grad(expected.sum(), z)[0], rtol=1e-15, atol=0)
