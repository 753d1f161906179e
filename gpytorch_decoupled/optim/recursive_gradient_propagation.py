from __future__ import annotations

import warnings
from typing import Any

import torch
from gpytorch import settings
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ApproximateGP
from torch import Tensor
from torch.func import functional_call, jvp, vmap

from ..variational import KalmanIncrements, KalmanVariationalStrategy
from ._inducing_jacobians import STRUCTURED_APPROXIMATIONS, InducingJacobians
from ._rbf_cross_tangents import RBFCrossTangents

PROPAGATE = ("full", "hyperparameters", "none")
PRIORS = ("frozen", "current")

# Elements of the per-chunk Jacobian intermediates (float64: 128 MiB) that the automatic chunk size aims for.
_CHUNK_ELEMENTS = 2**24
# The same for the kernel tangents of VFE and DTC (float64: 16 MiB): chunks of them that stay in cache take half the
# time of larger ones (M = 100, B = 1000, one thread).
_CACHED_ELEMENTS = 2**21


class _Increments(torch.nn.Module):
    r"""The model and likelihood as submodules, so that :func:`torch.func.functional_call` swaps their parameters;
    the forward pass is a mini-batch's information increments (the packed upper triangle of the matrix), without ``x``
    the jittered float64 :math:`\mathbf K_{\mathbf{uu}}`, or without ``y`` what the increments of VFE and DTC are
    made of: :math:`\mathbf K_{\mathbf uk}`, :math:`\mu_0(\mathbf X_k)`
    and :math:`\sigma^2`, in the model's dtype."""

    def __init__(self, model: ApproximateGP, likelihood: GaussianLikelihood):
        super().__init__()
        self.model = model
        self.likelihood = likelihood

    def forward(
        self, x: Tensor | None = None, y: Tensor | None = None, rows: Tensor | None = None, cols: Tensor | None = None
    ) -> Tensor | tuple[Tensor, ...]:
        strategy = self.model.variational_strategy
        if x is None:
            return strategy.inducing_covariance()
        if y is None:
            return (*strategy.data_prior(x), self.likelihood.noise[..., 0])
        terms, _ = strategy.observation_terms(x, y)
        return terms.information_vector, terms.information_matrix[..., rows, cols]


class RecursiveGradientPropagation:
    r"""
    Stochastic recursive gradient propagation (SRGP, `Schuerch et al. (2020)`_, Sec. 4.1, eqs. 26-28 and Prop. 1;
    :ref:`derivations-information-form`): learns the hyperparameters :math:`\theta` (kernel, mean, Gaussian noise and
    inducing inputs) of a model with a :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` from a stream
    of mini-batches, one gradient step per mini-batch on the recursive collapsed bound :math:`\sum_k\psi_k(\theta)`.

    The information-form increments of a mini-batch depend on :math:`\theta` only, not on the state, so the state's
    Jacobians :math:`\mathbf J_\eta = \partial\tilde{\boldsymbol\eta}/\partial\theta` and
    :math:`\mathbf J_\Lambda = \partial\tilde{\boldsymbol\Lambda}/\partial\theta` are running sums of the increments'
    Jacobians (computed in forward mode, :func:`torch.func.jvp` vectorized over chunks of directions). Each
    :meth:`step`, in the reference order:

    1. computes :math:`\psi_k` and its total gradient at the current :math:`\theta` from the stored statistics
       (leaves of one reverse pass) and their propagated Jacobians,

       .. math::

           \mathbf g_k = \frac{\partial\psi_k}{\partial\theta}
           + \mathbf J_\eta^\top\frac{\partial\psi_k}{\partial\tilde{\boldsymbol\eta}}
           + \sum_{a,b}(\mathbf J_\Lambda)_{ab:}
           \Big(\frac{\partial\psi_k}{\partial\tilde{\boldsymbol\Lambda}}\Big)_{ab};

    2. absorbs the mini-batch into the strategy (so ``strategy.recursive_bound`` is the running
       :math:`\sum_k\psi_k` of the epoch) and adds the increments' Jacobians to the propagated ones;
    3. sets ``p.grad`` to :math:`-\mathbf g_k` (the gradient of the loss :math:`-\psi_k`; previous gradients are
       overwritten) for every parameter of ``optimizer`` and calls ``optimizer.step()``.

    :meth:`start_epoch` resets the strategy and the Jacobians at the current :math:`\theta` (call it before each
    pass over the data). At a fixed :math:`\theta` (learning rate 0), the gradients of an epoch sum to the exact
    gradient of the batch bound (Proposition 1). While :math:`\theta` moves, each mini-batch's statistics stay those of
    the :math:`\theta` at which it was absorbed, as in the paper. ``prior`` chooses the prior
    :math:`\mathbf K_{\mathbf{uu}}` of the state: ``"frozen"`` (default) takes it at the :math:`\theta` of the epoch's
    start, as the authors' code does (its initial Jacobian :math:`-\mathbf K^{-1}\partial\mathbf K\mathbf K^{-1}` is
    kept for the whole epoch), so that the state is one consistent function of the parameters at which each of its
    parts was computed; ``"current"`` re-evaluates it at the current :math:`\theta` at every step, which mixes a prior
    at new hyperparameters with statistics absorbed at old ones (:ref:`derivations-srgp-prior`). Either way the
    gradient is exact for the state as defined: the oracle test unrolls it with automatic differentiation. Because
    the state mixes parameters, a large step shows as a bound term far below the epoch's others or as hyperparameters
    far from their values at the epoch's start; :meth:`step` warns (once per epoch each) when a term per datum falls
    more than ``bound_tolerance`` times :math:`\max(1, |\text{mean}|)` below the epoch's mean so far, or a raw
    hyperparameter (not the inducing inputs) moves more than ``drift_tolerance`` from its value at the epoch's start.
    The stochastic gradient is that of one term; Adam is invariant to its scale, plain SGD wants a learning rate
    :math:`K_b` times larger. For predictions after training, one more pass at the final :math:`\theta`
    (``strategy.reset()`` and ``strategy.update`` per mini-batch) gives the exact posterior.

    **Memory, time and the cheaper variants.** With :math:`P` propagated scalar parameters (for SE-ARD with learned
    inducing inputs :math:`P = Md + d + 2`, plus the mean's), dense Jacobians cost :math:`M(M+1)/2 \cdot P` floats
    for :math:`\mathbf J_\Lambda` (its symmetric upper triangle is stored) and :math:`MP` for :math:`\mathbf J_\eta`,
    times the number of latents, and :math:`P` forward-mode passes per mini-batch, :math:`O(P(BM^2 + M^3))`.
    ``propagate`` chooses what is propagated:

    * ``"full"``: every parameter of ``optimizer`` (the published algorithm; exact in the sense of Proposition 1).

      - VFE and DTC, whose noise :math:`\mathbf V_k = \sigma^2\mathbf I` does not depend on :math:`\mathbf Z`: the
        Jacobians of the inducing inputs are exact *and structured*. Entry :math:`(m, i)` of
        :math:`\mathbf K_{\mathbf uk}` depends on :math:`\mathbf z_m` only, so :math:`\partial\Delta\tilde{\boldsymbol
        \Lambda}_k/\partial Z_{md} = \mathbf e_m\boldsymbol\rho_{md}^\top + \boldsymbol\rho_{md}\mathbf e_m^\top` and
        :math:`\partial\Delta\tilde{\boldsymbol\eta}_k/\partial Z_{md} = \nu_{md}\mathbf e_m`, with
        :math:`\boldsymbol\rho_{md} = \mathbf K_{\mathbf uk}\mathbf c_{md}/\sigma^2`, :math:`\nu_{md} =
        \mathbf c_{md}^\top(\mathbf y_k - \mu_0(\mathbf X_k))/\sigma^2` and :math:`\mathbf c_{md} = \partial
        k(\mathbf z_m, \mathbf X_k)/\partial Z_{md}`; sums over mini-batches keep the form. Stored are the summed
        :math:`\boldsymbol\rho_{md}` and :math:`\nu_{md}`, :math:`M^2d + Md` floats, computed with :math:`d`
        forward-mode passes through :math:`\mathbf K_{\mathbf uk}` (the tangent moves every inducing input along one
        axis) and :math:`d` products, :math:`O(BM^2d)`; the history term of :math:`Z_{md}` is
        :math:`((\bar{\boldsymbol\Lambda} + \bar{\boldsymbol\Lambda}^\top)\boldsymbol\rho_{md})_m +
        \bar\eta_m\nu_{md}`. The other :math:`P - Md` parameters are dense. Memory :math:`O(M^2d)`, as
        ``"hyperparameters"``; time :math:`O((P - Md)(BM^2 + M^3) + BM^2d)`. At the first mini-batch of each epoch
        the structure is checked against one dense forward-mode pass along a random direction of :math:`\mathbf Z`;
        a model whose ``forward`` is not pointwise (it mixes the inputs) falls back, with a warning, to dense
        Jacobians.
      - FITC, PITC and PEP: every :math:`\partial\mathbf V_k/\partial Z_{md}` is a full diagonal (a full block for
        PITC) through :math:`\mathbf Q_{kk}`, so :math:`\partial\Delta\tilde{\boldsymbol\Lambda}_k/\partial Z_{md}`
        has a dense part :math:`-\mathbf K_{\mathbf uk}\mathbf V_k^{-1}(\partial\mathbf V_k/\partial Z_{md})
        \mathbf V_k^{-1}\mathbf K_{k\mathbf u}` that sums over mini-batches to no low-rank form: dense Jacobians,
        memory :math:`O(M^3d)` (for :math:`M = 500`, :math:`d = 8`, 4 GiB in float64) and :math:`P` passes.

      Measured (one thread on a shared CPU, float64, SE-ARD, constant mean, VFE), seconds per step with dense
      Jacobians for :math:`\mathbf Z` and structured ones: :math:`M = 100`, :math:`d = 5`, :math:`B = 1000`
      (:math:`P = 508`): 4-8 and 0.08-0.10 (``"hyperparameters"``: 0.06-0.08), Jacobians 20 and 0.7 MiB;
      :math:`M = 20`, :math:`d = 18`, :math:`B = 300` (:math:`P = 381`): 0.2-0.4 and 0.035-0.06
      (``"hyperparameters"``: 0.04). For a (scaled) RBF kernel, the kernel blocks' derivatives are taken in closed
      form instead of by forward mode (checked against forward mode at each epoch's first mini-batch; a model whose
      ``forward`` transforms the inputs falls back with a warning): with :math:`M = 100`, :math:`d = 8`,
      :math:`B = 1000`, structured, a step costs about 35 ms instead of 90 ms, most of it the :math:`2d` products
      :math:`(\mathbf K_{\mathbf uk}\odot\boldsymbol\delta_d^{\odot k})\mathbf K_{k\mathbf u}`.
    * ``"hyperparameters"``: every parameter except the inducing inputs :math:`\mathbf Z` (:math:`P = d + 2`, memory
      :math:`O(M^2d)`). The kernel, mean and noise gradients stay exact; the gradient of :math:`\mathbf Z` is the
      *naive* one, :math:`\partial\psi_k/\partial\mathbf Z` at fixed statistics: it drops exactly the history term
      :math:`\sum_{j<k}(\partial\psi_k/\partial\text{state})(\partial\Delta\text{state}_j / \partial\mathbf Z)`, so
      it is biased towards fitting the current mini-batch (still exact in the prior :math:`\mathbf K_{\mathbf{uu}}
      (\mathbf Z)`). For VFE and DTC, ``"full"`` costs little more; for the other models, use it when the inducing
      inputs are many, or learn them with a smaller learning rate.
    * ``"none"``: the naive gradient for every parameter (no Jacobians; memory :math:`O(M^2)`). It forgets how the
      past mini-batches depend on :math:`\theta` and overfits the current one; meant as an ablation.

    :param model: An :class:`~gpytorch.models.ApproximateGP` with a
        :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`.
    :param likelihood: The strategy's :class:`~gpytorch.likelihoods.GaussianLikelihood`.
    :param optimizer: Any :class:`torch.optim.Optimizer` over parameters of ``model`` and ``likelihood`` (typically
        Adam; per-group learning rates work as usual).
    :param propagate: ``"full"`` (default), ``"hyperparameters"`` or ``"none"`` (see above).
    :param chunk_size: Directions (for structured inducing inputs: input dimensions) per vectorized forward-mode
        pass (default: chosen to keep the intermediates near 16 MiB for VFE and DTC, 128 MiB for the other models).
    :param prior: ``"frozen"`` (default) or ``"current"``: the state's prior :math:`\mathbf K_{\mathbf{uu}}` at the
        epoch's start or at the current hyperparameters (see above).
    :param bound_tolerance: Warn when a bound term per datum falls this far (nats; relative to the mean's magnitude
        where that exceeds 1) below the epoch's mean so far (default 3; ``None``: never).
    :param drift_tolerance: Warn when a raw hyperparameter moves this far from its value at the epoch's start
        (default 1, about a factor :math:`e` of a positive hyperparameter; ``None``: never).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.optim import RecursiveGradientPropagation
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points, likelihood):
        ...         super().__init__(KalmanVariationalStrategy(self, inducing_points, likelihood=likelihood))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 500).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(500)
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = RecursiveGP(torch.linspace(-3, 3, 10).unsqueeze(-1), likelihood)
        >>> optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.05)
        >>> srgp = RecursiveGradientPropagation(model, likelihood, optimizer)
        >>> strategy, epoch_bounds = model.variational_strategy, []
        >>> for epoch in range(3):
        ...     srgp.start_epoch()
        ...     for batch in torch.randperm(500).split(100):
        ...         psi = srgp.step(x[batch], y[batch])
        ...     epoch_bounds.append(strategy.recursive_bound.item())  # the epoch's sum of terms, at a moving theta
        >>> epoch_bounds[0] < epoch_bounds[-1]
        True
        >>> strategy.reset()  # one more pass: the exact posterior at the final hyperparameters
        >>> for batch in torch.arange(500).split(100):
        ...     _ = strategy.update(x[batch], y[batch])

    .. _Schuerch et al. (2020):
        https://arxiv.org/abs/1910.08393
    """

    def __init__(
        self,
        model: ApproximateGP,
        likelihood: GaussianLikelihood,
        optimizer: torch.optim.Optimizer,
        propagate: str = "full",
        chunk_size: int | None = None,
        prior: str = "frozen",
        bound_tolerance: float | None = 3.0,
        drift_tolerance: float | None = 1.0,
    ):
        self.strategy = KalmanVariationalStrategy.of_model(model, likelihood, type(self).__name__)
        if propagate not in PROPAGATE:
            raise ValueError(f"propagate must be one of {', '.join(map(repr, PROPAGATE))}, got {propagate!r}.")
        if prior not in PRIORS:
            raise ValueError(f"prior must be one of {', '.join(map(repr, PRIORS))}, got {prior!r}.")
        self.prior = prior
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}.")
        for name, tolerance in (("bound_tolerance", bound_tolerance), ("drift_tolerance", drift_tolerance)):
            if tolerance is not None and not tolerance > 0:
                raise ValueError(f"{name} must be a positive number or None, got {tolerance}.")
        self.bound_tolerance, self.drift_tolerance = bound_tolerance, drift_tolerance
        self.optimizer = optimizer
        self.propagate = propagate
        self.chunk_size = chunk_size
        self._increment_module = _Increments(model, likelihood)
        self._names = {id(parameter): name for name, parameter in self._increment_module.named_parameters()}
        # VFE's and DTC's kernel-block tangents in closed form where the kernel is a (scaled) RBF; checked against
        # forward mode at each epoch's first mini-batch (_closed_form_at).
        self._closed_form = RBFCrossTangents.of(model, likelihood, self._names.get(id(self.strategy.inducing_points)))
        self._closed_form_verified = False
        self._parameters: list[torch.nn.Parameter] = []
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if id(parameter) not in self._names:
                    raise ValueError(
                        f"{type(self).__name__}: the optimizer holds a tensor of shape {tuple(parameter.shape)} that "
                        "is not a parameter of the model or the likelihood."
                    )
                if parameter.requires_grad and all(parameter is not known for known in self._parameters):
                    self._parameters.append(parameter)
        self.propagated_parameters: list[torch.nn.Parameter] = [
            parameter
            for parameter in self._parameters
            if propagate == "full"
            or (propagate == "hyperparameters" and parameter is not self.strategy.inducing_points)
        ]
        self._sizes = [parameter.numel() for parameter in self.propagated_parameters]
        # Whether the structured Jacobians of the inducing inputs may be used (VFE and DTC); turned off for good when
        # the model's increments turn out not to have the structure (see _checked_structure).
        self._structure_allowed = True
        self._inducing_jacobians: InducingJacobians | None = None
        self._structure_verified = False
        self._configure(structured=False)
        self._vector_jacobian: Tensor | None = None
        self._matrix_jacobian: Tensor | None = None
        self._num_observed = 0
        # The parameters at the start of the epoch: the state's prior K_uu is taken at them (prior="frozen"), and the
        # drift warning measures from them.
        self._epoch_parameters: dict[str, Tensor] | None = None
        # The epoch's bound terms per datum so far (sum and count), for the warning when one falls far below them, and
        # whether the epoch has warned already (once per epoch and kind).
        self._bound_per_datum = (0.0, 0)
        self._warned: set[str] = set()

    def _configure(self, structured: bool) -> None:
        """Which propagated parameters have dense Jacobians: all of them, or all but the inducing inputs."""
        self._dense_parameters = [
            parameter
            for parameter in self.propagated_parameters
            if not (structured and parameter is self.strategy.inducing_points)
        ]
        self._dense_names = [self._names[id(parameter)] for parameter in self._dense_parameters]
        self._dense_sizes = [parameter.numel() for parameter in self._dense_parameters]

    def _structured(self) -> bool:
        """Whether the Jacobians of the inducing inputs can be propagated in their low-rank structure."""
        strategy = self.strategy
        return (
            self._structure_allowed
            and strategy.approximation in STRUCTURED_APPROXIMATIONS
            and any(parameter is strategy.inducing_points for parameter in self.propagated_parameters)
        )

    # ------------------------------------------------------------------ Jacobians
    @property
    def num_propagated(self) -> int:
        """:math:`P`, the number of scalar parameters whose Jacobians are propagated."""
        return sum(self._sizes)

    def _triangle(self) -> tuple[Tensor, Tensor]:
        num_inducing = self.strategy.inducing_points.size(-2)
        rows, cols = torch.triu_indices(num_inducing, num_inducing, device=self.strategy.inducing_points.device)
        return rows, cols

    def information_jacobians(self) -> tuple[Tensor, Tensor]:
        r"""
        The propagated Jacobians of the strategy's statistics (``information_vector`` :math:`\tilde{\boldsymbol\eta}`
        and ``information_matrix`` :math:`\tilde{\boldsymbol\Lambda} - \mathbf K_{\mathbf{uu}}`) with respect to the
        flattened :attr:`propagated_parameters`, in their order: ``(..., M, P)`` and ``(..., M, M, P)``. Those of
        structured inducing inputs are materialized (:math:`O(M^3D)` memory).
        """
        if self._vector_jacobian is None:
            raise RuntimeError("no epoch has been started; call start_epoch() first.")
        rows, cols = self._triangle()
        num_inducing = self._vector_jacobian.size(-2)
        dense = self._matrix_jacobian.new_zeros(
            *self._matrix_jacobian.shape[:-2], num_inducing, num_inducing, self._matrix_jacobian.size(-1)
        )
        dense[..., rows, cols, :] = self._matrix_jacobian
        dense[..., cols, rows, :] = self._matrix_jacobian
        if self._inducing_jacobians is None:
            return self._vector_jacobian, dense
        vectors, matrices, start = [], [], 0
        for parameter, size in zip(self.propagated_parameters, self._sizes, strict=True):
            if parameter is self.strategy.inducing_points:
                vector, matrix = self._inducing_jacobians.dense()
            else:
                vector, matrix = self._vector_jacobian[..., start : start + size], dense[..., start : start + size]
                start += size
            vectors.append(vector)
            matrices.append(matrix)
        return torch.cat(vectors, dim=-1), torch.cat(matrices, dim=-1)

    @property
    def jacobian_bytes(self) -> int:
        """Memory held by the propagated Jacobians (0 before the first epoch and for ``propagate="none"``)."""
        if self._vector_jacobian is None:
            return 0
        dense = sum(tensor.numel() * tensor.element_size() for tensor in (self._vector_jacobian, self._matrix_jacobian))
        return dense + (0 if self._inducing_jacobians is None else self._inducing_jacobians.nbytes)

    def state_dict(self) -> dict[str, Any]:
        """
        What a resumed run needs besides the model, the likelihood and the optimizer (which have their own state dicts):
        the propagated Jacobians of the current epoch, the number of points they cover and whether the structured
        Jacobians of the inducing inputs are in use. Tensors are the live ones: copy them (``torch.save`` does) to keep
        a snapshot.
        """
        inducing = self._inducing_jacobians
        return {
            "prior": self.prior,
            "epoch_parameters": self._epoch_parameters,
            "bound_per_datum": self._bound_per_datum,
            "warned": sorted(self._warned),
            "num_observed": self._num_observed,
            "structure_allowed": self._structure_allowed,
            "structure_verified": self._structure_verified,
            "vector_jacobian": self._vector_jacobian,
            "matrix_jacobian": self._matrix_jacobian,
            "inducing_jacobian_values": None if inducing is None else inducing.values,
            "inducing_jacobian_rows": None if inducing is None else inducing.rows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """
        Restores a :meth:`state_dict` of an update object for the same model and optimizer parameters (load the
        model's state dict too, so that its strategy has absorbed the same points).

        :raises ValueError: If the Jacobians do not have the shapes of this object's (other parameters, another
            number of inducing points or latents); nothing is changed then.
        """
        values, rows = state_dict["inducing_jacobian_values"], state_dict["inducing_jacobian_rows"]
        vector, matrix = state_dict["vector_jacobian"], state_dict["matrix_jacobian"]
        epoch_parameters = state_dict["epoch_parameters"]
        if state_dict["prior"] != self.prior:
            raise ValueError(f"the state was saved with prior={state_dict['prior']!r}, this object has {self.prior!r}.")
        if epoch_parameters is not None:
            expected = {name: p.shape for name, p in self._increment_module.named_parameters()}
            if expected != {name: value.shape for name, value in epoch_parameters.items()}:
                raise ValueError("the state's epoch parameters do not match the model's parameters (names or shapes).")
        structured = values is not None
        self._configure(structured)
        if vector is not None:
            expected = (self.strategy.statistics.information_vector.shape, sum(self._dense_sizes))
            found = (vector.shape[:-1], vector.size(-1))
            if found != expected or (structured and values.shape != self.strategy.inducing_points.shape):
                self._configure(self._inducing_jacobians is not None)
                raise ValueError(
                    f"the state's Jacobians have shapes {tuple(vector.shape)}, but this object propagates "
                    f"{expected[1]} scalar parameters for statistics of shape {tuple(expected[0])}."
                )
        self._num_observed = state_dict["num_observed"]
        self._epoch_parameters = epoch_parameters
        self._bound_per_datum = tuple(state_dict["bound_per_datum"])
        self._warned = set(state_dict["warned"])
        self._structure_allowed = state_dict["structure_allowed"]
        self._structure_verified = state_dict["structure_verified"]
        self._closed_form_verified = False
        self._vector_jacobian, self._matrix_jacobian = vector, matrix
        self._inducing_jacobians = InducingJacobians(values, rows) if structured else None

    def start_epoch(self) -> None:
        """Resets the strategy to the prior and the Jacobians to zero, at the current hyperparameters (with
        ``prior="frozen"``, the prior of the epoch's state is fixed here)."""
        self.strategy.reset()
        self._zero_jacobians()
        self._num_observed = 0
        self._epoch_parameters = {
            name: parameter.detach().clone() for name, parameter in self._increment_module.named_parameters()
        }
        self._bound_per_datum = (0.0, 0)
        self._warned = set()

    def _state_prior(self) -> tuple[Tensor | None, dict[str, Tensor]]:
        r"""With ``prior="frozen"``: :math:`\mathbf K_{\mathbf{uu}}` at the epoch's start, as a function of leaves
        holding those parameters, and the leaves of the optimized parameters by parameter id (their gradient, the
        adjoint of the prior contracted with its Jacobian at the epoch's start, is part of the total gradient, as the
        reference code's initial Jacobian :math:`-\mathbf K^{-1}\partial\mathbf K\mathbf K^{-1}` is; it takes one
        reverse pass through :math:`\mathbf K_{\mathbf{uu}}`, so every parameter gets it whatever ``propagate``
        says). ``None`` with ``prior="current"``."""
        if self.prior == "current":
            return None, {}
        parameters = dict(self._increment_module.named_parameters())
        optimized = {id(parameter) for parameter in self._parameters}
        values, leaves = {}, {}
        for name, value in self._epoch_parameters.items():
            value = value.detach()
            if id(parameters[name]) in optimized:
                value = value.requires_grad_(True)
                leaves[id(parameters[name])] = value
            values[name] = value
        return functional_call(self._increment_module, values, ()), leaves

    def _zero_jacobians(self) -> None:
        structured = self._structured()
        self._configure(structured)
        self._inducing_jacobians = InducingJacobians.zeros(self.strategy.inducing_points) if structured else None
        self._structure_verified = False
        self._closed_form_verified = False
        vector = self.strategy.statistics.information_vector
        *batch_shape, num_inducing = vector.shape
        size = sum(self._dense_sizes)
        self._vector_jacobian = vector.new_zeros(*batch_shape, num_inducing, size)
        self._matrix_jacobian = vector.new_zeros(*batch_shape, num_inducing * (num_inducing + 1) // 2, size)

    def _add_increment_jacobians(self, x: Tensor, y: Tensor, increments: KalmanIncrements) -> None:
        """Adds the Jacobians of a mini-batch's increments with respect to the propagated parameters to the propagated
        ones, chunk by chunk of unit directions (vectorized forward-mode passes), so that no second copy of the dense
        Jacobians is ever held: for VFE and DTC from the tangents of the kernel blocks alone (and those of the inducing
        inputs in their structure), for the other models through the whole increments."""
        rows, cols = self._triangle()
        # trace_mode keeps GPyTorch's kernels off custom autograd Functions, which have no forward-mode rules.
        with torch.no_grad(), settings.trace_mode(True):
            if self.strategy.approximation in STRUCTURED_APPROXIMATIONS:
                self._add_block_jacobians(x, y, rows, cols, increments)
            else:
                self._add_dense_jacobians(x, y, rows, cols)

    def _chunk(self, per_direction: int, elements: int = _CHUNK_ELEMENTS) -> int:
        batch_size = self.strategy.statistics.information_vector[..., 0].numel()
        return self.chunk_size or max(1, elements // (batch_size * per_direction))

    def _add_dense_jacobians(self, x: Tensor, y: Tensor, rows: Tensor, cols: Tensor) -> None:
        primals = {name: parameter.detach() for name, parameter in zip(self._dense_names, self._dense_parameters)}

        def increments(parameters: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            return functional_call(self._increment_module, parameters, (x, y, rows, cols))

        def directional(tangents: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            return jvp(increments, (primals,), (tangents,))[1]

        size = sum(self._dense_sizes)
        num_inducing, batch = self.strategy.inducing_points.size(-2), x.size(-2)
        chunk = self._chunk(num_inducing**2 + 4 * num_inducing * batch + batch**2)
        for start in range(0, size, chunk):
            stop = min(start + chunk, size)
            directions = torch.zeros(stop - start, size, dtype=torch.float64, device=x.device)
            directions[:, start:stop].fill_diagonal_(1.0)
            tangents = {
                name: column.reshape(stop - start, *parameter.shape).to(parameter.dtype)
                for name, parameter, column in zip(
                    self._dense_names, self._dense_parameters, directions.split(self._dense_sizes, dim=-1)
                )
            }
            vector, matrix = vmap(directional)(tangents)
            if not (torch.isfinite(vector).all() and torch.isfinite(matrix).all()):
                raise RuntimeError("the Jacobians of the mini-batch's increments are not finite.")
            self._vector_jacobian[..., start:stop] += vector.movedim(0, -1)
            self._matrix_jacobian[..., start:stop] += matrix.movedim(0, -1)

    def _add_block_jacobians(
        self, x: Tensor, y: Tensor, rows: Tensor, cols: Tensor, increments: KalmanIncrements
    ) -> None:
        r"""
        The Jacobians of VFE's and DTC's increments :math:`\Delta\tilde{\boldsymbol\Lambda}_k = \mathbf K_{\mathbf uk}
        \mathbf K_{k\mathbf u}/\sigma^2` and :math:`\Delta\tilde{\boldsymbol\eta}_k = \mathbf K_{\mathbf uk}
        \mathbf r_k/\sigma^2` (:math:`\mathbf r_k = \mathbf y_k - \mu_0(\mathbf X_k)`) by the product rule from the
        tangents :math:`\dot{\mathbf K}_{\mathbf uk}`, :math:`\dot\mu_0`, :math:`\dot\sigma^2` of the kernel blocks
        (no factorization; for a (scaled) RBF kernel in closed form, otherwise by forward mode through the kernel):

        .. math::

            \dot{\Delta\tilde{\boldsymbol\Lambda}}_k = \frac{\dot{\mathbf K}_{\mathbf uk}\mathbf K_{k\mathbf u}
                + \mathbf K_{\mathbf uk}\dot{\mathbf K}_{k\mathbf u}}{\sigma^2}
                - \Delta\tilde{\boldsymbol\Lambda}_k\frac{\dot\sigma^2}{\sigma^2}, \qquad
            \dot{\Delta\tilde{\boldsymbol\eta}}_k = \frac{\dot{\mathbf K}_{\mathbf uk}\mathbf r_k
                - \mathbf K_{\mathbf uk}\dot\mu_0}{\sigma^2} - \Delta\tilde{\boldsymbol\eta}_k
                \frac{\dot\sigma^2}{\sigma^2}.

        The products :math:`\dot{\mathbf K}_{\mathbf uk}\mathbf K_{k\mathbf u}` (one batched matrix product over the
        directions, :math:`O(BM^2)` each) are taken in the model's dtype and accumulated in float64, only for the
        parameters that enter :math:`\mathbf K_{\mathbf uk}` (not for the noise or the mean). The directions are the
        dense parameters' unit vectors, one parameter at a time, and, with structured inducing inputs, one per input
        dimension that moves every inducing input along it: row :math:`m` of its :math:`\dot{\mathbf K}_{\mathbf uk}`
        is :math:`\mathbf c_{md}`, so row :math:`m` of the product is :math:`\sigma^2\boldsymbol\rho_{md}` (checked
        against a dense pass at the first mini-batch of each epoch). With the closed form, the products along all these
        directions are combinations of :math:`2D + 1` products per mini-batch, and no :math:`M\times B` tangent goes
        through automatic differentiation.
        """
        inducing_points = self.strategy.inducing_points
        structured = self._inducing_jacobians is not None
        cross, mean, noise = self._increment_module(x)
        residual = (y - mean).unsqueeze(-1)
        latent_shape = increments.information_vector.shape[:-1]
        inverse_noise = noise.double().expand(latent_shape).reciprocal()
        scale = inverse_noise.unsqueeze(-1)
        ones = (1,) * (len(latent_shape) - noise.dim())

        closed_form = self._closed_form_at(x, cross, residual)

        def tangents(name: str, directions: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
            r"""The increments' tangents along ``directions`` of one parameter: the products
            :math:`\dot{\mathbf K}_{\mathbf uk}\mathbf K_{k\mathbf u}` (``None`` when the parameter does not enter
            the kernel block, so that no product is taken), the vector part and :math:`\dot\sigma^2/\sigma^2`."""
            count = directions.size(0)
            if closed_form is not None and closed_form.handles(name):
                products, vectors, noise_tangent = closed_form.tangents({name: directions})
                noise_tangent = noise.new_zeros(count, *noise.shape) if noise_tangent is None else noise_tangent
            else:
                products, vectors, noise_tangent = self._forward_mode_tangents({name: directions}, x, cross, residual)
            if products is not None:
                products = products.double() * scale.unsqueeze(-1)  # (c, ..., M, M)
            if vectors is None:
                vectors = scale.new_zeros(count, *latent_shape, cross.size(-2))
            vectors = vectors.double() * scale
            noise_tangent = noise_tangent.double().view(count, *ones, *noise.shape)
            return products, vectors, (noise_tangent.expand(-1, *latent_shape) * inverse_noise).unsqueeze(-1)

        # One parameter at a time, in chunks of its unit directions: forward mode through the kernel only for the
        # parameters that enter it, and chunks small enough to keep the tangents in cache.
        num_inducing = inducing_points.size(-2)
        chunk = self._chunk(2 * num_inducing * (num_inducing + x.size(-2)), _CACHED_ELEMENTS)
        offset = 0
        for name, parameter, size in zip(self._dense_names, self._dense_parameters, self._dense_sizes, strict=True):
            for start in range(0, size, chunk):
                stop = min(start + chunk, size)
                directions = parameter.new_zeros(stop - start, size)
                directions[range(stop - start), range(start, stop)] = 1.0
                products, vector, relative = tangents(name, directions.view(-1, *parameter.shape))
                matrix = -increments.information_matrix[..., rows, cols] * relative
                if products is not None:
                    matrix += products[..., rows, cols] + products[..., cols, rows]
                vector -= increments.information_vector * relative
                if not (torch.isfinite(vector).all() and torch.isfinite(matrix).all()):
                    raise RuntimeError("the Jacobians of the mini-batch's increments are not finite.")
                self._vector_jacobian[..., offset + start : offset + stop] += vector.movedim(0, -1)
                self._matrix_jacobian[..., offset + start : offset + stop] += matrix.movedim(0, -1)
            offset += size
        if not structured:
            return
        # Row m of the product along axis d is sigma^2 rho_md (the rows of other inducing inputs are zero).
        increment = InducingJacobians.zeros(inducing_points)
        name, dims = self._names[id(inducing_points)], inducing_points.size(-1)
        for start in range(0, dims, chunk):
            stop = min(start + chunk, dims)
            directions = inducing_points.new_zeros(stop - start, *inducing_points.shape)
            for index in range(stop - start):
                directions[index, ..., start + index] = 1.0
            products, vector, _ = tangents(name, directions)
            if products is not None:
                increment.rows[..., start:stop, :] += products.movedim(0, -2)
            increment.values[..., start:stop] += vector.movedim(0, -1)
        if not increment.all_finite():
            raise RuntimeError("the Jacobians of the mini-batch's increments are not finite.")
        if not self._structure_verified:
            self._structure_verified = self._checked_structure(x, y, rows, cols, increment)
        if self._inducing_jacobians is not None:
            self._inducing_jacobians.add_(increment)
        else:  # the structure check failed: from now on dense, and this mini-batch's Jacobians again, densely
            self._add_dense_jacobians(x, y, rows, cols)

    def _forward_mode_tangents(
        self, tangents: dict[str, Tensor], x: Tensor, cross: Tensor, residual: Tensor
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        r"""Along ``c`` directions of parameters (``tangents`` maps their names to ``(c, *shape)``), by forward mode
        through the kernel blocks of VFE's and DTC's increments: :math:`\dot{\mathbf K}_{\mathbf uk}
        \mathbf K_{k\mathbf u}` (None where the directions do not move the kernel block),
        :math:`\dot{\mathbf K}_{\mathbf uk}\mathbf r_k - \mathbf K_{\mathbf uk}\dot\mu_0` and :math:`\dot\sigma^2`,
        in the model's dtype."""
        parameters = dict(self._increment_module.named_parameters())
        primals = {name: parameters[name].detach() for name in tangents}

        def blocks(values: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
            return functional_call(self._increment_module, values, (x,))

        cross_tangent, mean_tangent, noise_tangent = vmap(lambda t: jvp(blocks, (primals,), (t,))[1])(tangents)
        vectors = -(cross @ mean_tangent.unsqueeze(-1)).squeeze(-1)
        products = None
        if cross_tangent.any():
            products = cross_tangent @ cross.mT
            vectors = vectors + (cross_tangent @ residual).squeeze(-1)
        return products, vectors, noise_tangent

    def _closed_form_at(self, x: Tensor, cross: Tensor, residual: Tensor) -> RBFCrossTangents | None:
        r"""The closed-form tangents of the kernel blocks, prepared for the mini-batch ``x``, or None where the model's
        kernel has none. At the first mini-batch of each epoch (and after a restore) they are compared with one
        forward-mode pass through the kernel blocks along a random direction of the parameters they serve; should they
        differ (a model whose ``forward`` transforms the inputs or the kernel's output), forward mode is used for
        good, with a warning."""
        closed_form = self._closed_form
        if closed_form is None:
            return None
        closed_form.prepare(x, cross, residual, _CACHED_ELEMENTS)
        if self._closed_form_verified:
            return closed_form
        structured = [] if self._inducing_jacobians is None else [self._names[id(self.strategy.inducing_points)]]
        served = [name for name in (*self._dense_names, *structured) if closed_form.handles(name)]
        if not served:  # nothing to compare; no tangent will be asked of the closed form
            return closed_form
        parameters = dict(self._increment_module.named_parameters())
        generator = torch.Generator().manual_seed(0)
        directions = {
            name: torch.randn((1, *parameters[name].shape), generator=generator, dtype=torch.float64).to(
                parameters[name]
            )
            for name in served
        }
        expected = self._forward_mode_tangents(directions, x, cross, residual)
        actual = closed_form.tangents(directions)
        pairs = [
            (torch.zeros_like(b) if a is None else a, torch.zeros_like(a) if b is None else b)
            for a, b in zip(actual, expected, strict=True)
            if a is not None or b is not None
        ]
        scale = max(float(tensor.abs().max()) for pair in pairs for tensor in pair)
        error = max(float((a - b).abs().max()) for a, b in pairs)
        # A cube root of the working precision: float32 rounding through GPyTorch's distances reaches 5e-4 relative
        # (the demo's model), a model that transforms its inputs differs at order one.
        if error <= torch.finfo(cross.dtype).eps ** (1 / 3) * scale:
            self._closed_form_verified = True
            return closed_form
        warnings.warn(
            f"{type(self).__name__}: the closed-form derivatives of the model's RBF kernel block differ from a "
            f"forward-mode pass (relative difference {error / scale:.2e} along a random direction; does the model's "
            "forward transform the inputs?); using forward mode through the kernel instead (slower).",
            RuntimeWarning,
            stacklevel=5,
        )
        self._closed_form = None
        return None

    def _checked_structure(
        self, x: Tensor, y: Tensor, rows: Tensor, cols: Tensor, increment: InducingJacobians
    ) -> bool:
        """Compares the structured Jacobians of the first mini-batch of an epoch with one dense forward-mode pass along
        a random direction of the inducing inputs. Should they differ (a model whose ``forward`` mixes the inputs, a
        mean that depends on them), falls back to dense Jacobians for good, with a warning; those are all zero still."""
        inducing_points = self.strategy.inducing_points
        name = self._names[id(inducing_points)]
        generator = torch.Generator().manual_seed(0)
        direction = torch.randn(inducing_points.shape, generator=generator, dtype=torch.float64)
        direction = direction.to(device=inducing_points.device)

        def increments(points: Tensor) -> tuple[Tensor, Tensor]:
            return functional_call(self._increment_module, {name: points}, (x, y, rows, cols))

        tangent = direction.to(inducing_points.dtype)
        expected = jvp(increments, (inducing_points.detach(),), (tangent,))[1]
        vector, matrix = increment.directional(direction)
        actual = (vector, matrix[..., rows, cols])
        scale = max(float(tensor.abs().max()) for tensor in (*expected, *actual))
        error = max(float((a - e).abs().max()) for a, e in zip(actual, expected, strict=True))
        if error <= torch.finfo(inducing_points.dtype).eps ** 0.5 * scale:
            return True
        warnings.warn(
            f"{type(self).__name__}: the increments' Jacobians with respect to the inducing inputs do not have the "
            f"structure of a pointwise kernel (relative difference {error / scale:.2e} along a random direction); "
            "propagating them densely instead (O(M^3 D) memory, M D forward-mode passes per mini-batch).",
            RuntimeWarning,
            stacklevel=4,
        )
        self._structure_allowed = False
        self._zero_jacobians()
        return False

    # ------------------------------------------------------------------ the step
    def step(self, x: Tensor, y: Tensor) -> Tensor:
        r"""
        One SRGP step on a mini-batch: :math:`\psi_k` and its total gradient, absorb the mini-batch, one optimizer step.

        :param x: Inputs, ``(B, D)``.
        :param y: Targets, ``(B,)``.
        :return: :math:`\psi_k` at the hyperparameters before the step (summed over latents; the objective's value,
            so higher is better), a detached 0-dim tensor in the model's dtype.
        """
        strategy = self.strategy
        x, y = strategy.checked_data(x, y)
        if self._vector_jacobian is None:
            self.start_epoch()
        if strategy.num_observed != self._num_observed:
            raise RuntimeError(
                "the strategy's state and the propagated Jacobians are out of step (the state changed outside this "
                "optimizer by update, reset or load_state_dict, or a step failed half-way); call start_epoch() to "
                "restart the epoch."
            )
        information_vector, information_matrix = (
            statistic.detach().clone().requires_grad_(True) for statistic in strategy.statistics
        )
        with torch.enable_grad():
            terms, inducing_covariance = strategy.observation_terms(x, y)
            state_prior, prior_leaves = self._state_prior()
            if state_prior is not None:
                inducing_covariance = state_prior
            psi = strategy.bound_term(terms, inducing_covariance, information_vector, information_matrix)
            gradients = torch.autograd.grad(
                psi.sum(),
                [*self._parameters, information_vector, information_matrix, *prior_leaves.values()],
                allow_unused=True,
            )
        count = len(self._parameters)
        direct, (vector_adjoint, matrix_adjoint) = gradients[:count], gradients[count : count + 2]
        histories = self._history(vector_adjoint, matrix_adjoint)
        for key, gradient in zip(prior_leaves, gradients[count + 2 :], strict=True):
            if gradient is not None:
                histories[key] = histories[key] + gradient.double() if key in histories else gradient.double()
        increments = strategy.increments(terms, psi)

        # The Jacobians are added in place, chunk by chunk: should that fail half-way (out of memory), the epoch
        # cannot go on, and the next step says so.
        self._num_observed = -1
        self._add_increment_jacobians(x, y, increments)
        strategy.absorb(increments, x.size(-2))
        self._num_observed = strategy.num_observed

        for parameter, gradient in zip(self._parameters, direct, strict=True):
            total = torch.zeros_like(parameter) if gradient is None else gradient.detach().clone()
            if id(parameter) in histories:
                total += histories[id(parameter)].to(parameter.dtype)
            parameter.grad = total.neg_()
        self.optimizer.step()
        strategy._clear_cache()
        psi = psi.detach().sum()
        self._warn_on_jumps(float(psi) / x.size(-2))
        return psi.to(strategy.inducing_points.dtype)

    def _warn_on_jumps(self, per_datum: float) -> None:
        r"""The warnings of :meth:`step`, each at most once per epoch: a bound term per datum more than
        ``bound_tolerance`` times :math:`\max(1, |\text{mean}|)` below the epoch's mean so far, and a hyperparameter
        (raw value; the inducing inputs are not watched) more than ``drift_tolerance`` away from its value at the
        epoch's start."""
        total, count = self._bound_per_datum
        self._bound_per_datum = (total + per_datum, count + 1)
        name = type(self).__name__
        if self.bound_tolerance is not None and count >= 2 and "bound" not in self._warned:
            mean = total / count
            if per_datum < mean - self.bound_tolerance * max(1.0, abs(mean)):
                self._warned.add("bound")
                warnings.warn(
                    f"{name}: the bound term of this mini-batch is {per_datum:.3g} per datum, {mean - per_datum:.3g} "
                    f"below the epoch's mean so far ({mean:.3g}): the hyperparameters may have jumped (lower the "
                    "learning rate) or the data changed abruptly.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if self.drift_tolerance is None or "drift" in self._warned:
            return
        for parameter in self._parameters:
            if parameter is self.strategy.inducing_points:
                continue
            start = self._epoch_parameters[self._names[id(parameter)]]
            change = float((parameter.detach() - start).abs().max())
            if change > self.drift_tolerance:
                self._warned.add("drift")
                warnings.warn(
                    f"{name}: {self._names[id(parameter)]} moved by {change:.3g} (raw value) since the start of the "
                    f"epoch, more than drift_tolerance={self.drift_tolerance}: the hyperparameters drift within the "
                    "epoch (lower the learning rate, or start epochs more often); the state's statistics were "
                    "absorbed at the older values.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return

    def _history(self, vector_adjoint: Tensor | None, matrix_adjoint: Tensor | None) -> dict[int, Tensor]:
        r""":math:`\mathbf J_\eta^\top\bar{\boldsymbol\eta}+\langle\mathbf J_\Lambda,\bar{\boldsymbol\Lambda}\rangle`,
        summed over latents, per propagated parameter (by ``id``, shaped like it); the packed triangle weighs
        off-diagonal entries by both of their adjoints."""
        device = self.strategy.inducing_points.device
        if vector_adjoint is None:
            return {
                id(parameter): torch.zeros(parameter.shape, dtype=torch.float64, device=device)
                for parameter in self.propagated_parameters
            }
        histories = {}
        if self._inducing_jacobians is not None:
            gradient = self._inducing_jacobians.gradient(vector_adjoint, matrix_adjoint)
            histories[id(self.strategy.inducing_points)] = gradient
        size = sum(self._dense_sizes)
        if size:
            rows, cols = self._triangle()
            weights = matrix_adjoint + matrix_adjoint.mT
            weights = weights[..., rows, cols] - torch.where(rows == cols, matrix_adjoint[..., rows, cols], 0.0)
            vector_part = torch.einsum("...m,...mp->...p", vector_adjoint, self._vector_jacobian)
            matrix_part = torch.einsum("...t,...tp->...p", weights, self._matrix_jacobian)
            dense = (vector_part + matrix_part).reshape(-1, size).sum(0)
            for parameter, history in zip(self._dense_parameters, dense.split(self._dense_sizes), strict=True):
                histories[id(parameter)] = history.view(parameter.shape)
        return histories
