from __future__ import annotations

import torch
from gpytorch.likelihoods import GaussianLikelihood
from torch import Tensor

from ..linalg import LeanKernel, add_to_diagonal, symmetrized
from ..variational import KalmanIncrements, KalmanVariationalStrategy, ObservationTerms
from .lean_elbo import prior_mean, unsupported_prior
from .lean_likelihood import LeanLikelihood


class LeanKalmanBlocks(torch.nn.Module):
    r"""
    The prior blocks of a model with a :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` as plain
    tensor operations (the lean training path of :func:`~gpytorch_decoupled.training.compile_training_step`): the
    values and gradients of the strategy's own blocks, which it takes from one evaluation of ``model.forward`` at
    :math:`[\mathbf Z; \mathbf x]` through GPyTorch's lazy kernel tensors, read from the model's parameters at every
    call. The model and likelihood are its submodules under the names that
    :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation` gives their parameters, so that
    :func:`torch.func.functional_call` swaps them by the same names (forward-mode tangents, the prior at the epoch's
    start).

    Called without arguments it returns the jittered float64 :math:`\mathbf K_{\mathbf{uu}}` (the strategy's
    ``inducing_covariance()``); with a mini-batch ``x`` it returns :math:`\mathbf K_{\mathbf u\mathbf x}`,
    :math:`\mu_0(\mathbf x)` and :math:`\sigma^2` in the model's dtype (its ``data_prior(x)`` and the noise), what the
    increments :math:`\Delta\tilde{\boldsymbol\eta}_k = \mathbf K_{\mathbf uk}(\mathbf y_k - \mu_0)/\sigma^2`,
    :math:`\Delta\tilde{\boldsymbol\Lambda}_k = \mathbf K_{\mathbf uk}\mathbf K_{k\mathbf u}/\sigma^2` of VFE and
    DTC are made of (`Schuerch et al. (2020)`_, Sec. 3.2).

    Supported (:meth:`unsupported`): the strategy without batch shape, a zero or constant mean and a kernel of
    :class:`~gpytorch_decoupled.linalg.LeanKernel` as ``model.mean_module`` and ``model.covar_module`` with
    ``model.forward`` their Gaussian prior (checked once, numerically), any of the strategy's approximations.

    :param model: The model.
    :param likelihood: The strategy's :class:`~gpytorch.likelihoods.GaussianLikelihood`.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z, likelihood):
        ...         super().__init__(KalmanVariationalStrategy(self, z, likelihood=likelihood))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        >>> model = RecursiveGP(torch.linspace(-2, 2, 6, dtype=torch.float64).unsqueeze(-1), likelihood).double()
        >>> blocks = LeanKalmanBlocks(model, likelihood)
        >>> bool(torch.allclose(blocks(), model.variational_strategy.inducing_covariance(), rtol=1e-12))
        True

    .. _Schuerch et al. (2020):
        https://arxiv.org/abs/1910.08393
    """

    def __init__(self, model, likelihood: GaussianLikelihood):
        super().__init__()
        self.model = model
        self.likelihood = likelihood
        self.kernel = LeanKernel.of(model.covar_module)

    @staticmethod
    def unsupported(model, likelihood) -> str | None:
        """Why the lean path cannot compute the blocks of ``model`` and ``likelihood``, or None when it can."""
        strategy = getattr(model, "variational_strategy", None)
        if type(strategy) is not KalmanVariationalStrategy:
            return f"the strategy {type(strategy).__name__} (supported: KalmanVariationalStrategy; no subclasses)"
        if strategy.inducing_points.dim() != 2 or strategy._variational_distribution.batch_shape != torch.Size([]):
            return "the inducing points or the state have a batch shape (several latents)"
        lean_likelihood = LeanLikelihood.of(likelihood)
        if lean_likelihood is None or not lean_likelihood.is_gaussian:
            return f"the likelihood {type(likelihood).__name__} (supported: GaussianLikelihood)"
        return unsupported_prior(model)

    def forward(self, x: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        z = self.model.variational_strategy.inducing_points
        if x is None:
            return self._jittered(self.kernel(z, z).double())
        return self.kernel(z, x), prior_mean(self.model, x), self.likelihood.noise[..., 0]

    def observation_terms(self, x: Tensor, y: Tensor) -> tuple[ObservationTerms, Tensor]:
        r"""The mini-batch's :class:`~gpytorch_decoupled.variational.ObservationTerms` and the jittered float64
        :math:`\mathbf K_{\mathbf{uu}}`, as the strategy's ``observation_terms(x, y)`` computes them."""
        strategy = self.model.variational_strategy
        z = strategy.inducing_points
        inducing_covariance = self._jittered(self.kernel(z, z).double())
        if strategy.approximation == "pitc":
            data_covariance = self.kernel(x, x).double()
        else:
            data_covariance = self.kernel.diagonal(x).double()
        residual = y.double() - prior_mean(self.model, x).double()
        noise = strategy.noise_variance(self.likelihood).unsqueeze(-1)
        return strategy.terms_of_blocks(
            inducing_covariance, self.kernel(z, x).double(), data_covariance, residual, noise
        )

    def _jittered(self, covariance: Tensor) -> Tensor:
        jitter = self.model.variational_strategy.jitter_val
        return add_to_diagonal(covariance, jitter)

    def increments(self, terms: ObservationTerms, psi: Tensor) -> tuple[KalmanIncrements, Tensor]:
        r"""The mini-batch's increments of the state and its bound term, detached (the strategy's ``increments``), and
        whether all of them are finite (a boolean tensor: inside a compiled graph the eager check's error would be a
        graph break)."""
        increments = KalmanIncrements(
            terms.information_vector.detach(), symmetrized(terms.information_matrix).detach(), psi.detach()
        )
        return increments, all_finite(*increments)

    @torch.no_grad()
    def absorb(self, increments: KalmanIncrements, done: Tensor) -> None:
        r"""Adds the increments to the state's sums where ``done`` (else adds nothing: the state stays exactly as it
        was); the number of points is counted outside the graph, after the flag is read."""
        state = self.model.variational_strategy._variational_distribution
        for total, increment in zip((state.information_vector, state.information_matrix, state.bound), increments):
            # through a flat view: torch 2.13 under AOTAutograd drops in-place updates of 0-dim graph inputs (the
            # bound) that are not parameters, but keeps those made through a view
            total.view(-1).add_(torch.where(done, increment, torch.zeros_like(increment)).reshape(-1))

    def count(self, size: int) -> None:
        """After a graph that absorbed ``size`` points (its flag read): counts them and drops the strategy's cached
        factors, as its ``absorb`` does."""
        strategy = self.model.variational_strategy
        strategy._variational_distribution.num_observed.add_(size)
        strategy.variational_params_initialized.fill_(1)
        strategy._clear_cache()


# Raised after a compiled step whose flag says that the update failed (what the eager update raises inside it).
NOT_FINITE = (
    "the Kalman update produced NaN or inf (or a matrix was not positive definite even with the largest jitter; check "
    "the kernel hyperparameters and the noise); "
)


def all_finite(*tensors: Tensor) -> Tensor:
    """Whether every entry of every tensor is finite, as a boolean tensor (no data-dependent branch)."""
    return torch.stack([torch.isfinite(tensor).all() for tensor in tensors]).all()
