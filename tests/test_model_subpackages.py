"""The model package's subpackages import only downward: network (the network alone), then
quant (packed weights for it), then formats (files read into both)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "nanoserve" / "model"
SUBPACKAGES = ["network", "quant", "formats"]


def imported_subpackages(path: Path) -> set[str]:
    """The model subpackages a module imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:2] == ["nanoserve", "model"]:
                found.update(parts[2:3] or [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("nanoserve.model."))
    return found & set(SUBPACKAGES)


def test_every_model_module_sits_in_a_subpackage():
    assert sorted(p.name for p in MODEL.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in MODEL.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(SUBPACKAGES)


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_a_model_subpackage_imports_only_those_below_it(package):
    allowed = set(SUBPACKAGES[:SUBPACKAGES.index(package) + 1])
    upward = {path.name: sorted(imported_subpackages(path) - allowed) for path in (MODEL / package).rglob("*.py")}
    assert not {name: found for name, found in upward.items() if found}
