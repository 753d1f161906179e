"""The package's architecture rules, checked on its source and classes.

* Across subpackages only public names are used: no module imports a leading-underscore name (or anything from a
  leading-underscore module) of another subpackage of ours.
* Private names of GPyTorch and linear_operator are imported in one module only,
  ``gpytorch_decoupled/gpytorch_compat.py``, which says what each relies on.
* Composition over deep class hierarchies: no strategy's MRO is longer than that of GPyTorch's
  :class:`~gpytorch.variational.VariationalStrategy` plus one class.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import gpytorch
import pytest

import gpytorch_decoupled
from gpytorch_decoupled import variational
from gpytorch_decoupled.gpytorch_compat import VariationalStrategyBase

PACKAGE = Path(gpytorch_decoupled.__file__).resolve().parent
COMPAT = PACKAGE / "gpytorch_compat.py"
EXTERNAL = ("gpytorch", "linear_operator")
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(absolute module, imported names, line)`` for every import statement of a source file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module
            found.append((target, [alias.name for alias in node.names], node.lineno))
    return found


def _subpackage(module: str) -> str:
    """The first component below ``gpytorch_decoupled`` (a subpackage, or a top-level module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_private_name_is_imported_from_another_subpackage(path: Path) -> None:
    here = _subpackage(_module_name(path))
    for target, names, line in _imports(path):
        if not target.startswith("gpytorch_decoupled.") or _subpackage(target) == here:
            continue
        private = [part for part in target.split(".")[1:] if _is_private(part)]
        private += [name for name in names if _is_private(name)]
        assert not private, f"{path.name}:{line} imports private {private} from {target}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_private_gpytorch_names_are_imported_by_the_compat_module_only(path: Path) -> None:
    if path == COMPAT:
        return
    for target, names, line in _imports(path):
        if target.split(".")[0] not in EXTERNAL:
            continue
        private = [part for part in target.split(".") if _is_private(part)]
        private += [name for name in names if _is_private(name)]
        assert not private, f"{path.name}:{line} imports {private} from {target}: go through gpytorch_compat.py"


def test_the_checks_see_what_they_look_for() -> None:
    """The scans are not vacuous: they resolve relative imports and find the compat module's private imports."""
    compat_imports = {target for target, _, _ in _imports(COMPAT)}
    assert "gpytorch.variational._variational_strategy" in compat_imports
    strategy = PACKAGE / "variational" / "decoupled_variational_strategy.py"
    relative = [
        names for target, names, _ in _imports(strategy) if target == "gpytorch_decoupled.variational.mean_basis"
    ]
    assert relative and "MeanBasis" in relative[0]  # ``from .mean_basis import MeanBasis, ...``


GPYTORCH_DEPTH = len(gpytorch.variational.VariationalStrategy.__mro__)
STRATEGIES = sorted(
    (cls for _, cls in inspect.getmembers(variational, inspect.isclass) if issubclass(cls, VariationalStrategyBase)),
    key=lambda cls: cls.__name__,
)


def test_gpytorch_variational_strategy_depth() -> None:
    # VariationalStrategy, _VariationalStrategy, gpytorch.Module, torch.nn.Module, ABC, object (GPyTorch 1.15): the
    # bound below is relative to it, so that a GPyTorch release that changes it is noticed here.
    assert GPYTORCH_DEPTH == 6


def test_every_strategy_is_checked() -> None:
    assert len(STRATEGIES) == 7


@pytest.mark.parametrize("strategy_cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_no_strategy_is_deeper_than_gpytorchs_plus_one(strategy_cls: type) -> None:
    depth = len(strategy_cls.__mro__)
    assert depth <= GPYTORCH_DEPTH + 1, [cls.__name__ for cls in strategy_cls.__mro__]
