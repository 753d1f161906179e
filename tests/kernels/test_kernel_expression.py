from __future__ import annotations

import copy
import math
import pickle
import random

import gpytorch
import pytest
import torch

from gpytorch_decoupled.kernels import KernelExpression, KernelSpace

E = KernelExpression.parse


def _evaluate(expression: KernelExpression, values: dict[int, float], offset: int = 0) -> tuple[float, int]:
    """The tree evaluated on numbers (one per leaf index), as an independent check of sum_of_products."""
    if expression.is_base:
        return values[offset], offset + 1
    results = []
    for operand in expression.operands:
        value, offset = _evaluate(operand, values, offset)
        results.append(value)
    return (sum(results) if expression.operator == "+" else math.prod(results)), offset


@pytest.mark.parametrize(
    "text",
    ["SE + PER*LIN", "se+per×lin", "s+p*l", "  S +P × L ", "SE+(PER*LIN)", "((SE)) + PER×(LIN)", "Se + pEr*LiN"],
)
def test_parse_spellings(text):
    expression = E(text)
    assert expression.name == "SE + PER×LIN"
    assert expression == KernelExpression.base("SE") + KernelExpression.base("PER") * KernelExpression.base("LIN")


def test_precedence_and_left_to_right():
    assert E("s+p*l").operator == "+"
    assert E("s+p*l").operands == (E("SE"), E("PER×LIN"))
    assert E("s*p+l").name == "SE×PER + LIN"
    assert E("s+p*l", left_to_right=True).name == "(SE + PER)×LIN"
    assert E("p*l+s", left_to_right=True) == E("p*l+s")
    assert E("s*p+l*r", left_to_right=True).name == "(SE×PER + LIN)×RQ"
    # parentheses still group when reading left to right
    assert E("s*(p+l)", left_to_right=True).name == "SE×(PER + LIN)"
    assert KernelExpression("s+p*l", left_to_right=True) == E("(s+p)*l")


def test_flattening_and_names():
    assert E("(SE+PER)+LIN") == E("SE+(PER+LIN)") == E("SE+PER+LIN")
    assert E("SE×(PER×LIN)").operands == (E("SE"), E("PER"), E("LIN"))
    assert E("(PER+RQ)×LIN").name == "(PER + RQ)×LIN"
    assert E("LIN×(PER+RQ×SE)").name == "LIN×(PER + RQ×SE)"
    assert str(E("(PER+RQ)*LIN")) == "(PER + RQ)×LIN"
    assert repr(E("s+p*l")) == "KernelExpression('SE + PER×LIN')"
    assert E("s+p*l").num_operators == 2 and E("LIN").num_operators == 0


def test_round_trip():
    expressions = list(KernelSpace.enumerate(max_operators=3, parentheses=True)) + list(KernelSpace.paper(True))
    for expression in expressions:
        assert E(expression.name) == expression
        assert eval(repr(expression)) == expression
        assert pickle.loads(pickle.dumps(expression)) == expression
    assert copy.deepcopy(expressions[-1]) == expressions[-1]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("SE +", "ends"),
        ("+ SE", "unexpected '+'"),
        ("SE PER", "unexpected 'PER'"),
        ("(SE + PER", "unbalanced"),
        ("SE + PER)", "unexpected ')'"),
        ("()", "unexpected ')'"),
        ("SE ++ PER", "unexpected '+'"),
        ("SE & PER", "unexpected character '&'"),
        ("SE + FOO", "Unknown base kernel 'FOO'"),
        ("PERxLIN", "Unknown base kernel 'PERxLIN'"),
        ("SE2", "unexpected character '2'"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        E(text)


def test_type_errors_and_immutability():
    with pytest.raises(TypeError):
        E(3)
    with pytest.raises(TypeError):
        KernelExpression.base(None)
    expression = E("SE")
    with pytest.raises(AttributeError):
        expression._base = "LIN"
    with pytest.raises(TypeError):
        expression + "LIN"
    assert E(expression) is expression


def test_structural_equality_and_canonical_form():
    assert E("SE+PER") != E("PER+SE")
    assert E("SE+PER").canonical() == E("PER+SE").canonical()
    assert E("LIN×PER + SE").canonical() == E("SE + PER×LIN").canonical()
    assert E("LIN×(RQ+PER)").canonical() == E("(PER+RQ)×LIN").canonical()
    assert E("(PER+RQ)×LIN").canonical() != E("PER×LIN + RQ×LIN").canonical()  # no distribution
    assert E("SE + SE×SE").canonical() == E("SE×SE + SE").canonical()
    assert E("SE+PER") != "SE + PER"
    assert len({E("SE+PER"), E("SE + PER"), E("PER+SE")}) == 2
    assert hash(E("s+p*l")) == hash(E("SE + PER×LIN"))
    for expression in KernelSpace.enumerate(max_operators=3, parentheses=True, deduplicate=False):
        canonical = expression.canonical()
        assert canonical.canonical() == canonical
        assert sorted(canonical.leaves) == sorted(expression.leaves)


def test_leaves_and_sum_of_products():
    assert E("(PER+RQ)×LIN").leaves == ("PER", "RQ", "LIN")
    assert E("(PER+RQ)×LIN").sum_of_products() == ((0, 2), (1, 2))
    assert E("(SE+RQ)×(PER+LIN)").sum_of_products() == ((0, 2), (0, 3), (1, 2), (1, 3))
    assert E("SE×(RQ+PER×(LIN+SE))").sum_of_products() == ((0, 1), (0, 2, 3), (0, 2, 4))
    assert E("LIN").sum_of_products() == ((0,),)
    rng = random.Random(0)
    for expression in KernelSpace.enumerate(max_operators=3, parentheses=True):
        values = {i: rng.uniform(0.5, 2.0) for i in range(len(expression.leaves))}
        expansion = sum(math.prod(values[i] for i in term) for term in expression.sum_of_products())
        assert expansion == pytest.approx(_evaluate(expression, values)[0], rel=1e-13)
        assert sorted({i for term in expression.sum_of_products() for i in term}) == list(range(len(values)))


def test_build_structure():
    kernels = gpytorch.kernels
    se = E("SE").build()
    assert isinstance(se, kernels.ScaleKernel) and isinstance(se.base_kernel, kernels.RBFKernel)
    assert isinstance(E("RQ").build().base_kernel, kernels.RQKernel)
    assert isinstance(E("PER").build().base_kernel, kernels.PeriodicKernel)
    assert type(E("LIN").build()) is kernels.LinearKernel
    kernel = E("(PER+RQ)×LIN").build(ard_num_dims=3, batch_shape=torch.Size([2]))
    assert isinstance(kernel, kernels.ProductKernel) and isinstance(kernel.kernels[0], kernels.AdditiveKernel)
    assert kernel.kernels[0].kernels[0].base_kernel.period_length.shape == (2, 1, 3)
    assert kernel.kernels[1].variance.shape == (2, 1, 3)
    assert kernel(torch.randn(4, 3)).shape == (2, 4, 4)
    assert len(list(E("SE+SE").build().parameters())) == 4  # every leaf has its own hyperparameters
    with pytest.raises(ValueError, match="3 leaves"):
        E("(PER+RQ)×LIN").combine([kernels.RBFKernel()])
    with pytest.raises(TypeError):
        E("SE").combine(["SE"])


def test_built_kernels_match_the_formulas():
    """SE, RQ, PER (GPyTorch's lengthscale is the Duvenaud l^2) and LIN, in float64 with ARD inputs."""
    generator = torch.Generator().manual_seed(1)
    x1 = torch.randn(5, 2, dtype=torch.float64, generator=generator)
    x2 = torch.randn(4, 2, dtype=torch.float64, generator=generator)
    r = x1[:, None, :] - x2[None, :, :]
    lengthscale = torch.tensor([0.7, 1.9], dtype=torch.float64)
    period = torch.tensor([1.3, 2.2], dtype=torch.float64)
    expected = {
        "SE": 1.5 * torch.exp(-0.5 * (r / lengthscale).square().sum(-1)),
        "RQ": 1.5 * (1 + (r / lengthscale).square().sum(-1) / (2 * 0.8)) ** -0.8,
        "PER": 1.5 * torch.exp(-2 * (torch.sin(math.pi * r.abs() / period).square() / lengthscale.square()).sum(-1)),
        "LIN": (x1[:, None, :] * x2[None, :, :] * torch.tensor([0.3, 2.0], dtype=torch.float64)).sum(-1),
    }
    for name, reference in expected.items():
        kernel = E(name).build(ard_num_dims=2).double()
        if name == "LIN":
            kernel.variance = torch.tensor([0.3, 2.0], dtype=torch.float64)
        else:
            kernel.outputscale = 1.5
            kernel.base_kernel.lengthscale = lengthscale.square() if name == "PER" else lengthscale
            if name == "RQ":
                kernel.base_kernel.alpha = torch.tensor(0.8, dtype=torch.float64)  # Python floats: float32 rounding
            if name == "PER":
                kernel.base_kernel.period_length = period
        torch.testing.assert_close(kernel(x1, x2).to_dense(), reference, rtol=1e-12, atol=1e-14, msg=name)
