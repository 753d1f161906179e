from __future__ import annotations

from gpytorch import mlls

from ._target_checks import _TargetChecks


class VariationalELBO(_TargetChecks, mlls.VariationalELBO):
    r"""
    GPyTorch's :class:`~gpytorch.mlls.VariationalELBO` (`Hensman et al. (2015)`_),

    .. math::

        \mathcal L = \frac{1}{n}\Big(\frac{n}{B}\sum_{i=1}^B \mathbb E_{q(f_i)}[\log p(y_i \mid f_i)]
            - \beta\,\mathrm{KL}[q(\mathbf u) \Vert p(\mathbf u)]\Big),

    with the targets checked before they are read: a drop-in replacement (same arguments, same value) that raises a
    clear error for targets of the wrong shape, dtype or device, NaN or inf, or labels the likelihood does not take.
    GPyTorch's own objective reads such targets silently: ``y`` of shape ``(B, 1)`` against an output of shape ``(B,)``
    broadcasts into a :math:`B \times B` sum, and a NaN target gives a NaN loss whose gradient an optimizer writes into
    the parameters. Every strategy of this package trains with either.

    :param likelihood: The likelihood of the model.
    :param model: The approximate GP.
    :param num_data: Number :math:`n` of training points.
    :param beta: Weight :math:`\beta` of the KL term (1 for the ELBO).
    :param combine_terms: As GPyTorch's: return the sum of the terms (default) or the terms.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.mlls import VariationalELBO
        >>> from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy
        >>> class ODVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points, mean_inducing_points):
        ...         q = gpytorch.variational.CholeskyVariationalDistribution(inducing_points.size(0))
        ...         strategy = OrthogonallyDecoupledVariationalStrategy(self, inducing_points, q, mean_inducing_points)
        ...         super().__init__(strategy)
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> model = ODVGP(torch.randn(8, 1), torch.randn(20, 1))
        >>> mll = VariationalELBO(gpytorch.likelihoods.GaussianLikelihood(), model, num_data=100)
        >>> x, y = torch.randn(32, 1), torch.randn(32)
        >>> (-mll(model(x), y)).backward()
        >>> mll(model(x), y.unsqueeze(-1))
        Traceback (most recent call last):
        ...
        ValueError: target must have shape (32,) to match the model's output, got (32, 1).

    .. _Hensman et al. (2015):
        https://arxiv.org/abs/1411.2005
    """
