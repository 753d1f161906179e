from __future__ import annotations

from gpytorch.likelihoods import Likelihood
from gpytorch.models import ApproximateGP

from ..variational import KalmanVariationalStrategy


def kalman_strategy(model: ApproximateGP, likelihood: Likelihood, owner: str) -> KalmanVariationalStrategy:
    """The model's :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy`, checked to be built with
    ``likelihood`` (whose noise its updates use)."""
    strategy = getattr(model, "variational_strategy", None)
    if not isinstance(strategy, KalmanVariationalStrategy):
        raise TypeError(
            f"{owner} needs a model whose variational_strategy is a KalmanVariationalStrategy, got "
            f"{type(strategy).__name__}."
        )
    if likelihood is not strategy.likelihood:
        raise ValueError(
            f"{owner}: the likelihood must be the one the model's KalmanVariationalStrategy was built with."
        )
    return strategy
