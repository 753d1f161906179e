from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch

from gpytorch_decoupled import datasets

# Where the project keeps its data beside a checkout; found by default unless the test run hides it.
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

# (name, source) -> (N, D) as stated in each folder's README.txt of the shared data
EXPECTED_SIZES = {
    ("kin40k", "evans"): (40000, 8),
    ("elevators", "evans"): (16599, 18),
    ("pol", "evans"): (15000, 26),
    ("bike", "evans"): (17379, 17),
    ("keggdirected", "evans"): (48827, 20),
    ("airfoil", "evans"): (1503, 5),
    ("autompg", "evans"): (392, 7),
    ("autos", "evans"): (159, 25),
    ("breastcancer", "evans"): (194, 33),
    ("challenger", "evans"): (23, 4),
    ("concreteslump", "evans"): (103, 7),
    ("fertility", "evans"): (100, 9),
    ("forest", "evans"): (517, 12),
    ("machine", "evans"): (209, 7),
    ("pendulum", "evans"): (630, 9),
    ("servo", "evans"): (167, 4),
    ("solar", "evans"): (1066, 10),
    ("stock", "evans"): (536, 11),
    ("protein", "gal"): (45730, 9),
    ("protein", "evans"): (45730, 9),
    ("concrete", "gal"): (1030, 8),
    ("concrete", "evans"): (1030, 8),
    ("energy", "gal"): (768, 8),
    ("energy", "evans"): (768, 8),
    ("housing", "gal"): (506, 13),
    ("housing", "evans"): (506, 13),
    ("wine", "gal"): (1599, 11),
    ("wine", "evans"): (1599, 11),
    ("yacht", "gal"): (308, 6),
    ("yacht", "evans"): (308, 6),
    ("kin8nm", "gal"): (8192, 8),
    ("naval", "gal"): (11934, 16),
    ("power", "gal"): (9568, 4),
    ("kuka", "kuka"): (20068, 21),
    ("co2", "noaa"): (787, 1),
    ("sonar", "tsvgp"): (208, 60),
    ("ionosphere", "tsvgp"): (351, 32),
    ("pima", "tsvgp"): (768, 8),
}
GAL_SETS = ["concrete", "energy", "housing", "kin8nm", "naval", "power", "protein", "wine", "yacht"]
KUKA_TRAJECTORY_LENGTHS = [1814, 1857, 1971, 1941, 1915, 2061, 1984, 2509, 2019, 1997]
CLASS_COUNTS = {"sonar": (97, 111), "ionosphere": (225, 126), "pima": (500, 268)}


def _assert_finite(split: datasets.Split) -> None:
    for tensor in split:
        assert torch.isfinite(tensor).all()


class TestRegistry:
    def test_every_shared_set_is_registered(self):
        assert {name for name, _ in EXPECTED_SIZES} == set(datasets.available())
        for (name, source), (n, d) in EXPECTED_SIZES.items():
            entry = datasets.info(name, source)
            assert (entry.n, entry.d) == (n, d)
            assert entry.license and entry.description

    def test_defaults_and_aliases(self):
        assert datasets.sources("concrete") == ["gal", "evans"]
        assert datasets.info("protein").source == "gal"
        assert datasets.info("protein").num_splits == 5
        assert datasets.info("kuka_lwr_forward_dynamics") is datasets.info("kuka")
        assert datasets.info("mauna_loa_co2") is datasets.info("co2")
        assert datasets.info("kuka").num_outputs == 14

    def test_unknown_name_lists_available(self):
        with pytest.raises(ValueError, match="Available: .*kin40k"):
            datasets.load("kin41k")

    def test_unknown_source(self):
        with pytest.raises(ValueError, match="sources are \\['evans'\\]"):
            datasets.load("kin40k", source="gal")

    @pytest.mark.parametrize("split", [-1, 10])
    def test_bad_split(self, split):
        with pytest.raises(ValueError, match="split must be in 0..9"):
            datasets.load("elevators", split=split)

    def test_bad_split_co2(self):
        with pytest.raises(ValueError, match="split must be in 0..0"):
            datasets.load("co2", split=1)


class TestSharedData:
    @pytest.mark.parametrize(
        "name,source", [pytest.param(*key, marks=pytest.mark.data(key[0], source=key[1])) for key in EXPECTED_SIZES]
    )
    def test_row_counts_and_shapes(self, name, source):
        n, d = EXPECTED_SIZES[name, source]
        split = datasets.load(name, source=source)
        train_x, train_y, test_x, test_y = split
        assert len(train_x) + len(test_x) == n
        assert train_x.shape[1:] == test_x.shape[1:] == (d,)
        expected_y_shape = (14,) if name == "kuka" else ()
        assert train_y.shape == (len(train_x), *expected_y_shape)
        assert test_y.shape == (len(test_x), *expected_y_shape)
        assert all(t.dtype == torch.get_default_dtype() for t in (*split, split.x_mean, split.y_std))
        assert (split.name, split.source, split.split) == (name, source, 0)
        _assert_finite(split)

    @pytest.mark.parametrize(
        "name", [pytest.param(name, marks=pytest.mark.data(name, source="gal")) for name in GAL_SETS]
    )
    def test_gal_splits_follow_index_files(self, name):
        folder = datasets.locate(name, "gal").parent
        num_splits = int((folder / "n_splits.txt").read_text())
        assert datasets.info(name).num_splits == num_splits
        raw = np.loadtxt(folder / "data.txt")
        features = np.loadtxt(folder / "index_features.txt", dtype=int)
        target = int(np.loadtxt(folder / "index_target.txt"))
        for k in (0, num_splits - 1):
            train_idx = np.loadtxt(folder / f"index_train_{k}.txt", dtype=int)
            test_idx = np.loadtxt(folder / f"index_test_{k}.txt", dtype=int)
            split = datasets.load(name, split=k, dtype=torch.float64)
            assert (len(split.train_x), len(split.test_x)) == (len(train_idx), len(test_idx))
            restored_x = split.test_x * split.x_std + split.x_mean
            np.testing.assert_allclose(restored_x.numpy(), raw[test_idx][:, features], rtol=1e-12, atol=1e-9)
            restored_y = split.unstandardize_y(split.train_y)
            np.testing.assert_allclose(restored_y.numpy(), raw[train_idx, target], rtol=1e-12, atol=1e-9)

    @pytest.mark.data("protein")
    def test_protein_gal_split_sizes(self):
        for k in range(5):
            split = datasets.load("protein", split=k)
            assert (len(split.train_x), len(split.test_x)) == (41157, 4573)

    @pytest.mark.data("kin40k")
    def test_evans_splits_follow_test_mask(self):
        with gzip.open(datasets.locate("kin40k").parent / "test_mask.csv.gz") as file:
            mask = np.loadtxt(file, delimiter=",", dtype=int)
        test_means = set()
        for k in range(10):
            split = datasets.load("kin40k", split=k)
            assert len(split.test_x) == mask[:, k].sum()
            assert 0.09 * 40000 <= len(split.test_x) <= 0.11 * 40000
            test_means.add(split.test_y.mean().item())
        assert len(test_means) == 10

    @pytest.mark.parametrize(
        "name", [pytest.param(name, marks=pytest.mark.data(name)) for name in ("kin40k", "naval", "kuka", "co2")]
    )
    def test_standardized_with_train_statistics(self, name):
        split = datasets.load(name, dtype=torch.float64)
        x_constant = split.train_x.std(0) == 0
        torch.testing.assert_close(split.train_x.mean(0), torch.zeros_like(split.x_mean), atol=1e-10, rtol=0)
        torch.testing.assert_close(
            split.train_x.std(0, correction=0)[~x_constant], torch.ones_like(split.x_std)[~x_constant]
        )
        torch.testing.assert_close(split.train_y.mean(0), torch.zeros_like(split.y_mean), atol=1e-10, rtol=0)
        torch.testing.assert_close(split.train_y.std(0, correction=0), torch.ones_like(split.y_std))
        assert split.test_x.mean(0).abs().max() > 1e-3
        assert split.test_y.mean(0).abs().max() > 1e-3

    @pytest.mark.data("naval")
    def test_constant_columns_get_unit_scale(self):
        split = datasets.load("naval", dtype=torch.float64)
        constant = (split.train_x == split.train_x[0]).all(0)
        assert constant.any()
        assert (split.x_std[constant] == 1).all()
        _assert_finite(split)

    @pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.data(name)) for name in CLASS_COUNTS])
    def test_classification_folds_partition_the_data(self, name):
        negatives, positives = CLASS_COUNTS[name]
        test_rows, test_positives = [], 0
        for k in range(5):
            split = datasets.load(name, split=k, dtype=torch.float64)
            assert split.task == "classification"
            for labels in (split.train_y, split.test_y):
                assert set(labels.unique().tolist()) <= {0.0, 1.0}
            assert split.y_mean.item() == 0 and split.y_std.item() == 1
            assert split.train_y.sum() + split.test_y.sum() == positives
            test_rows.append((split.test_x * split.x_std + split.x_mean).numpy())
            test_positives += int(split.test_y.sum())
        sizes = [len(rows) for rows in test_rows]
        assert sum(sizes) == negatives + positives and max(sizes) - min(sizes) <= 1
        assert test_positives == positives
        raw = np.loadtxt(datasets.locate(name), delimiter=",", skiprows=int(name == "pima"))
        # rounding away the standardization round-off makes the row sort below stable between the two copies
        folds, raw = np.concatenate(test_rows).round(9), raw[:, :-1].round(9)
        np.testing.assert_array_equal(folds[np.lexsort(folds.T)], raw[np.lexsort(raw.T)])

    @pytest.mark.data("co2")
    def test_co2_split_is_chronological(self):
        split = datasets.load("mauna_loa_co2", dtype=torch.float64)
        assert split.train_x.shape == (629, 1) and split.test_x.shape == (158, 1)
        train_dates = split.train_x * split.x_std + split.x_mean
        test_dates = split.test_x * split.x_std + split.x_mean
        assert train_dates.max() < test_dates.min()
        assert 1958 < train_dates.min() < 1959 and 2023 < test_dates.max() < 2024
        ppm = split.unstandardize_y(split.test_y)
        assert 300 < ppm.min() and ppm.max() < 450

    @pytest.mark.data("kuka")
    def test_kuka_holds_out_one_trajectory(self):
        mat = scipy.io.loadmat(datasets.locate("kuka"))
        for k in (0, 7, 9):
            split = datasets.load("kuka", split=k, dtype=torch.float64)
            assert len(split.test_x) == KUKA_TRAJECTORY_LENGTHS[k]
            assert len(split.train_x) == 20068 - KUKA_TRAJECTORY_LENGTHS[k]
            trajectory = mat[f"kukatraj{k + 1}"]
            restored_x = split.test_x * split.x_std + split.x_mean
            np.testing.assert_allclose(restored_x.numpy(), trajectory[:, :21], atol=1e-9)
            mean, var = split.unstandardize_y(split.test_y, torch.ones_like(split.test_y))
            np.testing.assert_allclose(mean.numpy(), trajectory[:, 21:], atol=1e-9)
            torch.testing.assert_close(var, split.y_std.square().expand_as(var))

    @pytest.mark.data("yacht")
    def test_dtype_and_device(self):
        split = datasets.load("yacht", dtype=torch.float32, device="cpu")
        for tensor in (*split, split.x_mean, split.x_std, split.y_mean, split.y_std):
            assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"

    @pytest.mark.cuda
    @pytest.mark.data("yacht")
    def test_cuda(self):
        split = datasets.load("yacht", device="cuda")
        assert all(tensor.is_cuda for tensor in (*split, split.x_mean, split.y_std))

    def test_embedded_elevators_matches_shared_copy(self, tmp_path):
        entry = datasets.info("elevators")
        copies = [directory for directory in datasets.data_dirs() if (directory / entry.file).is_file()]
        if not copies:
            pytest.skip(f"no copy of {entry.file} in the data directories {datasets.data_dirs()} to compare with")
        embedded = datasets.load("elevators", split=4, data_dir=tmp_path, dtype=torch.float64)
        shared = datasets.load("elevators", split=4, data_dir=copies[0], dtype=torch.float64)
        for a, b in zip(embedded, shared):
            assert torch.equal(a, b)


class TestDataDirectories:
    def test_elevators_loads_without_any_data_dir(self, tmp_path, monkeypatch):
        monkeypatch.setenv(datasets.DATA_ENV_VAR, str(tmp_path))
        monkeypatch.chdir(tmp_path)
        train_x, train_y, test_x, test_y = datasets.load("elevators")
        assert len(train_x) + len(test_x) == 16599
        assert train_x.shape[1] == 18 and train_y.shape == (len(train_x),)

    def test_elevators_falls_back_from_explicit_dir(self, tmp_path):
        split = datasets.load("elevators", split=9, data_dir=tmp_path)
        assert len(split.train_x) + len(split.test_x) == 16599

    def test_missing_set_names_searched_dirs(self, tmp_path):
        with pytest.raises(FileNotFoundError) as error:
            datasets.load("kin40k", data_dir=tmp_path)
        message = str(error.value)
        assert str(tmp_path / "kin40k" / "evans") in message
        assert datasets.DATA_ENV_VAR in message and "data_dir=" in message

    def test_env_var_is_searched(self, tmp_path, monkeypatch):
        monkeypatch.setenv(datasets.DATA_ENV_VAR, str(tmp_path))
        assert datasets.data_dirs() == [tmp_path]
        with pytest.raises(FileNotFoundError, match=str(tmp_path)):
            datasets.load("pima")

    def test_default_dirs(self, tmp_path, monkeypatch):
        monkeypatch.delenv(datasets.DATA_ENV_VAR, raising=False)
        monkeypatch.delenv(datasets.SHARED_FALLBACK_ENV_VAR, raising=False)
        monkeypatch.chdir(tmp_path)
        searched = datasets.data_dirs()
        assert (tmp_path.parent / "shared" / "data").resolve() in searched
        assert SHARED_DATA.resolve() in searched
        assert datasets.data_dirs(tmp_path) == [tmp_path]

    @pytest.mark.parametrize("value", ["0", "false", "No", " off "])
    def test_shared_fallback_can_be_disabled(self, tmp_path, monkeypatch, value):
        monkeypatch.delenv(datasets.DATA_ENV_VAR, raising=False)
        monkeypatch.setenv(datasets.SHARED_FALLBACK_ENV_VAR, value)
        monkeypatch.setenv(datasets.CACHE_ENV_VAR, str(tmp_path / "cache"))
        assert datasets.data_dirs() == []
        with pytest.raises(FileNotFoundError, match=re.escape(f"directories ({tmp_path / 'cache' / 'kin40k'}")):
            datasets.locate("kin40k")
        assert datasets.locate("elevators").is_relative_to(Path(datasets.__file__).parent)
        assert datasets.data_dirs(tmp_path) == [tmp_path]  # an explicit directory is still searched

    def test_env_var_holds_several_dirs(self, tmp_path, monkeypatch):
        first, second = tmp_path / "a", tmp_path / "b"
        (second / "pima").mkdir(parents=True)
        (second / "pima" / "tsvgp_diabetes.csv").write_text("1,2\n")
        monkeypatch.setenv(datasets.DATA_ENV_VAR, f"{first}{os.pathsep}{second}")
        assert datasets.data_dirs() == [first, second]
        assert datasets.locate("pima") == (second / "pima" / "tsvgp_diabetes.csv").resolve()


class TestArguments:
    """Every argument of the public data set functions is checked before any file is read."""

    @pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
    def test_dtype_must_be_floating(self, dtype):
        with pytest.raises(TypeError, match=f"dtype must be a floating point torch.dtype.*got {dtype}"):
            datasets.load("elevators", dtype=dtype)

    @pytest.mark.parametrize("dtype", ["float64", np.float64, 64])
    def test_dtype_must_be_a_torch_dtype(self, dtype):
        with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
            datasets.load("elevators", dtype=dtype)

    @pytest.mark.parametrize("split", [1.5, 1.0, "1", True, None, torch.tensor([1, 2])])
    def test_split_must_be_an_int(self, split):
        with pytest.raises(TypeError, match="split must be an int"):
            datasets.load("elevators", split=split)

    def test_split_accepts_integer_scalars(self):
        by_int = datasets.load("elevators", split=2, dtype=torch.float64)
        for split in (np.int64(2), torch.tensor(2)):
            assert torch.equal(datasets.load("elevators", split=split, dtype=torch.float64).test_x, by_int.test_x)

    @pytest.mark.parametrize("name", [3, None, ("kin40k",)])
    def test_name_must_be_a_string(self, name):
        for function in (datasets.load, datasets.info, datasets.sources, datasets.locate, datasets.files):
            with pytest.raises(TypeError, match="name must be a data set name"):
                function(name)

    def test_unknown_names_list_the_known_ones(self):
        for function in (datasets.load, datasets.info, datasets.sources, datasets.locate, datasets.files):
            with pytest.raises(ValueError, match="Unknown data set 'kin41k'. Available: airfoil, .*kin40k"):
                function("kin41k")

    def test_source_must_be_a_string(self):
        with pytest.raises(TypeError, match="source must be None or a source name"):
            datasets.load("elevators", source=0)
        with pytest.raises(ValueError, match="sources are \\['evans'\\]"):
            datasets.locate("elevators", source="gal")

    @pytest.mark.parametrize("data_dir", [3, ["/data"], b"/data"])
    def test_data_dir_must_be_a_path(self, data_dir):
        with pytest.raises(TypeError, match="data_dir must be a directory"):
            datasets.load("elevators", data_dir=data_dir)
        with pytest.raises(TypeError, match="data_dir must be a directory"):
            datasets.data_dirs(data_dir)

    def test_cache_dir_must_be_a_path(self):
        with pytest.raises(TypeError, match="cache_dir must be a directory"):
            datasets.cache_dir(3)

    @pytest.mark.parametrize("device,error", [(1.5, TypeError), (True, TypeError), ("gpu:banana", ValueError)])
    def test_device_must_be_a_device(self, device, error):
        with pytest.raises(error, match="device"):
            datasets.load("elevators", device=device)

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA device is present")
    def test_an_unavailable_device_fails_before_reading(self, monkeypatch):
        def no_reading(*args):
            raise AssertionError("a file was read")

        monkeypatch.setitem(datasets.loader.READERS, "evans", no_reading)
        with pytest.raises(ValueError, match="device 'cuda' is not a usable torch device"):
            datasets.load("elevators", device="cuda")

    @pytest.mark.parametrize("download", ["yes", 1, 0])
    def test_download_must_be_a_bool(self, download):
        with pytest.raises(TypeError, match="download must be True or False"):
            datasets.load("elevators", download=download)

    def test_unstandardize_y_takes_floating_tensors(self):
        data = datasets.load("elevators", dtype=torch.float64)
        with pytest.raises(TypeError, match="mean must be a floating point torch.Tensor, got a ndarray"):
            data.unstandardize_y(data.test_y.numpy())
        with pytest.raises(TypeError, match="var must be a floating point torch.Tensor, got a torch.int64 tensor"):
            data.unstandardize_y(data.test_y, torch.ones(3, dtype=torch.int64))
