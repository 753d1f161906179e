from __future__ import annotations

from collections.abc import Sequence

import torch
from gpytorch import Module
from gpytorch.likelihoods import GaussianLikelihood, Likelihood
from torch import Tensor

from ..gpytorch_compat import GaussianLikelihoodBase
from ..kernels import CandidateKernelBank, KernelExpression, KernelSpace
from ..validation import check_positive_int, check_positive_number, check_targets
from ..variational import checked_inputs
from .candidate_bank_gp import CandidateBankGP, StrategyFactory
from .gaussian_mixture_predictive import GaussianMixturePredictive
from .hyperparameter_posterior import HyperparameterPosterior
from .kernel_belief import KernelBelief
from .kernel_posterior import KernelPosterior


class KernelSelectionGP(Module):
    r"""
    Variational Bayesian kernel selection (VBKS, `Teng et al. (2020)`_): a posterior over a space of
    candidate kernels :math:`\kappa_1, \dots, \kappa_C` for sparse variational GP regression, and Bayesian model
    averaging over the most probable ones.

    Each candidate :math:`c` has its own sparse variational sub-model (hyperparameters :math:`\theta_c` with its own
    noise and constant mean, :math:`q(u_c) = \mathcal N(m_c, S_c)` at shared inducing inputs :math:`Z`); a kernel
    belief :math:`q(g)` (:class:`KernelBelief`) weighs them through :math:`p(\kappa_c \mid g) = \mathrm{softmax}(g)_c`.
    The ELBO (eq. 8 of the paper, the exact ELBO of the pseudo-prior family of :ref:`derivations-vbks-elbo`)

    .. math::

        \mathcal L = \mathbb E_{q(g)}\Big[\sum_c\mathrm{softmax}(g)_c\,\mathcal L_c\Big] - \mathrm{KL}[q(g) \Vert p(g)],
        \qquad
        \mathcal L_c = \sum_{i=1}^n\mathbb E_{q(f_i)}[\log p(y_i \mid f_i, \theta_c)] - \mathrm{KL}[q(u_c) \Vert
        p(u_c \mid \theta_c)]

    separates: its gradient in :math:`\Phi_c` is a positive multiple of :math:`\nabla\mathcal L_c`, so the local ELBOs
    are maximized independently with mini-batches (:meth:`local_elbos`, summed, is the training loss), then
    :math:`q(g)` is fitted to the optimized :math:`\mathcal L^*_c` (:meth:`fit_kernel_belief`). All candidates train as
    one batched GPyTorch model (:class:`CandidateBankGP`: one kernel evaluation for all, a batched Cholesky), so a
    step costs :math:`O(C(BM^2 + M^3))` with no Python loop over candidates.

    With ``hyperparameter_posterior=True``, :math:`\theta_c` gets a Gaussian posterior
    (:class:`HyperparameterPosterior`, full covariance per candidate, the unwhitened strategy),
    :math:`\mathcal L_c` averages over ``num_hyperparameter_samples`` reparameterized draws of :math:`\theta_c` with
    :math:`u_c` integrated analytically, and subtracts :math:`\mathrm{KL}[q(\theta_c) \Vert p(\theta_c)]`. By
    default :math:`\theta_c` is a point estimate, the paper's setting in all of its real-data experiments: each
    sub-model is then exactly SVGP.

    :param kernels: The candidates: a :class:`KernelSpace`, or expressions / strings such as ``"SE + PER×LIN"``
        (duplicates modulo commutativity are dropped).
    :param inducing_points: :math:`Z`, shape ``(M, d)``, shared by all candidates.
    :param ard_num_dims: Passed to the base kernels (one lengthscale per input dimension).
    :param likelihood: A likelihood with batch shape ``(C,)``; default a Gaussian one with a noise per candidate.
    :param variational_strategy: Strategy factory for the sub-models (see :class:`CandidateBankGP`).
    :param learn_inducing_locations: Whether :math:`Z` is trained (default strategy; the reference keeps it fixed).
    :param prior_variance: Variance :math:`\tau` of :math:`p(g) = \mathcal N(0, \tau I)`.
    :param num_belief_samples: Draws :math:`S` of the kernel belief's sample-average approximation.
    :param hyperparameter_posterior: Whether :math:`\theta_c` gets a posterior (else a point estimate).
    :param num_hyperparameter_samples: Draws of :math:`\theta` per local-ELBO evaluation in that mode.
    :param seed: Seed of the kernel belief's draws.

    Example:
        >>> import math, torch
        >>> from gpytorch_decoupled.models import KernelSelectionGP
        >>> x = torch.linspace(0, 6, 200).unsqueeze(-1)
        >>> y = torch.sin(2 * math.pi * x.squeeze(-1)) + 0.1 * torch.randn(200)
        >>> model = KernelSelectionGP(["SE", "PER", "LIN", "SE + PER"], inducing_points=x[::10].clone())
        >>> model.kernel.set_base_hyperparameters("PER", period_length=1.0)
        >>> trace = model.fit(x, y, num_iterations=50, batch_size=64, lr=0.05, progress=False)
        >>> posterior = model.kernel_posterior()  # a table, most probable first
        >>> bool(abs(posterior.probabilities.sum() - 1) < 1e-6)
        True
        >>> predictive = model.predict(torch.tensor([[6.5]]), top=2)
        >>> lower, upper = predictive.confidence_region()
        >>> bool(lower < predictive.mean < upper)
        True

    .. _Teng et al. (2020):
        https://arxiv.org/abs/1912.02641
    """

    def __init__(
        self,
        kernels: KernelSpace | Sequence[KernelExpression | str],
        inducing_points: Tensor,
        *,
        ard_num_dims: int | None = None,
        likelihood: Likelihood | None = None,
        variational_strategy: StrategyFactory | None = None,
        learn_inducing_locations: bool = False,
        prior_variance: float = 0.5,
        num_belief_samples: int = 2000,
        hyperparameter_posterior: bool = False,
        num_hyperparameter_samples: int = 1,
        seed: int = 0,
    ):
        super().__init__()
        if inducing_points.dim() != 2:
            raise ValueError(f"inducing_points must have shape (M, d), got {tuple(inducing_points.shape)}.")
        self.kernel_space = kernels if isinstance(kernels, KernelSpace) else KernelSpace(kernels)
        num_candidates = len(self.kernel_space)
        kernel = CandidateKernelBank(self.kernel_space, ard_num_dims=ard_num_dims)
        self.candidates = CandidateBankGP(
            kernel,
            inducing_points,
            variational_strategy=variational_strategy,
            whitened=not hyperparameter_posterior,
            learn_inducing_locations=learn_inducing_locations,
        )
        self.likelihood = likelihood if likelihood is not None else GaussianLikelihood(batch_shape=[num_candidates])
        self.kernel_belief = KernelBelief(num_candidates, prior_variance, num_samples=num_belief_samples, seed=seed)
        self.hyperparameter_posterior = None
        if hyperparameter_posterior:
            if num_hyperparameter_samples < 1:
                raise ValueError("num_hyperparameter_samples must be at least 1.")
            values = self._hyperparameters()
            self.hyperparameter_posterior = HyperparameterPosterior(
                self._hyperparameter_owners(values), values, num_candidates
            )
        self.num_hyperparameter_samples = num_hyperparameter_samples
        self.register_buffer("local_elbo_estimates", torch.full((num_candidates,), float("nan")))
        self.register_buffer("elbo_scale", torch.tensor(1.0))

    @property
    def kernel(self) -> CandidateKernelBank:
        """The candidate kernels, evaluated together (set initial hyperparameters here)."""
        return self.candidates.covar_module

    @property
    def names(self) -> list[str]:
        """The candidates' readable names, in the model's order."""
        return [expression.name for expression in self.kernel_space]

    @property
    def num_candidates(self) -> int:
        return len(self.kernel_space)

    def forward(self, x: Tensor, y: Tensor, num_data: int) -> tuple[Tensor, Tensor]:
        r"""The point-estimate terms of the local ELBOs at the current hyperparameters: the expected log-likelihood
        :math:`\frac nB\sum_{i\in\mathcal B}\mathbb E_{q(f_i)}[\log p(y_i \mid f_i)]` and
        :math:`\mathrm{KL}[q(u_c) \Vert p(u_c)]`, each of shape ``(C,)``. Use :meth:`local_elbo_terms`, which also
        validates the input and averages over the hyperparameter posterior."""
        function = self.candidates(x)
        expected_log_likelihood = self.likelihood.expected_log_prob(y, function).sum(-1) * (num_data / y.size(-1))
        return expected_log_likelihood, self.candidates.variational_strategy.kl_divergence()

    def local_elbo_terms(self, x: Tensor, y: Tensor, num_data: int) -> tuple[Tensor, Tensor]:
        r"""
        The unbiased mini-batch estimates of the two parts of every local ELBO,
        :math:`\mathcal L_c = \mathrm{ELL}_c - \mathrm{KL}_c`.

        :param x: Mini-batch inputs, shape ``(B, d)``.
        :param y: Mini-batch targets, shape ``(B,)``.
        :param num_data: The number :math:`n` of training points (the mini-batch scale is :math:`n/B`).
        :return: ``(ELL, KL)``, each of shape ``(C,)``; with a hyperparameter posterior, ELL and the KL of
            :math:`q(u_c)` are averaged over draws of :math:`\theta_c`, and KL includes
            :math:`\mathrm{KL}[q(\theta_c) \Vert p(\theta_c)]`.
        """
        x, y = self._checked_data(x, y)
        if not num_data >= y.size(-1):
            raise ValueError(f"num_data ({num_data}) must be at least the batch size ({y.size(-1)}).")
        return self._local_elbo_terms(x, y, num_data)

    def _local_elbo_terms(self, x: Tensor, y: Tensor, num_data: int) -> tuple[Tensor, Tensor]:
        """:meth:`local_elbo_terms` on data already checked (the mini-batches and blocks of checked data sets)."""
        if self.hyperparameter_posterior is None:
            return self(x, y, num_data)
        hyperparameters = self._hyperparameters()
        offsets = self.hyperparameter_posterior.sample(self.num_hyperparameter_samples)
        expected_log_likelihood, kl = 0.0, 0.0
        for s in range(self.num_hyperparameter_samples):
            sample = {name: value + offsets[name][s] for name, value in hyperparameters.items()}
            sample_ell, sample_kl = torch.func.functional_call(self, sample, (x, y, num_data), strict=False)
            expected_log_likelihood, kl = expected_log_likelihood + sample_ell, kl + sample_kl
        scale = 1.0 / self.num_hyperparameter_samples
        kl = kl * scale + self.hyperparameter_posterior.kl_divergence(hyperparameters)
        return expected_log_likelihood * scale, kl

    def local_elbos(self, x: Tensor, y: Tensor, num_data: int) -> Tensor:
        r"""Unbiased mini-batch estimates of the local ELBOs :math:`\mathcal L_c` (eq. 9), shape ``(C,)``. The training
        loss is ``-model.local_elbos(x, y, n).sum() / n``: the candidates share no parameters, so each gets the
        gradient of its own :math:`\mathcal L_c`."""
        expected_log_likelihood, kl = self.local_elbo_terms(x, y, num_data)
        return expected_log_likelihood - kl

    def elbo(self, x: Tensor, y: Tensor, num_data: int) -> Tensor:
        r"""The mini-batch estimate of the full ELBO (eq. 8) at the current :math:`q(g)` (sample average over its
        fixed draws)."""
        return self.kernel_belief.objective(self.local_elbos(x, y, num_data))

    def fit(
        self,
        x: Tensor,
        y: Tensor,
        num_iterations: int = 1000,
        batch_size: int = 256,
        lr: float = 0.01,
        elbo_scale: float | None = None,
        generator: torch.Generator | None = None,
        progress: bool = True,
        compile: bool = False,
        **compile_options,
    ) -> Tensor:
        r"""
        Trains every candidate's local ELBO with Adam on random mini-batches (the paper's local step, batched over
        candidates), then estimates :math:`\mathcal L^*_c` (:meth:`estimate_local_elbos`) and fits :math:`q(g)`
        (:meth:`fit_kernel_belief`). Call it again on more data to warm-start, as the paper's incremental protocol.

        The steps are :class:`~gpytorch_decoupled.training.KernelSelectionStep`'s: the lean tensor path where the
        model is supported (the default sub-models, with point hyperparameters or a posterior), else GPyTorch's
        general path (with a warning only when compiling was asked for). ``compile=True`` compiles the step with
        :func:`torch.compile` (one graph, no break): the first step then takes tens of seconds, and from then on each
        costs about half what an eager one does on a CPU (see the guide on compiling for measurements and when it
        pays). Every call compiles its own step (a later one finds the generated code in Inductor's on-disk cache,
        about 8 s on this project's CPU), so for the incremental protocol's short calls ``compile=False`` is faster.

        :param x: Training inputs, shape ``(n, d)``.
        :param y: Training targets, shape ``(n,)``.
        :param num_iterations: Adam steps.
        :param batch_size: Mini-batch size :math:`B`.
        :param lr: Adam learning rate.
        :param elbo_scale: Temperature of the kernel belief (default :math:`2B/n`, the reference code's twice the
            ELBO per mini-batch; 1 is the untempered posterior of the paper's text).
        :param generator: Random generator for the mini-batches.
        :param progress: Whether to show a progress bar.
        :param compile: Compile the training step.
        :param compile_options: Keyword arguments of :func:`torch.compile` when compiling.
        :return: The per-iteration local-ELBO estimates divided by :math:`n`, shape ``(num_iterations, C)``.
        """
        # imported here: the training steps import the models
        from ..training import KernelSelectionStep

        x, y = self._checked_data(x, y)
        check_positive_int(num_iterations, "num_iterations", minimum=0)
        check_positive_int(batch_size, "batch_size")
        check_positive_number(lr, "lr")
        if elbo_scale is not None:
            check_positive_number(elbo_scale, "elbo_scale")
        if compile_options and not compile:
            raise TypeError(f"compile options {sorted(compile_options)} are given, but compile=False.")
        num_data = y.size(-1)
        batch_size = min(batch_size, num_data)
        parameters = [p for name, p in self.named_parameters() if not name.startswith("kernel_belief.")]
        optimizer = torch.optim.Adam(parameters, lr=lr)
        # without compiling, a model the lean path does not support takes the general path as it always did: no warning
        lean = compile or KernelSelectionStep.unsupported(self, optimizer) is None
        step = KernelSelectionStep(self, optimizer, num_data, compile=compile, lean=lean, **compile_options)
        trace = torch.empty(num_iterations, self.num_candidates, dtype=y.dtype)
        iterations = range(num_iterations)
        if progress:  # imported only here: in Jupyter without ipywidgets, importing tqdm.auto prints a warning
            from tqdm.auto import tqdm

            iterations = tqdm(iterations, desc="VBKS local ELBOs")
        for iteration in iterations:
            batch = torch.randint(num_data, (batch_size,), generator=generator, device="cpu").to(y.device)
            trace[iteration] = step(x[batch], y[batch]).cpu()
        self.estimate_local_elbos(x, y, batch_size=max(batch_size, 1024))
        self.fit_kernel_belief(elbo_scale=2 * batch_size / num_data if elbo_scale is None else elbo_scale)
        return trace

    @torch.no_grad()
    def summed_local_elbo_terms(self, x: Tensor, y: Tensor, batch_size: int = 1024) -> tuple[Tensor, Tensor]:
        r"""
        The expected log-likelihood summed over the rows given, :math:`\sum_i\mathbb E_{q(f_i)}[\log p(y_i \mid
        f_i)]`, by one pass in blocks of ``batch_size``, and :math:`\mathrm{KL}_c`, each of shape ``(C,)``: the
        additive statistics of :math:`\mathcal L^*_c` (summed over shards by
        :func:`~gpytorch_decoupled.distributed.all_reduce_local_elbos`). Runs in training mode.
        """
        x, y = self._checked_data(x, y)
        check_positive_int(batch_size, "batch_size")
        self.train()
        expected_log_likelihood = 0.0
        for start in range(0, y.size(-1), batch_size):
            block = slice(start, start + batch_size)
            ell, kl = self._local_elbo_terms(x[block], y[block], y[block].size(-1))
            expected_log_likelihood = expected_log_likelihood + ell
        return expected_log_likelihood, kl

    def estimate_local_elbos(self, x: Tensor, y: Tensor, batch_size: int = 1024) -> Tensor:
        r"""
        :math:`\mathcal L^*_c` on the whole data set, by one pass in blocks of ``batch_size`` (exact for point
        hyperparameters; the reference code averages random mini-batch estimates instead). Stored for
        :meth:`fit_kernel_belief` and :meth:`predict`.

        :return: The local ELBOs, shape ``(C,)``.
        """
        expected_log_likelihood, kl = self.summed_local_elbo_terms(x, y, batch_size)
        return self.store_local_elbos(expected_log_likelihood - kl)

    def store_local_elbos(self, local_elbos: Tensor) -> Tensor:
        r"""Checks and stores :math:`\mathcal L^*_c` for :meth:`fit_kernel_belief` and :meth:`predict`."""
        local_elbos = torch.as_tensor(local_elbos).detach()
        if local_elbos.shape != (self.num_candidates,):
            raise ValueError(f"local ELBOs must have shape ({self.num_candidates},), got {tuple(local_elbos.shape)}.")
        if not torch.isfinite(local_elbos).all():
            failed = [self.names[i] for i in (~local_elbos.isfinite()).nonzero().flatten().tolist()]
            raise RuntimeError(f"non-finite local ELBOs for {failed}.")
        self.local_elbo_estimates.copy_(local_elbos)
        return local_elbos

    def fit_kernel_belief(self, local_elbos: Tensor | None = None, elbo_scale: float = 1.0) -> KernelPosterior:
        r"""
        Fits :math:`q(g)` to the local ELBOs (by default the stored :meth:`estimate_local_elbos`) with the temperature
        ``elbo_scale`` (see :class:`KernelBelief`), and returns :meth:`kernel_posterior`.
        """
        local_elbos = self._stored_local_elbos() if local_elbos is None else local_elbos
        self.kernel_belief.fit(local_elbos, elbo_scale=elbo_scale)
        self.store_local_elbos(local_elbos)
        self.elbo_scale.fill_(elbo_scale)
        return self.kernel_posterior()

    @torch.no_grad()
    def kernel_posterior(self) -> KernelPosterior:
        r"""The kernel posterior :math:`q^*(\kappa_c)` (eq. 13) as a table, most probable first."""
        return KernelPosterior(self.names, self.kernel_belief.probabilities())

    @torch.no_grad()
    def predict(
        self,
        x: Tensor,
        top: int | None = 10,
        observation_noise: bool = True,
        candidates: Sequence[int | str] | None = None,
    ) -> GaussianMixturePredictive:
        r"""
        The BMA predictive (eqs. 14-15) over the ``top`` most probable kernels, as the paper's pruning: :math:`q(g)`
        is re-fitted on that subset from the stored local ELBOs and temperature, and its kernel posterior weighs the
        candidates' marginal predictives (each with its own noise when ``observation_noise``, as the reference mixes
        ``predict_y``).

        :param x: Test inputs, shape ``(n_*, d)``.
        :param top: Number of kernels mixed (``None``: all, with the full :math:`q(g)`).
        :param observation_noise: Predict :math:`y_*` (else :math:`f_*`).
        :param candidates: Mix these candidates (indices or names) instead of the ``top`` ones, with :math:`q(g)`
            re-fitted on them; one candidate gives its own predictive.
        :return: A :class:`GaussianMixturePredictive` with batch shape ``(n_*,)``.
        """
        x = checked_inputs(x, self.candidates.variational_strategy.inducing_points, self)
        if observation_noise and not isinstance(self.likelihood, GaussianLikelihoodBase):
            raise ValueError("observation_noise=True needs a Gaussian likelihood; use observation_noise=False.")
        local_elbos = self._stored_local_elbos()
        if candidates is not None:
            indices = torch.tensor([self._candidate_index(candidate) for candidate in candidates], dtype=torch.long)
            if not 0 < indices.numel() == indices.unique().numel():
                raise ValueError(f"candidates must name distinct kernels, got {list(candidates)}.")
        elif top is None or top >= self.num_candidates:
            indices = None
        else:
            indices = self.kernel_posterior().indices[:top]
        if indices is None:
            indices, weights = torch.arange(self.num_candidates), self.kernel_belief.probabilities()
        else:
            belief = KernelBelief(
                indices.numel(), self.kernel_belief.prior_variance, num_samples=self.kernel_belief.draws.size(0)
            ).to(local_elbos)
            with torch.enable_grad():
                belief.fit(local_elbos[indices], elbo_scale=float(self.elbo_scale))
            weights = belief.probabilities()
        self.eval()
        if self.hyperparameter_posterior is None:
            means, variances = self._marginals(x, observation_noise)
        else:
            means, variances = self._hyperparameter_averaged_marginals(x, observation_noise)
        indices = indices.to(x.device)
        return GaussianMixturePredictive(weights.to(x), means[indices], variances[indices])

    def _marginals(self, x: Tensor, observation_noise: bool) -> tuple[Tensor, Tensor]:
        output = self.candidates(x)
        if observation_noise:
            output = self.likelihood(output)
        return output.mean, output.variance

    def _hyperparameter_averaged_marginals(self, x: Tensor, observation_noise: bool) -> tuple[Tensor, Tensor]:
        """Moments of the candidates' predictives averaged over draws of the hyperparameter posterior (Teng et al. 2020,
        Sec. 5), in training mode so that no factorization is cached across draws."""
        hyperparameters = self._hyperparameters()
        offsets = self.hyperparameter_posterior.sample(max(self.num_hyperparameter_samples, 32))
        num_samples = next(iter(offsets.values())).size(0)
        first, second = 0.0, 0.0
        self.train()
        for s in range(num_samples):
            sample = {name: value + offsets[name][s] for name, value in hyperparameters.items()}
            output = torch.func.functional_call(self.candidates, _submodule_entries(sample, "candidates."), (x,))
            if observation_noise:
                likelihood_sample = _submodule_entries(sample, "likelihood.")
                output = torch.func.functional_call(self.likelihood, likelihood_sample, (output,))
            first = first + output.mean / num_samples
            second = second + (output.variance + output.mean.square()) / num_samples
        self.eval()
        return first, second - first.square()

    def _hyperparameters(self) -> dict[str, Tensor]:
        """The raw hyperparameters :math:`\theta` (kernel, mean and likelihood; not :math:`q(u)`, :math:`Z` or
        :math:`q(g)`), by name."""
        skip = ("kernel_belief.", "hyperparameter_posterior.", "candidates.variational_strategy.")
        return {name: p for name, p in self.named_parameters() if not name.startswith(skip)}

    def _hyperparameter_owners(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        kernel_prefix = "candidates.covar_module."
        kernel_owners = {kernel_prefix + name: owner for name, owner in self.kernel.parameter_owners().items()}
        candidates = torch.arange(self.num_candidates)
        owners = {}
        for name, value in values.items():
            if name in kernel_owners:
                owners[name] = kernel_owners[name]
            elif value.size(0) == self.num_candidates:
                owners[name] = candidates.reshape(-1, *[1] * (value.dim() - 1)).expand(value.shape)
            else:
                raise ValueError(f"hyperparameter {name} of shape {tuple(value.shape)} has no batch of candidates.")
        return owners

    def _candidate_index(self, candidate: int | str) -> int:
        if isinstance(candidate, str):
            return self.kernel_space.index(candidate)
        if not -self.num_candidates <= int(candidate) < self.num_candidates:
            raise IndexError(f"candidate {candidate} is out of range for {self.num_candidates} candidates.")
        return int(candidate) % self.num_candidates

    def _stored_local_elbos(self) -> Tensor:
        if not torch.isfinite(self.local_elbo_estimates).all():
            raise RuntimeError("no local ELBOs yet: call fit() or estimate_local_elbos() first.")
        return self.local_elbo_estimates

    def _checked_data(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``(n, d)`` and ``y`` ``(n,)`` checked (:mod:`gpytorch_decoupled.validation`; labels against the
        likelihood), before anything is computed or changed."""
        inducing_points = self.candidates.variational_strategy.inducing_points
        x = checked_inputs(x, inducing_points, self, dim=2)
        check_targets(y, "y", (x.size(0),), inducing_points, self.likelihood)
        return x, y


def _submodule_entries(values: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {name[len(prefix) :]: value for name, value in values.items() if name.startswith(prefix)}
