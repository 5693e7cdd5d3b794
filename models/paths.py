"""Where Hearth keeps its files. HEARTH_HOME redirects all of them (tests use it)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "hearth"


def _home() -> Path | None:
    home = os.environ.get("HEARTH_HOME")
    return Path(home).expanduser() if home else None


def data_dir() -> Path:
    home = _home()
    return home / "data" if home else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def config_dir() -> Path:
    home = _home()
    return home / "config" if home else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def cache_dir() -> Path:
    home = _home()
    return home / "cache" if home else Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def models_dir() -> Path:
    """The library folder where downloaded and starter models live."""
    return data_dir() / "models"
