from __future__ import annotations


class DistributedStepError(RuntimeError):
    r"""
    A data-parallel step failed, on one rank or in the communication between ranks, and was abandoned by every rank
    at the same collective operation, before any of them changed its model or training state.

    Every helper of :mod:`gpytorch_decoupled.distributed` sends, with each all-reduce, one failure flag per rank: an
    error on one rank (bad data, a NaN or inf in its gradient or statistics, a matrix that is not positive definite)
    becomes this error on every rank, with the same message, naming the failed ranks and their reasons. The failed
    rank's own exception is chained as ``__cause__``. A collective that cannot complete (a rank died, or did not
    arrive within the process group's ``timeout``) raises it too, with ``ranks`` empty.

    :param message: What failed and why.
    :param ranks: The ranks that reported a failure (empty when the communication itself failed).

    Example:
        >>> from gpytorch_decoupled.distributed import DistributedStepError
        >>> error = DistributedStepError("the gradient all-reduce failed on rank 1: non-finite values", ranks=[1])
        >>> isinstance(error, RuntimeError), error.ranks
        (True, [1])
    """

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks or [])
