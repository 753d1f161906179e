"""Every public module of the package has a page in the API reference (``docs/api/``), listed in its table of
contents, so a new module cannot be left out of the documentation."""

import types
from pathlib import Path

import pytest

import gpytorch_decoupled

API = Path(__file__).resolve().parents[2] / "docs" / "api"
PUBLIC_MODULES = sorted(
    name for name in gpytorch_decoupled.__all__ if isinstance(getattr(gpytorch_decoupled, name), types.ModuleType)
)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_module_has_an_api_page(name: str):
    page = API / f"{name}.rst"
    assert page.is_file(), f"docs/api/{name}.rst is missing"
    assert f".. automodule:: gpytorch_decoupled.{name}" in page.read_text(encoding="utf-8")
    toctree = (API / "index.md").read_text(encoding="utf-8")
    assert f"\n{name}\n" in toctree, f"docs/api/index.md does not list {name}"
