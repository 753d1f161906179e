from __future__ import annotations

from gpytorch import mlls

from ._target_checks import _TargetChecks


class GammaRobustVariationalELBO(_TargetChecks, mlls.GammaRobustVariationalELBO):
    r"""
    GPyTorch's :class:`~gpytorch.mlls.GammaRobustVariationalELBO` (`Knoblauch et al. (2019)`_): the ELBO with each
    expected log-likelihood :math:`\mathbb E_{q(f_i)}[\log p(y_i \mid f_i)]` replaced by the expected
    :math:`\gamma`-divergence score :math:`s_\gamma(y_i, f_i)` of the Gaussian likelihood (GPyTorch computes it in
    closed form),

    .. math::

        \mathcal L_\gamma = \frac{1}{n}\Big(\frac{n}{B}\sum_{i=1}^B \mathbb E_{q(f_i)}[s_\gamma(y_i, f_i)]
            - \beta\,\mathrm{KL}[q(\mathbf u) \Vert p(\mathbf u)]\Big),

    with the targets checked before they are read, as :class:`~gpytorch_decoupled.mlls.VariationalELBO`: a drop-in
    replacement (same arguments, same value; Gaussian likelihoods only, as GPyTorch's) that raises a clear error for
    targets of the wrong shape, dtype or device, or NaN or inf.

    :param likelihood: The (Gaussian) likelihood of the model.
    :param model: The approximate GP.
    :param gamma: The :math:`\gamma` of the divergence (GPyTorch's default 1.03).
    :param kwargs: ``num_data``, ``beta``, ``combine_terms``, as GPyTorch's.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.demo import RegressionModel
        >>> from gpytorch_decoupled.mlls import GammaRobustVariationalELBO
        >>> from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy
        >>> q = gpytorch.variational.CholeskyVariationalDistribution(8)
        >>> strategy = lambda gp: OrthogonallyDecoupledVariationalStrategy(gp, torch.randn(8, 1), q, torch.randn(20, 1))
        >>> model = RegressionModel(strategy, num_dims=1)
        >>> mll = GammaRobustVariationalELBO(gpytorch.likelihoods.GaussianLikelihood(), model, num_data=100)
        >>> x, y = torch.randn(32, 1), torch.randn(32)
        >>> (-mll(model(x), y)).backward()
        >>> mll(model(x), y.double())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: target is torch.float64 but the model is torch.float32; convert one of them ...

    .. _Knoblauch et al. (2019):
        https://arxiv.org/abs/1904.02063
    """
