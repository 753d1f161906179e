from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch
from gpytorch import Module
from gpytorch.kernels import Kernel
from linear_operator.operators import LinearOperator
from torch import Tensor

from ..gpytorch_compat import cache_safe
from ..linalg import (
    coefficient_proportional_rows,
    column_sampled_quadratic_form,
    keep_freed_cpu_memory,
    kernel_matvec,
    kernel_quadratic_form,
)
from ..linalg.kernel_matvec import fused_block
from ._replace_tensor import replace_tensor
from .joint_prior import JointPrior, joint_prior


def load_renamed_keys(renamed: dict[str, str], dropped: tuple[str, ...], module, state_dict, prefix, *args) -> None:
    """A load-state-dict pre-hook of the strategies (bind ``renamed`` and ``dropped`` with :func:`functools.partial`):
    renames the keys of checkpoints saved before the mean basis became a component (``mean_inducing_points`` is now
    ``mean_basis.inducing_points``) and drops keys that are no longer state, so that they load as before."""
    for old, new in renamed.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
    for key in dropped:
        state_dict.pop(prefix + key, None)


class MeanBasisAttribute:
    """A strategy attribute that is its mean basis component's, under the name it had before the component existed
    (``strategy.mean_inducing_points`` is ``strategy.mean_basis.inducing_points``)."""

    def __init__(self, name: str, doc: str):
        self.name = name
        self.__doc__ = doc

    def __get__(self, strategy, owner=None):
        return self if strategy is None else getattr(strategy.mean_basis, self.name)

    def __set__(self, strategy, value) -> None:
        setattr(strategy.mean_basis, self.name, value)


class MeanBasisValues(NamedTuple):
    r"""What :meth:`MeanBasis.fused_values` computes from one kernel evaluation."""

    row_values: list[Tensor]  # K_{r alpha} a at each of the model's row sets r (e.g. the covariance basis)
    data_values: Tensor  # K_{x alpha} a at the data, (..., N)
    prior: JointPrior | None  # the prior at [rows...; (C;) x; alpha], or None when x has another batch shape


class SampledRows(NamedTuple):
    r"""A training step's rows :math:`C` of :math:`\mathbf K_\alpha` for an importance-sampled quadratic form: the
    indices (drawn with replacement, stratified), their probabilities and :math:`\mathbf K_{C\alpha}\mathbf a`."""

    indices: Tensor  # shape: (b,)
    probabilities: Tensor  # shape: (b,)
    values: Tensor  # shape: (..., b)


#: Mean bases of at most this many points get the exact quadratic form by default (zero variance); it costs one sweep
#: over the upper triangle of K_alpha per step (about 1, 4 and 16 ms at 1,000, 2,000 and 4,096 points on one core).
EXACT_KL_SIZE = 4096


@cache_safe
class MeanBasis(Module):
    r"""
    The mean basis of the decoupled strategies (Decoupled, Hybrid, orthogonally decoupled), as a component each of
    them owns (``strategy.mean_basis``): points :math:`\alpha` (:attr:`inducing_points`, shared by every latent of the
    batch) with coefficients :math:`\mathbf a` (:attr:`coefficients`, one row per latent), the mean function
    :math:`\mathbf K_{\mathbf x\alpha}\mathbf a`, the quadratic form :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a`
    of the KL and the growth of the basis. No :math:`M_\alpha\times M_\alpha` matrix is ever formed.

    Every product :math:`\mathbf K_{\cdot\alpha}\mathbf a` goes through :meth:`values_and_prior` (one evaluation of
    the model's prior at the stacked rows and :math:`\alpha`, and one :func:`~gpytorch_decoupled.linalg.kernel_matvec`):
    the data of a step, this step's sampled KL rows :math:`C` and the model's own rows (the covariance basis of the
    hybrid and orthogonal strategies) together in :meth:`fused_values`, and the quadratic form, exact in row blocks of
    bounded memory or column-sampled from ``num_kl_columns`` rows (:ref:`derivations-column-sampled-kl`), in
    :meth:`quadratic_form`. The coefficients the products use are passed in, so that a strategy may reparametrize
    them (the Jacobi preconditioning of the decoupled strategy); :attr:`coefficients` is the parameter that holds
    them, in the one place where GPyTorch's parameter routing wants it: this module (a hyperparameter, for Adam: the
    hybrid and orthogonal strategies, whose :math:`\mathbf a_\gamma` must not get natural-gradient steps) or the
    variational distribution given as ``coefficient_source`` (a variational parameter: the decoupled strategy).

    In training, :meth:`fused_values` draws this step's rows :math:`C` of the quadratic form with the data's, and keeps
    the estimate in the attribute ``sampled_quadratic_form`` for the step's KL (:meth:`quadratic_form`) and the rows in
    ``sampled_indices`` (for a step that reduces the variance of the estimate's gradient, as
    :class:`~gpytorch_decoupled.optim.MeanBasisAdam` does), or, with
    ``importance_sampling``, the rows and their values in ``sampled_rows`` for the strategy's estimate; None outside a
    training step, they are forgotten with GPyTorch's caches (the strategy's training call, ``train()``/``eval()``,
    ``load_state_dict``, ``.to()``; :func:`~gpytorch_decoupled.gpytorch_compat.cache_safe`). The rows are drawn from
    the module's own random generator, the attribute ``generator`` (a :class:`torch.Generator` on the basis's device),
    not from PyTorch's global one: unless set, it is seeded from the global generator at the first draw (so
    ``torch.manual_seed`` before training makes a run reproducible, as with GPyTorch), and from then on its state is
    part of the ``state_dict``, so a run resumed from a checkpoint draws the same rows as the uninterrupted one whatever
    the global generator does. On another device (``.to()``, or a checkpoint from another device) it is seeded
    deterministically from its former state.

    Inducing points may be wider than the data when a kernel of the model declares ``basis_parameter_dims``: their
    trailing columns then hold per-basis kernel parameters (e.g. the log length-scale multipliers of
    :class:`~gpytorch_decoupled.kernels.GeneralizedRBFKernel`), and data rows are padded with zeros (see
    :func:`~gpytorch_decoupled.variational.checked_inputs`).

    :param model: The model whose prior gives the kernel (the strategy's model), kept by reference.
    :param inducing_points: Points :math:`\alpha`, ``(M, D)``.
    :param covariance_inducing_points: The strategy's covariance basis, whose width, dtype and device :math:`\alpha`
        takes.
    :param learn_inducing_locations: Make :math:`\alpha` a parameter (a buffer otherwise).
    :param num_kl_columns: Rows :math:`b` of :math:`\mathbf K_\alpha` sampled per training step for the quadratic
        form of a basis larger than ``exact_kl_size``; ``None`` always computes it exactly.
    :param exact_kl_size: The quadratic form of a basis of at most this many points is exact in training too (one
        sweep over the tiles of :math:`\mathbf K_\alpha`, :math:`O(M^2)` time and memory of one tile): zero variance
        where that is cheap, i.e. for kernels with the fused sweep (:meth:`has_fused_sweep`: RBF and Matérn 3/2, 5/2,
        optionally scaled); other kernels are sampled above ``num_kl_columns`` points.
    :param importance_sampling: Draw the rows with probabilities :math:`\propto \lvert a_i\rvert`, stratified,
        and keep them with their values (``sampled_rows``) for the owning strategy's control-variate estimate
        (:func:`~gpytorch_decoupled.linalg.landmark_quadratic_form`), instead of uniformly without replacement.
    :param kl_block_size: Rows of :math:`\mathbf K_\alpha` evaluated at once by the exact quadratic form.
    :param batch_shape: Batch shape of the coefficients this module creates (one row per latent).
    :param init_std: Standard deviation of the coefficients this module creates, around 0 (exactly 0 would leave
        :math:`\alpha` without a gradient in the first step).
    :param coefficient_source: A module whose ``mean_coefficients`` parameter holds the coefficients (then this module
        creates none), kept by reference.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import HybridVariationalStrategy
        >>> class HybridGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, beta, gamma):
        ...         q = gpytorch.variational.CholeskyVariationalDistribution(beta.size(0))
        ...         super().__init__(HybridVariationalStrategy(self, beta, q, gamma))
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(torch.zeros_like(x[..., 0]), self.covar_module(x))
        >>> model = HybridGP(torch.randn(5, 1), torch.randn(200, 1))
        >>> basis = model.variational_strategy.mean_basis
        >>> basis.inducing_points.shape, basis.coefficients.shape
        (torch.Size([200, 1]), torch.Size([200]))
        >>> x, a = torch.randn(3, 1), basis.coefficients
        >>> torch.allclose(basis.values(x, a), model.covar_module(x, basis.inducing_points) @ a)
        True
        >>> basis.grow(torch.randn(10, 1))  # new points with zero coefficients: the mean function is unchanged
        >>> basis.coefficients.shape
        torch.Size([210])
    """

    _step_attributes = ("sampled_quadratic_form", "sampled_indices", "sampled_rows")
    sampled_quadratic_form: Tensor | None = None
    sampled_indices: Tensor | None = None
    sampled_rows: SampledRows | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        inducing_points: Tensor,
        covariance_inducing_points: Tensor,
        learn_inducing_locations: bool = True,
        num_kl_columns: int | None = 64,
        kl_block_size: int = 4096,
        batch_shape: torch.Size = torch.Size([]),
        init_std: float = 1e-3,
        coefficient_source: torch.nn.Module | None = None,
        exact_kl_size: int = EXACT_KL_SIZE,
        importance_sampling: bool = False,
    ):
        super().__init__()
        keep_freed_cpu_memory()  # the basis's step allocates vectors and kernel tiles of its size
        # Kept by reference, outside the module tree, like a strategy's model: registering them again here would
        # duplicate their parameters in the state dict.
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "_coefficient_source", coefficient_source)
        if inducing_points.dim() == 1:
            inducing_points = inducing_points.unsqueeze(-1)
        width = covariance_inducing_points.size(-1)
        if inducing_points.dim() != 2 or inducing_points.size(-1) != width:
            raise ValueError(
                f"mean_inducing_points must have shape (M_mean, {width}) to match inducing_points "
                f"{tuple(covariance_inducing_points.shape)}, got {tuple(inducing_points.shape)}."
            )
        if not torch.isfinite(inducing_points).all():
            raise ValueError("mean_inducing_points contains NaN or inf.")
        if num_kl_columns is not None and num_kl_columns < 1:
            raise ValueError(f"num_kl_columns must be a positive integer or None, got {num_kl_columns}.")
        if exact_kl_size < 0:
            raise ValueError(f"exact_kl_size must be a non-negative integer, got {exact_kl_size}.")
        points = inducing_points.detach().clone().to(covariance_inducing_points)
        if learn_inducing_locations:
            self.register_parameter("inducing_points", torch.nn.Parameter(points))
        else:
            self.register_buffer("inducing_points", points)
        self.num_kl_columns = num_kl_columns
        self.kl_block_size = kl_block_size
        self.exact_kl_size = exact_kl_size
        self.importance_sampling = importance_sampling
        self._fused_sweep: bool | None = None  # has_fused_sweep(), checked at the first need
        self.generator: torch.Generator | None = None  # seeded at the first draw (see device_generator)
        self.register_load_state_dict_pre_hook(_keep_generator_state_if_absent)
        if coefficient_source is None:
            coefficients = torch.randn(*batch_shape, points.size(-2), dtype=points.dtype)
            self.register_parameter("coefficients", torch.nn.Parameter(coefficients.mul_(init_std).to(points)))

    @property
    def coefficients(self) -> torch.nn.Parameter:
        r"""The parameter holding :math:`\mathbf a`, ``(..., M)``: this module's, or ``coefficient_source``'s
        ``mean_coefficients``."""
        if self._coefficient_source is not None:
            return self._coefficient_source.mean_coefficients
        try:
            return self._parameters["coefficients"]
        except KeyError:  # while __init__ registers it (``register_parameter`` asks whether the name is taken)
            raise AttributeError("coefficients") from None

    # ------------------------------------------------------------------ K a
    def values_and_prior(self, inputs: list[Tensor], coefficients: Tensor, **kwargs) -> tuple[Tensor, JointPrior]:
        r"""
        :math:`\mathbf K_{\mathbf x\alpha}\mathbf a` at the stacked input sets :math:`\mathbf x` (``(..., N)``, in their
        order), fused for the common kernels, and the joint prior at :math:`[\text{inputs}\ldots; \alpha]` it was
        computed from, whose other blocks the caller may reuse.

        :param inputs: Input sets, ``(..., n_i, D)``, batch dimensions broadcasting.
        :param coefficients: :math:`\mathbf a`, ``(..., M)``.
        :param kwargs: Passed to ``model.forward``.
        """
        prior = joint_prior(self.model, *inputs, self.inducing_points, **kwargs)
        end = len(inputs)
        return kernel_matvec(prior.covariance(slice(0, end), end), coefficients), prior

    def values(self, x: Tensor, coefficients: Tensor, **kwargs) -> Tensor:
        r""":math:`\mathbf K_{\mathbf x\alpha}\mathbf a`, the mean basis function at ``x``, ``(..., N)``."""
        return self.values_and_prior([x], coefficients, **kwargs)[0]

    def exact_quadratic_form(self) -> bool:
        """Whether the quadratic form is computed exactly now: in eval mode, or as :meth:`exact_in_training` says."""
        return not self.training or self.exact_in_training()

    def exact_in_training(self) -> bool:
        """Whether a training step computes the quadratic form exactly: with ``num_kl_columns=None``, or for a basis
        of at most ``exact_kl_size`` points (or no more points than rows to sample without replacement)."""
        num_points = self.inducing_points.size(-2)
        return (
            self.num_kl_columns is None
            or (num_points <= self.exact_kl_size and self.has_fused_sweep())
            or (not self.importance_sampling and self.num_kl_columns >= num_points)
        )

    def has_fused_sweep(self) -> bool:
        r"""Whether the model's kernel has the fused tile sweep of :func:`~gpytorch_decoupled.linalg.kernel_matvec`
        (RBF, Matérn 3/2 and 5/2, optionally scaled), which makes the exact quadratic form cheap. Other kernels
        evaluate :math:`\mathbf K_\alpha` entry by entry with autograd (a
        :class:`~gpytorch_decoupled.kernels.GeneralizedRBFKernel` at :math:`M = 1000`, :math:`D = 21`: over ten times
        the step of 64 sampled rows), so ``exact_kl_size`` applies to these kernels only. Checked once, on one basis
        point, with the model's ``covar_module`` where it has one (no extra ``forward`` of the model)."""
        if self._fused_sweep is None:
            points = self.inducing_points.detach()[..., :1, :]
            kernel = getattr(self.model, "covar_module", None)
            block = kernel(points, points) if isinstance(kernel, Kernel) else self.cross_covariance(points, points)
            self._fused_sweep = fused_block(block) is not None
        return self._fused_sweep

    def draw_rows(self, coefficients: Tensor) -> tuple[Tensor, Tensor | None] | None:
        r"""Rows :math:`C` of :math:`\mathbf K_\alpha` for a training step's estimate of the quadratic form and their
        probabilities (None for the uniform draw without replacement), or None when it is exact."""
        if self.exact_quadratic_form():
            return None
        if self.importance_sampling:
            return coefficient_proportional_rows(coefficients, self.num_kl_columns, self.device_generator())
        return self._uniform_rows(), None

    def _uniform_rows(self) -> Tensor:
        num_points, device = self.inducing_points.size(-2), self.inducing_points.device
        generator = self.device_generator()
        rows = torch.randperm(num_points, generator=generator, device=generator.device)[: self.num_kl_columns]
        return rows.to(device)

    # ------------------------------------------------------------------ the random generator
    def device_generator(self) -> torch.Generator:
        """:attr:`generator`, seeded from PyTorch's global generator if it has not been seeded yet, and moved to the
        device of the points if they have moved (seeded deterministically from its state there: the states of
        generators of different kinds of device are not interchangeable)."""
        device = _generator_device(self.inducing_points.device)
        if self.generator is None:
            self.generator = _generator_on(device, int(torch.randint(2**62, (), dtype=torch.int64)))
        elif self.generator.device != device:
            self.generator = _generator_on(device, _seed_from(self.generator.get_state()))
        return self.generator

    def get_extra_state(self) -> Tensor:
        """The state of :attr:`generator` (a CPU byte tensor; empty before the first draw), saved with the
        parameters."""
        if self.generator is None:
            return torch.zeros(0, dtype=torch.uint8)
        return self.generator.get_state()

    def set_extra_state(self, state: Tensor) -> None:
        """Restores the state of :attr:`generator`; a state saved from a generator of another kind of device seeds it
        deterministically instead, and an empty one leaves it to be seeded at the first draw."""
        if not isinstance(state, Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            raise TypeError(f"the mean basis's generator state must be a 1-D byte tensor, got {state!r:.80}.")
        state = state.cpu()
        if state.numel() == 0:
            self.generator = None
            return
        device = _generator_device(self.inducing_points.device)
        generator = self.generator if self.generator is not None else torch.Generator(device=device)
        if state.shape == generator.get_state().shape:
            self.generator = generator.set_state(state)
        else:
            self.generator = _generator_on(device, _seed_from(state))

    def fused_values(self, x: Tensor, model_rows: list[Tensor], coefficients: Tensor, **kwargs) -> MeanBasisValues:
        r"""
        :math:`\mathbf K_{\cdot\alpha}\mathbf a` at ``model_rows`` (inputs of the model, e.g. the covariance basis) and
        at the data ``x``, plus, in training, at this step's sampled rows :math:`C`, whose estimate
        :math:`\tfrac{M}{b}\mathbf a_C^\top[\mathbf K_{C\alpha}\mathbf a]` of :math:`\mathbf a^\top\mathbf K_\alpha
        \mathbf a` is kept (``sampled_quadratic_form``) for the step's KL.

        When ``x`` has the batch shape of the model's rows (or, without rows, of the coefficients), everything comes
        from one call of ``model.forward`` at :math:`[\text{model\_rows}\ldots; C; \mathbf x; \alpha]`, which is
        returned as well (its blocks among the model's rows and :math:`\mathbf x` are there for the caller to reuse);
        otherwise the prior is None.
        """
        drawn = self.draw_rows(coefficients) if self.training else None
        batch_shape = model_rows[0].shape[:-2] if model_rows else coefficients.shape[:-1]
        rows = list(model_rows)
        if drawn is not None:
            rows.append(self.inducing_points[drawn[0]].expand(*batch_shape, -1, -1))
        if not rows:
            return MeanBasisValues([], self.values(x, coefficients, **kwargs), None)
        sizes = [row.size(-2) for row in rows]
        prior = None
        if x.shape[:-2] == batch_shape:
            values, prior = self.values_and_prior([*rows, x], coefficients, **kwargs)
            *row_values, data_values = values.split([*sizes, x.size(-2)], dim=-1)
        else:  # a data batch the model does not have: keep the model's quantities free of it
            row_values = list(self.values(torch.cat(rows, dim=-2), coefficients, **kwargs).split(sizes, dim=-1))
            data_values = self.values(x, coefficients, **kwargs)
        if drawn is not None:
            indices, probabilities = drawn
            if probabilities is None:
                self.sampled_quadratic_form = self.column_sampled_estimate(coefficients, indices, row_values.pop())
                self.sampled_indices = indices
            else:
                self.sampled_rows = SampledRows(indices, probabilities, row_values.pop())
        return MeanBasisValues(row_values, data_values, prior)

    # ------------------------------------------------------------------ a^T K a
    def column_sampled_estimate(self, coefficients: Tensor, indices: Tensor, row_products: Tensor) -> Tensor:
        r"""The unbiased estimate :math:`\tfrac{M}{b}\mathbf a_C^\top[\mathbf K_{C\alpha}\mathbf a]` of
        :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a` from :math:`b` rows :math:`C` drawn uniformly without
        replacement (``indices``) and their products ``row_products`` :math:`= \mathbf K_{C\alpha}\mathbf a`."""
        return self.inducing_points.size(-2) / indices.numel() * (coefficients[..., indices] * row_products).sum(-1)

    def cross_covariance(self, x1: Tensor, x2: Tensor, **kwargs) -> LinearOperator:
        """The (lazy) prior covariance between two input sets, from one evaluation of the model's prior."""
        return joint_prior(self.model, x1, x2, **kwargs).covariance(0, 1)

    def quadratic_form(self, coefficients: Tensor, indices: Tensor | None = None) -> Tensor:
        r"""
        :math:`\mathbf a^\top\mathbf K_\alpha\mathbf a`: exact in eval mode, with ``num_kl_columns=None`` or for a
        basis of at most ``exact_kl_size`` points (:func:`~gpytorch_decoupled.linalg.kernel_quadratic_form`: one sweep
        over the tiles of the upper triangle, memory of one tile); otherwise, in training, the unbiased estimate from
        this step's uniformly sampled rows (drawn with the data by :meth:`fused_values`, or here if they have not
        been); for explicit ``indices``, the estimate from those rows of :math:`\mathbf K_\alpha`.
        """
        if indices is None and self.sampled_quadratic_form is not None:
            return self.sampled_quadratic_form
        if indices is None and not self.exact_quadratic_form():
            indices = self.sampled_indices = self._uniform_rows()
        if indices is None:  # exact: the block itself (no probe for a fused path; a lazy block is swept in row blocks)
            block = joint_prior(self.model, self.inducing_points).covariance(0, 0)
            return kernel_quadratic_form(block, coefficients, block_size=self.kl_block_size)
        return column_sampled_quadratic_form(
            self.cross_covariance,
            self.inducing_points,
            coefficients,
            indices=indices,
            block_size=self.kl_block_size,
        )

    # ------------------------------------------------------------------ growth
    @torch.no_grad()
    def grow(self, points: Tensor) -> None:
        """Appends points to the basis with zero coefficients, which leaves the mean function unchanged. The grown
        tensors are new parameters (:class:`~gpytorch_decoupled.optim.OnlineBasisGrowth` gives them to optimizers)."""
        if points.dim() != 2:
            raise ValueError(f"new mean basis points must have shape (n, D), got {tuple(points.shape)}.")
        coefficients = self.coefficients
        padding = coefficients.new_zeros(*coefficients.shape[:-1], points.size(-2))
        replace_tensor(self, "inducing_points", torch.cat([self.inducing_points, points]))
        if self._coefficient_source is None:
            replace_tensor(self, "coefficients", torch.cat([coefficients, padding], dim=-1))
        else:
            replace_tensor(self._coefficient_source, "mean_coefficients", torch.cat([coefficients, padding], dim=-1))


def _generator_device(device: torch.device) -> torch.device:
    """Where a generator for draws on ``device`` (a tensor's, so with its index) lives: there, or on the CPU for a
    device without generators (``meta``)."""
    return torch.device("cpu") if device.type == "meta" else device


def _generator_on(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=_generator_device(device)).manual_seed(seed)


def _seed_from(state: Tensor) -> int:
    """A seed determined by a generator's state (of any device)."""
    digest = hashlib.blake2b(state.cpu().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _keep_generator_state_if_absent(module: MeanBasis, state_dict, prefix, *args) -> None:
    """Checkpoints saved before the generator was part of the state load with the generator as it is."""
    state_dict.setdefault(prefix + "_extra_state", module.get_extra_state())
