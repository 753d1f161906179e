from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from .exact_regression_model import ExactRegressionModel
from .inducing_points import initial_inducing_points
from .method import Method, MethodNotApplicable

# Exact factorizations only: GPyTorch would otherwise switch silently to CG/Lanczos above 800 rows.
_CHOLESKY_ALWAYS = 2**62


class ExactGPMethod(Method):
    r"""
    Full-batch GPyTorch baselines: the exact GP (``num_inducing=None``) or collapsed SGPR (Titsias, 2009).

    Each step is one Adam step on the exact log marginal likelihood (or the collapsed bound) of all training data, so
    one iteration costs :math:`O(N^3)` (exact) or :math:`O(NM^2)` (SGPR). All factorizations are Cholesky.

    :param train_x: Training inputs.
    :param train_y: Training targets (standardized).
    :param num_inducing: SGPR inducing points :math:`M`, or ``None`` for the exact GP.
    :param lr: Adam learning rate.
    :param max_exact_rows: Refuse the exact GP above this many training rows (its cubic cost).
    :param seed: Seed for the inducing-point draw and initial parameters.
    """

    uses_minibatches = False

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        num_inducing: int | None = None,
        lr: float = 0.05,
        max_exact_rows: int = 5000,
        seed: int = 0,
        batch_size: int = 1024,
    ):
        if num_inducing is None and train_x.size(0) > max_exact_rows:
            raise MethodNotApplicable(
                f"the exact GP is limited to {max_exact_rows} training rows (its cost is cubic), got {train_x.size(0)}"
            )
        torch.manual_seed(seed)
        inducing_points = None if num_inducing is None else initial_inducing_points(train_x, num_inducing, seed)
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(train_x)
        super().__init__(
            "GPyTorch exact GP" if num_inducing is None else "GPyTorch SGPR (collapsed)",
            f"N={train_x.size(0)}" if num_inducing is None else f"M={num_inducing}",
            ExactRegressionModel(train_x, train_y, likelihood, inducing_points).to(train_x),
            likelihood,
            batch_size,
        )
        self.mll = gpytorch.mlls.ExactMarginalLogLikelihood(self.likelihood, self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def _numerics(self):
        return gpytorch.settings.max_cholesky_size(_CHOLESKY_ALWAYS)

    def _marginal_log_likelihood(self) -> Tensor:
        train_x, train_y = self.model.train_inputs[0], self.model.train_targets
        return self.mll(self.model(train_x), train_y)

    def step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        self.optimizer.zero_grad(set_to_none=True)
        with self._numerics():
            loss = -self._marginal_log_likelihood()
        loss.backward()
        self.optimizer.step()

    @torch.no_grad()
    def objective(self) -> float:
        self._set_training(True)
        with self._numerics():
            return self._marginal_log_likelihood().item()
