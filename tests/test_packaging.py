"""The wheel: what it ships, what it needs, and that it works installed alone.

The wheel is built from a clean copy of this checkout and installed (no dependencies, no index) into a fresh virtual
environment whose site-packages sees only the runtime-dependency closure of the package: the distributions its
metadata requires, and theirs, found in this environment and linked in, not downloaded. Nothing reaches the network.
"""

import email
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import gpytorch_decoupled

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_REQUIREMENTS = {"torch", "gpytorch", "linear-operator", "numpy", "scipy", "tqdm"}
#: Build outputs and environments of a checkout, which a clean build must not see.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def _requirements(requires: list[str] | None, extra: str = "") -> list[Requirement]:
    """The requirements among ``requires`` that apply here, for ``extra`` (``""``: the plain install)."""
    parsed = [Requirement(text) for text in requires or []]
    return [
        requirement
        for requirement in parsed
        if requirement.marker is None or requirement.marker.evaluate({"extra": extra})
    ]


def _runtime_closure(wheel: Path) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions the wheel needs at run time, by canonical name: its requirements, theirs, ..."""
    closure, pending = {}, _requirements(_metadata(wheel).get_all("Requires-Dist"))
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name not in closure:
            closure[name] = importlib.metadata.distribution(requirement.name)
            pending += _requirements(closure[name].requires)
    return closure


def _link_distribution(distribution: importlib.metadata.Distribution, target: Path) -> None:
    """Symbolic links in ``target`` to the top-level packages, modules and metadata of an installed distribution."""
    if distribution.files is None:
        raise RuntimeError(f"{distribution.metadata['Name']} lists no files (no RECORD): cannot link it")
    site = Path(distribution.locate_file(""))
    for top in {file.parts[0] for file in distribution.files if file.parts[0] not in ("..", "__pycache__")}:
        if (site / top).exists() and not (target / top).exists():
            (target / top).symlink_to(site / top)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # A copy, so that no build/ folder of an earlier build (with modules since removed) gets into the wheel.
    source = tmp_path_factory.mktemp("source") / "checkout"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES, symlinks=True)
    output = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    subprocess.run([*command, "-w", str(output), str(source)], check=True, cwd=output)
    (path,) = output.glob("gpytorch_decoupled-*.whl")
    return path


@pytest.fixture(scope="module")
def clean_python(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment (no pip, no system packages) with the runtime closure linked in and the wheel
    installed by pip with ``--no-deps --no-index``; its interpreter."""
    root = tmp_path_factory.mktemp("clean")
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    runtime = root / "runtime"
    runtime.mkdir()
    for distribution in _runtime_closure(wheel).values():
        _link_distribution(distribution, runtime)
    (Path(purelib) / "runtime_dependencies.pth").write_text(f"{runtime}\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    subprocess.run([*install, str(wheel)], check=True)
    return python


def test_wheel_ships_every_module_and_the_embedded_data_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = "gpytorch_decoupled/datasets/data/elevators/"
    assert {data + "data.csv.gz", data + "test_mask.csv.gz", data + "LICENSE.txt"} <= names
    assert "gpytorch_decoupled/datasets/checksums.txt" in names  # what downloads verify against
    package = Path(gpytorch_decoupled.__file__).parent
    assert {path.relative_to(package.parent).as_posix() for path in package.rglob("*.py")} <= names
    # No benchmark harness, no tests, no notebooks: the package and its metadata only.
    assert {name.split("/")[0] for name in names} == {"gpytorch_decoupled", wheel.name.split("-py")[0] + ".dist-info"}


def test_wheel_requires_the_runtime_dependencies_only_and_offers_the_rest_as_extras(wheel):
    metadata = _metadata(wheel)
    assert {canonicalize_name(r.name) for r in _requirements(metadata.get_all("Requires-Dist"))} == RUNTIME_REQUIREMENTS
    assert {"bench", "data", "notebooks", "dev", "botorch"} <= set(metadata.get_all("Provides-Extra"))

    def extra(name: str) -> set[str]:
        return {
            canonicalize_name(r.name) for r in _requirements(metadata.get_all("Requires-Dist"), name)
        } - RUNTIME_REQUIREMENTS

    assert {"matplotlib", "scikit-learn"} <= extra("bench") <= extra("dev")
    assert extra("data") == {"pooch"} and extra("data") <= extra("dev")
    assert extra("botorch") == {"botorch"} and extra("botorch") <= extra("dev")
    assert extra("notebooks") - {"jupyter"} <= extra("dev")  # the notebooks run headless in `make test`


#: Runs in the clean environment: imports every module of the installed package, and reports which of the harness,
#: the tests and the dev-only packages it can import (none) and which distributions it sees.
PROBE = """
import importlib, importlib.metadata, json, pkgutil
import gpytorch_decoupled
modules = [info.name for info in pkgutil.walk_packages(gpytorch_decoupled.__path__, "gpytorch_decoupled.")]
optional = []
for name in modules:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:  # a module of an optional extra must say how to get it
        if 'pip install "gpytorch_decoupled[' not in str(error):
            raise
        optional.append(name)
importable = []
for name in NOT_NEEDED:
    try:
        importlib.import_module(name)
        importable.append(name)
    except ModuleNotFoundError:
        pass
distributions = sorted({distribution.metadata["Name"] for distribution in importlib.metadata.distributions()})
print(json.dumps({"file": gpytorch_decoupled.__file__, "modules": modules, "optional": optional,
                  "importable": importable,
                  "distributions": distributions}))
"""
#: One thread: the tiny runs gain nothing from more, and where the cores are shared OpenMP's waiting threads slow them
#: several-fold.
SINGLE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
#: Import names of what an installed package must not need: the harness, the tests, the dev extra's own packages.
NOT_NEEDED = ("benchmarks", "tests", "matplotlib", "pytest", "hypothesis", "xdist", "nbmake", "ipykernel", "ruff")


def test_installed_wheel_imports_every_module_and_runs_the_demo_with_the_runtime_dependencies_alone(
    wheel, clean_python, tmp_path
):
    probe = f"NOT_NEEDED = {NOT_NEEDED!r}\n{PROBE}"
    result = subprocess.run(
        [clean_python, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=SINGLE_THREAD
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert Path(report["file"]).is_relative_to(clean_python.parents[1])  # the installed copy, not this checkout
    package = Path(gpytorch_decoupled.__file__).parent
    modules = {".".join(path.relative_to(package.parent).with_suffix("").parts) for path in package.rglob("*.py")}
    modules = {name.removesuffix(".__init__") for name in modules} - {"gpytorch_decoupled"}
    # The BoTorch subpackage (the botorch extra) says how to get BoTorch; its modules are not reached without it.
    assert report["optional"] == ["gpytorch_decoupled.botorch"]
    assert set(report["modules"]) == {name for name in modules if not name.startswith("gpytorch_decoupled.botorch.")}
    assert report["importable"] == []
    seen = {canonicalize_name(name) for name in report["distributions"]}
    assert seen == set(_runtime_closure(wheel)) | {"gpytorch-decoupled"}

    # The console script, the demo's every method, no matplotlib: the plot is skipped, the results are written.
    script = clean_python.parent / "gpytorch-decoupled"
    command = [script, "demo", "--smoke", "--no-progress", "--max-train-rows", "1300", "--output-dir", "out"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=tmp_path, env=SINGLE_THREAD).stdout
    assert "SRGP (Kalman, VFE, ours)" in out and "plot:    skipped (pip install matplotlib to get it)" in out
    assert len(json.loads((tmp_path / "out" / "demo.json").read_text())["rows"]) == 6
