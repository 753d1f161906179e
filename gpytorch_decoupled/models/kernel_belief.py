from __future__ import annotations

import math

import torch
from gpytorch import Module
from torch import Tensor


class KernelBelief(Module):
    r"""
    The kernel belief of VBKS (`Teng et al. (2020)`_, Secs. 3-4; :ref:`derivations-vbks-priors`): a Gaussian
    :math:`q(g) = \mathcal N(m_g, L_g L_g^\top)` over the logits of the kernel prior
    :math:`p(\kappa_c \mid g) = \mathrm{softmax}(g)_c`, with prior :math:`p(g) = \mathcal N(\mu_{g0}, \tau I_C)`.

    Given the optimized local ELBOs :math:`\mathcal L^*_c` of the :math:`C` candidate kernels, :meth:`fit` maximizes
    the global objective (eq. 8, with the local ELBOs held fixed)

    .. math::

        F(m_g, L_g) = \frac1S\sum_{s=1}^S\sum_{c=1}^C \tilde{\mathcal L}_c\,
            \mathrm{softmax}(m_g + L_g\varepsilon_s)_c - \mathrm{KL}[q(g)\,\Vert\,p(g)],
        \qquad \tilde{\mathcal L}_c = \rho\,\mathcal L^*_c,

    as a sample-average approximation over :math:`S` fixed standard-normal draws :math:`\varepsilon_s` (antithetic
    pairs, drawn once from ``seed``), by L-BFGS. The temperature :math:`\rho` (``elbo_scale``) is 1 in the paper; the
    reference code uses :math:`\rho = 2/N_{\rm mb}` (twice the ELBO per mini-batch), without which ELBO differences of
    order :math:`n` make the posterior one-hot. The kernel posterior (eq. 13) is
    :math:`q^*(\kappa_c) = \frac1S\sum_s\mathrm{softmax}(m_g + L_g\varepsilon_s)_c`.

    :math:`L_g` is lower triangular with a log-parameterized diagonal, initialized (as are :math:`m_g = 0`) to the
    identity.

    :param num_kernels: Number :math:`C` of candidate kernels.
    :param prior_variance: :math:`\tau` (the reference code uses 0.5 for BMA and 0.1 for posterior plots).
    :param prior_mean: :math:`\mu_{g0}` (zeros by default), shape ``(C,)``.
    :param num_samples: Number :math:`S` of draws (even, for antithetic pairs).
    :param seed: Seed of the draws, so that :meth:`fit` is deterministic.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.models import KernelBelief
        >>> belief = KernelBelief(3, prior_variance=0.5, num_samples=1000)
        >>> belief.fit(torch.tensor([-120.0, -118.0, -125.0]), elbo_scale=1.0)
        >>> probabilities = belief.probabilities().detach()
        >>> bool(probabilities.argmax() == 1), round(float(probabilities.sum()), 6)
        (True, 1.0)

    .. _Teng et al. (2020):
        https://arxiv.org/abs/1912.02641
    """

    def __init__(
        self,
        num_kernels: int,
        prior_variance: float = 0.5,
        prior_mean: Tensor | None = None,
        num_samples: int = 2000,
        seed: int = 0,
    ):
        super().__init__()
        if num_kernels < 1:
            raise ValueError(f"num_kernels must be positive, got {num_kernels}.")
        if not prior_variance > 0:
            raise ValueError(f"prior_variance must be positive, got {prior_variance}.")
        if num_samples < 2 or num_samples % 2:
            raise ValueError(f"num_samples must be even and at least 2 (antithetic pairs), got {num_samples}.")
        prior_mean = torch.zeros(num_kernels) if prior_mean is None else torch.as_tensor(prior_mean)
        if prior_mean.shape != (num_kernels,):
            raise ValueError(f"prior_mean must have shape ({num_kernels},), got {tuple(prior_mean.shape)}.")
        self.num_kernels = num_kernels
        self.prior_variance = float(prior_variance)
        self.register_buffer("prior_mean", prior_mean.to(torch.get_default_dtype()))
        half = torch.randn(num_samples // 2, num_kernels, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("draws", torch.cat([half, -half]).to(torch.get_default_dtype()))
        self.mean = torch.nn.Parameter(torch.zeros(num_kernels))
        self.raw_scale_tril = torch.nn.Parameter(torch.zeros(num_kernels, num_kernels))

    @property
    def scale_tril(self) -> Tensor:
        r""":math:`L_g`: the strictly lower part of the raw parameter plus the exponentiated diagonal."""
        raw = self.raw_scale_tril
        return raw.tril(-1) + torch.diag_embed(raw.diagonal().exp())

    def reset_parameters(self) -> None:
        r"""Sets :math:`q(g)` to :math:`\mathcal N(0, I)`, the reference code's initialization."""
        with torch.no_grad():
            self.mean.zero_()
            self.raw_scale_tril.zero_()

    def softmax_samples(self) -> Tensor:
        r""":math:`\mathrm{softmax}(m_g + L_g\varepsilon_s)` for the :math:`S` fixed draws, shape ``(S, C)``."""
        logits = self.mean + self.draws @ self.scale_tril.mT
        return torch.softmax(logits, dim=-1)

    def probabilities(self) -> Tensor:
        r"""The kernel posterior :math:`q^*(\kappa_c) = \mathbb E_{q(g)}[\mathrm{softmax}(g)_c]` (eq. 13), shape
        ``(C,)``."""
        return self.softmax_samples().mean(0)

    def kl_divergence(self) -> Tensor:
        r""":math:`\mathrm{KL}[q(g) \Vert p(g)] = \frac12[\mathrm{tr}(L_gL_g^\top)/\tau
        + \lVert\mu_{g0} - m_g\rVert^2/\tau - C + C\log\tau - 2\sum_c\log (L_g)_{cc}]`."""
        tau, num = self.prior_variance, self.num_kernels
        trace = self.scale_tril.square().sum() / tau
        mahalanobis = (self.prior_mean - self.mean).square().sum() / tau
        return 0.5 * (trace + mahalanobis - num + num * math.log(tau) - 2 * self.raw_scale_tril.diagonal().sum())

    def objective(self, local_elbos: Tensor, elbo_scale: float = 1.0) -> Tensor:
        r"""The sample-average estimate of :math:`F` above (eq. 8 with the local ELBOs held at ``local_elbos``)."""
        local_elbos = self._checked_local_elbos(local_elbos)
        expected = (self.softmax_samples() * local_elbos).sum(-1).mean()
        return elbo_scale * expected - self.kl_divergence()

    def fit(self, local_elbos: Tensor, elbo_scale: float = 1.0, max_iterations: int = 100, num_starts: int = 4) -> None:
        r"""
        Maximizes :math:`F` over :math:`(m_g, L_g)` by L-BFGS with a strong Wolfe line search. :math:`F` is not concave
        in :math:`m_g`: with near-tied leading kernels it has one mode per leader, and where L-BFGS lands depends on
        its start. So it runs from several starts and keeps the best objective: :math:`q(g) = \mathcal N(0, I)` (the
        reference code's start) and :math:`m_g = 3\,\mathbf e_c` for each of the ``num_starts - 1`` largest local
        ELBOs (always with :math:`L_g = I`), so the result depends only on the arguments. The largest local ELBO is
        subtracted first: :math:`\sum_c\mathrm{softmax}_c = 1` makes that a constant shift of :math:`F`, and it keeps
        the line search well scaled. A start whose iterates leave the finite range is dropped.

        :param local_elbos: :math:`\mathcal L^*_c`, shape ``(C,)`` (as from
            :meth:`~gpytorch_decoupled.models.KernelSelectionGP.estimate_local_elbos`).
        :param elbo_scale: Temperature :math:`\rho`.
        :param max_iterations: L-BFGS iterations per start.
        :param num_starts: Number of starts (at least 1).
        :raises RuntimeError: If every start diverges (the belief is then left unchanged).
        """
        if not elbo_scale > 0:
            raise ValueError(f"elbo_scale must be positive, got {elbo_scale}.")
        if num_starts < 1:
            raise ValueError(f"num_starts must be at least 1, got {num_starts}.")
        centred = self._checked_local_elbos(local_elbos).detach()
        centred = centred - centred.max()
        parameters = (self.mean, self.raw_scale_tril)
        best, best_value = [parameter.detach().clone() for parameter in parameters], -math.inf
        leaders = torch.argsort(centred, descending=True)[: num_starts - 1].tolist()
        for leader in [None, *leaders]:
            self.reset_parameters()
            if leader is not None:
                with torch.no_grad():
                    self.mean[leader] = 3.0
            value = self._maximize(centred, elbo_scale, max_iterations)
            if value > best_value:
                best, best_value = [parameter.detach().clone() for parameter in parameters], value
        with torch.no_grad():
            for parameter, value in zip(parameters, best):
                parameter.copy_(value)
        if best_value == -math.inf:
            raise RuntimeError(
                "the kernel-belief optimization diverged from every start (belief left unchanged); try a smaller "
                "elbo_scale."
            )

    def _maximize(self, centred: Tensor, elbo_scale: float, max_iterations: int) -> float:
        """L-BFGS from the current parameters; the final objective, or -inf if the iterates left the finite range."""
        optimizer = torch.optim.LBFGS(
            [self.mean, self.raw_scale_tril],
            max_iter=max_iterations,
            tolerance_grad=1e-9,
            tolerance_change=1e-12,
            line_search_fn="strong_wolfe",
        )

        def closure():
            optimizer.zero_grad()
            loss = -self.objective(centred, elbo_scale)
            loss.backward()
            return loss

        with torch.enable_grad():
            optimizer.step(closure)
        self.mean.grad = self.raw_scale_tril.grad = None
        with torch.no_grad():
            value = self.objective(centred, elbo_scale)
        return float(value) if torch.isfinite(value) and torch.isfinite(self.raw_scale_tril).all() else -math.inf

    def _checked_local_elbos(self, local_elbos: Tensor) -> Tensor:
        local_elbos = torch.as_tensor(local_elbos, dtype=self.mean.dtype, device=self.mean.device)
        if local_elbos.shape != (self.num_kernels,):
            raise ValueError(f"local_elbos must have shape ({self.num_kernels},), got {tuple(local_elbos.shape)}.")
        if not torch.isfinite(local_elbos).all():
            raise ValueError("local_elbos contain NaN or inf.")
        return local_elbos
