from __future__ import annotations

import torch
from gpytorch import Module
from torch import Tensor


class HyperparameterPosterior(Module):
    r"""
    A Gaussian posterior :math:`q(\theta_c) = \mathcal N(m_{\theta,c}, C_{\theta,c}C_{\theta,c}^\top)` over each
    candidate's hyperparameters in VBKS (Teng et al. 2020, Sec. 3 and App. C.2), for the full-Bayesian mode
    :math:`C_\theta \ne 0`, with prior :math:`p(\theta_c) = \mathcal N(\theta_{c,\rm init}, s^2 I)` (the paper leaves it
    open: :ref:`derivations-vbks-priors`; default :math:`s = 1`).

    The hyperparameters are the model's raw (unconstrained) GPyTorch parameters; their current values are the means
    :math:`m_\theta` (trained by the optimizer as usual), and this module holds the full-covariance Cholesky factors
    :math:`C_{\theta,c}` (lower triangular, log-parameterized diagonal), one block per candidate, stored padded to the
    largest block as ``(C, P_max, P_max)``. Reparameterized draws :math:`\theta = m_\theta + C_\theta\varepsilon` feed
    the local ELBOs; :meth:`kl_divergence` is the closed-form :math:`\mathrm{KL}[q(\theta_c) \Vert p(\theta_c)]` per
    candidate. Positive hyperparameters live in GPyTorch's raw space (softplus, not the paper's log).

    :param owners: For every hyperparameter (by name), a LongTensor of its shape giving the candidate owning each
        entry.
    :param values: The hyperparameters' initial raw values (the prior means), by name.
    :param num_candidates: Number :math:`C` of candidates.
    :param initial_std: Initial :math:`C_\theta = ` ``initial_std`` :math:`\cdot I`.
    :param prior_std: :math:`s`.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.models import HyperparameterPosterior
        >>> owners = {"noise": torch.tensor([0, 1]), "lengthscale": torch.tensor([[0, 0], [1, 1]])}
        >>> values = {"noise": torch.zeros(2), "lengthscale": torch.zeros(2, 2)}
        >>> posterior = HyperparameterPosterior(owners, values, num_candidates=2, initial_std=1.0)
        >>> posterior.kl_divergence(values)  # q = p
        tensor([0., 0.], grad_fn=<MulBackward0>)
        >>> {name: tuple(delta.shape) for name, delta in posterior.sample(5).items()}
        {'noise': (5, 2), 'lengthscale': (5, 2, 2)}
    """

    def __init__(
        self,
        owners: dict[str, Tensor],
        values: dict[str, Tensor],
        num_candidates: int,
        initial_std: float = 0.01,
        prior_std: float = 1.0,
    ):
        super().__init__()
        if set(owners) != set(values) or any(owners[name].shape != values[name].shape for name in owners):
            raise ValueError("owners and values must name the same hyperparameters with the same shapes.")
        if not (initial_std > 0 and prior_std > 0):
            raise ValueError("initial_std and prior_std must be positive.")
        self.names = list(owners)
        self.shapes = [owners[name].shape for name in self.names]
        entry_candidate = torch.cat([owners[name].reshape(-1) for name in self.names]).long()
        if entry_candidate.min() < 0 or entry_candidate.max() >= num_candidates:
            raise ValueError(f"owner indices must lie in [0, {num_candidates}).")
        counts = torch.bincount(entry_candidate, minlength=num_candidates)
        order = torch.argsort(entry_candidate, stable=True)
        block_start = torch.cumsum(counts, 0) - counts
        entry_slot = torch.empty_like(entry_candidate)
        entry_slot[order] = torch.arange(entry_candidate.numel()) - block_start[entry_candidate[order]]
        size = int(counts.max())
        self.num_candidates = num_candidates
        self.prior_std = float(prior_std)
        self.register_buffer("entry_candidate", entry_candidate)
        self.register_buffer("entry_slot", entry_slot)
        self.register_buffer("block_sizes", counts)
        self.register_buffer("block_mask", torch.arange(size) < counts.unsqueeze(-1))
        self.register_buffer("prior_mean", self.flatten(values).detach().clone())
        raw = torch.diag_embed(torch.full((num_candidates, size), float(initial_std)).log())
        self.raw_scale_tril = torch.nn.Parameter(raw * self.block_mask.unsqueeze(-1) * self.block_mask.unsqueeze(-2))

    def flatten(self, values: dict[str, Tensor]) -> Tensor:
        """The hyperparameters of ``values`` as one flat vector, in this module's order."""
        return torch.cat([values[name].reshape(-1) for name in self.names])

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Inverse of :meth:`flatten`, keeping leading sample dimensions."""
        pieces = flat.split([shape.numel() for shape in self.shapes], dim=-1)
        return {
            name: piece.reshape(*flat.shape[:-1], *shape) for name, piece, shape in zip(self.names, pieces, self.shapes)
        }

    @property
    def scale_tril(self) -> Tensor:
        r""":math:`C_{\theta,c}` for every candidate, zero outside each block, shape ``(C, P_max, P_max)``."""
        raw, mask = self.raw_scale_tril, self.block_mask
        diagonal = raw.diagonal(dim1=-2, dim2=-1).exp() * mask
        return raw.tril(-1) * mask.unsqueeze(-1) * mask.unsqueeze(-2) + torch.diag_embed(diagonal)

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        r"""Reparameterized offsets :math:`C_\theta\varepsilon` (differentiable in :math:`C_\theta`), by name, each of
        shape ``(num_samples, *hyperparameter shape)``: :meth:`offsets` of :meth:`standard_normal_draws`."""
        return self.offsets(self.standard_normal_draws(num_samples, generator))

    def standard_normal_draws(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        r"""The draws :math:`\varepsilon \sim \mathcal N(\mathbf 0, \mathbf I)` of :meth:`sample`, shape
        ``(num_samples, C, P_max)`` (drawn apart from the offsets, e.g. before a compiled training step)."""
        raw = self.raw_scale_tril
        return torch.randn(num_samples, *raw.shape[:-1], generator=generator, dtype=raw.dtype, device=raw.device)

    def offsets(self, draws: Tensor) -> dict[str, Tensor]:
        r"""The offsets :math:`C_\theta\varepsilon` of draws of :meth:`standard_normal_draws`, by name."""
        blocks = (self.scale_tril @ draws.unsqueeze(-1)).squeeze(-1)
        return self.unflatten(blocks[:, self.entry_candidate, self.entry_slot])

    def kl_divergence(self, values: dict[str, Tensor]) -> Tensor:
        r""":math:`\mathrm{KL}[q(\theta_c) \Vert p(\theta_c)] = \frac12[(\lVert C_{\theta,c}\rVert_F^2
        + \lVert m_{\theta,c} - \theta_{c,\rm init}\rVert^2)/s^2 - P_c + 2P_c\log s
        - 2\sum\log\mathrm{diag}\,C_{\theta,c}]` at the means ``values``, shape ``(C,)``."""
        variance = self.prior_std**2
        offsets = (self.flatten(values) - self.prior_mean).square()
        squared_mean = torch.zeros_like(self.block_sizes, dtype=offsets.dtype).index_add(
            0, self.entry_candidate, offsets
        )
        tril = self.scale_tril
        log_diagonal = (self.raw_scale_tril.diagonal(dim1=-2, dim2=-1) * self.block_mask).sum(-1)
        sizes = self.block_sizes.to(offsets.dtype)
        trace = tril.square().sum((-2, -1))
        return 0.5 * (
            (trace + squared_mean) / variance - sizes + sizes * torch.log(torch.tensor(variance)) - 2 * log_diagonal
        )
