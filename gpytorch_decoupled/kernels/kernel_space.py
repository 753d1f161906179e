from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from .kernel_expression import BASE_KERNELS, KernelExpression

_PAPER_12 = (
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


class KernelSpace(Sequence[KernelExpression]):
    r"""
    An ordered set of candidate kernels :math:`\mathcal K = \{\kappa_1, \dots, \kappa_C\}` for variational Bayesian
    kernel selection (`Teng et al. (2020)`_, Sec. 6 and App. E.1), each a :class:`KernelExpression`.

    By default candidates that are equal up to the order and grouping of operands (the same
    :meth:`KernelExpression.canonical` form) are kept once, in first-seen order. The reference kernel list
    (:meth:`paper`) is not de-duplicated, as in the reference code.

    :param expressions: Kernel expressions or their text (parsed by :meth:`KernelExpression.parse`).
    :param deduplicate: Keep only the first of candidates with the same canonical form.
    :param left_to_right: How to parse text (see :meth:`KernelExpression.parse`).

    Example:
        >>> from gpytorch_decoupled.kernels import KernelSpace
        >>> space = KernelSpace(["SE", "s+p*l", "LIN×PER + SE"])
        >>> space
        KernelSpace(2 kernels: SE, SE + PER×LIN)
        >>> space.index("PER×LIN + SE"), len(KernelSpace.enumerate(max_operators=1))
        (1, 24)
        >>> len(KernelSpace.paper()), len(KernelSpace.paper_12())
        (144, 12)

    .. _Teng et al. (2020):
        https://arxiv.org/abs/1912.02641
    """

    def __init__(
        self,
        expressions: Iterable[KernelExpression | str],
        deduplicate: bool = True,
        left_to_right: bool = False,
    ):
        if isinstance(expressions, (str, KernelExpression)):
            raise TypeError("KernelSpace needs an iterable of kernel expressions, e.g. ['SE', 'PER×LIN'].")
        seen: set[KernelExpression] = set()
        self._expressions: list[KernelExpression] = []
        for expression in expressions:
            expression = KernelExpression.parse(expression, left_to_right=left_to_right)
            if deduplicate:
                key = expression.canonical()
                if key in seen:
                    continue
                seen.add(key)
            self._expressions.append(expression)
        if not self._expressions:
            raise ValueError("A KernelSpace needs at least one kernel expression.")
        self._expressions = tuple(self._expressions)

    @property
    def names(self) -> tuple[str, ...]:
        """The readable names of the candidates, in order."""
        return tuple(expression.name for expression in self._expressions)

    def __len__(self) -> int:
        return len(self._expressions)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return KernelSpace(self._expressions[index], deduplicate=False)
        return self._expressions[index]

    def index(self, expression: KernelExpression | str, start: int = 0, stop: int | None = None) -> int:
        """
        The position of a candidate: the first structurally equal one if any, else the first with the same canonical
        form (so ``"PER×LIN"`` finds ``LIN×PER``).

        :raises ValueError: If no candidate matches.
        """
        target = KernelExpression.parse(expression)
        for key in (lambda e: e, KernelExpression.canonical):
            wanted = key(target)
            for position, candidate in enumerate(self._expressions[start:stop], start):
                if key(candidate) == wanted:
                    return position
        raise ValueError(f"{target.name} is not in this KernelSpace.")

    def __contains__(self, expression) -> bool:
        try:
            self.index(expression)
        except (ValueError, TypeError):
            return False
        return True

    def __repr__(self) -> str:
        shown = ", ".join(self.names[:6]) + (", ..." if len(self) > 6 else "")
        return f"KernelSpace({len(self)} kernel{'s' if len(self) > 1 else ''}: {shown})"

    # standard spaces --------------------------------------------------------------------------------------------------

    @classmethod
    def enumerate(
        cls,
        base: Sequence[str] = BASE_KERNELS,
        max_operators: int = 2,
        deduplicate: bool = True,
        parentheses: bool = False,
    ) -> KernelSpace:
        r"""
        All expressions over ``base`` with at most ``max_operators`` binary operators, by number of operators.

        Without ``parentheses`` these are the operator strings :math:`x_1 o_1 x_2 \cdots` read with :math:`\times`
        before :math:`+` (sums of products); with ``parentheses``, every grouping (also products of sums, such as
        :math:`(\mathrm{PER}+\mathrm{RQ})\times\mathrm{LIN}`). Over the four base kernels, with de-duplication,
        ``max_operators=1`` gives 4 + 10 + 10 = 24 kernels and ``max_operators=2`` gives 104 (144 with
        ``parentheses``). The number of strings grows as :math:`(2\lvert\text{base}\rvert)^{\text{operators}}`.

        :param base: Base kernel names (see :meth:`KernelExpression.base`).
        :param max_operators: Largest number of operators, at least 0.
        :param deduplicate: Keep one expression per canonical form (see the class description).
        :param parentheses: Also enumerate groupings that need parentheses.
        """
        if isinstance(base, str):
            base = (base,)
        leaves = tuple(KernelExpression.base(name) for name in base)
        if not leaves or len(set(leaves)) != len(leaves):
            raise ValueError(f"enumerate needs distinct base kernels, got {tuple(base)}.")
        if not isinstance(max_operators, int) or max_operators < 0:
            raise ValueError(f"max_operators must be a non-negative integer, got {max_operators!r}.")
        if parentheses:
            levels = [(), leaves]  # levels[n]: the expressions with n leaves
            for n in range(2, max_operators + 2):
                levels.append(_groupings(levels, n, deduplicate))
            expressions = [expression for level in levels for expression in level]
        else:
            expressions = [
                KernelExpression.parse(_interleave(chosen, operators))
                for n in range(1, max_operators + 2)
                for operators in itertools.product("+×", repeat=n - 1)
                for chosen in itertools.product([leaf.name for leaf in leaves], repeat=n)
            ]
        return cls(expressions, deduplicate=deduplicate)

    @staticmethod
    def paper_strings() -> tuple[str, ...]:
        r"""
        The reference kernel list :math:`\mathcal K_{144}` (``kernelstring3.csv``) as letter strings: letters
        s < r < p < l, strings :math:`x_1`, :math:`x_1 o_1 x_2` and :math:`x_1 o_1 x_2 o_2 x_3` with
        :math:`x_2 \le x_1`, and :math:`x_3 \le x_2` if :math:`o_2 = o_1` (else :math:`x_3` is free): 4 + 20 + 120.
        Ordered by length, then :math:`x_1, x_2, o_1, o_2, x_3` in letter order.
        """
        letters = "srpl"
        singles = list(letters)
        pairs = [f"{x1}{o1}{x2}" for i1, x1 in enumerate(letters) for x2 in letters[: i1 + 1] for o1 in "+*"]
        triples = [
            f"{x1}{o1}{x2}{o2}{x3}"
            for i1, x1 in enumerate(letters)
            for i2, x2 in enumerate(letters[: i1 + 1])
            for o1 in "+*"
            for o2 in "+*"
            for x3 in (letters[: i2 + 1] if o2 == o1 else letters)
        ]
        return tuple(singles + pairs + triples)

    @classmethod
    def paper(cls, left_to_right: bool = False) -> KernelSpace:
        """
        The reference 144-kernel space (:meth:`paper_strings`), not de-duplicated (e.g. ``s+s*s`` and ``s*s+s`` are
        both kept). The reference code reads it with precedence for Swissgrid and ``left_to_right`` (``ker_bracket``)
        for IEQ; only the latter contains :math:`(\\mathrm{PER}+\\mathrm{RQ})\\times\\mathrm{LIN}` (as ``p+r*l``).

        :param left_to_right: Read the strings strictly from left to right.
        """
        return cls(cls.paper_strings(), deduplicate=False, left_to_right=left_to_right)

    @classmethod
    def paper_12(cls) -> KernelSpace:
        """The 12 kernels :math:`\\mathcal K_{12}` of the paper's App. E, Table 1, in the table's order."""
        return cls(_PAPER_12)


def _interleave(names: Sequence[str], operators: Sequence[str]) -> str:
    return "".join(itertools.chain.from_iterable(zip(names, operators))) + names[-1]


def _groupings(levels: list, n: int, deduplicate: bool) -> tuple[KernelExpression, ...]:
    """Every expression with ``n`` leaves, as ``left o right`` over all splits (de-duplicated per level if asked)."""
    expressions = [
        left + right if operator == "+" else left * right
        for split in range(1, n)
        for operator in "+×"
        for left in levels[split]
        for right in levels[n - split]
    ]
    return tuple(KernelSpace(expressions, deduplicate=True)) if deduplicate else tuple(expressions)
