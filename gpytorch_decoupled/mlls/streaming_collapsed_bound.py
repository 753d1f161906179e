from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ApproximateGP
from torch import Tensor

from ..variational import KalmanVariationalStrategy

#: Mini-batches ``(x, y)`` of a whole data set: a re-iterable collection or a function returning a fresh iterable.
Batches = Iterable[tuple[Tensor, Tensor]] | Callable[[], Iterable[tuple[Tensor, Tensor]]]


class CollapsedBoundStatistics(NamedTuple):
    r"""What the first pass of :class:`StreamingCollapsedBound` accumulates over mini-batches (float64, no graph)."""

    vector: Tensor  # eta~, (..., M)
    matrix: Tensor  # Lambda~ - K_uu, (..., M, M)
    offsets: Tensor  # sum_k c_k, (...)
    count: int  # points seen


class StreamingCollapsedBound:
    r"""
    The exact full-data gradient of the collapsed bound :math:`\mathcal L_{\rm model}(\theta)` of a
    :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` (VFE, DTC, FITC, PITC or PEP;
    :ref:`derivations-pep-family`), in two streaming passes over mini-batches with memory independent of the number of
    data :math:`N`.

    In the transformed information form the bound splits into a sum over mini-batches and a term of the accumulated
    statistics :math:`\tilde{\boldsymbol\eta} = \sum_k\Delta\tilde{\boldsymbol\eta}_k`,
    :math:`\tilde{\boldsymbol\Lambda} = \sum_k\Delta\tilde{\boldsymbol\Lambda}_k` (Woodbury and the determinant lemma
    for :math:`\log\mathcal N(\mathbf y \mid \mathbf 0, \mathbf Q_{ff} + \mathbf V)`):

    .. math::

        \mathcal L(\theta) = \sum_k c_k(\theta) + F\big(\theta, \tilde{\boldsymbol\eta}(\theta),
            \tilde{\boldsymbol\Lambda}(\theta)\big), \qquad
        c_k = -\tfrac12\big(B_k\log2\pi + \log\lvert\mathbf V_k\rvert + \mathbf y_k^\top\mathbf V_k^{-1}
            \mathbf y_k\big) - \rho_k,

    .. math::

        F = -\tfrac12\big[\log\lvert\mathbf K_{\mathbf{uu}} + \tilde{\boldsymbol\Lambda}\rvert
            - \log\lvert\mathbf K_{\mathbf{uu}}\rvert - \tilde{\boldsymbol\eta}^\top(\mathbf K_{\mathbf{uu}}
            + \tilde{\boldsymbol\Lambda})^{-1}\tilde{\boldsymbol\eta}\big].

    Pass 1 accumulates :math:`\tilde{\boldsymbol\eta}`, :math:`\tilde{\boldsymbol\Lambda}` and
    :math:`\sum_k c_k` without a graph; the adjoints :math:`\bar{\boldsymbol\eta} = \partial F/\partial
    \tilde{\boldsymbol\eta}`, :math:`\bar{\boldsymbol\Lambda} = \partial F/\partial\tilde{\boldsymbol\Lambda}` come
    from one reverse pass through :math:`F` (which also back-propagates :math:`F`'s direct dependence on
    :math:`\mathbf K_{\mathbf{uu}}`). Pass 2 back-propagates every mini-batch's
    :math:`c_k + \langle\bar{\boldsymbol\eta}, \Delta\tilde{\boldsymbol\eta}_k\rangle + \langle\bar{\boldsymbol\Lambda},
    \Delta\tilde{\boldsymbol\Lambda}_k\rangle` (a vector-Jacobian product per mini-batch), so the accumulated
    gradients are exactly those of autograd through the batch bound. Memory is :math:`O(M^2 + BM)`, time two
    Kalman passes.

    :meth:`value_and_backward` accumulates the gradient of the **loss** :math:`-\mathcal L` into ``.grad`` of every
    parameter of the model and likelihood (kernel, mean, noise, inducing inputs), exactly like ``loss.backward()``,
    and returns that loss, so it is a closure for any optimizer (including L-BFGS); the bound itself is
    :attr:`bound`. The strategy's state is not touched. :func:`~gpytorch_decoupled.mlls.fit_collapsed_bound` runs
    L-BFGS on it from a data-driven initialization and warns at the noise-only solution, which GPyTorch's default
    hyperparameters can stall at.

    :param model: An :class:`~gpytorch.models.ApproximateGP` with a
        :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` (its ``approximation`` chooses the bound),
        or with one as the base of an :class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy` (one
        latent per task; the mini-batches' targets are then ``(T, B)``, and the loss sums the tasks' bounds).
    :param likelihood: The strategy's :class:`~gpytorch.likelihoods.GaussianLikelihood` (for several tasks, a
        :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood` without correlated task noise).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.mlls import StreamingCollapsedBound
        >>> from gpytorch_decoupled.variational import KalmanVariationalStrategy
        >>> class RecursiveGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points, likelihood):
        ...         super().__init__(KalmanVariationalStrategy(self, inducing_points, likelihood=likelihood))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 1000).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(1000)
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood()
        >>> model = RecursiveGP(torch.linspace(-3, 3, 10).unsqueeze(-1), likelihood)
        >>> objective = StreamingCollapsedBound(model, likelihood)
        >>> batches = list(zip(x.split(250), y.split(250)))  # or a DataLoader, or a function returning batches
        >>> parameters = [*model.parameters(), *likelihood.parameters()]
        >>> optimizer = torch.optim.LBFGS(parameters, max_iter=20, line_search_fn="strong_wolfe")
        >>> def closure():
        ...     optimizer.zero_grad()
        ...     return objective.value_and_backward(batches)
        >>> _ = optimizer.step(closure)
        >>> bool(likelihood.noise < 0.05)
        True
    """

    def __init__(self, model: ApproximateGP, likelihood: GaussianLikelihood):
        self.strategy = KalmanVariationalStrategy.of_model(model, likelihood, type(self).__name__)
        self.bound: Tensor | None = None

    @staticmethod
    def _iterate(batches: Batches) -> Iterator[tuple[Tensor, Tensor]]:
        if callable(batches):
            return iter(batches())
        if iter(batches) is batches:
            raise TypeError(
                "StreamingCollapsedBound reads the mini-batches twice: pass a collection (list, DataLoader) or a "
                "function that returns a fresh iterable, not a one-shot iterator or generator."
            )
        return iter(batches)

    def value_and_backward(self, batches: Batches) -> Tensor:
        r"""
        Two passes over ``batches``: accumulates :math:`\nabla_\theta(-\mathcal L)` into the parameters' ``.grad``.

        :param batches: The mini-batches ``(x, y)`` of the whole data set: a re-iterable collection (list,
            :class:`~torch.utils.data.DataLoader`) or a function returning a fresh iterable. Both passes must see the
            same data; the partition into mini-batches only matters for PITC (its blocks).
        :return: The loss :math:`-\mathcal L` (detached, summed over latents); :attr:`bound` holds :math:`\mathcal L`
            per latent.
        :raises RuntimeError: If the second pass sees other data than the first.
        """
        statistics = self._first_pass(batches)
        vector_adjoint, matrix_adjoint, tail = self._tail(statistics)
        self._second_pass(batches, statistics, vector_adjoint, matrix_adjoint)
        return self._loss(statistics.offsets, tail)

    def value(self, batches: Batches) -> Tensor:
        r"""
        The bound :math:`\mathcal L` alone, in one pass over ``batches`` and without gradients (also set as
        :attr:`bound`).

        :param batches: As for :meth:`value_and_backward`.
        :return: :math:`\mathcal L` per latent (detached).
        """
        statistics = self._total_statistics(batches)
        with torch.no_grad():
            tail = self.strategy.collapsed_bound_tail(statistics.vector, statistics.matrix)
        self._loss(statistics.offsets, tail)
        return self.bound

    def _total_statistics(self, batches: Batches) -> CollapsedBoundStatistics:
        """The statistics of the whole data set (here: the first pass over ``batches``)."""
        return self._first_pass(batches)

    def _first_pass(self, batches: Batches) -> CollapsedBoundStatistics:
        r"""Pass 1: :math:`\tilde{\boldsymbol\eta}`, :math:`\tilde{\boldsymbol\Lambda}`, :math:`\sum_k c_k` and the
        number of points, without a graph."""
        strategy = self.strategy
        vector = matrix = offsets = None
        count = 0
        with torch.no_grad():
            for x, y in self._iterate(batches):
                x, y = strategy.checked_data(x, y)
                terms, _ = strategy.observation_terms(x, y)
                increments = (terms.information_vector, terms.information_matrix, terms.offset)
                if vector is None:
                    vector, matrix, offsets = increments
                else:
                    vector, matrix, offsets = (
                        total + part for total, part in zip((vector, matrix, offsets), increments)
                    )
                count += x.size(-2)
        if vector is None:
            raise ValueError("no mini-batches were given.")
        return CollapsedBoundStatistics(vector, matrix, offsets, count)

    def _tail(self, statistics: CollapsedBoundStatistics, parameters: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        r"""
        :math:`F` at the statistics, back-propagated: returns the adjoints :math:`\bar{\boldsymbol\eta}`,
        :math:`\bar{\boldsymbol\Lambda}` and :math:`F` (detached), and accumulates :math:`-\partial F/\partial\theta`
        (through :math:`\mathbf K_{\mathbf{uu}}`) into the parameters' ``.grad`` unless ``parameters`` is false.
        """
        vector = statistics.vector.detach().requires_grad_(True)
        matrix = statistics.matrix.detach().requires_grad_(True)
        with torch.enable_grad():
            tail = self.strategy.collapsed_bound_tail(vector, matrix)
            tail.sum().neg().backward(inputs=None if parameters else [vector, matrix])
        return vector.grad.neg(), matrix.grad.neg(), tail.detach()

    def _second_pass(
        self, batches: Batches, statistics: CollapsedBoundStatistics, vector_adjoint: Tensor, matrix_adjoint: Tensor
    ) -> None:
        r"""Pass 2: back-propagates every mini-batch's :math:`c_k + \langle\bar{\boldsymbol\eta},
        \Delta\tilde{\boldsymbol\eta}_k\rangle + \langle\bar{\boldsymbol\Lambda}, \Delta\tilde{\boldsymbol
        \Lambda}_k\rangle`, checking that it sees the data of the first pass (``statistics``)."""
        strategy = self.strategy
        seen, repeated_offsets = 0, torch.zeros_like(statistics.offsets)
        for x, y in self._iterate(batches):
            x, y = strategy.checked_data(x, y)
            with torch.enable_grad():
                terms, _ = strategy.observation_terms(x, y)
                contribution = (
                    terms.offset
                    + (vector_adjoint * terms.information_vector).sum(-1)
                    + (matrix_adjoint * terms.information_matrix).sum((-2, -1))
                )
                if contribution.requires_grad:
                    contribution.sum().neg().backward()
            repeated_offsets += terms.offset.detach()
            seen += x.size(-2)
        if seen != statistics.count or not torch.allclose(repeated_offsets, statistics.offsets, rtol=1e-8, atol=1e-8):
            raise RuntimeError(
                "the second pass over the mini-batches saw other data than the first (a different number of points, "
                "other values, or for PITC another partition); the accumulated gradients are wrong."
            )

    def _loss(self, offsets: Tensor, tail: Tensor) -> Tensor:
        r"""Sets :attr:`bound` (:math:`\mathcal L` per latent) and returns the loss :math:`-\mathcal L`."""
        bound = offsets + tail
        dtype = self.strategy.inducing_points.dtype
        self.bound = bound.to(dtype)
        return bound.sum().neg().to(dtype)
