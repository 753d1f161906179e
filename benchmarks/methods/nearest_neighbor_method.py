from __future__ import annotations

import gpytorch
import torch
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from .approximate_gp_method import ApproximateGPMethod
from .approximate_regression_model import ApproximateRegressionModel
from .blocked_nn_variational_strategy import BlockedNNVariationalStrategy


class NearestNeighborMethod(ApproximateGPMethod):
    r"""
    GPyTorch's VNNGP (Wu et al., 2022): :class:`~gpytorch.variational.NNVariationalStrategy` (its neighbour structure
    built in blocks, :class:`BlockedNNVariationalStrategy`), an inducing point at
    every training input, each conditioned on its ``k`` nearest earlier inducing points, with a mean-field
    :math:`q(\mathbf u)`, trained as GPyTorch's VNNGP tutorial does: Adam on every parameter, and each step on the
    strategy's own mini-batch of inducing points, which are also the observations of that step (the tutorial's
    recommended option, :math:`O(k^3)` per point). :meth:`step` therefore ignores the mini-batch it is given and takes
    the same number of rows from the strategy's own epoch order.

    The kernel is the benchmark's scaled ARD squared exponential, the same as every other method of a comparison (the
    tutorial's Matérn-5/2 would change the model as well as the approximation).

    :param train_x: Training inputs (all of them become inducing points).
    :param train_y: Training targets (standardized).
    :param k: Nearest neighbours per inducing point (the tutorial's 256).
    :param training_batch_size: Inducing points (= observations) per step.
    :param lr: Adam learning rate.
    :param seed: Seed of the initial parameters and the strategy's batch order.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        k: int = 256,
        training_batch_size: int = 256,
        lr: float = 0.01,
        seed: int = 0,
    ):
        torch.manual_seed(seed)
        num_points = train_x.size(0)

        def make_strategy(model):
            distribution = gpytorch.variational.MeanFieldVariationalDistribution(num_points)
            return BlockedNNVariationalStrategy(
                model, train_x.clone(), distribution, k=k, training_batch_size=training_batch_size
            )

        model = ApproximateRegressionModel(make_strategy, train_x.size(-1)).to(train_x)
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(train_x)
        optimizers = [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)]
        super().__init__("GPyTorch VNNGP", f"M=N={num_points}, k={k}", model, likelihood, optimizers, train_x, train_y)

    def step(self, x: Tensor, y: Tensor) -> None:
        self._set_training(True)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        strategy = self.model.variational_strategy
        output = strategy(x=None)  # the strategy's next batch of inducing points, which are training inputs
        loss = -self.mll(output, self.train_y[..., strategy.current_training_indices])
        loss.backward()
        for optimizer in self.optimizers:
            optimizer.step()

    @torch.no_grad()
    def objective(self) -> float:
        # Mean field: q(f_n) of a training point is its own q(u_n), so the expected log-likelihood of every row is
        # cheap. The KL's exact sum costs an epoch of O(k^3) solves; its unbiased estimate from the first k points
        # (exact) and one random batch of the others (scaled up) does not, and leaves the training order alone.
        self._set_training(True)
        strategy = self.model.variational_strategy
        distribution = strategy._variational_distribution
        marginals = gpytorch.distributions.MultivariateNormal(
            distribution.variational_mean, DiagLinearOperator(distribution._variational_stddev.pow(2))
        )
        expected_log_lik = self.likelihood.expected_log_prob(self.train_y, marginals).sum()
        generator = torch.Generator().manual_seed(0)
        others = torch.randperm(strategy.M - strategy.k, generator=generator)[: strategy.training_batch_size]
        kl = strategy._firstk_kl_helper() + strategy._stochastic_kl_helper(others + strategy.k) * (
            (strategy.M - strategy.k) / others.numel()
        )
        return ((expected_log_lik - kl.sum()) / self.train_y.size(0)).item()
