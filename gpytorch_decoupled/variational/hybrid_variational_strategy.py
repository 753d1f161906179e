from __future__ import annotations

from torch import Tensor

from ._residual_mean_variational_strategy import _ResidualMeanVariationalStrategy


class HybridVariationalStrategy(_ResidualMeanVariationalStrategy):
    r"""
    The hybrid decoupled basis of `Cheng & Boots (2017)`_ (App. A.3; Salimbeni et al. 2018, eq. 11): an SVGP block on
    the covariance basis :math:`\beta` (``inducing_points``) plus an extra mean basis :math:`\gamma`
    (``mean_inducing_points``, possibly many more points) with coefficients :math:`\mathbf a_\gamma`
    (``mean_coefficients``):

    .. math::

        m(\mathbf x) &= \mu_0(\mathbf x) + \mathbf k_{\mathbf x\gamma}\mathbf a_\gamma
            + \mathbf k_{\mathbf x\beta}\mathbf K_\beta^{-1}\mathbf m_\beta, \\
        s(\mathbf x, \mathbf x') &= k(\mathbf x, \mathbf x') + \mathbf k_{\mathbf x\beta}\mathbf K_\beta^{-1}
            (\mathbf S - \mathbf K_\beta)\mathbf K_\beta^{-1}\mathbf k_{\beta\mathbf x'},

    with :math:`\mathbf m_\beta = \mathbf L_\beta \mathbf m_w`, :math:`\mathbf S = \mathbf L_\beta \mathbf S_w
    \mathbf L_\beta^\top` from the whitened :math:`q(\mathbf u_\beta) = \mathcal N(\mathbf m_w, \mathbf S_w)` (any
    GPyTorch Gaussian distribution). Its KL (`Cheng & Boots (2017)`_, App. A.3, eq. 14, with the :math:`\tfrac12` on the
    log-determinant that the printed equation lacks: :ref:`derivations-hybrid-kl`) is

    .. math::

        \mathrm{KL}[q \Vert p] = \mathrm{KL}[\mathcal N(\mathbf m_w, \mathbf S_w) \Vert \mathcal N(\mathbf 0,\mathbf I)]
        + \mathbf m_w^\top \mathbf c
        + \tfrac12 \mathbf a_\gamma^\top \mathbf K_\gamma \mathbf a_\gamma,
        \qquad \mathbf c = \mathbf L_\beta^{-1}\mathbf K_{\beta\gamma}\mathbf a_\gamma,

    where :math:`\mathbf a_\gamma^\top \mathbf K_\gamma \mathbf a_\gamma = \lVert\mathbf c\rVert^2 +
    \mathbf a_\gamma^\top\mathbf K_{\gamma\perp\beta}\mathbf a_\gamma` is exact for a mean basis of up to
    ``exact_kl_size`` (4,096) points (one sweep over cache-sized tiles of :math:`\mathbf K_\gamma`) and for a larger
    one estimated in training from ``num_kl_columns`` rows drawn in proportion to :math:`\lvert a_{\gamma,i}\rvert`
    (stratified), with :math:`\beta` and the step's mini-batch as the landmarks of a control variate
    (:ref:`derivations-landmark-kl`), so a step costs
    :math:`O(N_b(M_\gamma + M_\beta^2) + M_\beta M_\gamma + bM_\gamma + M_\beta^3)`.
    With :math:`\mathbf a_\gamma = \mathbf 0` it is exactly GPyTorch's SVGP.

    With the same :math:`\gamma, \beta` and hyperparameters, the hybrid and orthogonal bases describe the same
    processes (:func:`~gpytorch_decoupled.variational.convert_mean_basis` maps one onto the other exactly); they differ
    in optimization geometry. Natural gradients on the :math:`\beta` block with :math:`\mathbf a_\gamma` fixed
    (:class:`gpytorch.optim.NGD` on ``model.variational_parameters()``) are exact natural-gradient steps, since a
    constant mean shift is an affine reparametrization; but :math:`\mathbf a_\gamma` moves the :math:`\beta` block's
    natural parameters too, so alternating steps converge more slowly than with
    :class:`~gpytorch_decoupled.variational.OrthogonallyDecoupledVariationalStrategy`, whose blocks decouple.

    :param model: Model this strategy is applied to (typically the :class:`~gpytorch.models.ApproximateGP` itself).
    :param inducing_points: Covariance basis :math:`\beta`, ``(..., M_beta, D)``.
    :param variational_distribution: Gaussian :math:`q(\mathbf u_\beta)` over the whitened :math:`\beta` block.
    :param mean_inducing_points: Mean basis :math:`\gamma`, ``(M_gamma, D)``, shared by every latent of the batch.
    :param learn_inducing_locations: Learn :math:`\beta` and :math:`\gamma` (default True).
    :param num_kl_columns: Rows :math:`b` of :math:`\mathbf K_\gamma` drawn for the training KL of a mean basis
        larger than ``exact_kl_size``; ``None`` always computes it exactly.
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
        >>> from gpytorch_decoupled.variational import HybridVariationalStrategy
        >>> class HybridGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, beta, gamma):
        ...         q_beta = gpytorch.variational.CholeskyVariationalDistribution(beta.size(0))
        ...         super().__init__(HybridVariationalStrategy(self, beta, q_beta, gamma))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 500).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1)) + 0.1 * torch.randn(500)
        >>> model, likelihood = HybridGP(x[::25].clone(), x[::5].clone()), gpytorch.likelihoods.GaussianLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=500)
        >>> optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
        >>> for _ in range(20):
        ...     optimizer.zero_grad()
        ...     loss = -mll(model(x), y)
        ...     loss.backward()
        ...     optimizer.step()
        >>> model.eval()(x[:3]).mean.shape
        torch.Size([3])

    .. _Cheng & Boots (2017):
        https://arxiv.org/abs/1711.10127
    """

    def _covariance_block_mean(self, inducing_values: Tensor, coordinates: Tensor) -> Tensor:
        return inducing_values

    def kl_divergence(self) -> Tensor:
        whitened_mean = self.variational_distribution.mean
        cross = (whitened_mean * self.residual_coordinates()).sum(-1)
        return self._block_kl_divergence() + cross + 0.5 * self.mean_basis_quadratic_form()
