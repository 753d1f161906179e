from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.utils.memoize import (
    _add_to_cache_ignore_args,
    _get_from_cache_ignore_args,
    _is_in_cache_ignore_args,
)
from gpytorch.variational import VariationalStrategy
from gpytorch.variational._variational_distribution import _VariationalDistribution
from linear_operator.operators import LinearOperator
from torch import Tensor

from ..linalg import column_sampled_quadratic_form
from ._cache_safe_mixin import _CacheSafeMixin


class OrthogonallyDecoupledVariationalStrategy(_CacheSafeMixin, VariationalStrategy):
    r"""
    Orthogonally decoupled variational GP (ODVGP) of `Salimbeni et al. (2018)`_, exactly as in the paper, at linear
    cost in the mean-basis size.

    Two inducing sets: a covariance basis :math:`\beta` (``inducing_points``, :math:`M_\beta` points) carrying a
    Gaussian :math:`q(\mathbf u_\beta)` (any GPyTorch distribution, whitened as in
    :class:`~gpytorch.variational.VariationalStrategy`), and a mean basis :math:`\gamma` (``mean_inducing_points``,
    :math:`M_\gamma` points, possibly many more) with coefficients :math:`\mathbf a_\gamma` acting only in the part of
    the RKHS orthogonal to :math:`\operatorname{span}\Psi_\beta`:

    .. math::

        m(\mathbf x) &= \mu_0(\mathbf x) + \tilde{\mathbf k}_{\mathbf x\gamma}\mathbf a_\gamma
            + \mathbf k_{\mathbf x\beta}\mathbf K_{\beta}^{-1}\mathbf m_\beta,
        \qquad \tilde{\mathbf k}_{\mathbf x\gamma} = \mathbf k_{\mathbf x\gamma}
            - \mathbf k_{\mathbf x\beta}\mathbf K_\beta^{-1}\mathbf K_{\beta\gamma}, \\
        s(\mathbf x, \mathbf x') &= k(\mathbf x, \mathbf x') + \mathbf k_{\mathbf x\beta}\mathbf K_\beta^{-1}
            (\mathbf S - \mathbf K_\beta)\mathbf K_\beta^{-1}\mathbf k_{\beta\mathbf x'},

    with :math:`\mathbf m_\beta = \mathbf L_\beta \mathbf m_w`, :math:`\mathbf S = \mathbf L_\beta \mathbf S_w
    \mathbf L_\beta^\top` from the whitened :math:`q(\mathbf u_\beta) = \mathcal N(\mathbf m_w, \mathbf S_w)`. So
    :math:`q(f(\beta)) = \mathcal N(\mathbf m_\beta, \mathbf S)` whatever :math:`\mathbf a_\gamma` is, and the KL of the
    process is (spec eq. 5.3)

    .. math::

        \mathrm{KL}[q \Vert p] = \tfrac12 \mathbf a_\gamma^\top \mathbf K_{\gamma\perp\beta} \mathbf a_\gamma
        + \mathrm{KL}[\mathcal N(\mathbf m_w, \mathbf S_w) \Vert \mathcal N(\mathbf 0, \mathbf I)],
        \qquad \mathbf a_\gamma^\top \mathbf K_{\gamma\perp\beta} \mathbf a_\gamma
        = \mathbf a_\gamma^\top \mathbf K_\gamma \mathbf a_\gamma - \lVert \mathbf c \rVert^2,
        \quad \mathbf c = \mathbf L_\beta^{-1} \mathbf K_{\beta\gamma} \mathbf a_\gamma .

    In training, :math:`\mathbf a_\gamma^\top \mathbf K_\gamma \mathbf a_\gamma` is estimated without bias from
    ``num_kl_columns`` sampled rows of :math:`\mathbf K_\gamma` (spec §0.1); in eval mode, or with
    ``num_kl_columns=None``, it is exact, in row blocks of bounded memory. No :math:`M_\gamma \times M_\gamma` matrix is
    ever formed: a training step costs :math:`O(N_b (M_\gamma + M_\beta^2) + M_\beta M_\gamma + b M_\gamma +
    M_\beta^3)`.

    **Training.** The covariance block is an ordinary whitened SVGP block: with a
    :class:`~gpytorch.variational.NaturalVariationalDistribution` it is trained exactly by natural gradients with
    :class:`gpytorch.optim.NGD` (the paper's OrthNat; one step of size 1 is exact for a Gaussian likelihood), with a
    :class:`~gpytorch.variational.CholeskyVariationalDistribution` by Adam (Orth). The mean coefficients
    :math:`\mathbf a_\gamma` (``mean_coefficients``) are deliberately *not* a variational parameter: an NGD step on them
    is not a natural-gradient step (GPyTorch issue #1267), so ``model.variational_parameters()`` yields only the
    :math:`\beta` block and ``model.hyperparameters()`` yields :math:`\mathbf a_\gamma` for Adam, or for the diagonal
    rule of :class:`gpytorch_decoupled.optim.OrthogonalMeanNaturalGradient` (paper eq. 17).

    Unlike :class:`gpytorch.variational.OrthogonallyDecoupledVariationalStrategy` (which uses the posterior instead of
    the projection, so its KL is not the KL of its process and no natural gradient applies), this is the paper's model.

    :param model: Model this strategy is applied to (typically the :class:`~gpytorch.models.ApproximateGP` itself).
    :param inducing_points: Covariance basis :math:`\beta`, ``(..., M_beta, D)``.
    :param variational_distribution: Gaussian :math:`q(\mathbf u_\beta)` over the whitened :math:`\beta` block.
    :param mean_inducing_points: Mean basis :math:`\gamma`, ``(M_gamma, D)``, shared by every latent of the batch.
    :param learn_inducing_locations: Learn :math:`\beta` and :math:`\gamma` (default True).
    :param num_kl_columns: Rows :math:`b` of :math:`\mathbf K_\gamma` sampled for the training KL (the paper's 64);
        ``None`` computes it exactly.
    :param kl_block_size: Rows of :math:`\mathbf K_\gamma` evaluated at once by the exact KL.
    :param mean_init_std: Standard deviation of the initial :math:`\mathbf a_\gamma` around 0.
    :param jitter_val: Diagonal jitter of :math:`\mathbf K_\beta` (default: GPyTorch's, by dtype).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy
        >>> class ODVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, beta, gamma):
        ...         q_beta = gpytorch.variational.NaturalVariationalDistribution(beta.size(0))
        ...         super().__init__(OrthogonallyDecoupledVariationalStrategy(self, beta, q_beta, gamma))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 500).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(500)
        >>> model, likelihood = ODVGP(x[::25].clone(), x[::5].clone()), gpytorch.likelihoods.GaussianLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=500)
        >>> ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=500, lr=0.1)  # beta block
        >>> adam = torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.01)  # a_gamma & rest
        >>> for _ in range(20):
        ...     ngd.zero_grad()
        ...     adam.zero_grad()
        ...     loss = -mll(model(x), y)
        ...     loss.backward()
        ...     ngd.step()
        ...     adam.step()
        >>> model.eval()(x[:3]).mean.shape
        torch.Size([3])

    .. _Salimbeni et al. (2018):
        https://arxiv.org/abs/1809.08820
    """

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: _VariationalDistribution,
        mean_inducing_points: Tensor,
        learn_inducing_locations: bool = True,
        num_kl_columns: int | None = 64,
        kl_block_size: int = 4096,
        mean_init_std: float = 1e-3,
        jitter_val: float | None = None,
    ):
        if mean_inducing_points.dim() == 1:
            mean_inducing_points = mean_inducing_points.unsqueeze(-1)
        covariance_dims = inducing_points.size(-1) if inducing_points.dim() > 1 else 1
        if mean_inducing_points.dim() != 2 or mean_inducing_points.size(-1) != covariance_dims:
            raise ValueError(
                f"mean_inducing_points must have shape (M_gamma, {covariance_dims}) to match inducing_points "
                f"{tuple(inducing_points.shape)}, got {tuple(mean_inducing_points.shape)}."
            )
        if not torch.isfinite(mean_inducing_points).all():
            raise ValueError("mean_inducing_points contains NaN or inf.")
        if num_kl_columns is not None and num_kl_columns < 1:
            raise ValueError(f"num_kl_columns must be a positive integer or None, got {num_kl_columns}.")
        super().__init__(model, inducing_points, variational_distribution, learn_inducing_locations, jitter_val)
        # The fantasy (OVC) machinery of the base class assumes the single-basis SVGP.
        self.has_fantasy_strategy = False

        gamma = mean_inducing_points.detach().clone().to(self.inducing_points)
        if learn_inducing_locations:
            self.register_parameter("mean_inducing_points", torch.nn.Parameter(gamma))
        else:
            self.register_buffer("mean_inducing_points", gamma)
        batch_shape = variational_distribution.batch_shape
        # Near zero, as GPyTorch starts variational means (mean_init_std): exactly zero would leave gamma without a
        # gradient in the first step.
        coefficients = torch.randn(*batch_shape, gamma.size(-2), dtype=gamma.dtype, device=gamma.device)
        coefficients.mul_(mean_init_std)
        self.register_parameter("mean_coefficients", torch.nn.Parameter(coefficients))
        self.num_kl_columns = num_kl_columns
        self.kl_block_size = kl_block_size

    # ------------------------------------------------------------------ kernel blocks
    def _cross_covariance(self, x1: Tensor, x2: Tensor, **kwargs) -> Tensor:
        """Dense prior covariance between two input sets through ``model.forward`` (only that block is evaluated)."""
        batch_shape = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
        x1 = x1.expand(*batch_shape, *x1.shape[-2:])
        x2 = x2.expand(*batch_shape, *x2.shape[-2:])
        joint = self.model.forward(torch.cat([x1, x2], dim=-2), **kwargs).lazy_covariance_matrix
        return joint[..., : x1.size(-2), x1.size(-2) :].to_dense()

    def _beta_cholesky(self):
        """Cholesky factor of :math:`\\mathbf K_\\beta` plus jitter, shared with the base class's cache."""
        beta = self.inducing_points
        covariance = self.model.forward(beta).lazy_covariance_matrix.add_jitter(self.jitter_val)
        return self._cholesky_factor(covariance)

    def residual_coordinates(self) -> Tensor:
        r"""
        :math:`\mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma`, so that the mean of the
        :math:`\gamma` block projected on :math:`\operatorname{span}\Psi_\beta` is :math:`\mathbf L_\beta \mathbf c`
        at :math:`\beta`. Cached in eval mode (where predictions then need only :math:`\mathbf k_{\mathbf x\gamma}`) and
        within one training step (shared by the forward pass and the KL).
        """
        if not _is_in_cache_ignore_args(self, "residual_coordinates"):
            self._cache_residual_coordinates(self._mean_basis_values(self.inducing_points))
        return _get_from_cache_ignore_args(self, "residual_coordinates")

    def _mean_basis_values(self, x: Tensor, **kwargs) -> Tensor:
        r""":math:`\mathbf K_{\mathbf x\gamma}\mathbf a_\gamma`, the mean basis function at ``x``."""
        return self._cross_covariance(x, self.mean_inducing_points, **kwargs) @ self.mean_coefficients.unsqueeze(-1)

    def _cache_residual_coordinates(self, beta_values: Tensor) -> Tensor:
        chol = self._beta_cholesky()
        coordinates = chol.solve(beta_values.type(chol.dtype)).squeeze(-1).type(beta_values.dtype)
        return _add_to_cache_ignore_args(self, "residual_coordinates", coordinates)

    def _sampled_rows(self) -> Tensor | None:
        r"""Rows of :math:`\mathbf K_\gamma` for this training step's KL estimate, or None when the KL is exact."""
        num_gamma = self.mean_inducing_points.size(-2)
        if not self.training or self.num_kl_columns is None or self.num_kl_columns >= num_gamma:
            return None
        return torch.randperm(num_gamma, device=self.mean_inducing_points.device)[: self.num_kl_columns]

    def _data_mean_basis_values(self, x: Tensor, **kwargs) -> Tensor:
        r"""
        :math:`\mathbf K_{\mathbf x\gamma}\mathbf a_\gamma`. Everything the mean basis contributes to a training step
        is this same product at other rows: at :math:`\beta` (the projection :math:`\mathbf c`) and at the sampled rows
        :math:`C` of :math:`\mathbf K_\gamma` (the KL estimate of spec §0.1,
        :math:`\tfrac{M_\gamma}{b}\mathbf a_C^\top[\mathbf K_{C\gamma}\mathbf a_\gamma]`). When the step has not
        computed them yet (training, or the first eval call), all rows go through one kernel evaluation and one
        product, and the model-level results are cached for :meth:`kl_divergence` and later eval calls.
        """
        if _is_in_cache_ignore_args(self, "residual_coordinates"):
            return self._mean_basis_values(x, **kwargs).squeeze(-1)
        gamma, beta = self.mean_inducing_points, self.inducing_points
        sampled = self._sampled_rows()
        rows = [beta] if sampled is None else [beta, gamma[sampled].expand(*beta.shape[:-2], -1, -1)]
        sizes = [row.size(-2) for row in rows]
        if x.shape[:-2] == beta.shape[:-2]:
            *model_values, data_values = self._mean_basis_values(torch.cat([*rows, x], dim=-2), **kwargs).split(
                [*sizes, x.size(-2)], dim=-2
            )
        else:  # a data batch the model does not have: keep the model's quantities free of it
            model_values = self._mean_basis_values(torch.cat(rows, dim=-2), **kwargs).split(sizes, dim=-2)
            data_values = self._mean_basis_values(x, **kwargs)
        self._cache_residual_coordinates(model_values[0])
        if sampled is not None:
            coefficients = self.mean_coefficients[..., sampled]
            estimate = (gamma.size(-2) / sampled.numel()) * (coefficients * model_values[1].squeeze(-1)).sum(-1)
            _add_to_cache_ignore_args(self, "sampled_mean_quadratic", estimate)
        return data_values.squeeze(-1)

    # ------------------------------------------------------------------ GPyTorch interface
    def forward(
        self,
        x: Tensor,
        inducing_points: Tensor,
        inducing_values: Tensor,
        variational_inducing_covar: LinearOperator | None = None,
        diag: bool = True,
        **kwargs,
    ) -> MultivariateNormal:
        # Shifting the whitened mean by c turns the SVGP mean k_xb L^-T m_w into k_xb K_b^-1 (m_beta - K_bg a_g): the
        # projection term of the orthogonal basis costs no extra kernel evaluation against beta.
        data_values = self._data_mean_basis_values(x, **kwargs)
        shifted_values = inducing_values - self.residual_coordinates()
        svgp = super().forward(x, inducing_points, shifted_values, variational_inducing_covar, diag=diag, **kwargs)
        mean = svgp.mean + data_values
        return MultivariateNormal(mean, svgp.lazy_covariance_matrix)

    def residual_variances(self) -> Tensor:
        r"""
        :math:`\mathbf D_{\gamma\mid\beta} = \operatorname{diag}(\mathbf K_\gamma - \mathbf K_{\gamma\beta}
        \mathbf K_\beta^{-1}\mathbf K_{\beta\gamma})`, the prior variance of each mean-basis function left after
        projecting out :math:`\operatorname{span}\Psi_\beta` (the FITC-like diagonal of paper eq. 17), in
        :math:`O(M_\beta^2 M_\gamma)`.
        """
        gamma = self.mean_inducing_points
        chol = self._beta_cholesky()
        beta_gamma = self._cross_covariance(self.inducing_points, gamma)
        projected = chol.solve(beta_gamma.type(chol.dtype)).type(beta_gamma.dtype)
        prior_variances = self.model.forward(gamma).lazy_covariance_matrix.diagonal(dim1=-2, dim2=-1)
        return prior_variances - projected.pow(2).sum(-2)

    def mean_quadratic_form(self, indices: Tensor | None = None) -> Tensor:
        r"""
        :math:`\mathbf a_\gamma^\top\mathbf K_{\gamma\perp\beta}\mathbf a_\gamma`: exact in eval mode or with
        ``num_kl_columns=None``; in training, the unbiased column-sampled estimate of this step (drawn in the forward
        pass, or here if no forward pass came first); for explicit ``indices``, the estimate for that sample of rows
        of :math:`\mathbf K_\gamma`.
        """
        if indices is None and _is_in_cache_ignore_args(self, "sampled_mean_quadratic"):
            quadratic = _get_from_cache_ignore_args(self, "sampled_mean_quadratic")
        else:
            quadratic = column_sampled_quadratic_form(
                self._cross_covariance,
                self.mean_inducing_points,
                self.mean_coefficients,
                indices=self._sampled_rows() if indices is None else indices,
                block_size=self.kl_block_size,
            )
        return quadratic - self.residual_coordinates().pow(2).sum(-1)

    def kl_divergence(self) -> Tensor:
        return super().kl_divergence() + 0.5 * self.mean_quadratic_form()

    def __call__(self, x: Tensor, prior: bool = False, diag: bool = True, **kwargs) -> MultivariateNormal:
        if x.size(-1) != self.inducing_points.size(-1):
            raise ValueError(
                f"inputs have {x.size(-1)} dimensions but the inducing points have {self.inducing_points.size(-1)}."
            )
        if x.dtype != self.inducing_points.dtype or x.device != self.inducing_points.device:
            raise ValueError(
                f"inputs are {x.dtype} on {x.device} but the model is {self.inducing_points.dtype} on "
                f"{self.inducing_points.device}; convert one of them (e.g. model.double() or x.to(...))."
            )
        if not torch.isfinite(x).all():
            raise ValueError("inputs contain NaN or inf.")
        return super().__call__(x, prior=prior, diag=diag, **kwargs)
