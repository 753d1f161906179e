"""Determinism across processes (issue 8): every family trained by 2 gloo processes, each on its shard of every
batch, ends where one process trained on the same batches ends, to float64 roundoff (every family of
:data:`~tests.distributed._families.FAMILIES`)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._families import FAMILIES
from tests.distributed._spawn import run_ranks

pytestmark = pytest.mark.usefixtures("single_thread")


def assert_same(actual, expected, rtol=1e-9, atol=1e-11, where="") -> None:
    """Nested dicts, lists and tensors equal to float64 roundoff."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], rtol, atol, f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for index, (first, second) in enumerate(zip(actual, expected, strict=True)):
            assert_same(first, second, rtol, atol, f"{where}[{index}]")
    elif expected.is_floating_point():
        torch.testing.assert_close(
            actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda message: f"{where}: {message}"
        )
    else:
        assert torch.equal(actual, expected), where


def test_two_processes_end_where_one_process_ends(tmp_path):
    # One 2-process job for all families (and one test, so that pytest-xdist starts it once).
    two_ranks = run_ranks("tests.distributed._families:run_all_families", 2, tmp_path)
    for family, train in FAMILIES.items():
        expected = train(distributed=False)
        first, second = (result[family] for result in two_ranks)
        assert_same(first, expected, where=family)
        # Every rank holds the same state, bit for bit: the same steps from the same all-reduced sums.
        assert_same(second, first, rtol=0, atol=0, where=family)
