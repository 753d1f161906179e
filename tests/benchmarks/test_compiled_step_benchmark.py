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


@pytest.mark.parametrize("mode", ["lean", "compiled"])
@pytest.mark.parametrize("family", ["gpytorch-svgp-adam", "ours-svgp-natural", "ours-orthnat", "ours-tsvgp"])
def test_lean_and_compiled_configurations_take_the_lean_path(family, mode, recwarn):
    # a fallback would time the eager step under the lean or compiled name; the worker refuses it (RuntimeError)
    config = f"{family}-{mode}"
    import torch

    from benchmarks.compiled_step_worker import make_step

    x = torch.randn(64, 3)
    y = torch.sin(x.sum(-1))
    step = make_step(config, x, y, x[:10].clone(), x[10:40].clone())
    assert not [warning for warning in recwarn if "lean training path" in str(warning.message)]
    if mode == "lean":  # runs without compiling: a step in seconds
        assert torch.isfinite(step(x[:16], y[:16]))


def test_compiled_recursive_step_tiny_run(tmp_path, capsys, recwarn):
    # one input dimension and Dynamo alone (backend "eager"): the plumbing, in seconds (tests/training tests the steps)
    main(
        ["compiled-recursive-step", "--dataset", "co2", "--num-inducing", "6", "--batch-size", "16",
         "--iterations", "2", "--warmup", "1", "--repeats", "2", "--max-train-rows", "200", "--backend", "eager",
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "compiled-recursive-step.json").read_text())
    ratios = payload["ratios"]
    assert ratios["compiled_srgp_step_vs_eager"] > 0 and ratios["compiled_update_vs_eager"] > 0
    assert ratios["srgp_compile_seconds"] > 0 and ratios["update_compile_seconds"] > 0
    assert len(payload["repeats"]) == 2 and set(payload["first_call"]) == {
        "srgp_eager", "srgp_compiled", "update_eager", "update_compiled"
    }  # fmt: skip
    assert "first call" in capsys.readouterr().out
    # the compiled methods take the lean path (a fallback would time the eager step under the compiled name)
    assert not [warning for warning in recwarn if "not supported" in str(warning.message)]
