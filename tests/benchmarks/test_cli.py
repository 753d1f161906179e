import json

import pytest

from benchmarks import BENCHMARKS
from benchmarks.cli import main

HELP_COMMANDS = [["--help"], *([name, "--help"] for name in BENCHMARKS)]


@pytest.mark.parametrize("argv", HELP_COMMANDS)
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_baselines_writes_results_with_ratios(tmp_path, capsys):
    main(
        ["baselines", "--dataset", "elevators", "--max-train-rows", "600", "--iterations", "6",
         "--eval-every", "3", "--warmup", "2", "--num-inducing", "20", "--num-mean-inducing", "40",
         "--exact-max-rows", "1000", "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "baselines.json").read_text())
    assert payload["benchmark"] == "baselines"
    assert {row["name"] for row in payload["rows"]} == {"svgp", "svgp-ngd", "gpytorch-odvgp", "sgpr", "exact"}
    assert all(row["skipped"] is None for row in payload["rows"])
    assert set(payload["ratios"]) >= {"svgp-ngd_seconds_per_iteration", "exact_peak_memory"}
    assert payload["passed"] is True and payload["goals"] == {}
    assert (tmp_path / "baselines.png").exists()
    assert "svgp-ngd_seconds_per_iteration" in capsys.readouterr().out
