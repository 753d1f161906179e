from __future__ import annotations

from typing import Any

import torch
from botorch.optim.fit import fit_gpytorch_mll_scipy
from botorch.optim.utils import get_parameters
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.mlls import MarginalLogLikelihood
from gpytorch.variational import IndependentMultitaskVariationalStrategy
from torch import Tensor

from ..mlls import StreamingCollapsedBound
from ..optim import DualEStep
from ..variational import DualVariationalStrategy, KalmanVariationalStrategy


def fit_variational_mll(
    mll: MarginalLogLikelihood,
    closure=None,
    closure_kwargs: dict[str, Any] | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    num_rounds: int = 10,
    **kwargs: Any,
) -> MarginalLogLikelihood:
    r"""
    Fits a model whose posterior is set in closed form, as BoTorch's ``fit_gpytorch_mll`` fits any other: it is the
    ``custom_fit`` that :class:`~gpytorch_decoupled.botorch.SingleTaskVariationalGP` gives its model, so
    ``fit_gpytorch_mll(mll)`` calls it. Gradient steps alone would leave these posteriors at the prior.

    - **Dual** (:class:`~gpytorch_decoupled.variational.DualVariationalStrategy`, t-SVGP): ``num_rounds`` rounds of
      Algorithm 2 of `Adam et al. (2021)`_ on the whole training set: an E-step
      (:class:`~gpytorch_decoupled.optim.DualEStep`; one step of size 1, which is exact for a Gaussian likelihood,
      or ten of size 1/2 otherwise), then an M-step maximizing ``mll`` (the ELBO with :math:`q_\theta` re-derived from
      the sites, with the model's priors) over the hyperparameters by BoTorch's L-BFGS-B; a last E-step makes
      :math:`q` optimal for the final hyperparameters.
    - **Kalman** (:class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`): the hyperparameters maximize
      the collapsed bound of the training set plus the model's log priors by L-BFGS-B, with the bound's exact
      gradient (:class:`~gpytorch_decoupled.mlls.StreamingCollapsedBound`), then the state absorbs the training set
      at the final hyperparameters (:meth:`~gpytorch_decoupled.variational.KalmanVariationalStrategy.update`). Several
      outputs (BoTorch's independent multitask wrapper, one latent per output) sum the outputs' bounds, each with its
      task's noise of the :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood`.

    Other strategies are fitted by BoTorch's L-BFGS-B on ``mll``, as BoTorch fits GPyTorch's.

    :param mll: A :class:`~gpytorch.mlls.VariationalELBO` (or another approximate marginal log likelihood) of a model
        with ``train_inputs`` and ``train_targets``, as BoTorch's models have.
    :param closure: Not supported for closed-form posteriors (BoTorch's closure would take gradient steps only).
    :param closure_kwargs: As ``closure``.
    :param optimizer_kwargs: Keyword arguments for :func:`botorch.optim.fit.fit_gpytorch_mll_scipy` (e.g.
        ``{"options": {"maxiter": 50}}``).
    :param num_rounds: Rounds of E- and M-steps for the dual strategy.
    :param kwargs: Ignored, as BoTorch's fitting routines ignore unexpected keywords.
    :return: ``mll``, in eval mode.
    :raises ValueError: If ``closure`` is given for a dual or Kalman model.

    Example:
        >>> import torch
        >>> from gpytorch.mlls import VariationalELBO
        >>> from gpytorch_decoupled.botorch import SingleTaskVariationalGP, fit_variational_mll
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> train_X = torch.rand(30, 1, dtype=torch.float64)
        >>> train_Y = (6 * train_X).sin()
        >>> model = SingleTaskVariationalGP(train_X, train_Y, variational_strategy=KalmanVariationalStrategy)
        >>> mll = fit_variational_mll(VariationalELBO(model.likelihood, model.model, num_data=30))
        >>> model.model.variational_strategy.num_observed  # the state absorbed the training set
        30

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """
    model = mll.model
    strategy = model.variational_strategy
    if isinstance(strategy, IndependentMultitaskVariationalStrategy):
        strategy = strategy.base_variational_strategy
    optimizer_kwargs = dict(optimizer_kwargs or {})
    mll.train()
    if not isinstance(strategy, DualVariationalStrategy | KalmanVariationalStrategy):
        fit_gpytorch_mll_scipy(mll, closure=closure, closure_kwargs=closure_kwargs, **optimizer_kwargs)
        return mll.eval()
    if closure is not None or closure_kwargs is not None:
        raise ValueError(
            f"fit_variational_mll: a {type(strategy).__name__} is fitted by its own closed-form steps; a closure "
            "would take gradient steps only. Pass none."
        )
    (x,), y = model.train_inputs, model.train_targets
    if isinstance(strategy, DualVariationalStrategy):
        _fit_dual(mll, x, y, num_rounds, optimizer_kwargs)
    else:
        # Several outputs (BoTorch's targets (n, m)) are the latents of the wrapper's base: its targets are (m, n).
        _fit_kalman(mll, strategy, x, y if strategy is model.variational_strategy else y.mT, optimizer_kwargs)
    return mll.eval()


def _fit_dual(mll: MarginalLogLikelihood, x: Tensor, y: Tensor, num_rounds: int, optimizer_kwargs: dict) -> None:
    gaussian = isinstance(mll.likelihood, GaussianLikelihood)
    e_step = DualEStep(mll.model, mll.likelihood, num_data=x.size(-2), lr=1.0 if gaussian else 0.5)
    steps = 1 if gaussian else 10
    previous = None
    for _ in range(num_rounds):
        for _ in range(steps):
            e_step.step(x, y)
        loss = fit_gpytorch_mll_scipy(mll, **optimizer_kwargs).fval
        # EM has converged when a round no longer lowers the loss.
        if previous is not None and abs(previous - loss) <= 1e-6 * max(1.0, abs(loss)):
            break
        previous = loss
    for _ in range(steps):
        e_step.step(x, y)


def _fit_kalman(
    mll: MarginalLogLikelihood, strategy: KalmanVariationalStrategy, x: Tensor, y: Tensor, optimizer_kwargs: dict
) -> None:
    bound = StreamingCollapsedBound(mll.model, mll.likelihood)
    parameters = get_parameters(mll, requires_grad=True)
    batches = [(x, y)]

    def closure() -> tuple[Tensor, list[Tensor | None]]:
        for parameter in parameters.values():
            parameter.grad = None
        loss = bound.value_and_backward(batches)
        # The model's priors (e.g. BoTorch's on the noise and length-scales), as the marginal log likelihood adds them.
        with torch.enable_grad():
            log_prior = sum(
                (
                    prior.log_prob(prior_closure(module)).sum()
                    for _, module, prior, prior_closure, _ in mll.named_priors()
                ),
                start=torch.zeros((), dtype=x.dtype, device=x.device),
            )
            if log_prior.requires_grad:
                log_prior.neg().backward()
        return loss + (-log_prior.detach()).to(loss.dtype), [parameter.grad for parameter in parameters.values()]

    fit_gpytorch_mll_scipy(mll, parameters=parameters, closure=closure, **optimizer_kwargs)
    strategy.reset()
    strategy.update(x, y, mll.likelihood)
