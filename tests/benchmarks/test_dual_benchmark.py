import json
import math

import gpytorch
import pytest
import torch

from benchmarks import METHODS, RunConfig, compare
from benchmarks.cli import main
from benchmarks.dual_benchmark import (
    E_STEP_LR,
    GOALS,
    _first_reaching,
    cross_validation_split,
    kmeans_inducing_points,
    matern52_kernel,
    time_to_accuracy,
)
from benchmarks.methods import build_method
from benchmarks.metrics import classification_test_metrics
from gpytorch_decoupled import datasets

pytestmark = pytest.mark.usefixtures("single_thread")


def _toy_regression(n=150, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=generator, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1]) + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64)
    return x, y - y.mean()


def test_dual_tiny_run(tmp_path, capsys):
    main(
        ["dual", "--dataset", "elevators", "--max-train-rows", "300", "--estep-sizes", "10", "20",
         "--estep-repeats", "4", "--warmup", "1", "--uci-datasets", "housing", "sonar", "--max-folds", "1",
         "--em-iterations", "2", "--m-steps", "2", "--em-inducing", "10", "--bernoulli-e-steps", "2",
         "--iterations", "4", "--eval-every", "2", "--digits-inducing", "10", "--digits-targets", "0.5", "0.2",
         "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    payload = json.loads((tmp_path / "dual.json").read_text())
    assert set(payload["goals"]) == set(GOALS) == set(payload["goal_met"])
    assert set(GOALS) <= set(payload["ratios"]) and set(GOALS) <= set(payload["ratio_notes"])
    assert all(math.isfinite(payload["ratios"][name]) for name in GOALS)
    names = {row["name"] for row in payload["rows"]}
    assert names == {
        "dual@estep/M=10", "q-svgp@estep/M=10", "dual@estep/M=20", "q-svgp@estep/M=20",
        "dual@housing", "q-svgp@housing", "dual@sonar", "q-svgp@sonar", "dual@digits", "q-svgp@digits",
    }  # fmt: skip

    estep = payload["estep"]["sizes"]
    assert [row["num_inducing"] for row in estep] == [10, 20]
    assert payload["ratios"]["estep_time_vs_ngd"] == max(row["ratio"] for row in estep)
    # The timed E-steps are the same natural-gradient step (T5): after 5 of them on the same batches the predictive
    # means agree up to float32 rounding and GPyTorch's random initial mean (scale 1e-3, decaying by 1 - r per step).
    assert all(row["max_test_mean_difference"] < 2e-3 for row in estep)

    em = payload["em"]["datasets"]
    assert set(em) == {"housing", "sonar"}
    for summary in em.values():
        assert set(summary["per_fold_em_iterations_to_qsvgp_final_elbo"]) == {"dual", "q-svgp"}
        assert all(len(curve) == 2 for curve in summary["fold_means"]["dual"].values())
        # q-SVGP reaches its own final ELBO at the latest in the last EM iteration.
        assert summary["em_iterations_to_qsvgp_final_elbo"]["q-svgp"] <= 2
    # Gaussian likelihood, full batch, E-step r = 1 from the same start: both have Titsias' optimal q, one ELBO.
    housing = em["housing"]["fold_means"]
    assert housing["dual"]["elbo"][0] == pytest.approx(housing["q-svgp"]["elbo"][0], rel=1e-6)
    assert "accuracy" in em["sonar"]["fold_means"]["dual"] and "rmse" in housing["dual"]

    digits = payload["digits"]
    assert digits["train_rows"] + digits["test_rows"] == 1797
    assert set(digits["seconds_to_accuracy"]) == {"0.5", "0.2"}
    assert all(
        0 <= point["accuracy"] <= 1 for row in payload["rows"] if "digits" in row["name"] for point in row["curve"]
    )
    assert set(payload["part_seconds"]) == {"estep", "em", "digits"}
    assert (tmp_path / "dual.png").stat().st_size > 5_000
    assert (tmp_path / "dual-digits.png").stat().st_size > 5_000
    out = capsys.readouterr().out
    assert "estep_time_vs_ngd" in out and "training time to test accuracy 0.5" in out


def test_one_dual_e_step_at_r1_on_a_full_gaussian_batch_matches_one_ngd_step():
    x, y = _toy_regression()
    dual = build_method("dual", x, y, num_inducing=12, e_step_lr=1.0, seed=1)
    qsvgp = build_method("q-svgp", x, y, num_inducing=12, ngd_lr=1.0, seed=1)
    dual.e_step(x, y)
    qsvgp.e_step(x, y)
    # Both are Titsias' optimal q(u): the same ELBO and the same predictive.
    assert dual.objective() == pytest.approx(qsvgp.objective(), rel=1e-6)
    for ours, theirs in zip(dual.predict(x[:20]), qsvgp.predict(x[:20])):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # A second E-step at r = 1 changes nothing (fixed point, T3), for neither method.
    before = dual.objective()
    dual.e_step(x, y)
    assert dual.objective() == pytest.approx(before, rel=1e-10)


def test_the_m_step_moves_only_the_hyperparameters_and_inducing_inputs():
    x, y = _toy_regression()
    for name in ("dual", "q-svgp"):
        method = build_method(name, x, y, num_inducing=10, lr=0.1, **{E_STEP_LR[name]: 1.0})
        method.e_step(x, y)
        # The sites of t-SVGP (buffers), the natural parameters of q-SVGP.
        distribution = method.model.variational_strategy._variational_distribution
        q_state = {key: tensor.clone() for key, tensor in distribution.state_dict().items()}
        hypers = [tensor.detach().clone() for tensor in method.m_parameters]
        method.m_step(x, y)
        assert all(torch.equal(q_state[key], tensor) for key, tensor in distribution.state_dict().items())
        assert all(not torch.equal(a, b) for a, b in zip(hypers, method.m_parameters))


def test_dual_is_registered_and_fits_real_data():
    assert {"dual", "q-svgp"} <= METHODS.keys()
    split = datasets.load("elevators", split=0)
    config = RunConfig(iterations=300, batch_size=256, eval_every=300, warmup=5, progress=False)
    dual, svgp = compare([("dual", {"num_inducing": 50}), ("svgp-ngd", {"num_inducing": 50})], split, config)
    assert dual.label == "t-SVGP (dual, ours)"
    # As accurate as GPyTorch's natural-gradient SVGP after the same iterations (0.05 nats of slack).
    assert dual.nll < svgp.nll + 0.05
    assert dual.rmse < 0.55 * split.y_std.item()


def test_softmax_latents_share_inducing_inputs_and_predict_probabilities():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=generator)
    y = x[:, 0].gt(0).long() + x[:, 1].gt(0).long()
    options = {
        "num_inducing": 8,
        "covar_module": matern52_kernel(3, torch.Size([3])),
        "likelihood": gpytorch.likelihoods.SoftmaxLikelihood(num_features=3, num_classes=3, mixing_weights=False),
        "num_latents": 3,
        "lr": 0.05,
    }
    method = build_method("dual", x, y, e_step_lr=0.5, **options)
    for _ in range(10):
        method.step(x, y)
    assert method.model.variational_strategy.base_variational_strategy.inducing_points.shape == (8, 3)
    probabilities = method.predict_probabilities(x, num_samples=16)
    assert probabilities.shape == (60, 3)
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(60))
    assert classification_test_metrics(probabilities, y)["accuracy"] > 0.6


def test_cross_validation_folds_partition_the_rows_and_standardize_on_the_training_fold():
    folds = [cross_validation_split("housing", fold, 5) for fold in range(5)]
    assert sum(split.test_x.size(0) for split in folds) == datasets.info("housing").n
    rows = torch.cat([split.unstandardize_y(split.test_y) for split in folds])
    whole = datasets.load("housing", dtype=torch.float64)
    everything = torch.cat([whole.unstandardize_y(whole.train_y), whole.unstandardize_y(whole.test_y)])
    torch.testing.assert_close(rows.sort().values, everything.sort().values)
    first = folds[0]
    assert first.train_x.dtype == torch.float64 and first.split == 0
    torch.testing.assert_close(first.train_y.mean(), torch.zeros((), dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(first.train_y.std(unbiased=False), torch.ones((), dtype=torch.float64))
    # The classification sets come with the paper's folds already.
    sonar = cross_validation_split("sonar", 2, 5)
    torch.testing.assert_close(sonar.test_y, datasets.load("sonar", split=2, dtype=torch.float64).test_y)


def test_kmeans_inducing_points_are_seeded_cluster_centres():
    x, _ = _toy_regression(n=80)
    first, second = kmeans_inducing_points(x, 6, seed=0), kmeans_inducing_points(x, 6, seed=0)
    assert first.shape == (6, 2) and first.dtype == x.dtype
    torch.testing.assert_close(first, second)


def test_first_reaching_and_time_to_accuracy():
    assert _first_reaching([-3.0, -2.0, -1.0], -2.0) == 2
    assert _first_reaching([-3.0, -2.5], -2.0) is None
    curve = [{"seconds": 0.0, "accuracy": 0.1}, {"seconds": 1.5, "accuracy": 0.92}, {"seconds": 3.0, "accuracy": 0.9}]
    assert time_to_accuracy(curve, 0.9) == 1.5
    assert time_to_accuracy(curve, 0.95) is None


def test_classification_metrics_for_binary_and_multiclass_probabilities():
    binary = classification_test_metrics(torch.tensor([0.8, 0.4]), torch.tensor([1.0, 1.0]))
    assert binary["accuracy"] == 0.5
    assert binary["nll"] == pytest.approx(-(math.log(0.8) + math.log(0.4)) / 2)
    probabilities = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    multiclass = classification_test_metrics(probabilities, torch.tensor([0, 1]))
    assert multiclass["accuracy"] == 0.5
    assert multiclass["nll"] == pytest.approx(-(math.log(0.7) + math.log(0.1)) / 2, rel=1e-6)
