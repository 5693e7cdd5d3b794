"""Turn what a user typed as MODEL (a path or a starter model's name) into a file path."""

from __future__ import annotations

from pathlib import Path

from models.errors import ModelNotFoundError
from models.hub import is_mmproj
from models.starter import STARTERS, Progress, ensure_starter


def resolve_model(spec: str, progress: Progress | None = None) -> Path:
    """A path to an existing file, or the name of a starter model (fetched on first use).

    Raises:
        ModelNotFoundError: neither an existing file nor a known starter name.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if spec in STARTERS:
        return ensure_starter(spec, progress=progress)
    if path.is_dir() and (path / "config.json").is_file():
        return path  # a Hugging Face model folder
    if path.is_dir():
        ggufs = sorted(p for p in path.glob("*.gguf") if not is_mmproj(p.name))  # a tower goes with its model
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(f"{path} is a folder with {len(ggufs)} .gguf files; name the file to use")
    names = ", ".join(sorted(STARTERS))
    raise ModelNotFoundError(f"{spec!r} is neither a model file nor a starter model name (starters: {names})")
