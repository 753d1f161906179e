from __future__ import annotations

from typing import NamedTuple

import torch
from gpytorch.distributions import MultivariateNormal
from torch import Tensor

from ..gpytorch_compat import VariationalDistributionBase


class DualSites(NamedTuple):
    r"""What a :class:`DualVariationalDistribution` returns: the first and second site parameters, either in u-space
    (:math:`\boldsymbol\ell_1`, ``(..., M)``, and :math:`\mathbf L_2`, ``(..., M, M)``) or per datum
    (:math:`\boldsymbol\lambda_1` and :math:`\boldsymbol\lambda_2`, both ``(..., n)``)."""

    site_mean: Tensor
    site_precision: Tensor


class DualVariationalDistribution(VariationalDistributionBase):
    r"""
    The dual (site) parameters of t-SVGP (`Adam et al. (2021)`_), for
    :class:`~gpytorch_decoupled.variational.DualVariationalStrategy`. The approximate posterior is the prior times one
    Gaussian site per datum in the projected variable :math:`\mathbf a_i^\top\mathbf u = \mathbb E[f_i \mid \mathbf u]`,
    :math:`\mathbf a_i = \mathbf K_{\mathbf{uu}}^{-1}\mathbf k_{\mathbf u i}`:

    .. math::

        q(\mathbf u) \propto p(\mathbf u) \prod_{i=1}^n \exp\!\big(\lambda_{1,i}\,\mathbf a_i^\top\mathbf u
        - \tfrac12\lambda_{2,i}\,(\mathbf a_i^\top\mathbf u)^2\big)
        = p(\mathbf u)\exp\!\big(\boldsymbol\ell_1^\top\mathbf u - \tfrac12\mathbf u^\top\mathbf L_2\mathbf u\big),

    with :math:`\boldsymbol\ell_1 = \sum_i \mathbf a_i\lambda_{1,i}` and
    :math:`\mathbf L_2 = \sum_i\lambda_{2,i}\mathbf a_i\mathbf a_i^\top \succeq 0`, so that
    :math:`\mathbf S^{-1} = \mathbf K_{\mathbf{uu}}^{-1} + \mathbf L_2` and :math:`\mathbf S^{-1}\mathbf m =
    \boldsymbol\ell_1` (`Adam et al. (2021)`_, App. C, eqs. 42-48).

    By default the u-space sites :math:`(\boldsymbol\ell_1, \mathbf L_2)` are stored (``site_mean``, ``site_precision``,
    :math:`O(M^2)` memory): they are held fixed when the hyperparameters move, so :math:`q` is re-derived from them at
    every :math:`\theta` (variant A of :ref:`derivations-tsvgp-m-step`, the authors' reference implementation's choice).
    With ``datum_inputs`` (the :math:`n` training inputs, for full-batch use) the per-datum sites
    :math:`(\boldsymbol\lambda_1, \boldsymbol\lambda_2)` are stored instead (``datum_site_mean``,
    ``datum_site_precision``) and :math:`\boldsymbol\ell_1, \mathbf L_2` are recomputed from them at the current kernel
    and inducing inputs on every call (variant C: an exact upper envelope for conjugate kernel learning, at
    :math:`O(nM^2)` per evaluation).

    The sites are buffers, not parameters: they are set by the closed-form natural-gradient E-step
    :class:`~gpytorch_decoupled.optim.DualEStep`, never by a gradient optimizer, and they round-trip through
    ``state_dict``. They start at zero, which is the prior.

    :param num_inducing_points: Number :math:`M` of inducing points.
    :param batch_shape: Batch shape of independent latents (e.g. one per class of a softmax likelihood).
    :param datum_inputs: Training inputs ``(n, D)`` for per-datum sites (variant C); ``None`` keeps u-space sites.

    Example:
        >>> from gpytorch_decoupled.variational import DualVariationalDistribution
        >>> q = DualVariationalDistribution(num_inducing_points=20, batch_shape=torch.Size([3]))
        >>> q().site_mean.shape, q().site_precision.shape
        (torch.Size([3, 20]), torch.Size([3, 20, 20]))
        >>> sorted(name for name, _ in q.named_buffers())
        ['site_mean', 'site_precision']

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """

    def __init__(
        self,
        num_inducing_points: int,
        batch_shape: torch.Size = torch.Size([]),
        datum_inputs: Tensor | None = None,
    ):
        super().__init__(num_inducing_points=num_inducing_points, batch_shape=batch_shape)
        if datum_inputs is None:
            self.register_buffer("site_mean", torch.zeros(*batch_shape, num_inducing_points))
            self.register_buffer("site_precision", torch.zeros(*batch_shape, num_inducing_points, num_inducing_points))
        else:
            if datum_inputs.dim() != 2 or not torch.isfinite(datum_inputs).all():
                raise ValueError(
                    "datum_inputs must be a finite (n, D) matrix of training inputs, got shape "
                    f"{tuple(datum_inputs.shape)}."
                )
            self.register_buffer("datum_inputs", datum_inputs.detach().clone())
            self.register_buffer("datum_site_mean", torch.zeros(*batch_shape, datum_inputs.size(0)))
            self.register_buffer("datum_site_precision", torch.zeros(*batch_shape, datum_inputs.size(0)))

    @property
    def per_datum(self) -> bool:
        """Whether per-datum sites (variant C) are stored."""
        return hasattr(self, "datum_inputs")

    def forward(self) -> DualSites:
        if self.per_datum:
            return DualSites(self.datum_site_mean, self.datum_site_precision)
        return DualSites(self.site_mean, self.site_precision)

    @torch.no_grad()
    def reset_sites(self) -> None:
        r"""Sets every site to zero: :math:`q` becomes the prior."""
        for site in self():
            site.zero_()

    def add_sites(self, site_mean: Tensor, site_precision: Tensor) -> None:
        r"""
        Adds new points' u-space sites :math:`\sum_i\mathbf a_i\lambda_{1,i}` and
        :math:`\sum_i\lambda_{2,i}\mathbf a_i\mathbf a_i^\top` (a fantasy, already validated). Sites with batch
        dimensions beyond the distribution's enlarge its batch shape: each sum then has its own broadcast shape, so
        that :math:`\mathbf L_2` keeps the batch shape of the inputs rather than that of a sample batch of targets.
        Out of place, keeping the sites' autograd graph (BoTorch differentiates acquisition values through fantasies).
        """
        self._extend(site_mean=self.site_mean + site_mean, site_precision=self.site_precision + site_precision)

    def append_datum_sites(self, inputs: Tensor, site_mean: Tensor, site_precision: Tensor) -> None:
        r"""Appends new points ``(k, D)`` and their per-datum sites ``(..., k)`` (a fantasy, already validated)."""
        shape = self.batch_shape + self.datum_site_mean.shape[-1:]
        self._extend(
            datum_inputs=torch.cat([self.datum_inputs, inputs.to(self.datum_inputs)], dim=-2),
            datum_site_mean=torch.cat([self.datum_site_mean.expand(shape), site_mean.to(self.datum_site_mean)], -1),
            datum_site_precision=torch.cat(
                [self.datum_site_precision.expand(shape), site_precision.to(self.datum_site_precision)], -1
            ),
        )

    def _extend(self, **buffers: Tensor) -> None:
        for name, value in buffers.items():
            setattr(self, name, value.to(getattr(self, name)))
        site_mean = self().site_mean
        self.batch_shape = torch.broadcast_shapes(self.batch_shape, site_mean.shape[:-1])

    def initialize_variational_distribution(self, prior_dist: MultivariateNormal) -> None:
        self.reset_sites()
