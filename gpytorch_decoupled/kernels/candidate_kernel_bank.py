from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from gpytorch.kernels import Kernel, ScaleKernel
from linear_operator import to_dense
from torch import Tensor

from .kernel_expression import BASE_KERNELS, KernelExpression
from .kernel_space import KernelSpace


class CandidateKernelBank(Kernel):
    r"""
    :math:`C` composite candidate kernels :math:`\kappa_1, \dots, \kappa_C` (each a :class:`KernelExpression`)
    evaluated together as one kernel with ``batch_shape = [C]``, so that one batched
    :class:`~gpytorch.models.ApproximateGP` trains all candidates of variational Bayesian kernel selection at once
    (`Teng et al. (2020)`_, Sec. 3):

    .. math::

        \big[\mathbf K\big]_{c} = \kappa_c(\mathbf X_1, \mathbf X_2)
            = \sum_{t \in T_c} \prod_{j \in t} k_j(\mathbf X_1, \mathbf X_2),

    where :math:`T_c` is the sum-of-products expansion of candidate :math:`c`
    (:meth:`KernelExpression.sum_of_products`) and :math:`k_j` are its leaves. Every leaf occurrence has its own
    hyperparameters. The leaves of one base type (SE, RQ, PER, LIN) across all candidates form one batched GPyTorch
    kernel in :attr:`base_kernels` (e.g. ``ScaleKernel(RBFKernel(batch_shape=[n_SE]), batch_shape=[n_SE])``), so a
    call evaluates each base type once, then forms all products and sums by gathering: no Python loop over
    candidates or terms. Everything is dense: with :math:`L` leaves and :math:`F` product factors in all, a call
    holds :math:`O((L + F)\,nm)` numbers for autograd (:math:`O((L + F)\,n)` with ``diag=True``).

    Inputs are either shared by all candidates (``(n, d)``) or given per candidate: their last batch dimension
    (``-3``) is then :math:`C` (or 1), e.g. ``(C, n, d)`` or ``(b, C, n, d)``; the output is
    ``(..., C, n, m)`` (``(..., C, n)`` with ``diag=True``). The candidate dimension cannot be indexed: use
    :meth:`candidate` for one candidate's kernel, or a bank over a sub-space.

    :param expressions: The candidates: a :class:`KernelSpace`, or kernel expressions or their text (kept as given,
        without de-duplication).
    :param ard_num_dims: Passed to every base kernel: one lengthscale (period, linear variance) per input dimension
        if given, else one shared by all dimensions.

    :ivar torch.nn.ModuleDict base_kernels: One batched GPyTorch kernel per base type present, keyed ``"SE"``,
        ``"RQ"``, ``"PER"``, ``"LIN"``; batch entry :math:`i` is the :math:`i`-th leaf of that type, counting the
        candidates' leaves in order.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.kernels import CandidateKernelBank
        >>> bank = CandidateKernelBank(["SE", "SE + PER×LIN", "(PER + RQ)×LIN"])
        >>> bank.set_base_hyperparameters("PER", period_length=6.0)
        >>> x = torch.randn(7, 1)
        >>> bank(x).shape, bank(x, diag=True).shape
        (torch.Size([3, 7, 7]), torch.Size([3, 7]))
        >>> {kind: kernel.batch_shape for kind, kernel in bank.base_kernels.items()}
        {'SE': torch.Size([2]), 'RQ': torch.Size([1]), 'PER': torch.Size([2]), 'LIN': torch.Size([2])}
        >>> torch.allclose(bank(x).to_dense()[1], bank.candidate(1)(x).to_dense())
        True
        >>> bank.parameter_owners()["base_kernels.PER.raw_outputscale"]
        tensor([1, 2])

    .. _Teng et al. (2020):
        https://arxiv.org/abs/1912.02641
    """

    def __init__(self, expressions: KernelSpace | Sequence[KernelExpression | str], ard_num_dims: int | None = None):
        space = expressions if isinstance(expressions, KernelSpace) else KernelSpace(expressions, deduplicate=False)
        super().__init__(ard_num_dims=ard_num_dims, batch_shape=torch.Size([len(space)]))
        self.space = space
        counts = dict.fromkeys(BASE_KERNELS, 0)
        self._leaf_slots: list[tuple[tuple[str, int], ...]] = []  # candidate -> ((kind, slot within kind), ...)
        for expression in space:
            slots = []
            for kind in expression.leaves:
                slots.append((kind, counts[kind]))
                counts[kind] += 1
            self._leaf_slots.append(tuple(slots))
        kinds = [kind for kind in BASE_KERNELS if counts[kind]]
        self.base_kernels = torch.nn.ModuleDict(
            {kind: KernelExpression.base_kernel(kind, ard_num_dims, torch.Size([counts[kind]])) for kind in kinds}
        )
        # Leaves are numbered globally kind by kind (the order of the concatenated base evaluations in forward); the
        # product terms are grouped by their number of factors, so that no product is padded.
        offsets = dict(zip(kinds, itertools.accumulate([counts[kind] for kind in kinds[:-1]], initial=0)))
        leaf_candidates = torch.empty(sum(counts.values()), dtype=torch.long)
        groups: dict[int, tuple[list[list[int]], list[int]]] = {}  # factors -> (leaves of each term, candidates)
        for c, (expression, slots) in enumerate(zip(space, self._leaf_slots)):
            leaves = [offsets[kind] + slot for kind, slot in slots]
            leaf_candidates[leaves] = c
            for term in expression.sum_of_products():
                factors, candidates = groups.setdefault(len(term), ([], []))
                factors.append([leaves[j] for j in term])
                candidates.append(c)
        self._offsets = offsets
        self._term_lengths = sorted(groups)
        self.register_buffer("_leaf_candidates", leaf_candidates, persistent=False)
        for length, (factors, candidates) in groups.items():
            self.register_buffer(f"_term_factors_{length}", torch.tensor(factors), persistent=False)
            self.register_buffer(f"_term_candidates_{length}", torch.tensor(candidates), persistent=False)

    @property
    def num_candidates(self) -> int:
        """The number :math:`C` of candidate kernels."""
        return len(self.space)

    @property
    def names(self) -> tuple[str, ...]:
        """The candidates' names, in batch order."""
        return self.space.names

    def leaf_candidates(self, kind: str) -> Tensor:
        """
        The candidate owning each leaf of one base type: entry :math:`i` is the candidate of batch entry :math:`i`
        of ``base_kernels[kind]``.
        """
        kind = self._kind(kind)
        start = self._offsets[kind]
        return self._leaf_candidates[start : start + self.base_kernels[kind].batch_shape[0]]

    def _kind(self, kind: str) -> str:
        kind = KernelExpression.base(kind).leaves[0]
        if kind not in self.base_kernels:
            raise ValueError(f"No candidate has a {kind} leaf; the bank's base types are {list(self.base_kernels)}.")
        return kind

    # evaluation -------------------------------------------------------------------------------------------------------

    def _check_input(self, x: Tensor | None) -> None:
        if x is None:
            return
        if not torch.is_tensor(x):
            raise TypeError(f"CandidateKernelBank inputs must be tensors, got {type(x).__name__}.")
        if x.dim() >= 3 and x.size(-3) not in (1, self.num_candidates):
            raise ValueError(
                f"CandidateKernelBank with C={self.num_candidates} candidates got inputs of shape {tuple(x.shape)}: "
                f"the last batch dimension (-3) must be 1 or C (one input set per candidate); use (n, d) inputs to "
                "share them."
            )

    def __call__(self, x1: Tensor, x2: Tensor | None = None, diag: bool = False, **params):
        self._check_input(x1)
        self._check_input(x2)
        return super().__call__(x1, x2, diag=diag, **params)

    # Kernel.batch_shape broadcasts the shapes of all kernel submodules, but the base kernels are batched over leaves,
    # not candidates: the bank's batch shape is its own.
    @property
    def batch_shape(self) -> torch.Size:
        return self._batch_shape

    @batch_shape.setter
    def batch_shape(self, value: torch.Size) -> None:
        if hasattr(self, "_batch_shape") and torch.Size(value) != self._batch_shape:
            raise ValueError(f"The batch shape of a CandidateKernelBank is [C] = {list(self._batch_shape)}.")
        self._batch_shape = torch.Size(value)

    def expand_batch(self, batch_shape: torch.Size) -> Kernel:
        if torch.Size(batch_shape) == self._batch_shape:
            return self
        raise NotImplementedError("CandidateKernelBank cannot expand its batch shape [C].")

    def __getitem__(self, index) -> Kernel:
        index = index if isinstance(index, tuple) else (index,)
        if all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in index):
            return self
        raise NotImplementedError(
            "CandidateKernelBank cannot index its candidate (batch) dimension; use candidate(c) for one candidate's "
            "kernel, or build a bank over a sub-space."
        )

    def _leaf_inputs(self, x: Tensor, kind: str) -> Tensor:
        """Per-candidate inputs ``(..., C, n, d)`` become per-leaf inputs ``(..., n_kind, n, d)``."""
        if x.dim() < 3 or x.size(-3) == 1:
            return x
        return x.index_select(-3, self.leaf_candidates(kind))

    def forward(self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params) -> Tensor:
        if last_dim_is_batch:
            raise NotImplementedError("CandidateKernelBank does not support last_dim_is_batch.")
        self._check_input(x1)
        self._check_input(x2)
        dim = -2 if diag else -3  # the leaf dimension
        blocks = [
            to_dense(kernel.forward(self._leaf_inputs(x1, kind), self._leaf_inputs(x2, kind), diag=diag))
            for kind, kernel in self.base_kernels.items()
        ]
        return self.combine_leaves(torch.cat(blocks, dim=dim), diag=diag)

    def combine_leaves(self, leaves: Tensor, diag: bool = False) -> Tensor:
        r"""
        The candidates' covariances from their leaves' values: :math:`\sum_{t \in T_c} \prod_{j \in t} k_j` for
        every candidate :math:`c`, by gathering (a loop over product lengths, not over candidates or terms).

        :param leaves: Every leaf's values, kind by kind in the order of :attr:`base_kernels` and within a kind in
            the order of :meth:`leaf_candidates`: ``(..., L, n, m)``, or ``(..., L, n)`` with ``diag=True``.
        :param diag: Whether the values are diagonals.
        :return: ``(..., C, n, m)`` (``(..., C, n)`` with ``diag=True``).
        """
        dim = -2 if diag else -3  # the leaf (then candidate) dimension
        shape = list(leaves.shape)
        shape[dim] = self.num_candidates
        covariance = leaves.new_zeros(shape)
        for length in self._term_lengths:  # a loop over product lengths (1 to 3 for the paper's spaces)
            factors = getattr(self, f"_term_factors_{length}")
            products = leaves.index_select(dim, factors[:, 0])
            for position in range(1, length):
                products = products * leaves.index_select(dim, factors[:, position])
            covariance = covariance.index_add(dim, getattr(self, f"_term_candidates_{length}"), products)
        return covariance

    # export and initialisation ----------------------------------------------------------------------------------------

    def candidate(self, c: int) -> Kernel:
        """
        A standalone GPyTorch kernel for candidate ``c`` (built by :meth:`KernelExpression.combine`), with copies of
        the bank's hyperparameters, constraints and priors for that candidate (not tied to the bank).

        On symmetric inputs (``x1`` equal to ``x2``) GPyTorch multiplies two LIN leaves through jittered root
        decompositions, which is inexact for these low-rank factors (relative errors near 1e-3 were seen for
        LIN×LIN×LIN); the bank's dense products are exact.

        :param c: Candidate index, ``-C <= c < C``.
        """
        if not isinstance(c, int) or not -self.num_candidates <= c < self.num_candidates:
            raise IndexError(f"Candidate index {c!r} is out of range for a bank of {self.num_candidates} candidates.")
        c = c % self.num_candidates
        leaves = []
        for kind, slot in self._leaf_slots[c]:
            leaf = self.base_kernels[kind][slot]  # Kernel.__getitem__: a deep copy with the batch entry selected
            for parameter in leaf.parameters():
                parameter.data = parameter.data.clone()  # drop the copied storage of the other batch entries
            leaves.append(leaf)
        return self.space[c].combine(leaves)

    def parameter_owners(self) -> dict[str, Tensor]:
        """
        For every parameter (named as in :meth:`named_parameters`), a ``LongTensor`` of the parameter's shape giving
        the candidate that owns each entry.
        """
        owners = {}
        for kind, kernel in self.base_kernels.items():
            leaf_candidates = self.leaf_candidates(kind)
            for name, parameter in kernel.named_parameters():
                shape = (-1,) + (1,) * (parameter.dim() - 1)
                owners[f"base_kernels.{kind}.{name}"] = leaf_candidates.view(shape).expand(parameter.shape).clone()
        return owners

    def set_base_hyperparameters(self, kind: str, **values: float | Tensor) -> None:
        """
        Set a hyperparameter of every leaf of one base type, e.g. ``set_base_hyperparameters("PER",
        period_length=6.28, lengthscale=4.0)``.

        :param kind: ``"SE"``, ``"RQ"``, ``"PER"`` or ``"LIN"``.
        :param values: Positive values by name: ``outputscale`` (SE, RQ, PER), ``lengthscale`` (SE, RQ, PER; the
            periodic one is :math:`\\lambda = \\ell^2`, see :class:`KernelExpression`), ``alpha`` (RQ),
            ``period_length`` (PER), ``variance`` (LIN). Each is a scalar or a tensor broadcastable to the
            hyperparameter's shape, e.g. ``(n_PER, 1, d)`` for ``period_length`` (``(n_kind, ...)``: one row per leaf,
            in the order of :meth:`leaf_candidates`).
        """
        kind = self._kind(kind)
        kernel = self.base_kernels[kind]
        modules = [kernel] + ([kernel.base_kernel] if isinstance(kernel, ScaleKernel) else [])
        available = [name[4:] for module in modules for name, _ in module.named_parameters(recurse=False)]
        updates = []
        for name, value in values.items():
            module = next((m for m in modules if f"raw_{name}" in dict(m.named_parameters(recurse=False))), None)
            if module is None:
                raise ValueError(f"{kind} leaves have no hyperparameter {name!r}; they have {available}.")
            raw = getattr(module, f"raw_{name}")
            value = torch.as_tensor(value, dtype=raw.dtype, device=raw.device)
            try:
                broadcastable = torch.broadcast_shapes(value.shape, raw.shape) == raw.shape
            except RuntimeError:
                broadcastable = False
            if not broadcastable:
                raise ValueError(
                    f"{kind} {name} has shape {tuple(raw.shape)}; got a value of shape {tuple(value.shape)}, which "
                    "does not broadcast to it."
                )
            if not (torch.isfinite(value).all() and (value > 0).all()):
                raise ValueError(f"{kind} {name} must be positive and finite.")
            updates.append((module, name, value))
        for module, name, value in updates:  # validated first, so a bad value changes nothing
            setattr(module, name, value.expand_as(getattr(module, f"raw_{name}")))
