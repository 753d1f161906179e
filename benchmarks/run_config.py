from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class RunConfig:
    """How a method is trained and measured; one config is shared by every method of a comparison.

    :param iterations: Training iterations (mini-batch steps, or full-batch steps for full-batch methods).
    :param batch_size: Mini-batch size.
    :param eval_every: Evaluate the test metrics every this many iterations (outside the timed region).
    :param warmup: Iterations excluded from the per-iteration timing; the peak memory is taken over them.
    :param time_budget: Stop a method once its training time (seconds) reaches this, for equal wall-clock runs.
    :param seed: Seed of the mini-batch order (the same for every method).
    :param device: Device of the data and models.
    :param dtype: Floating-point type of the data and models.
    :param progress: Show a tqdm progress bar.
    :param clock: ``"wall"`` (wall-clock, CUDA synchronized) or ``"thread"`` (CPU time of the training thread,
        ``time.thread_time``: on a shared CPU machine it does not count the time other processes take; meaningful
        for a single-threaded CPU run only).
    """

    iterations: int = 1000
    batch_size: int = 256
    eval_every: int = 100
    warmup: int = 10
    time_budget: float | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    progress: bool = True
    clock: str = "wall"

    def __post_init__(self):
        if self.clock not in ("wall", "thread"):
            raise ValueError(f"clock must be 'wall' or 'thread', got {self.clock!r}.")
        if self.clock == "thread" and torch.device(self.device).type == "cuda":
            raise ValueError("clock='thread' measures CPU time; a CUDA run needs clock='wall'.")

    def to_json(self) -> dict:
        """A JSON-ready dictionary (dtype as a string)."""
        return {**asdict(self), "dtype": str(self.dtype).replace("torch.", "")}
