from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence

import torch
from gpytorch.kernels import (
    AdditiveKernel,
    Kernel,
    LinearKernel,
    PeriodicKernel,
    ProductKernel,
    RBFKernel,
    RQKernel,
    ScaleKernel,
)

BASE_KERNELS = ("SE", "RQ", "PER", "LIN")
"""The base kernels, in the reference code's letter order s < r < p < l."""

_ALIASES = {"se": "SE", "s": "SE", "rq": "RQ", "r": "RQ", "per": "PER", "p": "PER", "lin": "LIN", "l": "LIN"}
_SUM, _PRODUCT = "+", "×"
_TOKEN = re.compile(r"\s*(?:([A-Za-z]+)|([+*×()])|(\S))")


class KernelExpression:
    r"""
    An immutable expression over the base kernels SE, RQ, PER and LIN combined by :math:`+` and :math:`\times`: a
    candidate kernel of variational Bayesian kernel selection (`Teng et al. (2020)`_, App. E.1). With
    :math:`r = \mathbf x - \mathbf x'`, the base kernels are

    .. math::

        \begin{aligned}
            \mathrm{SE}(\mathbf x, \mathbf x') &= \sigma^2 \exp\Big(-\tfrac12 \sum_d r_d^2 / \ell_d^2\Big), &
            \mathrm{RQ}(\mathbf x, \mathbf x') &= \sigma^2 \Big(1 + \tfrac{1}{2\alpha} \sum_d r_d^2 / \ell_d^2
                \Big)^{-\alpha}, \\
            \mathrm{PER}(\mathbf x, \mathbf x') &= \sigma^2 \exp\Big(-2 \sum_d \sin^2(\pi \lvert r_d \rvert / p_d)
                / \lambda_d\Big), &
            \mathrm{LIN}(\mathbf x, \mathbf x') &= \sum_d v_d\, x_d x'_d,
        \end{aligned}

    i.e. :class:`~gpytorch.kernels.ScaleKernel` around :class:`~gpytorch.kernels.RBFKernel`,
    :class:`~gpytorch.kernels.RQKernel` and :class:`~gpytorch.kernels.PeriodicKernel`, and a
    :class:`~gpytorch.kernels.LinearKernel` (no offset; it carries its own variance). GPyTorch's periodic
    "lengthscale" :math:`\lambda` is **not squared**: it is :math:`\ell^2` of the Duvenaud form
    :math:`\exp(-2\sin^2(\pi\lvert r\rvert/p)/\ell^2)`. Every leaf of an expression has its own hyperparameters, so
    products over-parameterize, as in the reference code.

    Text uses the names SE, RQ, PER, LIN (any case) or the reference code's letters s, r, p, l, the operators ``+``
    and ``×`` (or ``*``), and parentheses. Products bind tighter than sums, unless ``left_to_right`` asks for the
    reference code's ``ker_bracket`` reading :math:`((x_1 o_1 x_2) o_2 x_3)`. Nested sums (and nested products) are
    flattened, since grouping them changes neither the kernel nor its parameters; equality (and the hash) is then
    structural: the same operands in the same order. :meth:`canonical` also sorts the operands, so expressions that
    are equal by commutativity compare equal; it does not distribute :math:`\times` over :math:`+`, because
    :math:`(\mathrm{PER}+\mathrm{RQ})\times\mathrm{LIN}` has fewer parameters than
    :math:`\mathrm{PER}\times\mathrm{LIN}+\mathrm{RQ}\times\mathrm{LIN}`.

    :param text: The expression, e.g. ``"SE + PER×LIN"``, ``"(PER+RQ)*LIN"`` or ``"s+p*l"``.
    :param left_to_right: Read operators strictly from left to right, ignoring precedence (parentheses still group).

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.kernels import KernelExpression
        >>> expression = KernelExpression.parse("(per+rq)*lin")
        >>> expression
        KernelExpression('(PER + RQ)×LIN')
        >>> expression.leaves, expression.sum_of_products()
        (('PER', 'RQ', 'LIN'), ((0, 2), (1, 2)))
        >>> KernelExpression.parse("p+r*l", left_to_right=True) == expression
        True
        >>> KernelExpression("LIN×PER + SE").canonical() == KernelExpression("SE + PER×LIN").canonical()
        True
        >>> kernel = expression.build()
        >>> kernel(torch.randn(5, 1)).shape
        torch.Size([5, 5])

    .. _Teng et al. (2020):
        https://arxiv.org/abs/1912.02641
    """

    __slots__ = ("_operator", "_base", "_operands", "_hash")

    def __init__(self, text: str, left_to_right: bool = False):
        parsed = self.parse(text, left_to_right=left_to_right)
        self._set(parsed._operator, parsed._base, parsed._operands)

    # construction -----------------------------------------------------------------------------------------------------

    def _set(self, operator: str | None, base: str | None, operands: tuple[KernelExpression, ...]) -> None:
        object.__setattr__(self, "_operator", operator)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_operands", operands)
        object.__setattr__(self, "_hash", hash((operator, base, operands)))

    @classmethod
    def _node(cls, operator: str | None, base: str | None = None, operands: Sequence[KernelExpression] = ()):
        node = object.__new__(cls)
        flat: list[KernelExpression] = []
        for operand in operands:  # associativity: a sum of sums is one sum
            flat.extend(operand._operands if operand._operator == operator else (operand,))
        node._set(operator, base, tuple(flat))
        return node

    @classmethod
    def base(cls, name: str) -> KernelExpression:
        """
        A single base kernel.

        :param name: ``"SE"``, ``"RQ"``, ``"PER"`` or ``"LIN"`` (any case), or a letter ``s``, ``r``, ``p``, ``l``.
        """
        if not isinstance(name, str):
            raise TypeError(f"A base kernel name must be a string, got {type(name).__name__}.")
        canonical_name = _ALIASES.get(name.lower())
        if canonical_name is None:
            raise ValueError(
                f"Unknown base kernel {name!r}: use one of {', '.join(BASE_KERNELS)} (any case) or the letters "
                "s, r, p, l."
            )
        return cls._node(None, canonical_name)

    @classmethod
    def parse(cls, text: str, left_to_right: bool = False) -> KernelExpression:
        """
        Parse a kernel expression (see the class description for the syntax).

        :param text: The expression.
        :param left_to_right: Ignore precedence and read operators strictly from left to right.
        :raises ValueError: On malformed text or an unknown base kernel.
        """
        if isinstance(text, KernelExpression):
            return text
        if not isinstance(text, str):
            raise TypeError(f"A kernel expression must be a string or a KernelExpression, got {type(text).__name__}.")
        tokens = _tokenize(text)
        expression, position = _parse_chain(cls, text, tokens, 0, left_to_right)
        if position < len(tokens):
            raise ValueError(f"Cannot parse kernel expression {text!r}: unexpected {tokens[position]!r}.")
        return expression

    def __add__(self, other: KernelExpression) -> KernelExpression:
        if not isinstance(other, KernelExpression):
            return NotImplemented
        return self._node(_SUM, operands=(self, other))

    def __mul__(self, other: KernelExpression) -> KernelExpression:
        if not isinstance(other, KernelExpression):
            return NotImplemented
        return self._node(_PRODUCT, operands=(self, other))

    def __setattr__(self, name, value):
        raise AttributeError("KernelExpression is immutable.")

    def __reduce__(self):
        return (type(self), (self.name,))

    # structure --------------------------------------------------------------------------------------------------------

    @property
    def operator(self) -> str | None:
        """``"+"`` for a sum, ``"×"`` for a product, ``None`` for a base kernel."""
        return self._operator

    @property
    def operands(self) -> tuple[KernelExpression, ...]:
        """The operands of a sum or product (at least two; empty for a base kernel)."""
        return self._operands

    @property
    def is_base(self) -> bool:
        """Whether this is a single base kernel."""
        return self._operator is None

    @property
    def leaves(self) -> tuple[str, ...]:
        """The base-kernel name of every leaf, from left to right (one entry per occurrence)."""
        if self.is_base:
            return (self._base,)
        return tuple(leaf for operand in self._operands for leaf in operand.leaves)

    @property
    def num_operators(self) -> int:
        """The number of binary operators, one fewer than the number of leaves."""
        return len(self.leaves) - 1

    def sum_of_products(self) -> tuple[tuple[int, ...], ...]:
        r"""
        The expansion :math:`\sum_t \prod_{j \in t} k_j` of the expression into products of leaves, each term a
        tuple of leaf indices (into :attr:`leaves`). The leaves keep their identity (and hyperparameters), so the
        expansion evaluates to the same kernel.
        """
        return tuple(self._terms(0)[0])

    def _terms(self, offset: int) -> tuple[list[tuple[int, ...]], int]:
        if self.is_base:
            return [(offset,)], offset + 1
        parts = []
        for operand in self._operands:
            terms, offset = operand._terms(offset)
            parts.append(terms)
        if self._operator == _SUM:
            return [term for part in parts for term in part], offset
        return [tuple(itertools.chain.from_iterable(factors)) for factors in itertools.product(*parts)], offset

    def canonical(self) -> KernelExpression:
        """
        The normal form modulo associativity and commutativity of :math:`+` and :math:`\\times`: operands are
        flattened and sorted by name (recursively). Products are not distributed over sums.
        """
        if self.is_base:
            return self
        operands = sorted((operand.canonical() for operand in self._operands), key=lambda operand: operand.name)
        return self._node(self._operator, operands=operands)

    # text -------------------------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """Readable text, e.g. ``"SE + PER×LIN"``, with parentheses only where needed; it parses back to ``self``."""
        if self.is_base:
            return self._base
        if self._operator == _SUM:
            return " + ".join(operand.name for operand in self._operands)
        return _PRODUCT.join(f"({o.name})" if o._operator == _SUM else o.name for o in self._operands)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, KernelExpression):
            return NotImplemented
        return self._hash == other._hash and (self._operator, self._base, self._operands) == (
            other._operator,
            other._base,
            other._operands,
        )

    def __hash__(self) -> int:
        return self._hash

    # kernels ----------------------------------------------------------------------------------------------------------

    @staticmethod
    def base_kernel(name: str, ard_num_dims: int | None = None, batch_shape: torch.Size = torch.Size()) -> Kernel:
        """
        A fresh GPyTorch kernel for one base kernel (see the class description for the forms).

        :param name: ``"SE"``, ``"RQ"``, ``"PER"`` or ``"LIN"`` (or an alias, see :meth:`base`).
        :param ard_num_dims: One lengthscale (period, variance) per input dimension if given, else one shared.
        :param batch_shape: Batch shape of the hyperparameters.
        """
        kind = KernelExpression.base(name)._base
        # PeriodicKernel(ard_num_dims=None) fails in GPyTorch 1.15 (it reads the keyword with default 1): omit it.
        dims = {} if ard_num_dims is None else {"ard_num_dims": ard_num_dims}
        if kind == "LIN":
            return LinearKernel(batch_shape=batch_shape, **dims)
        inner = {"SE": RBFKernel, "RQ": RQKernel, "PER": PeriodicKernel}[kind]
        return ScaleKernel(inner(batch_shape=batch_shape, **dims), batch_shape=batch_shape)

    def combine(self, leaf_kernels: Sequence[Kernel]) -> Kernel:
        """
        Combine given kernels, one per leaf (in the order of :attr:`leaves`), into a kernel with this expression's
        structure (:class:`~gpytorch.kernels.AdditiveKernel` and :class:`~gpytorch.kernels.ProductKernel`).

        :param leaf_kernels: ``len(self.leaves)`` GPyTorch kernels.
        """
        leaf_kernels = list(leaf_kernels)
        if len(leaf_kernels) != len(self.leaves):
            raise ValueError(f"{self.name} has {len(self.leaves)} leaves, but {len(leaf_kernels)} kernels were given.")
        if not all(isinstance(kernel, Kernel) for kernel in leaf_kernels):
            raise TypeError("combine needs GPyTorch kernels (gpytorch.kernels.Kernel), one per leaf.")
        return self._assemble(iter(leaf_kernels))

    def _assemble(self, leaf_kernels: Iterator[Kernel]) -> Kernel:
        if self.is_base:
            return next(leaf_kernels)
        parts = [operand._assemble(leaf_kernels) for operand in self._operands]
        return AdditiveKernel(*parts) if self._operator == _SUM else ProductKernel(*parts)

    def build(self, ard_num_dims: int | None = None, batch_shape: torch.Size = torch.Size()) -> Kernel:
        """
        A standalone GPyTorch kernel for this expression, with fresh hyperparameters for every leaf.

        :param ard_num_dims: Passed to every base kernel (see :meth:`base_kernel`).
        :param batch_shape: Batch shape of every leaf's hyperparameters.
        """
        return self.combine([self.base_kernel(name, ard_num_dims, batch_shape) for name in self.leaves])


def _tokenize(text: str) -> list[str]:
    tokens = []
    for match in _TOKEN.finditer(text):
        name, symbol, other = match.groups()
        if other is not None:
            raise ValueError(
                f"Cannot parse kernel expression {text!r}: unexpected character {other!r} (use base kernel names, "
                "'+', '*' or '×', and parentheses)."
            )
        tokens.append(name or ("×" if symbol == "*" else symbol))
    if not tokens:
        raise ValueError("Cannot parse an empty kernel expression.")
    return tokens


def _parse_chain(cls, text: str, tokens: list[str], position: int, left_to_right: bool):
    """Operands joined by operators, up to a closing parenthesis or the end; returns (expression, next position)."""
    operand, position = _parse_atom(cls, text, tokens, position, left_to_right)
    terms, operators = [operand], []
    while position < len(tokens) and tokens[position] in (_SUM, _PRODUCT):
        operators.append(tokens[position])
        operand, position = _parse_atom(cls, text, tokens, position + 1, left_to_right)
        terms.append(operand)
    if left_to_right:
        expression = terms[0]
        for operator, operand in zip(operators, terms[1:]):
            expression = expression + operand if operator == _SUM else expression * operand
        return expression, position
    products = [terms[0]]
    for operator, operand in zip(operators, terms[1:]):
        if operator == _PRODUCT:
            products[-1] = products[-1] * operand
        else:
            products.append(operand)
    expression = products[0]
    for product in products[1:]:
        expression = expression + product
    return expression, position


def _parse_atom(cls, text: str, tokens: list[str], position: int, left_to_right: bool):
    if position >= len(tokens):
        raise ValueError(f"Cannot parse kernel expression {text!r}: it ends where a base kernel or '(' is expected.")
    token = tokens[position]
    if token == "(":
        expression, position = _parse_chain(cls, text, tokens, position + 1, left_to_right)
        if position >= len(tokens) or tokens[position] != ")":
            raise ValueError(f"Cannot parse kernel expression {text!r}: unbalanced parentheses.")
        return expression, position + 1
    if token in (_SUM, _PRODUCT, ")"):
        raise ValueError(f"Cannot parse kernel expression {text!r}: unexpected {token!r} where a kernel is expected.")
    try:
        return cls.base(token), position + 1
    except ValueError as error:
        raise ValueError(f"Cannot parse kernel expression {text!r}: {error}") from None
