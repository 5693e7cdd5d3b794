"""Only app/qt.py imports the Qt binding; models/ and engine/ never import app/ or Qt."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QT = re.compile(r"^\s*(from|import)\s+(PySide6|PyQt5|PyQt6|shiboken6)\b", re.MULTILINE)


def test_only_app_qt_imports_pyside():
    offenders = [p for p in (ROOT / "app").rglob("*.py") if p.name != "qt.py" and QT.search(p.read_text())]
    assert not offenders, offenders


def test_engine_and_models_never_import_app_or_qt():
    app_import = re.compile(r"^\s*(from|import)\s+app\b", re.MULTILINE)
    for pkg in ("engine", "models"):
        for p in (ROOT / pkg).rglob("*.py"):
            text = p.read_text()
            assert not QT.search(text) and not app_import.search(text), p
