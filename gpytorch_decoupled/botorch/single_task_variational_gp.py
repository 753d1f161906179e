from __future__ import annotations

import copy
import functools

import torch
from botorch.models import SingleTaskVariationalGP as BoTorchSingleTaskVariationalGP
from botorch.models.model import FantasizeMixin
from botorch.models.transforms.input import InputTransform
from botorch.models.transforms.outcome import OutcomeTransform
from botorch.models.utils.gpytorch_modules import get_covar_module_with_dim_scaled_prior
from botorch.models.utils.inducing_point_allocators import GreedyVarianceReduction, InducingPointAllocator
from gpytorch.kernels import Kernel
from gpytorch.likelihoods import Likelihood
from gpytorch.means import Mean
from gpytorch.variational import VariationalStrategy
from torch import Tensor
from typing_extensions import Self

from ..variational import (
    DecoupledVariationalDistribution,
    DecoupledVariationalStrategy,
    DualVariationalDistribution,
    DualVariationalStrategy,
    HybridVariationalStrategy,
    KalmanVariationalDistribution,
    KalmanVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)
from .fit_variational_mll import fit_variational_mll

#: The strategies with a second (mean) basis, which BoTorch does not pass.
_MEAN_BASIS_STRATEGIES = (
    DecoupledVariationalStrategy,
    HybridVariationalStrategy,
    OrthogonallyDecoupledVariationalStrategy,
)


class SingleTaskVariationalGP(BoTorchSingleTaskVariationalGP, FantasizeMixin):
    r"""
    BoTorch's :class:`~botorch.models.SingleTaskVariationalGP` with any strategy of this package: pass the strategy
    class as ``variational_strategy`` and everything else as to BoTorch's. What BoTorch cannot know is filled in:

    - the variational distribution the strategy needs
      (:class:`~gpytorch_decoupled.variational.DualVariationalDistribution`,
      :class:`~gpytorch_decoupled.variational.KalmanVariationalDistribution`,
      :class:`~gpytorch_decoupled.variational.DecoupledVariationalDistribution`; GPyTorch's Cholesky distribution
      for the :math:`\beta` block of the hybrid and orthogonal strategies), with the inducing points allocated here
      (BoTorch's greedy variance reduction may return fewer than asked for, and the distribution must know how many);
    - the mean basis of the decoupled strategies (``mean_inducing_points``): by default the training inputs (a random
      subset of 1024 of them when there are more);
    - the fitting routine: BoTorch's ``fit_gpytorch_mll`` calls the model's ``custom_fit``, here
      :func:`~gpytorch_decoupled.botorch.fit_variational_mll` (closed-form E-steps for the dual strategy,
      absorption plus hyperparameter steps for the Kalman strategy), which would otherwise stay at the prior.

    Posteriors, sampling and acquisition functions (e.g. qLogEI) work as for BoTorch's model.

    :param train_X: Training inputs, ``(n, d)``.
    :param train_Y: Training targets, ``(n, 1)``.
    :param variational_strategy: A strategy class (of this package, or GPyTorch's); a :func:`functools.partial` of
        one is passed to BoTorch as it is.
    :param inducing_points: The inducing points or their number (default: a quarter of the training points).
    :param mean_inducing_points: The mean basis of a decoupled strategy or its size (default: the training inputs, at
        most 1024 of them).
    :param variational_distribution: Built for the strategy when ``None``.
    :param likelihood: As BoTorch's (a Gaussian likelihood with BoTorch's noise prior by default).

    The other arguments are BoTorch's.

    Example:
        >>> import torch
        >>> from botorch.fit import fit_gpytorch_mll
        >>> from gpytorch.mlls import VariationalELBO
        >>> from gpytorch_decoupled.botorch import SingleTaskVariationalGP
        >>> from gpytorch_decoupled.variational import DualVariationalStrategy
        >>> train_X = torch.rand(40, 2, dtype=torch.float64)
        >>> train_Y = (train_X * 6).sin().sum(-1, keepdim=True)
        >>> model = SingleTaskVariationalGP(train_X, train_Y, variational_strategy=DualVariationalStrategy)
        >>> mll = fit_gpytorch_mll(VariationalELBO(model.likelihood, model.model, num_data=40))
        >>> posterior = model.posterior(train_X)
        >>> bool((posterior.mean - train_Y).abs().mean() < 0.1)
        True
    """

    def __init__(
        self,
        train_X: Tensor,
        train_Y: Tensor | None = None,
        likelihood: Likelihood | None = None,
        num_outputs: int = 1,
        learn_inducing_points: bool = True,
        covar_module: Kernel | None = None,
        mean_module: Mean | None = None,
        variational_distribution=None,
        variational_strategy: type = VariationalStrategy,
        inducing_points: Tensor | int | None = None,
        inducing_point_allocator: InducingPointAllocator | None = None,
        outcome_transform: OutcomeTransform | None = None,
        input_transform: InputTransform | None = None,
        mean_inducing_points: Tensor | int | None = None,
    ) -> None:
        strategy_cls = variational_strategy
        ours = isinstance(strategy_cls, type) and issubclass(
            strategy_cls, (DualVariationalStrategy, KalmanVariationalStrategy, *_MEAN_BASIS_STRATEGIES)
        )
        if ours:
            inputs = train_X if input_transform is None else input_transform(train_X)
            num_outputs = num_outputs if train_Y is None else train_Y.size(-1)
            batch_shape = train_X.shape[:-2] + (torch.Size([num_outputs]) if num_outputs > 1 else torch.Size([]))
            if not isinstance(inducing_points, Tensor):
                inducing_points = _allocated(inputs, inducing_points, inducing_point_allocator, batch_shape)
            num_inducing = inducing_points.size(-2)
            if issubclass(strategy_cls, _MEAN_BASIS_STRATEGIES):
                mean_inducing_points = _mean_basis(inputs, mean_inducing_points)
                variational_strategy = functools.partial(strategy_cls, mean_inducing_points=mean_inducing_points)
            if variational_distribution is None:
                variational_distribution = _distribution(strategy_cls, num_inducing, mean_inducing_points, batch_shape)
        elif mean_inducing_points is not None:
            raise ValueError(
                f"mean_inducing_points is for the decoupled strategies of this package, not {strategy_cls!r}."
            )
        super().__init__(
            train_X,
            train_Y,
            likelihood=likelihood,
            num_outputs=num_outputs,
            learn_inducing_points=learn_inducing_points,
            covar_module=covar_module,
            mean_module=mean_module,
            variational_distribution=variational_distribution,
            variational_strategy=variational_strategy,
            inducing_points=inducing_points,
            inducing_point_allocator=inducing_point_allocator,
            outcome_transform=outcome_transform,
            input_transform=input_transform,
        )
        # BoTorch's fit_gpytorch_mll(mll) calls mll.model.custom_fit where there is one (a function, not a bound
        # method: BoTorch passes the mll, and copies of the model keep it).
        self.model.custom_fit = fit_variational_mll
        if input_transform is not None:
            # BoTorch's condition_on_observations appends the new inputs to the untransformed training inputs, which
            # BoTorch's approximate model does not keep.
            self._original_train_inputs = train_X

    def condition_on_observations(self, X: Tensor, Y: Tensor, noise: Tensor | None = None, **kwargs) -> Self:
        r"""BoTorch's, in eval mode (as :meth:`posterior` puts the model first): in training mode BoTorch's input and
        outcome transforms would learn from the new observations, and the model would change."""
        self.eval()
        return super().condition_on_observations(X, Y, noise=noise, **kwargs)

    def get_fantasy_model(self, inputs: Tensor, targets: Tensor, noise: Tensor | None = None) -> Self:
        r"""
        A copy of the model conditioned on new observations by the strategy's closed-form conditioning (the
        ``get_fantasy_model`` of :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` and
        :class:`~gpytorch_decoupled.variational.DualVariationalStrategy`; exact for a Gaussian likelihood), with no
        refit: what BoTorch's ``condition_on_observations`` and ``fantasize`` call (with the inputs and targets
        transformed), so that lookahead acquisition functions (e.g. ``qKnowledgeGradient``) work. The copy shares the
        likelihood; its batch shape is that of the fantasies (e.g. ``num_fantasies x batch``). The other strategies
        raise a ``NotImplementedError`` that names these two.

        :param inputs: New inputs, ``(..., k, d)`` (transformed).
        :param targets: New targets, ``(..., k)`` (transformed), or ``(..., k, m)`` for ``m`` outputs.
        :param noise: Their noise variances, broadcastable to the targets (BoTorch passes them for fixed noise).
        :raises NotImplementedError: For a strategy without closed-form conditioning.
        """
        # Several outputs are a batch of latents inside GPyTorch's independent multitask wrapper: its base conditions.
        strategy = self.model.variational_strategy
        strategy = getattr(strategy, "base_variational_strategy", strategy)
        model = strategy.get_fantasy_model(inputs, targets, likelihood=self.likelihood, noise=noise)
        # The wrapper's copy takes the conditioned GPyTorch model in place of its own and shares the likelihood.
        fantasy = copy.deepcopy(self, {id(self.model): model, id(self.likelihood): self.likelihood})
        strategy = model.variational_strategy
        latent_shape = getattr(strategy, "base_variational_strategy", strategy)._variational_distribution.batch_shape
        fantasy._input_batch_shape = latent_shape[:-1] if self.num_outputs > 1 else latent_shape
        return fantasy


def _allocated(
    inputs: Tensor, number: int | None, allocator: InducingPointAllocator | None, batch_shape: torch.Size
) -> Tensor:
    """BoTorch's allocation of ``number`` inducing points (a quarter of the inputs by default) with a kernel like its
    default one; where the greedy allocation stops early, random training inputs fill up to ``number``."""
    number = int(0.25 * inputs.size(-2)) if number is None else number
    kernel = get_covar_module_with_dim_scaled_prior(ard_num_dims=inputs.size(-1), batch_shape=batch_shape).to(inputs)
    allocator = GreedyVarianceReduction() if allocator is None else allocator
    points = allocator.allocate_inducing_points(
        inputs=inputs, covar_module=kernel, num_inducing=number, input_batch_shape=inputs.shape[:-2]
    )
    missing = number - points.size(-2)
    if missing > 0:
        extra = inputs[..., torch.randperm(inputs.size(-2), device=inputs.device)[:missing], :]
        points = torch.cat([points, extra], dim=-2)
    return points


def _mean_basis(inputs: Tensor, mean_inducing_points: Tensor | int | None) -> Tensor:
    if isinstance(mean_inducing_points, Tensor):
        return mean_inducing_points
    number = min(inputs.size(-2), 1024 if mean_inducing_points is None else mean_inducing_points)
    if number == inputs.size(-2):
        return inputs.clone()
    return inputs[..., torch.randperm(inputs.size(-2), device=inputs.device)[:number], :].clone()


def _distribution(strategy_cls: type, num_inducing: int, mean_inducing_points, batch_shape: torch.Size):
    if issubclass(strategy_cls, DualVariationalStrategy):
        return DualVariationalDistribution(num_inducing, batch_shape=batch_shape)
    if issubclass(strategy_cls, KalmanVariationalStrategy):
        return KalmanVariationalDistribution(num_inducing, batch_shape=batch_shape)
    if issubclass(strategy_cls, DecoupledVariationalStrategy):
        return DecoupledVariationalDistribution(mean_inducing_points.size(-2), num_inducing, batch_shape=batch_shape)
    return None  # BoTorch's CholeskyVariationalDistribution for the beta block of the hybrid and orthogonal strategies
