from __future__ import annotations

from torch import Tensor

from ..variational import DualVariationalStrategy
from .variational_elbo import VariationalELBO


class DualVariationalELBO(VariationalELBO):
    r"""
    The M-step objective of t-SVGP (`Adam et al. (2021)`_, App. B, eqs. 39-41): the ELBO of the :math:`q_\theta`
    that the fixed sites of a :class:`~gpytorch_decoupled.variational.DualVariationalStrategy` define at the candidate
    hyperparameters :math:`\theta`,

    .. math::

        \tilde{\mathcal L}(\theta) = \sum_{i=1}^n\mathbb E_{q_\theta(f_i)}[\log p(y_i \mid f_i)]
            - \mathrm{KL}[q_\theta \Vert p_\theta]
            = \log\mathcal Z(\theta) + c(\theta),

    divided by :math:`n` and mini-batched with the unbiased :math:`n/B` scale, as
    :class:`~gpytorch.mlls.VariationalELBO`; here :math:`\mathcal Z(\theta)` normalizes the prior times the sites and
    :math:`c(\theta) = \sum_i\mathbb E_{q_\theta}[\log p(y_i \mid f_i)] - \mathbb E_{q_\theta}[\log t(\mathbf u)]`.
    At a converged E-step its value and gradient equal those of the ELBO with :math:`q` held fixed (Adam et al. 2021,
    App. A; :ref:`derivations-tsvgp-m-step`); away from it, re-deriving :math:`q_\theta` lets the M-step move further
    per step. Which sites are held fixed follows the distribution: u-space sites (variant A, the default) or per-datum
    sites (variant C, an exact upper envelope of the fixed-:math:`q` ELBO for conjugate kernel learning).

    Maximize it with any torch optimizer over the hyperparameters and inducing inputs; the sites are buffers and get
    no gradient. The targets are checked before they are read, as by
    :class:`~gpytorch_decoupled.mlls.VariationalELBO`. For the standard M-step of q-SVGP, use
    :class:`~gpytorch.mlls.VariationalELBO` with a GPyTorch strategy, as the benchmarks do.

    :param likelihood: The likelihood of the model.
    :param model: A model with a :class:`~gpytorch_decoupled.variational.DualVariationalStrategy` (optionally inside an
        independent multitask wrapper).
    :param num_data: Number :math:`n` of training points.
    :param beta: Weight of the KL term (1 for the ELBO).

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.mlls import DualVariationalELBO
        >>> from gpytorch_decoupled.optim import DualEStep
        >>> from gpytorch_decoupled.variational import DualVariationalDistribution, DualVariationalStrategy
        >>> class DualGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, inducing_points):
        ...         q = DualVariationalDistribution(inducing_points.size(0))
        ...         super().__init__(DualVariationalStrategy(self, inducing_points, q))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> model, likelihood = DualGP(torch.randn(10, 1)), gpytorch.likelihoods.GaussianLikelihood()
        >>> objective = DualVariationalELBO(likelihood, model, num_data=100)
        >>> x, y = torch.randn(100, 1), torch.randn(100)
        >>> objective.site_log_normalizer()  # log Z = 0 while the sites are zero (q is the prior)
        tensor(0., grad_fn=<DivBackward0>)
        >>> DualEStep(model, likelihood, num_data=100).step(x, y)  # the E-step sets the sites (t-SVGP, Algorithm 2)
        >>> loss = -objective(model(x), y)  # the M-step objective; at the prior this would raise a RuntimeError
        >>> loss.backward()
        >>> bool(objective.site_log_normalizer() != 0)
        True

    .. _Adam et al. (2021):
        https://arxiv.org/abs/2111.03412
    """

    def __init__(self, likelihood, model, num_data: int, beta: float = 1.0):
        strategy, _ = DualVariationalStrategy.of_model(model, "DualVariationalELBO")
        super().__init__(likelihood, model, num_data=num_data, beta=beta)
        self.dual_strategy = strategy

    def site_log_normalizer(self) -> Tensor:
        r""":math:`\log\mathcal Z(\theta) / n`, summed over latents: the first term of the decomposition
        :math:`\tilde{\mathcal L} = \log\mathcal Z + c` (Adam et al. 2021, eq. 40), on the objective's :math:`1/n`
        scale."""
        return self.dual_strategy.site_log_normalizer().sum() / self.num_data
