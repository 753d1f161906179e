import json

import pytest

from benchmarks.cli import main
from benchmarks.compiled_step_benchmark import GOALS


def test_compiled_step_tiny_run(tmp_path, capsys):
    output = tmp_path / "compiled-step.json"
    configs = ["gpytorch-svgp-adam", "ours-svgp-natural-eager", "gpflow-svgp-adam"]
    main(
        ["compiled-step", "--num-inducing", "10", "--num-mean-inducing", "20", "--batch-size", "16",
         "--num-batches", "3", "--seconds", "0.2", "--warmup", "1", "--rounds", "2", "--configs", *configs,
         "--gpflow-python", str(tmp_path / "no-such-python"), "--output", str(output)]
    )  # fmt: skip
    payload = json.loads(output.read_text())
    assert set(GOALS) <= set(payload["ratios"]) and payload["goals"] == GOALS
    rows = payload["configurations"]
    assert set(rows) == {"gpytorch-svgp-adam", "ours-svgp-natural-eager"}
    for row in rows.values():
        assert len(row["step_ms_per_round"]) == 2 and row["step_ms"] > 0
    assert "no interpreter" in payload["skipped"]["gpflow-svgp-adam"]
    assert payload["passed"] is False  # the GPflow goals have no baseline in this run
    assert "skipped" in capsys.readouterr().out
    assert set(payload["machine"]["load_average"]) == {"start", "end"}


@pytest.mark.parametrize("config", ["ours-svgp-natural-compiled", "ours-orthnat-compiled", "ours-tsvgp-compiled"])
def test_compiled_configurations_take_the_lean_path(config, recwarn):
    # a fallback would time the eager step under the compiled name; the worker refuses it (RuntimeError)
    import torch

    from benchmarks.compiled_step_worker import make_step

    x = torch.randn(64, 3)
    y = torch.sin(x.sum(-1))
    make_step(config, x, y, x[:10].clone(), x[10:40].clone())
    assert not [warning for warning in recwarn if "lean training path" in str(warning.message)]
