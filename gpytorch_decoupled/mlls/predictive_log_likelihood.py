from __future__ import annotations

from gpytorch import mlls

from ._target_checks import _TargetChecks


class PredictiveLogLikelihood(_TargetChecks, mlls.PredictiveLogLikelihood):
    r"""
    GPyTorch's :class:`~gpytorch.mlls.PredictiveLogLikelihood` (`Jankowiak et al. (2020)`_),

    .. math::

        \mathcal L_{\mathrm{PLL}} = \frac{1}{n}\Big(\frac{n}{B}\sum_{i=1}^B \log \mathbb E_{q(f_i)}[p(y_i \mid f_i)]
            - \beta\,\mathrm{KL}[q(\mathbf u) \Vert p(\mathbf u)]\Big),

    with the targets checked before they are read, as :class:`~gpytorch_decoupled.mlls.VariationalELBO`: a drop-in
    replacement (same arguments, same value) that raises a clear error for targets of the wrong shape, dtype or
    device, NaN or inf, or labels the likelihood does not take.

    :param likelihood: The likelihood of the model.
    :param model: The approximate GP.
    :param num_data: Number :math:`n` of training points.
    :param beta: Weight :math:`\beta` of the KL term.
    :param combine_terms: As GPyTorch's: return the sum of the terms (default) or the terms.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.demo import RegressionModel
        >>> from gpytorch_decoupled.mlls import PredictiveLogLikelihood
        >>> from gpytorch_decoupled.variational import HybridVariationalStrategy
        >>> q = gpytorch.variational.CholeskyVariationalDistribution(8)
        >>> strategy = lambda gp: HybridVariationalStrategy(gp, torch.randn(8, 1), q, torch.randn(20, 1))
        >>> model = RegressionModel(strategy, num_dims=1)
        >>> mll = PredictiveLogLikelihood(gpytorch.likelihoods.GaussianLikelihood(), model, num_data=100)
        >>> x, y = torch.randn(32, 1), torch.randn(32)
        >>> (-mll(model(x), y)).backward()
        >>> mll(model(x), torch.full_like(y, float("nan")))
        Traceback (most recent call last):
        ...
        ValueError: target contains NaN or inf.

    .. _Jankowiak et al. (2020):
        https://arxiv.org/abs/1910.07123
    """
