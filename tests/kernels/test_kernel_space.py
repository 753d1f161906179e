from __future__ import annotations

import itertools

import pytest

from gpytorch_decoupled.kernels import KernelExpression, KernelSpace

E = KernelExpression.parse
K12 = (
    "LIN+RQ",
    "LIN×RQ+LIN",
    "LIN×RQ+PER",
    "PER+RQ+SE",
    "PER+LIN+RQ",
    "PER+PER+SE",
    "PER×SE+SE",
    "PER×RQ+SE",
    "PER×LIN+SE",
    "PER×LIN×SE",
    "PER×LIN×RQ",
    "(PER+RQ)×LIN",
)


def _canonical_set(space):
    return {expression.canonical() for expression in space}


def test_v9_the_reference_space_has_144_strings():
    strings = KernelSpace.paper_strings()
    assert [sum(len(s) == n for s in strings) for n in (1, 3, 5)] == [4, 20, 120]
    assert len(set(strings)) == 144
    # the C.6 rule, applied by brute force to every string over s < r < p < l
    order = {letter: i for i, letter in enumerate("srpl")}
    expected = set("srpl")
    for x1, o1, x2 in itertools.product("srpl", "+*", "srpl"):
        if order[x2] <= order[x1]:
            expected.add(x1 + o1 + x2)
            for o2, x3 in itertools.product("+*", "srpl"):
                if o2 != o1 or order[x3] <= order[x2]:
                    expected.add(x1 + o1 + x2 + o2 + x3)
    assert set(strings) == expected


def test_v9_precedence_and_the_12_kernels():
    paper = KernelSpace.paper()
    assert len(paper) == 144 and paper.names[:4] == ("SE", "RQ", "PER", "LIN")
    strings = KernelSpace.paper_strings()
    assert paper[strings.index("l+p*s")] == E("LIN + PER×SE")  # × before +
    assert paper[strings.index("p*s+p")] == E("PER×SE + PER")  # the IEQ top kernel
    by_bracket = KernelSpace.paper(left_to_right=True)
    assert by_bracket[strings.index("l+p*s")] == E("(LIN + PER)×SE")
    twelve = KernelSpace.paper_12()
    assert twelve.names == tuple(E(text).name for text in K12)
    # Read left to right (ker_bracket), the 144 contain all of K12; with precedence, (PER+RQ)×LIN (a product of a
    # sum) cannot be written without parentheses, and only the other 11 are in it.
    assert _canonical_set(twelve) <= _canonical_set(by_bracket)
    missing = _canonical_set(twelve) - _canonical_set(paper)
    assert missing == {E("(PER+RQ)×LIN").canonical()}


def test_reference_space_duplicates_and_the_enumerator():
    paper, by_bracket = KernelSpace.paper(), KernelSpace.paper(left_to_right=True)
    strings = KernelSpace.paper_strings()
    assert paper[strings.index("s+s*s")].canonical() == paper[strings.index("s*s+s")].canonical()  # both kept
    # With precedence the 144 strings are 104 distinct kernels, exactly the sums of products with at most two
    # operators; read left to right they are 144 distinct kernels, exactly every grouping with at most two.
    assert _canonical_set(paper) == _canonical_set(KernelSpace.enumerate(max_operators=2))
    assert len(_canonical_set(paper)) == 104
    assert _canonical_set(by_bracket) == _canonical_set(KernelSpace.enumerate(max_operators=2, parentheses=True))
    assert len(_canonical_set(by_bracket)) == 144
    assert len(KernelSpace(strings, left_to_right=True)) == 144


@pytest.mark.parametrize(
    "kwargs, count",
    [
        ({"max_operators": 0}, 4),
        ({"max_operators": 1}, 4 + 10 + 10),
        # three leaves: sums 20, products 20, product of two + one 10 * 4
        ({"max_operators": 2}, 24 + 20 + 20 + 40),
        # four leaves: sums 35, products 35, 2+1+1: 10 * 10, 3+1: 20 * 4, 2+2: multisets of two of the 10 pairs, 55
        ({"max_operators": 3}, 104 + 35 + 35 + 100 + 80 + 55),
        ({"max_operators": 2, "parentheses": True}, 104 + 40),  # plus (a + b)×c: 10 * 4
        ({"max_operators": 1, "deduplicate": False}, 4 + 16 * 2),
        ({"max_operators": 2, "deduplicate": False}, 4 + 16 * 2 + 64 * 4),
        ({"max_operators": 1, "base": ("SE", "PER")}, 2 + 3 + 3),
        ({"max_operators": 2, "base": "lin"}, 1 + 2 + 3),
    ],
)
def test_enumerate_counts(kwargs, count):
    space = KernelSpace.enumerate(**kwargs)
    assert len(space) == count
    if kwargs.get("deduplicate", True):
        assert len(_canonical_set(space)) == count


def test_enumerate_order_and_content():
    space = KernelSpace.enumerate(max_operators=1)
    assert space.names[:6] == ("SE", "RQ", "PER", "LIN", "SE + SE", "SE + RQ")
    assert "RQ + SE" not in space.names and E("RQ + SE") in space
    assert max(expression.num_operators for expression in KernelSpace.enumerate(max_operators=3)) == 3
    assert E("(PER+RQ)×LIN") in KernelSpace.enumerate(max_operators=2, parentheses=True)
    assert E("(PER+RQ)×LIN") not in KernelSpace.enumerate(max_operators=2)


def test_construction_deduplication_and_sequence_protocol():
    space = KernelSpace(["SE+PER", "PER+SE", E("LIN"), "per + se"])
    assert space.names == ("SE + PER", "LIN")
    assert len(KernelSpace(["SE+PER", "PER+SE"], deduplicate=False)) == 2
    assert KernelSpace(["s+p*l"], left_to_right=True).names == ("(SE + PER)×LIN",)
    assert space[1] == E("LIN") and space[-1] == E("LIN")
    assert isinstance(space[:1], KernelSpace) and space[:1].names == ("SE + PER",)
    assert list(space) == [E("SE+PER"), E("LIN")]
    assert space.index("LIN") == 1 and space.index(E("PER+SE")) == 0
    duplicates = KernelSpace(["PER+SE", "SE+PER"], deduplicate=False)
    assert duplicates.index("SE+PER") == 1  # a structural match first, then a canonical one
    assert "RQ" not in space and 3 not in space
    with pytest.raises(ValueError, match="not in"):
        space.index("RQ")
    assert repr(space) == "KernelSpace(2 kernels: SE + PER, LIN)"
    assert repr(KernelSpace.paper()).startswith("KernelSpace(144 kernels: SE, RQ, PER, LIN, SE + SE, SE×SE, ...")


def test_errors():
    with pytest.raises(TypeError, match="iterable"):
        KernelSpace("SE + PER")
    with pytest.raises(ValueError, match="at least one"):
        KernelSpace([])
    with pytest.raises(TypeError):
        KernelSpace([3])
    with pytest.raises(ValueError, match="Unknown base kernel"):
        KernelSpace(["SE", "FOO"])
    with pytest.raises(ValueError, match="non-negative"):
        KernelSpace.enumerate(max_operators=-1)
    with pytest.raises(ValueError, match="distinct"):
        KernelSpace.enumerate(base=("SE", "se"))
    with pytest.raises(ValueError, match="Unknown base kernel"):
        KernelSpace.enumerate(base=("SE", "MAT"))
