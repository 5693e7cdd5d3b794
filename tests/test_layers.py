"""Imports only point down: models never imports engine/app; engine never imports app or Qt."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "models": {"engine", "app", "PySide6", "numba", "cupy"},
    "engine": {"app", "PySide6"},
}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imports(path)
        if name in FORBIDDEN[package]
    ]
    assert not bad, bad


def test_only_app_qt_imports_qt():
    bad = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "app").rglob("*.py"))
        if path.name != "qt.py" and "PySide6" in set(_imports(path))
    ]
    assert not bad, bad
