"""Architecture registry: GGUF `general.architecture` name -> model class.

Each family module registers itself with `@register("name", ...)`; built-in families use the
same path a new one would. `model_class(name)` raises a typed error for unknown names.
"""

from __future__ import annotations

import importlib

from engine.errors import UnsupportedArchitectureError

_REGISTRY: dict[str, type] = {}
_BUILTIN_MODULES = (
    "engine.arch.llama", "engine.arch.gemma3", "engine.arch.gemma4", "engine.arch.gemma3n",
    "engine.arch.nemotron_h", "engine.arch.deepseek2", "engine.arch.bert", "engine.arch.nomic_bert",
    "engine.arch.modernbert",
)


def register(*names: str):
    """Class decorator: make a model class the implementation of the given architecture names."""

    def wrap(cls):
        for name in names:
            _REGISTRY[name] = cls
        return cls

    return wrap


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def model_class(name: str) -> type:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnsupportedArchitectureError(
            f"model architecture {name!r} is not supported by this version of Hearth (supported: {known})"
        ) from None


def supported_architectures() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)
