import json

import pytest

from gpytorch_decoupled.__main__ import main

HELP_COMMANDS = [
    ["--help"],
    ["demo", "--help"],
    ["bench", "--help"],
    ["bench", "baselines", "--help"],
    ["datasets", "--help"],
]


@pytest.mark.parametrize("argv", HELP_COMMANDS)
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_demo_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    main(["demo", "--smoke", "--no-progress", "--max-train-rows", "2000", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    for column in ("method", "inducing sizes", "s / iteration", "test RMSE", "test NLL", "final ELBO / N"):
        assert column in out
    assert "GPyTorch SVGP (Adam)" in out
    assert (tmp_path / "demo_nll_vs_time.png").stat().st_size > 10_000
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    assert all(row["iterations"] == 20 for row in rows)


def test_bench_baselines_writes_results_with_ratios(tmp_path, capsys):
    main(
        ["bench", "baselines", "--dataset", "elevators", "--max-train-rows", "600", "--iterations", "6",
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


def test_datasets_listing(capsys):
    main(["datasets"])
    out = capsys.readouterr().out
    assert "elevators" in out and "kin40k" in out
