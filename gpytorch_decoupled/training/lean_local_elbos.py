from __future__ import annotations

import torch
from gpytorch.variational import UnwhitenedVariationalStrategy
from torch import Tensor

from .lean_candidate_bank import LeanCandidateBank
from .lean_likelihood import LeanLikelihood
from .lean_strategies import svgp_terms, unwhitened_svgp_terms


class LeanLocalELBOs(torch.nn.Module):
    r"""
    The two parts of every candidate's local ELBO of a :class:`~gpytorch_decoupled.models.KernelSelectionGP`,
    :math:`\hat{\mathcal L}_c = \mathrm{ELL}_c - \mathrm{KL}_c`, as plain tensor operations (the lean path of
    :class:`~gpytorch_decoupled.training.KernelSelectionStep`): the values and gradients of the model's
    :meth:`~gpytorch_decoupled.models.KernelSelectionGP.local_elbo_terms`, read from its parameters at every call.

    With point hyperparameters, the candidates' whitened SVGPs (:func:`~gpytorch_decoupled.training.lean_strategies.
    svgp_terms`) on the bank's covariances (:class:`~gpytorch_decoupled.training.LeanCandidateBank`). With a
    hyperparameter posterior, the unwhitened SVGPs (:func:`~gpytorch_decoupled.training.lean_strategies.
    unwhitened_svgp_terms`) at each draw :math:`\theta_c + C_\theta\varepsilon_s` of the hyperparameters (the model's
    parameters replaced by :func:`torch.func.functional_call`, which :func:`torch.compile` traces), averaged, and
    :math:`\mathrm{KL}[q(\theta_c) \Vert p(\theta_c)]` added to the KL. A module only so that
    :func:`torch.func.functional_call` can replace the model's parameters (its submodule ``model``).

    :param model: The model, whose parts :class:`~gpytorch_decoupled.training.KernelSelectionStep` checked.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.kernel = LeanCandidateBank(model.kernel)
        self.lean_likelihood = LeanLikelihood(model.likelihood)
        strategy = model.candidates.variational_strategy
        self._terms = unwhitened_svgp_terms if type(strategy) is UnwhitenedVariationalStrategy else svgp_terms

    def draws(self) -> Tensor | None:
        r"""This step's draws :math:`\varepsilon` of the hyperparameter posterior (the same generator call as the
        model's own pass), made before a compiled region; None with point hyperparameters."""
        posterior = self.model.hyperparameter_posterior
        return None if posterior is None else posterior.standard_normal_draws(self.model.num_hyperparameter_samples)

    def forward(self, x: Tensor, y: Tensor, num_data: Tensor | float, draws: Tensor | None = None):
        """``(ELL, KL)``, each ``(C,)``, on the mini-batch ``(x, y)`` of a data set of ``num_data`` points, at the
        current hyperparameters (``draws`` None) or averaged over the posterior's draws ``draws``."""
        if draws is None:
            return self._point_terms(x, y, num_data)
        posterior = self.model.hyperparameter_posterior
        hyperparameters = self.model._hyperparameters()
        offsets = posterior.offsets(draws)
        expected_log_likelihood, kl = 0.0, 0.0
        for s in range(draws.size(0)):
            sample = {f"model.{name}": value + offsets[name][s] for name, value in hyperparameters.items()}
            sample_ell, sample_kl = torch.func.functional_call(self, sample, (x, y, num_data), strict=False)
            expected_log_likelihood, kl = expected_log_likelihood + sample_ell, kl + sample_kl
        scale = 1.0 / draws.size(0)
        kl = kl * scale + posterior.kl_divergence(hyperparameters)
        return expected_log_likelihood * scale, kl

    def _point_terms(self, x: Tensor, y: Tensor, num_data: Tensor | float) -> tuple[Tensor, Tensor]:
        candidates = self.model.candidates
        constant = candidates.mean_module.constant.unsqueeze(-1)

        def prior_mean(inputs: Tensor) -> Tensor:
            return constant.expand(*constant.shape[:-1], inputs.size(-2))

        mean, variance, kl, _ = self._terms(candidates.variational_strategy, self.kernel, prior_mean, x, None)
        expected_log_likelihood = self.lean_likelihood(y, mean, variance).sum(-1) * (num_data / y.size(-1))
        return expected_log_likelihood, kl
