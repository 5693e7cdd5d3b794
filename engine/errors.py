"""Errors the engine reports to users. All derive from models.errors.HearthError."""

from __future__ import annotations

from models.errors import HearthError, ModelFormatError

__all__ = [
    "ContextOverflowError",
    "EmbeddingInputError",
    "EmbeddingModelError",
    "EmbeddingOnlyModelError",
    "EmbeddingUnsupportedError",
    "HearthError",
    "ImageInputError",
    "MissingTensorError",
    "ModelFormatError",
    "UnsupportedArchitectureError",
]


class UnsupportedArchitectureError(HearthError):
    """The file's `general.architecture` has no implementation here."""


class MissingTensorError(ModelFormatError):
    """A tensor the architecture needs is absent (or has the wrong shape) in the file."""


class ContextOverflowError(HearthError):
    """A prompt (plus what is already cached) does not fit the context window."""

    def __init__(self, needed: int, n_ctx: int):
        self.needed = needed
        self.n_ctx = n_ctx
        super().__init__(
            f"the prompt needs {needed} tokens but the context holds {n_ctx}; "
            "shorten the prompt or load the model with a larger context (--ctx)"
        )


class ImageInputError(HearthError):
    """An image in a message cannot be used: the model reads no images, or the bytes are no readable
    image (the message says which and what to do)."""


class ImagesBusyError(ImageInputError):
    """The images of prompts still being read fill the model's image table (a server's concurrent
    requests): this prompt's images do not fit beside them until one finishes; retry shortly."""


class EmbeddingOnlyModelError(HearthError):
    """The model is an embedding model (a BERT encoder): it cannot chat or generate text."""


class EmbeddingUnsupportedError(HearthError):
    """The model cannot give embeddings here: its family has no final-hidden-states path, it runs on a
    device without one, or its pooling (a reranker's) is not supported."""


class EmbeddingInputError(HearthError):
    """An input to embed is unusable: empty, or longer than the model's context without truncation asked.

    Attributes:
        field: the request field at fault ("input", "prompt").
        code: a short machine-readable reason ("empty_input", "context_length_exceeded").
    """

    def __init__(self, message: str, code: str = "invalid_input", field: str = "input"):
        self.code = code
        self.field = field
        super().__init__(message)


class EmbeddingModelError(HearthError):
    """An embedding model the worker was asked to embed with cannot be used: missing, unreadable, not an
    embedding model, or too big for the memory left beside the chat model (the message says which; the app
    then ranks documents by keywords alone).

    Attributes:
        path: the model asked for.
    """

    def __init__(self, message: str, path: str = ""):
        self.path = path
        super().__init__(message)
