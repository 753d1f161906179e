"""UnboundFunction: an autograd.Function in the setup_context style whose apply skips the per-call argument binding
where it changes nothing, and is the standard apply everywhere else (functorch transforms, defaults, keywords)."""

from __future__ import annotations

import unittest

import torch

from gpytorch_decoupled.linalg._unbound_function import UnboundFunction


class _Scaled(UnboundFunction):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return 2.0 * x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.tangent_inputs = inputs

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return 2.0 * grad * y, 2.0 * grad * x

    @staticmethod
    def jvp(ctx, tangent_x, tangent_y):
        x, y = ctx.tangent_inputs
        return 2.0 * (tangent_x * y + x * tangent_y)


class _WithDefault(UnboundFunction):
    @staticmethod
    def forward(x, scale=3.0):
        return scale * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return ctx.scale * grad, None


class TestUnboundFunction(unittest.TestCase):
    def test_binding_is_skipped_only_without_defaults(self):
        self.assertTrue(_Scaled._binding_is_identity)
        self.assertFalse(_WithDefault._binding_is_identity)

    def test_values_and_gradients(self):
        x, y = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        out = _Scaled.apply(x, y)
        torch.testing.assert_close(out, 2.0 * x * y)
        gx, gy = torch.autograd.grad(out.sum(), (x, y))
        torch.testing.assert_close(gx, 2.0 * y.detach())
        torch.testing.assert_close(gy, 2.0 * x.detach())
        # A default is filled in (binding) when the argument is left out, and keywords are taken as the standard apply
        # takes them (torch 2.11's rejects them with a TypeError).
        torch.testing.assert_close(_WithDefault.apply(x), 3.0 * x)
        try:
            expected = super(UnboundFunction, _WithDefault).apply(x, scale=0.5)
        except TypeError:
            with self.assertRaises(TypeError):
                _WithDefault.apply(x, scale=0.5)
        else:
            torch.testing.assert_close(expected, 0.5 * x)
            torch.testing.assert_close(_WithDefault.apply(x, scale=0.5), expected)

    def test_functorch_transforms_take_the_standard_apply(self):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        _, tangent = torch.func.jvp(_Scaled.apply, (x, y), (torch.ones_like(x), torch.zeros_like(y)))
        torch.testing.assert_close(tangent, 2.0 * y)
        torch.testing.assert_close(torch.vmap(_Scaled.apply)(x, y), 2.0 * x * y)
        torch.testing.assert_close(torch.func.grad(lambda a: _Scaled.apply(a, y[0]).sum())(x[0]), 2.0 * y[0])

    def test_forward_mode_ad(self):
        import torch.autograd.forward_ad as fwAD

        x, y, t = torch.randn(4), torch.randn(4), torch.randn(4)
        with fwAD.dual_level():
            out = _Scaled.apply(fwAD.make_dual(x, t), y)
            torch.testing.assert_close(fwAD.unpack_dual(out).tangent, 2.0 * t * y)


if __name__ == "__main__":
    unittest.main()
