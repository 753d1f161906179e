from __future__ import annotations

import torch
from torch import Tensor
from torch.func import functional_call, jvp, vmap

from ..linalg import keep_freed_cpu_memory
from ..optim import RecursiveGradientPropagation
from ..variational import KalmanIncrements, KalmanVariationalStrategy
from .lean_kalman_blocks import NOT_FINITE, LeanKalmanBlocks, all_finite
from .optimizer_updates import current_update, optimizer_update, rate_tensor, unsupported_optimizer
from .training_step import _own_code, mark_stepped, unsupported_torch, warn_fallback


class RecursiveTrainingStep:
    r"""
    SRGP's step (:meth:`~gpytorch_decoupled.optim.RecursiveGradientPropagation.step`, `Schuerch et al. (2020)`_,
    Sec. 4.1, eqs. 26-28) as one function that :func:`torch.compile` captures whole, ``psi = step(x, y)``: the
    mini-batch's bound term :math:`\psi_k` from the stored statistics and its reverse pass, the total gradient with the
    propagated Jacobians (:math:`\mathbf g_k = \partial\psi_k/\partial\theta + \mathbf J_\eta^\top
    \bar{\boldsymbol\eta} + \langle\mathbf J_\Lambda, \bar{\boldsymbol\Lambda}\rangle`), the Kalman update (the
    closed-form absorption of the mini-batch), the forward-mode Jacobians of its increments added to the propagated
    ones, and the optimizer's step, in one graph with no graph break. With ``propagate="none"`` it is the Kalman update
    and one hyperparameter step on the mini-batch's term of the recursive collapsed bound at the stored statistics.
    Built by :func:`~gpytorch_decoupled.training.compile_training_step`.

    It reads and updates the SRGP object's own state (its Jacobians and epoch, the strategy's statistics, the
    optimizer's state), so compiled and eager steps (``srgp.step``), ``start_epoch()`` and ``state_dict()`` mix
    freely, and returns what ``srgp.step(x, y)`` returns, to float rounding.

    * **Supported** (:attr:`fallback_reason` is None): the model's prior as
      :class:`~gpytorch_decoupled.training.LeanKalmanBlocks` computes it, an optimizer :class:`torch.optim.Adam` or
      :class:`torch.optim.SGD` (as :func:`~gpytorch_decoupled.training.compile_training_step` supports them), and
      for ``propagate="full"`` or ``"hyperparameters"`` the VFE or DTC model, whose increments' Jacobians come from
      the tangents of the kernel block alone (FITC, PITC and PEP propagate them through whole increments in forward
      mode, through the jittered Cholesky factor's custom forward-mode rule, which Dynamo does not trace; with
      ``propagate="none"`` every approximation is supported). Anything else runs ``srgp.step`` eagerly, with a
      warning naming the reason.
    * **Outside the graph**, cheaply, once per step: the input checks of ``srgp.step`` (a ``ValueError`` before
      anything changes), the epoch's start, the leaves of the statistics and of the prior at the epoch's start, a copy
      of the parameters and the optimizer's state, and after the graph the count of absorbed points, the warnings on
      jumps and drift, and the check of the step's flag.
    * **Failures**: where ``srgp.step`` raises before changing anything (increments or Jacobians not finite, a
      matrix not positive definite even at the largest jitter: ``NotPSDError`` there), the compiled step adds nothing
      to the state and the Jacobians, restores the parameters and the optimizer's state from the copy, and raises a
      ``RuntimeError``: nothing has changed.
    * The check of the Jacobians' structure at an epoch's first mini-batch is not needed: the lean prior is
      pointwise by construction (``srgp``'s record of it is set as the check would set it).

    :param srgp: The SRGP object (its model, likelihood and optimizer).
    :param compile: Compile the step (False runs the same lean step eagerly).
    :param lean: Use the lean path where supported (False: always ``srgp.step``).
    :param compile_options: Keyword arguments of :func:`torch.compile`.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.training import compile_training_step
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z, likelihood):
        ...         super().__init__(KalmanVariationalStrategy(self, z, likelihood=likelihood))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = RecursiveGP(torch.linspace(-3, 3, 8).unsqueeze(-1), likelihood)
        >>> x = torch.linspace(-3, 3, 200).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1))
        >>> from gpytorch_decoupled.optim import RecursiveGradientPropagation
        >>> adam = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
        >>> srgp = RecursiveGradientPropagation(model, likelihood, adam)
        >>> step = compile_training_step(srgp, backend="eager")  # "inductor" (the default) is faster
        >>> srgp.start_epoch()
        >>> psi = [step(x_batch, y_batch) for x_batch, y_batch in zip(x.split(50), y.split(50))]
        >>> model.variational_strategy.num_observed, bool(torch.stack(psi).isfinite().all())
        (200, True)

    .. _Schuerch et al. (2020):
        https://arxiv.org/abs/1910.08393
    """

    def __init__(
        self, srgp: RecursiveGradientPropagation, *, compile: bool = True, lean: bool = True, **compile_options
    ):
        keep_freed_cpu_memory()
        self.srgp = srgp
        self.strategy = srgp.strategy
        self.compiled = compile
        reason = "lean=False" if not lean else _unsupported(srgp)
        self.fallback_reason: str | None = reason
        r"""Why the step runs ``srgp.step`` eagerly, or None when it runs the (compiled) lean step."""
        if reason is not None:
            if lean:
                warn_fallback(reason, "the lean SRGP step", "(srgp.step)")
            self._function = None
            return
        model = self.strategy.model
        self.blocks = LeanKalmanBlocks(model, self.strategy.likelihood)
        parameters = srgp._parameters
        positions = {id(parameter): index for index, parameter in enumerate(parameters)}
        # a parameter of the optimizer that SRGP does not step (no requires_grad) reads the trailing None gradient
        groups = [
            [positions.get(id(p), len(parameters)) for p in group["params"]] for group in srgp.optimizer.param_groups
        ]
        self._groups = groups
        self._update = optimizer_update(srgp.optimizer, groups)
        in_kernel = {id(parameter) for parameter in model.covar_module.parameters()} | {
            id(self.strategy.inducing_points)
        }
        self._in_kernel = {name: id(parameter) in in_kernel for name, parameter in self.blocks.named_parameters()}
        self._function = torch.compile(_own_code(self._lean_step), **compile_options) if compile else self._lean_step

    # ------------------------------------------------------------------ the graph
    def _lean_step(
        self,
        x: Tensor,
        y: Tensor,
        information_vector: Tensor,
        information_matrix: Tensor,
        epoch: dict | None,
        rates: Tensor,
    ) -> tuple[Tensor, Tensor]:
        srgp, parameters = self.srgp, self.srgp._parameters
        prior_keys = [] if epoch is None else [key for key, value in epoch.items() if value.requires_grad]
        with torch.enable_grad():
            terms, inducing_covariance = self.blocks.observation_terms(x, y)
            if epoch is not None:  # prior="frozen": K_uu at the epoch's start, a function of its leaves
                inducing_covariance = functional_call(self.blocks, epoch, ())
            psi = KalmanVariationalStrategy.bound_term(
                terms, inducing_covariance, information_vector, information_matrix
            )
            leaves = [*parameters, information_vector, information_matrix, *(epoch[key] for key in prior_keys)]
            gradients = torch.autograd.grad(psi.sum(), leaves, allow_unused=True)
        count = len(parameters)
        direct, (vector_adjoint, matrix_adjoint) = gradients[:count], gradients[count : count + 2]
        with torch.no_grad():
            histories = srgp._history(vector_adjoint, matrix_adjoint)
            names = {name: parameter for name, parameter in self.blocks.named_parameters()}
            for key, gradient in zip(prior_keys, gradients[count + 2 :], strict=True):
                if gradient is not None:
                    key = id(names[key])
                    histories[key] = histories[key] + gradient.double() if key in histories else gradient.double()
            increments, done = self.blocks.increments(terms, psi)
            jacobians = self._increment_jacobians(x, y, increments)
            done = done & all_finite(*jacobians)
            self._add_jacobians(jacobians, done)
            self.blocks.absorb(increments, done)
            totals = []
            for parameter, gradient in zip(parameters, direct, strict=True):
                total = torch.zeros_like(parameter) if gradient is None else gradient.detach().clone()
                if id(parameter) in histories:
                    total += histories[id(parameter)].to(parameter.dtype)
                totals.append(total.neg_())
            self._update([*totals, None], rates)
        return psi.detach().sum(), done

    def _increment_jacobians(self, x: Tensor, y: Tensor, increments: KalmanIncrements) -> tuple[Tensor, ...]:
        r"""
        The Jacobians of the mini-batch's increments that ``srgp`` propagates, by the product rule from the tangents
        of the lean kernel block :math:`\dot{\mathbf K}_{\mathbf uk}`, :math:`\dot\mu_0`, :math:`\dot\sigma^2`, the
        formulas of :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation` for VFE and DTC: the dense ones,
        ``(M, P)`` and packed ``(M(M+1)/2, P)``, and with structured inducing inputs their summed values and rows. All
        unit directions of a parameter go in one vectorized forward-mode pass (``srgp``'s chunks bound the memory of
        many directions; here the dense parameters are the few hyperparameters, and the inducing inputs have one
        direction per input dimension).
        """
        srgp = self.srgp
        rows, cols = srgp._triangle()
        cross, mean, noise = self.blocks(x)
        residual = (y - mean).unsqueeze(-1)
        inverse_noise = noise.double().reciprocal()
        scale = inverse_noise.unsqueeze(-1)

        def tangents(name: str, primal: Tensor, directions: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
            def blocks(value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
                return functional_call(self.blocks, {name: value}, (x,))

            cross_tangent, mean_tangent, noise_tangent = vmap(lambda t: jvp(blocks, (primal,), (t,))[1])(directions)
            vectors = -(cross @ mean_tangent.unsqueeze(-1)).squeeze(-1).double() * scale
            products = None
            if self._in_kernel[name]:  # decided once, not from the data (srgp looks for a zero tangent)
                products = (cross_tangent @ cross.mT).double() * scale.unsqueeze(-1)
                vectors += (cross_tangent @ residual).squeeze(-1).double() * scale
            relative = (noise_tangent.double().view(directions.size(0), *noise.shape) * inverse_noise).unsqueeze(-1)
            return products, vectors, relative

        vectors, matrices = [srgp._vector_jacobian[..., :0]], [srgp._matrix_jacobian[..., :0]]
        for name, parameter in zip(srgp._dense_names, srgp._dense_parameters, strict=True):
            directions = torch.eye(parameter.numel(), dtype=parameter.dtype, device=parameter.device)
            products, vector, relative = tangents(name, parameter.detach(), directions.view(-1, *parameter.shape))
            matrix = -increments.information_matrix[..., rows, cols] * relative
            if products is not None:
                matrix += products[..., rows, cols] + products[..., cols, rows]
            vector -= increments.information_vector * relative
            vectors.append(vector.movedim(0, -1))
            matrices.append(matrix.movedim(0, -1))
        dense = (torch.cat(vectors, dim=-1), torch.cat(matrices, dim=-1))
        if srgp._inducing_jacobians is None:
            return dense
        # Along axis d every inducing input moves: row m of the product is sigma^2 rho_md (row m of K_uk's tangent is
        # c_md, the derivative of k(z_m, X_k) in Z_md), and the vector's entry m is nu_md.
        inducing_points = self.strategy.inducing_points
        dims = inducing_points.size(-1)
        directions = torch.eye(dims, dtype=inducing_points.dtype, device=inducing_points.device)
        directions = directions.unsqueeze(-2).expand(dims, *inducing_points.shape)
        products, vector, _ = tangents(srgp._names[id(inducing_points)], inducing_points.detach(), directions)
        return (*dense, vector.movedim(0, -1), products.movedim(0, -2))

    def _add_jacobians(self, jacobians: tuple[Tensor, ...], done: Tensor) -> None:
        srgp = self.srgp
        totals = [srgp._vector_jacobian, srgp._matrix_jacobian]
        if srgp._inducing_jacobians is not None:
            totals += [srgp._inducing_jacobians.values, srgp._inducing_jacobians.rows]
        for total, increment in zip(totals, jacobians, strict=True):
            total.add_(torch.where(done, increment, torch.zeros_like(increment)))

    # ------------------------------------------------------------------ around the graph
    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """One SRGP step on the mini-batch ``(x, y)``; returns :math:`\\psi_k` (detached, before the step)."""
        srgp, strategy = self.srgp, self.strategy
        if self._function is None:
            return srgp.step(x, y)
        x, y = strategy.checked_data(x, y)
        if srgp._vector_jacobian is None:
            srgp.start_epoch()
        if strategy.num_observed != srgp._num_observed:
            srgp.step(x, y)  # raises its error (state and Jacobians out of step) before it changes anything
        information_vector, information_matrix = (
            statistic.detach().clone().requires_grad_(True) for statistic in strategy.statistics
        )
        epoch = None
        if srgp.prior == "frozen":
            optimized = {id(parameter) for parameter in srgp._parameters}
            parameters = dict(self.blocks.named_parameters())
            epoch = {
                name: value.detach().requires_grad_(id(parameters[name]) in optimized)
                for name, value in srgp._epoch_parameters.items()
            }
        saved = _optimizer_snapshot(srgp.optimizer)
        # the optimizer's rates as data: a learning-rate scheduler does not recompile the step
        rates = rate_tensor([srgp.optimizer], [None], x.device)
        self._update = current_update(self._update, srgp.optimizer, self._groups)
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            psi, done = self._function(x, y, information_vector, information_matrix, epoch, rates)
        if not done:
            _restore(srgp.optimizer, saved)
            raise RuntimeError(
                NOT_FINITE + "the state, the Jacobians, the parameters and the optimizer's state were left unchanged."
            )
        mark_stepped([srgp.optimizer])
        self.blocks.count(x.size(-2))
        srgp._num_observed = strategy.num_observed
        if srgp._inducing_jacobians is not None:
            srgp._structure_verified = True
        srgp._warn_on_jumps(float(psi) / x.size(-2))
        return psi.to(strategy.inducing_points.dtype)


def _unsupported(srgp: RecursiveGradientPropagation) -> str | None:
    """Why the lean path cannot take ``srgp``'s step, or None when it can."""
    if type(srgp) is not RecursiveGradientPropagation:
        return f"{type(srgp).__name__} (supported: RecursiveGradientPropagation; no subclasses)"
    reason = unsupported_torch() or LeanKalmanBlocks.unsupported(srgp.strategy.model, srgp.strategy.likelihood)
    if reason is not None:
        return reason
    if type(srgp.optimizer) not in (torch.optim.Adam, torch.optim.SGD):
        return f"SRGP with {type(srgp.optimizer).__name__} (supported: torch.optim.Adam, torch.optim.SGD)"
    reason = unsupported_optimizer(srgp.optimizer)
    if reason is not None:
        return reason
    # the models whose noise V_k = sigma^2 I does not depend on the inducing inputs: their increments' Jacobians come
    # from the kernel block's tangents alone (RecursiveGradientPropagation takes the same path for them)
    if srgp.propagated_parameters and srgp.strategy.approximation not in ("vfe", "dtc"):
        return (
            f"propagated Jacobians of the {srgp.strategy.approximation.upper()} model (forward mode through whole "
            'increments; supported: VFE, DTC, or propagate="none")'
        )
    return None


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
    """Copies of every parameter and state tensor of ``optimizer``, to restore after a failed step."""
    tensors = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    tensors += [value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]
    return [(tensor, tensor.detach().clone()) for tensor in tensors]


@torch.no_grad()
def _restore(optimizer: torch.optim.Optimizer, saved: list[tuple[Tensor, Tensor]]) -> None:
    for tensor, copy in saved:
        tensor.copy_(copy)
