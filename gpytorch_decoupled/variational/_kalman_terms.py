from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..linalg import cholesky_logdet, cholesky_solve, jittered_cholesky, solve_lower, symmetrized

APPROXIMATIONS = ("vfe", "dtc", "fitc", "pitc", "pep")

# Weight of diag(Delta_k) in the mini-batch noise V_k = Vbar_k + sigma^2 I of the diagonal models (docs/derivations.md,
# "The sparse models of the PEP family").
_DIAGONAL_WEIGHT = {"vfe": 0.0, "dtc": 0.0, "fitc": 1.0}


def checked_approximation(approximation: str, alpha: float | None) -> tuple[str, float | None]:
    """The approximation's canonical name and its power :math:`\\alpha` (``None`` unless PEP), or a ValueError."""
    if not isinstance(approximation, str) or approximation.lower() not in APPROXIMATIONS:
        raise ValueError(f"approximation must be one of {', '.join(map(repr, APPROXIMATIONS))}, got {approximation!r}.")
    approximation = approximation.lower()
    if approximation != "pep":
        if alpha is not None:
            raise ValueError(f"alpha is the power of approximation='pep'; it has no meaning for {approximation!r}.")
        return approximation, None
    if alpha is None or not 0.0 < float(alpha) <= 1.0:
        raise ValueError(f"approximation='pep' needs a power 0 < alpha <= 1 (1 is FITC, alpha -> 0 VFE), got {alpha}.")
    return approximation, float(alpha)


class KalmanStatistics(NamedTuple):
    r"""
    The data part of a :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`'s information-form state in
    the transformed coordinates :math:`\tilde{\mathbf u} = \mathbf K_{\mathbf{uu}}^{-1}\mathbf u`, float64: sums over
    the absorbed mini-batches.
    """

    information_vector: Tensor  # eta~ = sum_k K_uk V_k^{-1} (y_k - mu_0(X_k)), (..., M)
    information_matrix: Tensor  # Lambda~ - K_uu = sum_k K_uk V_k^{-1} K_ku, (..., M, M)


class KalmanIncrements(NamedTuple):
    r"""What one mini-batch adds to a :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`'s state
    (detached, finite, the matrix exactly symmetric)."""

    information_vector: Tensor  # (..., M)
    information_matrix: Tensor  # (..., M, M)
    bound: Tensor  # psi_k, (...)


class ObservationTerms(NamedTuple):
    r"""
    One mini-batch's likelihood :math:`p(\mathbf y_k \mid \tilde{\mathbf u}) = \mathcal N(\mathbf K_{k\mathbf u}
    \tilde{\mathbf u}, \mathbf V_k)` in the transformed coordinates
    :math:`\tilde{\mathbf u} = \mathbf K_{\mathbf{uu}}^{-1}\mathbf u` (Schuerch et al. 2020, Sec. 3.2;
    :ref:`derivations-information-form`), whitened by the Cholesky factor :math:`\mathbf L_V` of :math:`\mathbf V_k`
    (diagonal except for PITC). Everything is float64 and, outside ``torch.no_grad``, differentiable in the
    hyperparameters.
    """

    features: Tensor  # W = L_V^{-1} K_ku, (..., B, M)
    targets: Tensor  # r = L_V^{-1} (y_k - mu_0(X_k)), (..., B)
    log_det_noise: Tensor  # log |V_k|, (...)
    regularizer: Tensor  # rho_k, subtracted from the bound term, (...)

    @property
    def information_vector(self) -> Tensor:
        r""":math:`\Delta\tilde{\boldsymbol\eta}_k = \mathbf K_{\mathbf uk}\mathbf V_k^{-1}(\mathbf y_k - \mu_0)`."""
        return (self.features.mT @ self.targets.unsqueeze(-1)).squeeze(-1)

    @property
    def information_matrix(self) -> Tensor:
        r""":math:`\Delta\tilde{\boldsymbol\Lambda}_k=\mathbf K_{\mathbf uk}\mathbf V_k^{-1}\mathbf K_{k\mathbf u}`."""
        return self.features.mT @ self.features

    @property
    def offset(self) -> Tensor:
        r"""The part of the bound that is a sum over mini-batches:
        :math:`-\tfrac12(B_k\log2\pi + \log\lvert\mathbf V_k\rvert + \lVert\mathbf r\rVert^2) - \rho_k`."""
        size = self.targets.size(-1)
        return -0.5 * (size * math.log(2 * math.pi) + self.log_det_noise + self.targets.square().sum(-1)) - (
            self.regularizer
        )


def observation_terms(
    approximation: str,
    alpha: float | None,
    inducing_cholesky: Tensor,  # (..., M, M), L_uu of the jittered K_uu
    inducing_data_covariance: Tensor,  # (..., M, B)
    data_covariance: Tensor,  # (..., B) diagonal, or (..., B, B) for PITC
    residual: Tensor,  # (..., B), y - mu_0(x)
    noise: Tensor,  # (..., 1), sigma^2, or (..., B), one noise variance per point
) -> ObservationTerms:
    r"""The :class:`ObservationTerms` of one mini-batch under its model's row of :ref:`derivations-pep-family` (with
    one noise variance per point, :math:`\sigma^2\mathbf I` becomes :math:`\operatorname{Diag}(\sigma_i^2)`)."""
    projection = solve_lower(inducing_cholesky, inducing_data_covariance)  # L_uu^{-1} K_uk
    if approximation == "pitc":
        conditional = data_covariance - projection.mT @ projection  # Delta_k, the whole block
        noise_matrix = torch.diag_embed(noise.expand(*noise.shape[:-1], conditional.size(-1)))
        noise_cholesky = jittered_cholesky(conditional + noise_matrix, name="PITC block V_k")
        features = solve_lower(noise_cholesky, inducing_data_covariance.mT)
        targets = solve_lower(noise_cholesky, residual.unsqueeze(-1)).squeeze(-1)
        log_det_noise = cholesky_logdet(noise_cholesky)
        return ObservationTerms(features, targets, log_det_noise, torch.zeros_like(log_det_noise))

    conditional = data_covariance - projection.square().sum(-2)  # delta_i = k_ii - q_ii
    weight = alpha if approximation == "pep" else _DIAGONAL_WEIGHT[approximation]
    variance = noise + weight * conditional
    scale = variance.rsqrt()
    features = inducing_data_covariance.mT * scale.unsqueeze(-1)
    targets = residual * scale
    log_det_noise = variance.log().sum(-1)
    if approximation == "vfe":
        regularizer = (conditional / noise).sum(-1) / 2
    elif approximation == "pep":
        regularizer = (1 - alpha) / (2 * alpha) * torch.log1p(alpha * conditional / noise).sum(-1)
    else:
        regularizer = torch.zeros_like(log_det_noise)
    return ObservationTerms(features, targets, log_det_noise, regularizer)


def bound_term(
    inducing_covariance: Tensor,  # (..., M, M), jittered K_uu
    information_vector: Tensor,  # (..., M), the absorbed statistics eta~
    information_matrix: Tensor,  # (..., M, M), the absorbed statistics Lambda~ - K_uu
    terms: ObservationTerms,
) -> Tensor:
    r"""
    The bound term :math:`\psi_k = \log\mathcal N(\mathbf e_k \mid \mathbf 0, \boldsymbol\Omega_k) - \rho_k` of a
    mini-batch given the statistics absorbed before it (:ref:`derivations-information-form`):

    .. math::

        \psi_k = -\tfrac12\big[B_k\log2\pi + \log\lvert\mathbf A_k\rvert - \log\lvert\mathbf A_{k-1}\rvert
            + \log\lvert\mathbf V_k\rvert + \tilde{\mathbf e}^\top\tilde{\mathbf e}
            - \tilde{\mathbf e}^\top\mathbf W\mathbf A_k^{-1}\mathbf W^\top\tilde{\mathbf e}\big] - \rho_k,

    with :math:`\mathbf A_{k-1} = \mathbf K_{\mathbf{uu}} + \tilde{\boldsymbol\Lambda}`, :math:`\mathbf A_k =
    \mathbf A_{k-1} + \mathbf W^\top\mathbf W` and the whitened innovation :math:`\tilde{\mathbf e} = \mathbf r -
    \mathbf W\mathbf A_{k-1}^{-1}\tilde{\boldsymbol\eta}` (Woodbury for :math:`\boldsymbol\Omega_k^{-1}`, the
    determinant lemma for :math:`\log\lvert\boldsymbol\Omega_k\rvert`). The statistics are symmetrized first, so that
    the gradient with respect to them is symmetric.
    """
    before = inducing_covariance + symmetrized(information_matrix)
    before_cholesky = jittered_cholesky(before, name="Kalman precision K_uu + Lambda")
    after_cholesky = jittered_cholesky(before + terms.information_matrix, name="Kalman precision K_uu + Lambda")
    mean = cholesky_solve(before_cholesky, information_vector.unsqueeze(-1))
    innovation = terms.targets - (terms.features @ mean).squeeze(-1)
    reduction = solve_lower(after_cholesky, terms.features.mT @ innovation.unsqueeze(-1))
    quadratic = innovation.square().sum(-1) - reduction.square().sum((-2, -1))
    size = terms.targets.size(-1)
    log_det_ratio = cholesky_logdet(after_cholesky) - cholesky_logdet(before_cholesky)
    return -0.5 * (size * math.log(2 * math.pi) + log_det_ratio + terms.log_det_noise + quadratic) - terms.regularizer


def held_in_u_space(
    prior_cholesky: Tensor,  # (..., M, M), L_uu of the jittered K_uu
    inducing_covariance: Tensor,  # (..., M, M), jittered K_uu, differentiable in the hyperparameters
    information_vector: Tensor,  # (..., M), the absorbed statistics eta~
    information_matrix: Tensor,  # (..., M, M), the absorbed statistics Lambda~ - K_uu
) -> KalmanStatistics:
    r"""
    The absorbed statistics :math:`\tilde{\boldsymbol\eta}` and :math:`\tilde{\boldsymbol\Lambda}` (the data part of
    the information matrix :math:`\mathbf A = \mathbf K_{\mathbf{uu}} + \tilde{\boldsymbol\Lambda}`) as functions of
    the hyperparameters :math:`\theta` with the data held fixed as sites in u-space
    (:ref:`derivations-kalman-gradients`): with :math:`\bar{\mathbf K}` the value of :math:`\mathbf K_{\mathbf{uu}}`
    (detached) and :math:`\mathbf D = \mathbf K_{\mathbf{uu}}(\theta) - \bar{\mathbf K}`, the sites
    :math:`\boldsymbol\ell_1 = \bar{\mathbf K}^{-1}\tilde{\boldsymbol\eta}` and
    :math:`\mathbf L_2 = \bar{\mathbf K}^{-1}\tilde{\boldsymbol\Lambda}\bar{\mathbf K}^{-1}` are constants and

    .. math::

        \mathbf K_{\mathbf{uu}}(\theta)\boldsymbol\ell_1 = \tilde{\boldsymbol\eta} + \mathbf D\boldsymbol\ell_1,
        \qquad
        \mathbf K_{\mathbf{uu}}(\theta)\mathbf L_2\mathbf K_{\mathbf{uu}}(\theta) = \tilde{\boldsymbol\Lambda}
            + \mathbf D\mathbf W + \mathbf W^\top\mathbf D + \mathbf D\mathbf L_2\mathbf D,
        \qquad \mathbf W = \bar{\mathbf K}^{-1}\tilde{\boldsymbol\Lambda}.

    :math:`\mathbf D` is exactly zero in value, so the statistics are returned bit for bit; the last term, which
    vanishes with its first derivative, is left out, so that values and gradients are exact (second derivatives are
    not). :math:`\boldsymbol\ell_1` and :math:`\mathbf W` are solves with ``prior_cholesky``, without a graph.
    """
    difference = inducing_covariance - inducing_covariance.detach()  # D, zero in value
    with torch.no_grad():
        site_vector = cholesky_solve(prior_cholesky, information_vector.unsqueeze(-1))  # ell_1
        solved_matrix = cholesky_solve(prior_cholesky, information_matrix)  # W
    first_order = difference @ solved_matrix
    vector = information_vector + (difference @ site_vector).squeeze(-1)
    return KalmanStatistics(vector, information_matrix + first_order + first_order.mT)


def collapsed_bound_tail(
    inducing_covariance: Tensor,  # (..., M, M), jittered K_uu
    information_vector: Tensor,  # (..., M), all data's eta~
    information_matrix: Tensor,  # (..., M, M), all data's Lambda~ - K_uu
) -> Tensor:
    r"""
    The part of the batch bound that is not a sum over mini-batches (so that :math:`\mathcal L = \sum_k
    \text{offset}_k + F`), from Woodbury and the determinant lemma applied to the whole data set:

    .. math::

        F = -\tfrac12\big[\log\lvert\mathbf K_{\mathbf{uu}} + \tilde{\boldsymbol\Lambda}\rvert
            - \log\lvert\mathbf K_{\mathbf{uu}}\rvert
            - \tilde{\boldsymbol\eta}^\top(\mathbf K_{\mathbf{uu}} + \tilde{\boldsymbol\Lambda})^{-1}
            \tilde{\boldsymbol\eta}\big].
    """
    prior_cholesky = jittered_cholesky(inducing_covariance, name="K_uu")
    cholesky = jittered_cholesky(inducing_covariance + symmetrized(information_matrix), name="K_uu + Lambda")
    whitened = solve_lower(cholesky, information_vector.unsqueeze(-1))
    return -0.5 * (cholesky_logdet(cholesky) - cholesky_logdet(prior_cholesky) - whitened.square().sum((-2, -1)))
