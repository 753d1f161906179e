from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.variational import MeanFieldVariationalDistribution

from .hybrid_variational_strategy import HybridVariationalStrategy
from .initialize_from_prior import initialize_from_prior
from .orthogonally_decoupled_variational_strategy import OrthogonallyDecoupledVariationalStrategy


def convert_mean_basis(
    source: HybridVariationalStrategy | OrthogonallyDecoupledVariationalStrategy,
    target: HybridVariationalStrategy | OrthogonallyDecoupledVariationalStrategy,
) -> None:
    r"""
    Makes ``target`` (and its model) describe exactly the process of ``source``, across the hybrid and orthogonally
    decoupled parametrizations (:ref:`derivations-hybrid-odvgp-map`). With the same bases :math:`\gamma, \beta` and
    hyperparameters the two describe the same set of processes; in whitened coordinates the map is

    .. math::

        \mathbf a_\gamma^{\rm orth} = \mathbf a_\gamma^{\rm hyb}, \qquad
        \mathbf m_w^{\rm orth} = \mathbf m_w^{\rm hyb} + \mathbf c, \qquad
        \mathbf S_w^{\rm orth} = \mathbf S_w^{\rm hyb}, \qquad
        \mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma,

    i.e. :math:`\mathbf m_\beta^{\rm orth} = \mathbf m_\beta^{\rm hyb} + \mathbf K_{\beta\gamma}\mathbf a_\gamma`: the
    orthogonal basis's :math:`\mathbf m_\beta` is the whole mean at :math:`\beta`, the hybrid's only the
    :math:`\beta` block's part. Means, covariances, KL and ELBO are then identical. Every other parameter and buffer
    (hyperparameters, bases, likelihood if it is a submodule of the model) is copied from ``source.model``, so the two
    models need the same structure; the variational distributions may be of different Gaussian types (e.g. a Cholesky
    one to a natural one), as long as the target's can represent the source's covariance (a mean-field target only
    takes a diagonal one: anything else raises ``ValueError`` and changes nothing).

    :param source: Strategy whose process is copied.
    :param target: Strategy that is overwritten.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import (
        ...     HybridVariationalStrategy, OrthogonallyDecoupledVariationalStrategy, convert_mean_basis
        ... )
        >>> class GP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, strategy_class):
        ...         beta, gamma = torch.linspace(-2, 2, 5).unsqueeze(-1), torch.linspace(-3, 3, 20).unsqueeze(-1)
        ...         q = gpytorch.variational.CholeskyVariationalDistribution(5)
        ...         super().__init__(strategy_class(self, beta, q, gamma))
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(torch.zeros_like(x[..., 0]), self.covar_module(x))
        >>> hybrid, orthogonal = GP(HybridVariationalStrategy), GP(OrthogonallyDecoupledVariationalStrategy)
        >>> convert_mean_basis(hybrid.variational_strategy, orthogonal.variational_strategy)
        >>> x = torch.randn(4, 1)
        >>> torch.allclose(hybrid.eval()(x).mean, orthogonal.eval()(x).mean, atol=1e-5)
        True
    """
    strategies = (HybridVariationalStrategy, OrthogonallyDecoupledVariationalStrategy)
    if not isinstance(source, strategies) or not isinstance(target, strategies):
        raise TypeError(
            f"convert_mean_basis maps between {' and '.join(s.__name__ for s in strategies)}, got "
            f"{type(source).__name__} -> {type(target).__name__}."
        )
    source_state, target_state = _process_state(source.model), _process_state(target.model)
    # Structure, shapes, dtypes and devices are checked before anything changes (load_state_dict would copy the
    # matching entries before it raised on the others).
    if set(target_state) != set(source_state):
        raise ValueError(
            f"the two models differ in structure: only in the source {sorted(set(source_state) - set(target_state))}, "
            f"only in the target {sorted(set(target_state) - set(source_state))}."
        )
    for name, value in source_state.items():
        other = target_state[name]
        if isinstance(value, torch.Tensor) and (value.shape, value.dtype, value.device) != (
            other.shape,
            other.dtype,
            other.device,
        ):
            raise ValueError(
                f"{name} is {tuple(value.shape)} {value.dtype} on {value.device} in the source but "
                f"{tuple(other.shape)} {other.dtype} on {other.device} in the target: the two models need the same "
                "bases (sizes), dtype and device."
            )
    source._clear_cache()  # parameters may have changed in place since the last call
    with torch.no_grad():
        initialize_from_prior(source)  # as GPyTorch would on the first call
        source_distribution = source.variational_distribution
        shift = source.residual_coordinates()
        if isinstance(target, type(source)):
            shift = torch.zeros_like(shift)
        elif isinstance(source, OrthogonallyDecoupledVariationalStrategy):
            shift = -shift
        covariance = source_distribution.covariance_matrix
        if isinstance(target._variational_distribution, MeanFieldVariationalDistribution) and not torch.equal(
            covariance, torch.diag_embed(covariance.diagonal(dim1=-2, dim2=-1))
        ):
            raise ValueError(
                "the target's MeanFieldVariationalDistribution cannot represent the source's full covariance; use a "
                "full-covariance distribution (e.g. CholeskyVariationalDistribution) for the target."
            )
        target.model.load_state_dict(source_state, strict=False)
        target._resize_variational_distribution(MultivariateNormal(source_distribution.mean + shift, covariance))
        target.variational_params_initialized.fill_(1)
    for strategy in (source, target):
        strategy._clear_cache()


def _process_state(model: torch.nn.Module) -> dict:
    """The entries of ``model``'s state that the conversion copies: all but the variational distribution (which it
    maps) and modules' extra state (the random generator of a mean basis's sampled KL rows: not part of the process,
    and present only once a training step has drawn rows)."""
    return {
        name: value
        for name, value in model.state_dict().items()
        if "._variational_distribution." not in f".{name}" and not name.endswith("_extra_state")
    }
