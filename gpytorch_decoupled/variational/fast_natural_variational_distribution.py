from __future__ import annotations

from gpytorch.variational import NaturalVariationalDistribution
from torch import Tensor

from ._natural_multivariate_normal import _NaturalMultivariateNormal
from ._natural_to_mean_covariance import _NaturalToMeanCovariance


class FastNaturalVariationalDistribution(NaturalVariationalDistribution):
    r"""
    :class:`gpytorch.variational.NaturalVariationalDistribution` (same parameters :math:`\boldsymbol\theta_1` =
    ``natural_vec``, :math:`\boldsymbol\Theta_2` = ``natural_mat``, same state dict, same natural gradients for
    :class:`gpytorch.optim.NGD`) with a cheaper map to :math:`q(\mathbf u) = \mathcal N(\boldsymbol\mu, \mathbf S)`.

    GPyTorch's version returns :math:`q` through a Cholesky factor of :math:`\mathbf S`, so every step factorizes
    twice, inverts two triangular matrices and differentiates a Cholesky factorization. Here the precision
    :math:`\boldsymbol\Lambda = -2\boldsymbol\Theta_2` is factorized once (float64, escalating jitter with one warning),

    .. math::

        \mathbf S = \boldsymbol\Lambda^{-1}, \qquad \boldsymbol\mu = \mathbf S\boldsymbol\theta_1, \qquad
        \log\lvert\mathbf S\rvert = -2\textstyle\sum_i \log L_{ii},

    and :math:`q` carries :math:`\mathbf S` densely together with its log-determinant, so the whitened KL costs
    :math:`O(M^2)` and the backward pass to the expectation parameters is :math:`O(M^2)` (no factorization is
    differentiated). Values and natural gradients equal GPyTorch's to rounding. Use it wherever GPyTorch's natural
    distribution is used, e.g. for the covariance block of OrthNat
    (:class:`~gpytorch_decoupled.variational.OrthogonallyDecoupledVariationalStrategy`) or a plain SVGP.

    :param num_inducing_points: Size :math:`M` of :math:`q(\mathbf u)`.
    :param batch_shape: Batch of independent distributions.
    :param mean_init_std: Standard deviation of the noise added to the initial mean.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.variational import FastNaturalVariationalDistribution
        >>> class SVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z):
        ...         q_u = FastNaturalVariationalDistribution(z.size(0))
        ...         super().__init__(gpytorch.variational.VariationalStrategy(self, z, q_u))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> _ = torch.manual_seed(0)
        >>> x = torch.linspace(-3, 3, 200).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1))
        >>> model, likelihood = SVGP(x[::10].clone()), gpytorch.likelihoods.GaussianLikelihood(noise=0.01)
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=200)
        >>> ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=200, lr=1.0)
        >>> for _ in range(3):  # a unit step is exact for a Gaussian likelihood: the loss is optimal after one
        ...     ngd.zero_grad()
        ...     loss = -mll(model(x), y)
        ...     loss.backward()
        ...     ngd.step()
        ...     print(f"{loss.item():.4f}")
        1.6111
        0.8138
        0.8138
    """

    def forward(self) -> _NaturalMultivariateNormal:
        mean, covariance, logdet = self.moments()
        return _NaturalMultivariateNormal(mean, covariance, covariance_logdet=logdet)

    def moments(self) -> tuple[Tensor, Tensor, Tensor]:
        r"""
        :math:`\boldsymbol\mu`, the dense :math:`\mathbf S` and :math:`\log\lvert\mathbf S\rvert` as plain tensors
        (what :meth:`forward` wraps in a distribution), with the natural-gradient backward pass described above; the
        lean training path (:func:`~gpytorch_decoupled.training.compile_training_step`) uses them directly.
        """
        return _NaturalToMeanCovariance.apply(self.natural_vec, self.natural_mat)
