from __future__ import annotations

from torch import Tensor

from ._residual_mean_variational_strategy import _ResidualMeanVariationalStrategy
from .joint_prior import joint_prior


class OrthogonallyDecoupledVariationalStrategy(_ResidualMeanVariationalStrategy):
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
    process is (`Salimbeni et al. (2018)`_, App. A, Prop. A.1)

    .. math::

        \mathrm{KL}[q \Vert p] = \tfrac12 \mathbf a_\gamma^\top \mathbf K_{\gamma\perp\beta} \mathbf a_\gamma
        + \mathrm{KL}[\mathcal N(\mathbf m_w, \mathbf S_w) \Vert \mathcal N(\mathbf 0, \mathbf I)],
        \qquad \mathbf a_\gamma^\top \mathbf K_{\gamma\perp\beta} \mathbf a_\gamma
        = \mathbf a_\gamma^\top \mathbf K_\gamma \mathbf a_\gamma - \lVert \mathbf c \rVert^2,
        \quad \mathbf c = \mathbf L_\beta^{-1} \mathbf K_{\beta\gamma} \mathbf a_\gamma .

    The quadratic form is exact for a mean basis of up to ``exact_kl_size`` (4,096) points, in eval mode and with
    ``num_kl_columns=None``: one sweep over cache-sized tiles of the upper triangle of :math:`\mathbf K_\gamma`,
    :math:`O(M_\gamma^2)` time and the memory of one tile. For a larger basis it is estimated without bias from
    ``num_kl_columns`` rows of :math:`\mathbf K_\gamma` drawn in proportion to :math:`\lvert a_{\gamma,i}\rvert`, with
    :math:`\beta` (and the step's mini-batch, whose products the step computes anyway) as landmarks of a control
    variate that takes out the part of the mean that they represent (:ref:`derivations-landmark-kl`); the draws are
    stratified by coefficient. No
    :math:`M_\gamma \times M_\gamma` matrix is ever formed: a training step then costs :math:`O(N_b (M_\gamma +
    M_\beta^2) + M_\beta M_\gamma + b M_\gamma + M_\beta^3)`.

    **Training.** The covariance block is an ordinary whitened SVGP block: with a natural-parameter distribution
    (:class:`~gpytorch_decoupled.variational.FastNaturalVariationalDistribution`, or GPyTorch's slower
    :class:`~gpytorch.variational.NaturalVariationalDistribution` with the same parameters) it is trained exactly by
    natural gradients with :class:`gpytorch.optim.NGD` (the paper's OrthNat; one step of size 1 is exact for a
    Gaussian likelihood), with a
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
    :param num_kl_columns: Rows :math:`b` of :math:`\mathbf K_\gamma` drawn for the training KL of a mean basis
        larger than ``exact_kl_size`` (the paper's 64); ``None`` always computes it exactly.
    :param kl_block_size: Rows of :math:`\mathbf K_\gamma` evaluated at once by the exact KL of a kernel without a
        fused product.
    :param mean_init_std: Standard deviation of the initial :math:`\mathbf a_\gamma` around 0.
    :param jitter_val: Diagonal jitter of :math:`\mathbf K_\beta` (default: GPyTorch's, by dtype).
    :param exact_kl_size: Mean bases of at most this many points have the exact KL in training too (zero variance).
    :param kl_control_variate: Estimate the sampled KL with :math:`\beta` as landmarks and rows drawn by
        :math:`\lvert a_{\gamma,i}\rvert` (default); False samples rows of :math:`\mathbf K_\gamma` uniformly
        (:ref:`derivations-column-sampled-kl`), with far more variance.
    :param kl_data_landmarks: With the control variate, use each training step's mini-batch as landmarks too
        (default): less variance at no extra kernel evaluation. The estimate then depends on the batch, so data-parallel
        ranks (:class:`~gpytorch_decoupled.distributed.GradientAllReduce`) each estimate the KL with their own shard:
        still unbiased, but not bitwise the KL of one process on the union batch; False restores that.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import (
        ...     FastNaturalVariationalDistribution,
        ...     OrthogonallyDecoupledVariationalStrategy,
        ... )
        >>> class ODVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, beta, gamma):
        ...         q_beta = FastNaturalVariationalDistribution(beta.size(0))
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

    def _covariance_block_mean(self, inducing_values: Tensor, coordinates: Tensor) -> Tensor:
        # Shifting the whitened mean by c turns the SVGP mean k_xb L^-T m_w into k_xb K_b^-1 (m_beta - K_bg a_g): the
        # projection term of the orthogonal basis costs no extra kernel evaluation against beta.
        return inducing_values - coordinates

    def residual_variances(self) -> Tensor:
        r"""
        :math:`\mathbf D_{\gamma\mid\beta} = \operatorname{diag}(\mathbf K_\gamma - \mathbf K_{\gamma\beta}
        \mathbf K_\beta^{-1}\mathbf K_{\beta\gamma})`, the prior variance of each mean-basis function left after
        projecting out :math:`\operatorname{span}\Psi_\beta` (the FITC-like diagonal of paper eq. 17), in
        :math:`O(M_\beta^2 M_\gamma)`.
        """
        gamma = self.mean_inducing_points
        chol = self._beta_cholesky()
        beta_gamma = self.mean_basis.cross_covariance(self.inducing_points, gamma).to_dense()
        projected = chol.solve(beta_gamma.type(chol.dtype)).type(beta_gamma.dtype)
        prior_variances = joint_prior(self.model, gamma).diagonal(0)
        return prior_variances - projected.pow(2).sum(-2)

    def mean_quadratic_form(self, indices: Tensor | None = None) -> Tensor:
        r"""
        :math:`\mathbf a_\gamma^\top\mathbf K_{\gamma\perp\beta}\mathbf a_\gamma
        = \mathbf a_\gamma^\top\mathbf K_\gamma\mathbf a_\gamma - \lVert\mathbf c\rVert^2`
        (:meth:`residual_quadratic_form`: exact, or this step's estimate).
        """
        return self.residual_quadratic_form(indices)

    def kl_divergence(self) -> Tensor:
        return self._block_kl_divergence() + 0.5 * self.mean_quadratic_form()
