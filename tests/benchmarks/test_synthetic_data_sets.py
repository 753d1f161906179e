"""The stand-in data of the benchmarks' tests (``conftest.synthetic_split``): the registered shapes, the loader's
standardization, and the real embedded set."""

import pytest
import torch

from gpytorch_decoupled import datasets


@pytest.mark.parametrize("name, d, outputs", [("kin40k", 8, None), ("pol", 26, None), ("kuka", 21, 14)])
def test_regression_stand_ins_have_the_registered_shape_and_training_statistics(name, d, outputs):
    split = datasets.load(name, split=1, dtype=torch.float64)
    assert split.name == name and split.task == "regression" and split.split == 1
    assert split.train_x.shape == (800, d) and split.test_x.shape == (200, d)
    assert split.train_y.shape == ((800,) if outputs is None else (800, outputs))
    for train in (split.train_x, split.train_y):
        torch.testing.assert_close(train.mean(0), torch.zeros_like(train[0]), atol=1e-12, rtol=0)
        torch.testing.assert_close(train.std(0, unbiased=False), torch.ones_like(train[0]))
    assert not torch.equal(split.train_x, datasets.load(name, split=0, dtype=torch.float64).train_x)


def test_classification_stand_ins_have_both_labels_unscaled():
    split = datasets.load("sonar", split=0)
    assert split.task == "classification" and split.train_x.shape == (167, 60)
    assert set(split.train_y.unique().tolist()) == {0.0, 1.0}
    assert split.y_std.item() == 1.0 and split.y_mean.item() == 0.0


def test_co2_stand_in_keeps_the_monthly_axis_and_chronological_split():
    split = datasets.load("co2", dtype=torch.float64)
    assert (split.train_x.size(0), split.test_x.size(0)) == (629, 158)
    assert split.train_x.max() < split.test_x.min()  # an extrapolation, as the real split
    # The real series' months give the same standardization (one year = 1 / 15.1323 standardized units).
    assert split.x_std.item() == pytest.approx(15.1323, rel=1e-4)
    assert split.x_mean.item() == pytest.approx(1958 + (2 + 314) / 12)


def test_embedded_set_is_the_real_one():
    split = datasets.load("elevators", split=0)
    assert split.train_x.shape == (14940, 18)
    with pytest.raises(ValueError, match="split"):
        datasets.load("kin40k", split=99)
