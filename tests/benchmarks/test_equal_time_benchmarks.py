import json
import math
import time

import gpytorch
import pytest
import torch
from gpytorch.utils.nearest_neighbors import NNUtil

from benchmarks import RunConfig
from benchmarks.cli import main
from benchmarks.decoupled_equal_time_benchmark import GOALS as EQUAL_TIME_GOALS
from benchmarks.mean_basis_adam_benchmark import GOAL as MEAN_STEP_GOAL
from benchmarks.mean_basis_adam_benchmark import _ratios, _verdict
from benchmarks.method_result import MethodResult
from benchmarks.methods import MethodNotApplicable, build_method
from benchmarks.methods.blocked_nn_variational_strategy import sequential_nearest_neighbors
from benchmarks.runner import timed_call
from gpytorch_decoupled.optim import MeanBasisAdam


def test_decoupled_equal_time_tiny_run(tmp_path, capsys):
    main(
        ["decoupled-equal-time", "--datasets", "kuka", "elevators", "--max-train-rows", "300", "--iterations", "6",
         "--eval-every", "3", "--warmup", "2", "--num-inducing", "10", "--num-mean-inducing", "40", "--vnngp-k", "8",
         "--batch-size", "64", "--clock", "thread", "--no-progress", "--checkpoints", "3", "6",
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "decoupled-equal-time.json").read_text())
    assert payload["complete"] and set(payload["goals"]) == set(EQUAL_TIME_GOALS) <= set(payload["ratios"])
    lean = {"orthnat-lean", "hybrid-lean", "svgp-lean", "svgp-ngd-lean"}
    methods = {"orthnat", "hybrid", "svgp", "svgp-ngd", "svgp-large-batch", "vnngp", *lean}
    assert {row["name"] for row in payload["rows"]} == {f"{m}@{d}" for m in methods for d in ("kuka", "elevators")}
    for record in payload["datasets"]:
        rows = record["methods"]
        assert set(rows) == methods and record["train_rows"] == 300
        assert rows["orthnat-lean"]["label"] == "OrthNat (ours), lean step"
        assert rows["svgp-ngd-lean"]["label"] == "SVGP (NGD, FastNatural q), lean step"
        # With every method on the lean step: the budget is the lean SVGP-Adam's time, both lean SVGPs the rivals.
        assert record["lean_svgp_seconds"] == rows["svgp-lean"]["train_seconds"]
        assert rows["svgp-lean"]["nll_at_lean_svgp_time"] == pytest.approx(rows["svgp-lean"]["nll"])
        at_lean = {name: row["nll_at_lean_svgp_time"] for name, row in rows.items()}
        assert record["wins_all_lean"] == {
            ours: at_lean[ours] <= min(at_lean["svgp-lean"], at_lean["svgp-ngd-lean"])
            for ours in ("orthnat-lean", "hybrid-lean")
        }
        # The lean methods are counted against GPyTorch's own SVGPs at SVGP-Adam's time, like the eager ones.
        wins = record["wins"]["orthnat-lean"]["nll_at_svgp_time"]
        assert wins["svgp"] == (rows["orthnat-lean"]["nll_at_svgp_time"] <= rows["svgp"]["nll_at_svgp_time"])
        # The reference's metrics at its own training time are its final ones.
        assert rows["svgp"]["nll_at_svgp_time"] == pytest.approx(rows["svgp"]["nll"])
        assert all(math.isfinite(row["nll_at_svgp_time"]) and row["iterations"] == 6 for row in rows.values())
        assert rows["vnngp"]["sizes"] == "M=N=300, k=8"
        wins = record["wins"]["orthnat"]["nll_at_svgp_time"]
        assert wins["svgp"] == (rows["orthnat"]["nll_at_svgp_time"] <= rows["svgp"]["nll_at_svgp_time"])
    expected = sum(
        all(record["wins"]["hybrid"]["nll_at_svgp_time"][rival] for rival in ("svgp", "svgp-ngd"))
        for record in payload["datasets"]
    )
    assert payload["ratios"]["hybrid_nll_wins_at_svgp_time_higher_is_better"] == expected
    expected = sum(record["wins_all_lean"]["orthnat-lean"] for record in payload["datasets"])
    assert payload["ratios"]["orthnat-lean_nll_wins_all_lean"] == expected
    # A shorter training read off the run: SVGP-Adam's time after 3 iterations; 6 is the full run, not a checkpoint.
    curves = {row["name"]: row["curve"] for row in payload["rows"]}
    for record in payload["datasets"]:
        assert set(record["checkpoints"]) == {"3"}
        checkpoint = record["checkpoints"]["3"]
        (svgp_point,) = (p for p in curves[f"svgp@{record['dataset']}"] if p["iteration"] == 3)
        assert checkpoint["svgp_seconds"] == svgp_point["seconds"] < record["svgp_seconds"]
        nll = checkpoint["nll_at_svgp_time"]
        assert nll["svgp"] == pytest.approx(svgp_point["nll"])
        assert checkpoint["wins"]["orthnat"] == (nll["orthnat"] <= min(nll["svgp"], nll["svgp-ngd"]))
    expected = sum(record["checkpoints"]["3"]["wins"]["orthnat"] for record in payload["datasets"])
    assert payload["ratios"]["orthnat_nll_wins_at_svgp_time_after_3_iterations"] == expected
    assert payload["datasets"][0]["output"] == 7  # KUKA fits qd1(t+1)
    assert (tmp_path / "decoupled-equal-time.png").stat().st_size > 5_000
    assert "SVGP-Adam's time" in capsys.readouterr().out


def test_decoupled_equal_time_variants_are_reported_without_a_goal(tmp_path):
    main(
        ["decoupled-equal-time", "--datasets", "elevators", "--max-train-rows", "200", "--iterations", "4",
         "--eval-every", "2", "--warmup", "1", "--num-inducing", "8", "--num-mean-inducing", "30", "--batch-size",
         "50", "--clock", "thread", "--no-progress", "--checkpoints", "2", "--variants", "orth", "--other-baselines",
         "--lean", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "decoupled-equal-time.json").read_text())
    (record,) = payload["datasets"]
    assert set(record["methods"]) == {"orthnat", "hybrid", "orth", "svgp", "svgp-ngd"}
    assert record["methods"]["orth"]["label"] == "Orth (ours)"
    rows = record["methods"]
    expected = int(
        all(rows["orth"]["nll_at_svgp_time"] <= rows[rival]["nll_at_svgp_time"] for rival in ("svgp", "svgp-ngd"))
    )
    assert payload["ratios"]["orth_nll_wins_at_svgp_time_higher_is_better"] == expected
    assert "orth_nll_wins_at_svgp_time_after_2_iterations" in payload["ratios"]
    # no goal for the variant, and none for lean methods that did not run
    assert set(payload["goals"]) == {name for name in EQUAL_TIME_GOALS if "-lean" not in name}
    assert record["wins_all_lean"] == {} and "lean_svgp_seconds" in record


def test_mean_basis_adam_softmax_tiny_run(tmp_path):
    main(
        ["mean-basis-adam", "--skip", "regression", "large", "binary", "--iterations", "4", "--eval-every", "2",
         "--warmup", "1", "--clock", "thread", "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "mean-basis-adam.json").read_text())
    assert [(case["method"], case["size"]) for case in payload["cases"]] == [("hybrid", 500), ("hybrid", 5000)]
    assert all(case["final_nll"] < case["initial_nll"] for case in payload["cases"])  # 3 classes: from log 3 down
    assert payload["ratios"][MEAN_STEP_GOAL] == sum(c["diverged"] or c["oscillates"] for c in payload["cases"])


def test_mean_basis_adam_controls_are_counted_apart_from_the_goal():
    # GPyTorch's SVGP (Adam, NGD + Adam) runs on the regression sets as a control: its oscillations are reported
    # beside the goal's count, never in it.
    def row(method, oscillates, task="regression", data="kuka"):
        return {"data": data, "task": task, "method": method, "size": 0, "diverged": False, "oscillates": oscillates,
                "final_accuracy": None}  # fmt: skip

    rows = [row("orthnat", True), row("hybrid", False), row("svgp", False), row("svgp-ngd", True)]
    rows += [row("svgp-ngd", True, task="binary", data="pima")]
    ratios = _ratios(rows)
    assert ratios[MEAN_STEP_GOAL] == 1
    assert ratios["svgp_cases_that_diverge_or_oscillate"] == 0
    assert ratios["svgp-ngd_cases_that_diverge_or_oscillate"] == 1


def _result(nll: list[float], accuracy: list[float] | None = None) -> MethodResult:
    curve = [{"iteration": 10 * i, "seconds": float(i), "nll": value} for i, value in enumerate(nll)]
    for point, value in zip(curve, accuracy or []):
        point["accuracy"] = value
    return MethodResult(name="case", label="case", iterations=10 * (len(nll) - 1), curve=curve)


def test_verdict_flags_divergence_and_oscillation_in_the_second_half_only():
    class Tolerances:
        nll_tolerance, accuracy_tolerance = 0.1, 0.05

    steady = _verdict(_result([1.0, 0.9, 1.5, 0.7, 0.65, 0.6, 0.62]), Tolerances)  # the early bump does not count
    assert not steady["diverged"] and not steady["oscillates"]
    assert steady["largest_nll_rise_in_second_half"] == pytest.approx(0.02)
    rising = _verdict(_result([1.0, 0.8, 0.7, 0.6, 0.9, 0.6, 0.6]), Tolerances)
    assert rising["oscillates"] and not rising["diverged"]
    assert _verdict(_result([1.0, 0.8, 0.7, 0.9, 1.1]), Tolerances)["diverged"]
    assert _verdict(_result([1.0, 0.8, math.nan]), Tolerances)["diverged"]
    flapping = _verdict(_result([0.7, 0.6, 0.5, 0.5, 0.5], [0.5, 0.8, 0.9, 0.8, 0.9]), Tolerances)
    assert flapping["oscillates"] and flapping["largest_accuracy_fall_in_second_half"] == pytest.approx(0.1)


def test_sequential_nearest_neighbors_match_gpytorch():
    points = torch.randn(300, 3, generator=torch.Generator().manual_seed(0))
    ours = sequential_nearest_neighbors(points, k=7, block_size=64)
    theirs = NNUtil(7, dim=3).build_sequential_nn_idx(points)
    assert torch.equal(ours.sort(-1).values, theirs.sort(-1).values)
    assert (ours < torch.arange(7, 300).unsqueeze(-1)).all()  # only earlier points


def test_vnngp_method_trains_on_its_own_batches():
    generator = torch.Generator().manual_seed(0)
    x = 4 * torch.rand(200, 2, generator=generator) - 2
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(200, generator=generator)
    method = build_method("vnngp", x, y, k=8, training_batch_size=50, lr=0.05)
    before = method.objective()
    for _ in range(40):
        method.step(x[:50], y[:50])
    assert method.objective() > before
    mean, variance = method.predict(x[:20])
    assert mean.shape == variance.shape == (20,) and (variance > 0).all()


def test_decoupled_methods_step_the_mean_coefficients_with_mean_basis_adam_by_default():
    x, y = torch.randn(100, 2), torch.randn(100)
    for name, options in (("orthnat", {}), ("hybrid", {}), ("decoupled", {})):
        method = build_method(name, x, y, num_inducing=10, num_mean_inducing=30, **options)
        mean_steps = [o for o in method.optimizers if isinstance(o, MeanBasisAdam)]
        default_rate = 0.1 if name == "decoupled" else 0.5  # its curvature step's size; Adam's rate in function space
        assert len(mean_steps) == 1 and mean_steps[0].param_groups[0]["lr"] == default_rate, name
        coefficients = mean_steps[0].param_groups[0]["params"][0]
        others = [p for o in method.optimizers if o is not mean_steps[0] for g in o.param_groups for p in g["params"]]
        assert all(p is not coefficients for p in others), name  # stepped once per iteration
    plain = build_method("orthnat", x, y, num_inducing=10, num_mean_inducing=30, mean_rule="adam", mean_lr=0.1)
    assert not any(isinstance(o, MeanBasisAdam) for o in plain.optimizers)
    with pytest.raises(ValueError, match="mean_rule"):
        build_method("orthnat", x, y, mean_rule="sgd")


def test_softmax_orthogonal_method_has_one_latent_per_class():
    x = torch.randn(120, 2)
    labels = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_features=3, num_classes=3, mixing_weights=False)
    method = build_method(
        "hybrid", x, labels.float(), num_inducing=8, num_mean_inducing=20, likelihood=likelihood, num_latents=3
    )
    method.step(x[:40], labels[:40].float())
    assert method.predict_probabilities(x[:10]).shape == (10, 3)
    assert math.isfinite(method.objective())


def test_thread_clock_counts_this_threads_work_only():
    assert timed_call(time.sleep, 0.2, device=torch.device("cpu"), clock="thread") < 0.05
    assert timed_call(time.sleep, 0.2, device=torch.device("cpu")) >= 0.2
    with pytest.raises(ValueError, match="clock"):
        RunConfig(clock="cpu")


def test_lean_step_of_a_method_takes_the_eager_steps_and_refuses_what_it_cannot_take():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(120, 2, dtype=torch.float64, generator=generator)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(120, dtype=torch.float64, generator=generator)
    sizes = {"num_inducing": 8, "num_mean_inducing": 20}
    eager, lean = (build_method("orthnat", x, y, step=kind, **sizes) for kind in ("eager", "lean"))
    assert lean.label == "OrthNat (ours), lean step" and lean.training_step.fallback_reason is None
    assert eager.training_step is None
    for batch in range(4):
        rows = slice(30 * batch, 30 * batch + 30)
        for method in (eager, lean):
            torch.manual_seed(batch)  # the same draws of MeanBasisAdam's function scale
            method.step(x[rows], y[rows])
    for (name, theirs), ours in zip(eager.model.named_parameters(), lean.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9, msg=name)
    with pytest.raises(MethodNotApplicable, match="NaturalVariationalDistribution"):
        build_method("svgp-ngd", x, y, num_inducing=8, step="lean")  # GPyTorch's natural q: no lean step
    assert build_method("svgp-ngd", x, y, num_inducing=8, fast_natural=True, step="lean").training_step is not None
    with pytest.raises(MethodNotApplicable, match="its own steps"):
        build_method("vnngp", x, y, k=4, training_batch_size=30, step="lean")
    with pytest.raises(ValueError, match="step must be one of"):
        build_method("svgp", x, y, num_inducing=8, step="fast")
