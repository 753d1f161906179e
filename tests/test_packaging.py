"""The wheel carries the package and its embedded data, so ``pip install .`` works without the source tree."""

import subprocess
import sys
import zipfile
from pathlib import Path

import gpytorch_decoupled

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_module_and_the_embedded_data(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("gpytorch_decoupled-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = "gpytorch_decoupled/datasets/data/elevators/"
    assert {data + "data.csv.gz", data + "test_mask.csv.gz", data + "LICENSE.txt"} <= names
    package = Path(gpytorch_decoupled.__file__).parent
    sources = {path.relative_to(package.parent).as_posix() for path in package.rglob("*.py")}
    assert sources <= names
    assert not any(name.startswith("tests/") for name in names)
