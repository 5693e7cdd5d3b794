"""Hearth's version: one number, set in pyproject.toml, read here by the app, the CLI and the installer."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _read_version() -> str:
    # A source checkout's pyproject.toml wins over installed metadata, which can be stale after an
    # editable install; a frozen bundle has no pyproject and falls back to the metadata it ships.
    if _PYPROJECT.is_file():
        m = re.search(r'^version\s*=\s*"([^"]+)"', _PYPROJECT.read_text(encoding="utf-8"), re.MULTILINE)
        if m:
            return m.group(1)
    try:
        return metadata.version("hearth")
    except metadata.PackageNotFoundError:
        return "0+unknown"


VERSION = _read_version()
