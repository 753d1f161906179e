"""``bench distributed``: a tiny run on 1 and 2 processes writes its results file with every ratio."""

import json
import math

import pytest

from benchmarks.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def test_distributed_tiny_run(tmp_path, capsys):
    main(
        ["distributed", "--iterations", "2", "--warmup", "1", "--batch-size", "32", "--num-inducing", "8",
         "--collective-repeats", "1", "--layouts", "1x1", "2x1", "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "distributed.json").read_text())
    assert payload["benchmark"] == "distributed" and payload["passed"] is True
    assert {row["name"] for row in payload["rows"]} == {
        f"{part}@{layout}" for part in ("gradient", "estep", "kalman") for layout in ("1x1", "2x1")
    }
    for part in ("gradient", "estep", "kalman"):
        for name in (f"{part}_throughput_2x1_vs_1x1_higher_is_better", f"{part}_communication_vs_step"):
            assert math.isfinite(payload["ratios"][name]) and payload["ratios"][name] > 0
            assert name in payload["ratio_notes"]
        two = payload["measurements"]["layouts"]["2x1"][part]
        assert two["message_bytes"] > 0 and two["collective_seconds"] > 0
    # M = 8: the E-step's message is the flags of 2 ranks, M + M^2 site statistics and the batch size, in float32.
    assert payload["measurements"]["layouts"]["2x1"]["estep"]["message_bytes"] == 4 * (2 + 8 + 64 + 1)
    assert "points/s" in capsys.readouterr().out


def test_distributed_layouts_are_checked():
    with pytest.raises(ValueError, match="PxT"):
        main(["distributed", "--layouts", "two", "--output-dir", "unused"])
