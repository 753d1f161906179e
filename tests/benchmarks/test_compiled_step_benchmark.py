import inspect
import json

import pytest
import torch

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


@pytest.mark.parametrize("mode", ["lean", "compiled", "graphs"])
@pytest.mark.parametrize(
    "family", ["gpytorch-svgp-adam", "ours-svgp-natural", "ours-orthnat", "ours-tsvgp", "ours-decoupled", "ours-vbks"]
)
def test_lean_and_compiled_configurations_take_the_lean_path(family, mode, recwarn):
    # a fallback would time the eager step under the lean or compiled name; the worker refuses it (RuntimeError)
    config = f"{family}-{mode}"
    from benchmarks.compiled_step_worker import make_step

    x = torch.randn(64, 3)
    y = torch.sin(x.sum(-1))
    step = make_step(config, x, y, x[:10].clone(), x[10:40].clone())
    assert not [warning for warning in recwarn if "lean training path" in str(warning.message)]
    if mode == "lean":  # runs without compiling: a step in seconds
        assert torch.isfinite(step(x[:16], y[:16])).all()
    if mode == "graphs":  # compiled for CUDA graphs (bench cuda-step); t-SVGP's iteration wraps its training step
        training_step = inspect.getclosurevars(step).nonlocals["lean"] if family == "ours-tsvgp" else step
        assert training_step.compiled and training_step._cuda_graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_step_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["cuda-step"])


def test_cuda_step_tiny_run_on_the_cpu(tmp_path, capsys):
    # The eager configurations on the CPU (the -graphs ones compile with Inductor: tests/training tests those steps),
    # and a configuration that fails is reported while the others run.
    output = tmp_path / "cuda-step.json"
    configs = ["gpytorch-svgp-adam", "gpytorch-largebatch-adam", "ours-orthnat-eager", "ours-tsvgp-eager"]
    main(
        ["cuda-step", "--device", "cpu", "--num-inducing", "10", "--num-mean-inducing", "20", "--batch-sizes", "16",
         "32", "--steps", "3", "--warmup", "1", "--configs", *configs, "ours-unknown-eager", "--output", str(output)]
    )  # fmt: skip
    payload = json.loads(output.read_text())
    for batch_size in ("16", "32"):
        rows = payload["configurations"][batch_size]
        assert set(rows) == set(configs)
        for row in rows.values():
            assert row["step_ms"] > 0 and row["first_step_s"] > 0 and row["cudagraph_skips"] == 0
        assert "unknown configuration" in payload["skipped"][f"ours-unknown-eager@{batch_size}"]
        assert payload["ratios"][f"largebatch_adam_vs_gpytorch_svgp_adam_b{batch_size}"] > 0
        assert payload["ratios"][f"orthnat_graphs_vs_eager_b{batch_size}"] is None  # not run: null in the JSON
    assert payload["goals"] == {} and payload["config"]["device"] == "cpu"
    assert "failed" in capsys.readouterr().out


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


def test_compiled_step_with_a_bernoulli_likelihood(tmp_path):
    # the labels and the likelihood reach the workers; configurations without a Bernoulli form and the peers are skipped
    output = tmp_path / "compiled-step.json"
    configs = ["gpytorch-svgp-adam", "ours-orthnat-lean", "ours-decoupled-eager", "gpflow-svgp-adam"]
    main(
        ["compiled-step", "--num-inducing", "10", "--num-mean-inducing", "20", "--batch-size", "16",
         "--num-batches", "3", "--seconds", "0.2", "--warmup", "1", "--rounds", "1", "--configs", *configs,
         "--likelihood", "bernoulli", "--output", str(output)]
    )  # fmt: skip
    payload = json.loads(output.read_text())
    assert set(payload["configurations"]) == {"gpytorch-svgp-adam", "ours-orthnat-lean"}
    assert "Bernoulli" in payload["skipped"]["ours-decoupled-eager"]
    assert "Gaussian" in payload["skipped"]["gpflow-svgp-adam"]
    assert payload["config"]["likelihood"] == "bernoulli"


def test_worker_builds_bernoulli_models():
    from benchmarks.compiled_step_worker import make_step

    x = torch.randn(64, 3)
    y = (x.sum(-1) > 0).float()
    step = make_step("ours-svgp-natural-lean", x, y, x[:10].clone(), x[10:40].clone(), "bernoulli")
    assert type(step.likelihood).__name__ == "BernoulliLikelihood" and step.fallback_reason is None
    assert torch.isfinite(step(x[:16], y[:16]))
    with pytest.raises(ValueError, match="Bernoulli"):
        make_step("ours-vbks-lean", x, y, x[:10].clone(), x[10:40].clone(), "bernoulli")
