"""The worker's embedding model: one, kept loaded beside its chat models (engine.worker).

Loaded on the first `embed` request that names it, replaced when a request names another, dropped when the
worker unloads everything (a restarted worker has none until asked again). It has its own LoadedModel, so
embedding never touches a chat model's KV cache; the worker runs embed requests on their own thread, so a
question's embedding does not wait behind a reply being written (engine.worker.serve).

Every failure to get the model (missing, unreadable, not a model that gives embeddings, too big for the
memory left) is one EmbeddingModelError naming the model and what to do.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine import memory_guard
from engine.errors import EmbeddingModelError
from models.errors import HearthError

# beside its weights, an embedding pass needs its activations (engine.embed.BATCH_TOKENS rows of a few
# hidden-size buffers) and the tokenizer: well under this for the embedders people run (up to 1024 wide)
EMBED_OVERHEAD = 96 << 20


def model_bytes(path: Path) -> int:
    """Bytes of a model's weights on disk: a GGUF file, or a folder's safetensors."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


class Embedder:
    """The one embedding model of a worker. Thread-safe: a request holds it while it embeds."""

    def __init__(self):
        self.path: Path | None = None
        self.lm = None
        self.nbytes = 0  # what its load was checked for (weights and overhead), for the chat models' checks
        self._lock = threading.Lock()

    def embed(
        self,
        model: str | Path,
        texts: Sequence[str],
        *,
        prompt_name: str | None = None,
        task: str | None = None,
        truncate: bool = False,
        available: int | None = None,
    ) -> np.ndarray:
        """Embeddings (len(texts), dims) float32, unit rows, of texts with `model` (loaded if it is not).

        Args:
            prompt_name, task, truncate: as engine.embed.embed_texts.
            available: bytes of RAM to plan a load with (default: what the OS reports).

        Raises:
            EmbeddingModelError: the model cannot be used. EmbeddingInputError: an input it refuses.
        """
        from engine.embed import embed_texts

        with self._lock:
            lm = self._get(model, available)
            vectors, _ = embed_texts(lm, list(texts), prompt_name=prompt_name, task=task, truncate=truncate)
            return vectors

    def _get(self, model: str | Path, available: int | None):
        from engine.embed import check_model
        from engine.loader import load_model
        from models.resolve import resolve_model

        try:
            path = resolve_model(str(model))
        except HearthError as e:
            message = f"the embedding model {model} cannot be used: {e}"
            raise EmbeddingModelError(message, str(model)) from None
        if self.lm is not None and self.path == path:
            return self.lm
        self._drop()
        need = model_bytes(path) + EMBED_OVERHEAD
        available = memory_guard.available_bytes() if available is None else available
        room = int(available * memory_guard.HEADROOM)
        if need > room:
            raise EmbeddingModelError(
                f"the embedding model {path.name} needs about {need >> 20} MiB and only {max(room, 0) >> 20} "
                "MiB are free beside the chat model; choose a smaller one, or unload models",
                str(model),
            )
        try:
            lm = load_model(path)
            check_model(lm)
        except Exception as e:  # noqa: BLE001 - a broken file fails in many ways; each is this one error
            reason = str(e) if isinstance(e, HearthError) else f"{type(e).__name__}: {e}"
            raise EmbeddingModelError(
                f"the embedding model {path.name} could not be loaded ({reason}); choose another one in "
                "Settings, or re-download it",
                str(model),
            ) from None
        self.lm, self.path, self.nbytes = lm, path, need
        return lm

    def drop(self) -> None:
        """Let the model go (waits for a request using it)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self.lm is not None:
            self.lm, self.path, self.nbytes = None, None, 0
            gc.collect()

    def status(self) -> dict | None:
        """The loaded embedding model ({"path", "name", "bytes"}), None when there is none."""
        lm, path = self.lm, self.path
        if lm is None or path is None:
            return None
        return {"path": str(path), "name": lm.name, "bytes": self.nbytes}
