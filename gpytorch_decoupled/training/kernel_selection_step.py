from __future__ import annotations

import itertools
import math

import torch
from gpytorch.means import ConstantMean
from gpytorch.variational import CholeskyVariationalDistribution, UnwhitenedVariationalStrategy, VariationalStrategy
from torch import Tensor

from ..gpytorch_compat import initialize_variational_distribution
from ..linalg import all_finite, keep_freed_cpu_memory
from ..models import CandidateBankGP, KernelSelectionGP
from ..validation import check_positive_int, checks_target_values
from .lean_candidate_bank import LeanCandidateBank
from .lean_likelihood import LeanLikelihood
from .lean_local_elbos import LeanLocalELBOs
from .optimizer_updates import current_update, optimizer_update, rate_tensor, unsupported_optimizer
from .training_step import (
    _own_code,
    _signature,
    _updated_in_place,
    _uses_cuda_graphs,
    batch_size_is_dynamic,
    mark_batch_dynamic,
    mark_stepped,
    unsupported_torch,
    warn_fallback,
)


class KernelSelectionStep:
    r"""
    One training step of variational Bayesian kernel selection (:class:`~gpytorch_decoupled.models.KernelSelectionGP`),
    ``local_elbos = step(x, y)``: the mini-batch estimates :math:`\hat{\mathcal L}_c / n` of every candidate's local
    ELBO (:meth:`~gpytorch_decoupled.models.KernelSelectionGP.local_elbos` divided by :math:`n`), the gradients of the
    loss :math:`-\sum_c\hat{\mathcal L}_c / n` and the optimizer's update, as one function that :func:`torch.compile`
    captures whole (no graph break). :meth:`KernelSelectionGP.fit <gpytorch_decoupled.models.KernelSelectionGP.fit>`
    takes its steps with it (``compile=True`` there compiles them).

    The lean path (:class:`~gpytorch_decoupled.training.LeanLocalELBOs`) computes the local ELBOs of the default
    sub-models (a full-covariance :math:`q(\mathbf u_c)` per candidate at shared inducing inputs, a constant mean and
    Gaussian noise per candidate; GPyTorch's whitened :class:`~gpytorch.variational.VariationalStrategy` with point
    hyperparameters, its :class:`~gpytorch.variational.UnwhitenedVariationalStrategy` with a hyperparameter posterior,
    whose draws :math:`\varepsilon` are made before the compiled region by the same generator call as the model's own
    pass) by plain tensor operations with the values and gradients of the general path: the bank's covariances by
    :class:`~gpytorch_decoupled.training.LeanCandidateBank`, the batched SVGP terms by
    :func:`~gpytorch_decoupled.training.lean_strategies.svgp_terms` or
    :func:`~gpytorch_decoupled.training.lean_strategies.unwhitened_svgp_terms`, the expected log-likelihood by
    :class:`~gpytorch_decoupled.training.LeanLikelihood`; the gradients by :func:`torch.autograd.grad` and the update by
    :func:`~gpytorch_decoupled.training.optimizer_updates.optimizer_update` (:class:`torch.optim.Adam` or
    :class:`torch.optim.SGD`). Anything else (another strategy or likelihood, priors on parameters, another optimizer,
    ``lean=False``) takes the eager step on GPyTorch's general path, with one warning naming the reason
    (:attr:`fallback_reason`); so does a mini-batch equal to the inducing points with a hyperparameter posterior
    (GPyTorch's unwhitened strategy then returns :math:`q(\mathbf u)` itself). Outside the compiled region: training
    mode, :math:`q(\mathbf u)`'s initialization on the first step (as GPyTorch's), the posterior's draws, the inputs'
    checks (before anything changes) and the loss's finiteness (a ``RuntimeError`` after the step). CUDA graphs
    (``mode="reduce-overhead"`` on a GPU) are prepared as :class:`~gpytorch_decoupled.training.TrainingStep` prepares
    them (static addresses of the optimizer's state and the model's buffers, the returned estimates copied).

    :param model: The model.
    :param optimizer: Steps the model's parameters (not the kernel belief's, which :meth:`fit_kernel_belief` fits).
    :param num_data: The number :math:`n` of training points (the mini-batch scale is :math:`n/B`).
    :param compile: Compile the step with :func:`torch.compile` (False runs the same lean step eagerly).
    :param lean: Use the lean path where supported (False always runs the eager general step).
    :param compile_options: Keyword arguments of :func:`torch.compile` (``mode``, ``dynamic``, ``backend`` ...).

    Example:
        >>> import math, torch
        >>> from gpytorch_decoupled.models import KernelSelectionGP
        >>> from gpytorch_decoupled.training import KernelSelectionStep
        >>> x = torch.linspace(0, 6, 200).unsqueeze(-1)
        >>> y = torch.sin(2 * math.pi * x.squeeze(-1)) + 0.1 * torch.randn(200)
        >>> model = KernelSelectionGP(["SE", "PER", "SE + PER"], inducing_points=x[::10].clone())
        >>> adam = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("kernel_belief")])
        >>> step = KernelSelectionStep(model, adam, num_data=200, backend="eager")  # "inductor" (default) is faster
        >>> traces = torch.stack([step(x, y) for _ in range(20)])
        >>> traces.shape, bool((traces[-1] > traces[0]).all())
        (torch.Size([20, 3]), True)
    """

    def __init__(
        self,
        model: KernelSelectionGP,
        optimizer: torch.optim.Optimizer,
        num_data: int,
        *,
        compile: bool = True,
        lean: bool = True,
        **compile_options,
    ):
        if not isinstance(model, KernelSelectionGP):
            raise TypeError(f"KernelSelectionStep needs a KernelSelectionGP, got {type(model).__name__}.")
        check_positive_int(num_data, "num_data")
        keep_freed_cpu_memory()
        self.model = model
        self.optimizer = optimizer
        self.num_data = num_data
        self.compiled = compile
        self.parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        if len({id(parameter) for parameter in self.parameters}) != len(self.parameters):
            raise ValueError("a parameter is in the optimizer twice.")
        reason = "lean=False" if not lean else self.unsupported(model, optimizer)
        self.fallback_reason: str | None = reason
        r"""Why the step runs eagerly on GPyTorch's general path, or None when it runs the (compiled) lean path."""
        self._checked_signature: tuple | None = None
        self._finiteness_suffices = not checks_target_values(model.likelihood)
        if reason is not None:
            if lean:
                warn_fallback(reason, "the lean kernel-selection step", "on GPyTorch's general path")
            self._function = None
            return
        self.lean = LeanLocalELBOs(model)
        ends = itertools.accumulate(len(group["params"]) for group in optimizer.param_groups)
        self._positions = [
            list(range(end - len(group["params"]), end)) for end, group in zip(ends, optimizer.param_groups)
        ]
        self._update = optimizer_update(optimizer, self._positions)
        self._dynamic_batch = compile and batch_size_is_dynamic(compile_options)
        self._cuda_graphs = compile and _uses_cuda_graphs(compile_options)
        if self._cuda_graphs:  # as TrainingStep: what the step updates in place keeps its address
            for tensor in _updated_in_place([optimizer], model):
                torch._dynamo.mark_static_address(tensor)
        self._function = torch.compile(_own_code(self._lean_step), **compile_options) if compile else self._lean_step
        self._trace_autograd_ops = torch._dynamo.config.patch(trace_autograd_ops=True)

    @staticmethod
    def unsupported(model: KernelSelectionGP, optimizer) -> str | None:
        """Why the lean path cannot take ``model``'s step with ``optimizer``, or None when it can."""
        reason = unsupported_torch() or unsupported_optimizer(optimizer)
        if reason is not None:
            return reason
        if type(optimizer) not in (torch.optim.Adam, torch.optim.SGD):
            return f"{type(optimizer).__name__} (supported: torch.optim.Adam, torch.optim.SGD)"
        candidates = model.candidates
        strategy = candidates.variational_strategy
        if type(candidates) is not CandidateBankGP or type(candidates.mean_module) is not ConstantMean:
            return f"the sub-models {type(candidates).__name__} (supported: CandidateBankGP with its ConstantMean)"
        # the default strategies: whitened with point hyperparameters, unwhitened with a posterior
        expected = VariationalStrategy if model.hyperparameter_posterior is None else UnwhitenedVariationalStrategy
        if type(strategy) is not expected or type(strategy._variational_distribution) is not (
            CholeskyVariationalDistribution
        ):
            return (
                f"the strategy {type(strategy).__name__} of {type(strategy._variational_distribution).__name__} "
                f"(supported: {expected.__name__} of CholeskyVariationalDistribution)"
            )
        if strategy.inducing_points.dim() != 2:
            return "inducing points with a batch shape (supported: shared by all candidates, (M, d))"
        reason = LeanCandidateBank.unsupported(model.kernel)
        if reason is not None:
            return reason
        if LeanLikelihood.of(model.likelihood, torch.Size([model.num_candidates])) is None:
            return (
                f"the likelihood {type(model.likelihood).__name__} (supported: GaussianLikelihood with batch [C], "
                "BernoulliLikelihood)"
            )
        if any(True for _ in model.named_priors()):
            return "a parameter has a prior (its log-density term is not part of the local ELBOs)"
        trained = {id(p) for name, p in model.named_parameters() if not name.startswith("kernel_belief.")}
        if any(id(parameter) not in trained for group in optimizer.param_groups for parameter in group["params"]):
            return "an optimizer stepping parameters other than the candidates' and the likelihood's"
        return None

    def _lean_step(self, x: Tensor, y: Tensor, draws: Tensor | None, rates: Tensor) -> Tensor:
        expected_log_likelihood, kl = self.lean(x, y, self.num_data, draws)
        local_elbos = (expected_log_likelihood - kl) / self.num_data
        gradients = torch.autograd.grad(-local_elbos.sum(), self.parameters, allow_unused=True)
        with torch.no_grad():
            self._update(gradients, rates, None)
        return local_elbos.detach()

    def _eager_step(self, x: Tensor, y: Tensor) -> Tensor:
        self.optimizer.zero_grad()
        expected_log_likelihood, kl = self.model._local_elbo_terms(x, y, self.num_data)
        local_elbos = (expected_log_likelihood - kl) / self.num_data
        (-local_elbos.sum()).backward()
        self.optimizer.step()
        return local_elbos.detach()

    def _is_inducing_batch(self, x: Tensor) -> bool:
        """Whether ``x`` is the inducing points of an unwhitened strategy (whose forward pass then returns
        :math:`q(\\mathbf u)`: the lean path leaves that case to the general one)."""
        if self.model.hyperparameter_posterior is None:
            return False
        inducing_points = self.model.candidates.variational_strategy.inducing_points
        return x.shape == inducing_points.shape and bool(torch.equal(x, inducing_points))

    def _check(self, x: Tensor, y: Tensor) -> None:
        """Validates the mini-batch before anything changes, as :class:`~gpytorch_decoupled.training.TrainingStep`
        does: in full where its types, shapes, dtypes or devices changed or the likelihood reads the targets' values
        (labels), else that its entries are finite."""
        signature = _signature(x, y, self.model.candidates.variational_strategy.inducing_points)
        if signature == self._checked_signature and self._finiteness_suffices and all_finite(x, y):
            return
        self.model._checked_data(x, y)
        if not self.num_data >= y.size(-1):
            raise ValueError(f"num_data ({self.num_data}) must be at least the batch size ({y.size(-1)}).")
        self._checked_signature = signature

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        r"""Takes one step on the mini-batch ``(x, y)`` (``(B, d)`` and ``(B,)``) and returns every candidate's
        local-ELBO estimate divided by :math:`n`, ``(C,)``, before the update (the loss is minus their sum)."""
        self._check(x, y)
        self.model.train()
        if self._function is None or self._is_inducing_batch(x):
            return self._eager_step(x, y)
        initialize_variational_distribution(self.model.candidates.variational_strategy)
        draws = self.lean.draws()
        rates = rate_tensor([self.optimizer], [None], x.device)
        self._update = current_update(self._update, self.optimizer, self._positions)
        if self._dynamic_batch:
            mark_batch_dynamic(x, y)
        with self._trace_autograd_ops:
            local_elbos = self._function(x, y, draws, rates)
        if self._cuda_graphs:  # the graph's output memory is overwritten by its next replay
            local_elbos = local_elbos.clone()
        mark_stepped([self.optimizer])
        if not math.isfinite(local_elbos.sum().item()):
            raise RuntimeError(
                "the kernel-selection step's local ELBOs are not finite (e.g. a kernel matrix that is not positive "
                "definite even with the largest jitter); the parameters were updated with non-finite values."
            )
        return local_elbos
