"""Fault behaviour across processes (issue 8): an error or a NaN on one rank stops every rank with the same clear
error and no state changes; a dead or hung rank stops the others (at once, or after the process group's timeout);
training resumes from a checkpoint (``state_dict``) with nothing lost. One test per 2-process job, so that
pytest-xdist starts each job once."""

from __future__ import annotations

import pytest

from tests.distributed._spawn import run_ranks
from tests.distributed.test_families import assert_same

pytestmark = pytest.mark.usefixtures("single_thread")

#: Per helper of the job's first part: the rank given bad data and what its error says.
FAILURES = {
    "e_step": (1, "y contains NaN or inf"),
    "gradients": (1, "NaN or inf"),
    "synchronize": (0, "rank 0 could not read its batch"),
    "kalman": (1, "ValueError"),
    "collapsed_bound": (1, "y contains NaN or inf"),
}


def _assert_stopped_by_the_collective(record: dict) -> None:
    assert record["ranks"] == [] and "the collective operation failed" in record["message"], record


def test_errors_on_one_rank_a_resumed_run_and_a_hung_rank(tmp_path):
    # The collective timeout is 8 s (room for a loaded CI machine); the hung rank answers only after rank 0 gave up.
    results = run_ranks("tests.distributed._faults:faults", 2, tmp_path, timeout_seconds=8.0)
    errors = [result["errors"] for result in results]

    # An error or a NaN on one rank: every rank raises the same error, naming the rank and its reason.
    for helper, (failed_rank, reason) in FAILURES.items():
        first, second = (result[helper] for result in errors)
        assert first["message"] is not None and first["message"] == second["message"], helper
        assert f"failed on rank(s) [{failed_rank}]" in first["message"] and reason in first["message"], first
        assert "no rank changed its state" in first["message"]
        assert first["ranks"] == second["ranks"] == [failed_rank]
        # The failed rank chains its own exception; the other knows the reason from the message alone.
        assert errors[failed_rank][helper]["cause"] != "NoneType"
        assert errors[1 - failed_rank][helper]["cause"] == "NoneType"

    # ... and no state changed; the group goes on with the next good step, the same on both ranks.
    for result in errors:
        assert result["e_step_unchanged"] and result["kalman_unchanged"] and result["gradients_kept"]
    assert_same(errors[1]["after"], errors[0]["after"], rtol=0, atol=0)
    assert errors[0]["after"]["0.variational_strategy._variational_distribution.site_mean"].abs().sum() > 0

    # A run saved by rank 0 after 4 of 6 steps and resumed by fresh objects ends where the uninterrupted run ends.
    for result in results:
        assert_same(result["resume"]["resumed"], result["resume"]["uninterrupted"], rtol=0, atol=0)

    # A hung rank stops the others after the timeout.
    assert "hung_rank" not in results[1]  # it never came back
    _assert_stopped_by_the_collective(results[0]["hung_rank"])
    assert 7.9 < results[0]["hung_rank"]["seconds"] < 40.0


def test_a_dead_rank_stops_the_others_at_once(tmp_path):
    rank_zero, rank_one = run_ranks("tests.distributed._faults:dead_rank", 2, tmp_path, timeout_seconds=10.0)
    assert rank_one is None  # it never came back
    _assert_stopped_by_the_collective(rank_zero["dead_rank"])
    assert rank_zero["dead_rank"]["seconds"] < 5.0  # long before the timeout
