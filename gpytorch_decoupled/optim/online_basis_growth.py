from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from gpytorch.likelihoods import Likelihood
from gpytorch.models import ApproximateGP
from torch import Tensor

from ..kernels import initialize_hyperparameters
from ..validation import check_targets
from ..variational import checked_inputs


class BasisGrowth(NamedTuple):
    """What one :meth:`OnlineBasisGrowth.step` added."""

    mean_points: int  # points added to the mean basis
    inducing_points: int  # points added to the covariance basis


class OnlineBasisGrowth:
    r"""
    The online learning procedure of `Cheng & Boots (2017)`_ (App. C.2, Algorithm 1; :ref:`derivations-basis-growth`)
    for the decoupled, hybrid and orthogonally decoupled strategies: call :meth:`step` with every mini-batch, before the
    optimizers' steps.

    1. On the first mini-batch the hyperparameters start from the median trick
       (:func:`~gpytorch_decoupled.kernels.initialize_hyperparameters`: length-scales the median pairwise distance per
       dimension, amplitude 1, Gaussian noise the variance of the targets).
    2. Each step takes ``points_per_step`` rows of the mini-batch as new basis functions, the same rows for the mean
       and the covariance basis (so that the two stay in a close subspace), until each basis has reached its budget.
       The strategy's ``grow_bases`` appends them without changing the current :math:`q` (coefficients 0, zero rows
       of :math:`\mathbf L_B`, or the current process at the new covariance points). Grown tensors are new
       :class:`~torch.nn.Parameter` objects: the given optimizers get them in place of the old ones, with their state
       zero-padded to the new shapes, so training simply goes on. Pass every optimizer that holds model parameters.

    With :class:`~gpytorch_decoupled.kernels.GeneralizedRBFKernel` the new points get length-scale multipliers 1.

    :param model: An :class:`~gpytorch.models.ApproximateGP` whose strategy (possibly inside a multitask wrapper) has
        ``grow_bases``.
    :param max_mean_points: Budget :math:`M_\alpha` (or :math:`M_\gamma`) of the mean basis.
    :param max_inducing_points: Budget :math:`M_\beta` of the covariance basis.
    :param points_per_step: Rows :math:`N_\Delta` of each mini-batch added to each basis.
    :param optimizers: Optimizers over the model's parameters whose state must follow the new shapes.
    :param likelihood: Gaussian likelihood whose noise the median trick initializes (optional).
    :param initialize: Apply the median trick on the first mini-batch.
    :param generator: Random generator choosing the rows.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.optim import OnlineBasisGrowth
        >>> from gpytorch_decoupled.variational import DecoupledVariationalDistribution, DecoupledVariationalStrategy
        >>> class DecoupledGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, x):  # start from one point of the first batch
        ...         q = DecoupledVariationalDistribution(1, 1)
        ...         super().__init__(DecoupledVariationalStrategy(self, x[:1], q, x[:1]))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=1))
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.rand(2000, 1) * 6
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(2000)
        >>> model, likelihood = DecoupledGP(x), gpytorch.likelihoods.GaussianLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=2000)
        >>> optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
        >>> growth = OnlineBasisGrowth(model, 200, 20, 10, optimizers=[optimizer], likelihood=likelihood)
        >>> for batch in torch.randperm(2000).split(100):
        ...     _ = growth.step(x[batch], y[batch])
        ...     optimizer.zero_grad()
        ...     (-mll(model(x[batch]), y[batch])).backward()
        ...     optimizer.step()
        >>> model.variational_strategy.mean_inducing_points.shape, model.variational_strategy.inducing_points.shape
        (torch.Size([200, 1]), torch.Size([20, 1]))

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """

    def __init__(
        self,
        model: ApproximateGP,
        max_mean_points: int,
        max_inducing_points: int,
        points_per_step: int,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        likelihood: Likelihood | None = None,
        initialize: bool = True,
        generator: torch.Generator | None = None,
    ):
        strategy = getattr(model.variational_strategy, "base_variational_strategy", model.variational_strategy)
        if not hasattr(strategy, "grow_bases"):
            raise TypeError(f"{type(strategy).__name__} cannot grow its bases (no grow_bases method).")
        if points_per_step < 1:
            raise ValueError(f"points_per_step must be positive, got {points_per_step}.")
        self.model = model
        self.strategy = strategy
        self.max_mean_points = max_mean_points
        self.max_inducing_points = max_inducing_points
        self.points_per_step = points_per_step
        self.optimizers = list(optimizers)
        self.likelihood = likelihood
        self.initialize = initialize
        self.generator = generator

    def step(self, x: Tensor, y: Tensor | None = None) -> BasisGrowth:
        """
        Grows the bases from the mini-batch ``x`` (and, on the first call, initializes the hyperparameters).

        :param x: The mini-batch's inputs, ``(B, D)``.
        :param y: Its targets, ``(B,)`` (for the median trick's noise; optional).
        :return: The numbers of points added to the mean and to the covariance basis: this step changes the model's
            structure, not the value of an objective.
        :raises TypeError: If ``x`` or ``y`` is not a tensor.
        :raises ValueError: On bad shapes, dtypes, devices, an empty batch (fewer than two rows for the median trick)
            or NaN/inf (:mod:`gpytorch_decoupled.validation`), before anything changes.
        :raises RuntimeError: If the grown bases cannot be factorized (see ``grow_bases``); the model, the
            likelihood and this object are then as they were.
        """
        points = self.strategy.inducing_points
        checked_inputs(x, points, self.model, "x", dim=2, min_rows=2 if self.initialize else 1)
        if y is not None:
            check_targets(y, "y", (x.size(0),), points, self.likelihood)
        if not self.initialize:
            return self._grow(x)
        # The median trick and the growth change the model together or not at all.
        modules = [self.model] if self.likelihood is None else [self.model, self.likelihood]
        saved = [{name: value.clone() for name, value in module.state_dict().items()} for module in modules]
        initialize_hyperparameters(self.model.covar_module, x, y, self.likelihood)
        try:
            grown = self._grow(x)
        except Exception:
            for module, state in zip(modules, saved, strict=True):
                module.load_state_dict(state)
            raise
        self.initialize = False
        return grown

    def _grow(self, x: Tensor) -> BasisGrowth:
        num_mean = self._room(self.strategy.mean_inducing_points, self.max_mean_points, x)
        num_covariance = self._room(self.strategy.inducing_points, self.max_inducing_points, x)
        if num_mean or num_covariance:
            generator_state = None if self.generator is None else self.generator.get_state()
            rows = torch.randperm(x.size(-2), generator=self.generator)[: max(num_mean, num_covariance)]
            rows = rows.to(x.device)
            try:
                self._grow_bases(
                    x[rows[:num_mean]] if num_mean else None, x[rows[:num_covariance]] if num_covariance else None
                )
            except Exception:
                if generator_state is not None:  # the failed step draws nothing
                    self.generator.set_state(generator_state)
                raise
        return BasisGrowth(num_mean, num_covariance)

    def _grow_bases(self, mean_points: Tensor | None, inducing_points: Tensor | None) -> None:
        """The strategy's ``grow_bases``, with the grown parameters swapped into the optimizers."""
        before = dict(self.model.named_parameters())
        self.strategy.grow_bases(mean_points, inducing_points)
        replaced = {
            before[name]: parameter
            for name, parameter in self.model.named_parameters()
            if name in before and before[name] is not parameter
        }
        for optimizer in self.optimizers:
            _swap_parameters(optimizer, replaced)

    def state_dict(self) -> dict[str, Any]:
        """Whether the median trick is still to be applied, the state of the random generator (if one was given), and
        the points of the two bases (of the first latent), so that a fresh model can be grown to them on loading."""
        generator = None if self.generator is None else self.generator.get_state()
        return {
            "initialize": self.initialize,
            "generator": generator,
            "mean_points": _shared_points(self.strategy.mean_inducing_points),
            "inducing_points": _shared_points(self.strategy.inducing_points),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        r"""
        Restores a :meth:`state_dict`: the median-trick flag, the generator's state (where this object has a
        generator), and the sizes of the bases. A model with smaller bases (e.g. freshly built for a resumed run) is
        grown to the checkpoint's with the checkpoint's points (and the optimizers given to this object follow), so
        that ``model.load_state_dict(checkpoint)`` then fits; load this state dict first. The median trick is not run
        again.

        :raises ValueError: If the model's bases are larger than the checkpoint's; nothing is then changed.
        """
        grown = []
        for key, points in (("mean_points", self.strategy.mean_inducing_points), ("inducing_points", None)):
            points = self.strategy.inducing_points if points is None else points
            saved = state_dict.get(key)  # absent from checkpoints of version 0.1
            if saved is None or saved.size(-2) == points.size(-2):
                grown.append(None)
            elif saved.size(-2) < points.size(-2):
                raise ValueError(
                    f"the checkpoint's {key} are {saved.size(-2)}, but the model has {points.size(-2)} already: load "
                    "it into a model built as the checkpointed one was (bases cannot shrink)."
                )
            else:
                grown.append(saved[points.size(-2) :].to(points))
        if any(points is not None for points in grown):
            self._grow_bases(*grown)
        self.initialize = bool(state_dict["initialize"])
        if self.generator is not None and state_dict["generator"] is not None:
            self.generator.set_state(state_dict["generator"])

    def _room(self, points: Tensor, budget: int, x: Tensor) -> int:
        return max(0, min(self.points_per_step, budget - points.size(-2), x.size(-2)))


def _shared_points(points: Tensor) -> Tensor:
    """The points of the first latent (``grow_bases`` adds the same points to every latent)."""
    return points.detach().reshape(-1, *points.shape[-2:])[0].clone()


def _swap_parameters(optimizer: torch.optim.Optimizer, replaced: dict[Tensor, torch.nn.Parameter]) -> None:
    """Puts the grown parameters in place of the old ones, with their per-parameter state (e.g. Adam's moments)
    zero-padded to the new shapes: the leading entries keep their meaning after growth."""
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(parameter, parameter) for parameter in group["params"]]
    for old, new in replaced.items():
        if old not in optimizer.state:
            continue
        state = optimizer.state.pop(old)
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == old.shape:
                state[key] = zero_padded(value, new.shape)
        optimizer.state[new] = state


def zero_padded(value: Tensor, shape: torch.Size) -> Tensor:
    """``value`` in the leading entries of zeros of ``shape`` (at least ``value``'s size in every dimension): state
    that follows a grown basis."""
    padded = value.new_zeros(shape)
    padded[tuple(slice(0, size) for size in value.shape)] = value
    return padded
