"""Typed errors a user can cause. Each message says what went wrong and what to do."""

from __future__ import annotations

from pathlib import Path


class HearthError(Exception):
    """Base of every error Hearth reports to a user (CLI prints the message, GUI shows it)."""


class ModelFormatError(HearthError):
    """A model file is malformed, truncated, foreign or uses something we do not support.

    Args:
        path: the offending file.
        problem: what is wrong with it, in plain words.
    """

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class VisionTowerError(ModelFormatError):
    """A vision tower (llama.cpp's mmproj GGUF, architecture "clip") was taken for a model to chat with."""

    def __init__(self, path: str | Path):
        super().__init__(
            path,
            "this is a vision tower (mmproj), not a model to chat with; keep it in the folder of its "
            "model and open that model, which reads images with it",
        )


class ModelNotFoundError(HearthError):
    """A model name or path does not resolve to a file."""


class StarterModelError(HearthError):
    """A starter model could not be fetched or failed verification."""
