from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class MethodResult:
    """What the runner measured for one method.

    :param name: Registry name of the method (``"svgp"``), or ``"<name>@<tag>"`` for variants of one run.
    :param label: Human-readable label.
    :param sizes: Inducing-set sizes.
    :param seconds_per_iteration: Median wall-clock seconds of a training iteration after warm-up.
    :param peak_memory_mb: Peak memory above the starting level during the warm-up iterations.
    :param iterations: Training iterations done.
    :param train_seconds: Total training time (evaluations excluded).
    :param rmse: Final test RMSE (original units).
    :param nll: Final test negative log predictive density (original units).
    :param objective: Final training objective per datum (ELBO / N; log marginal likelihood / N for the exact GP).
    :param curve: Test metrics over training: dicts with ``iteration``, ``seconds``, ``rmse``, ``nll``.
    :param skipped: Why the method did not run, if it did not.
    """

    name: str
    label: str
    sizes: str = ""
    seconds_per_iteration: float = float("nan")
    peak_memory_mb: float = float("nan")
    iterations: int = 0
    train_seconds: float = 0.0
    rmse: float = float("nan")
    nll: float = float("nan")
    objective: float = float("nan")
    curve: list[dict] = field(default_factory=list)
    skipped: str | None = None

    def to_json(self) -> dict:
        return asdict(self)
