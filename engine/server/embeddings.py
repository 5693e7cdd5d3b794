"""Embedding routes of `hearth serve`: OpenAI's POST /v1/embeddings and Ollama's POST /api/embed and legacy
POST /api/embeddings, over engine.embed.

Requests are validated here (a 400 names the field at fault), inputs are tokenized on a worker thread, and
each input's forward pass runs on the engine thread as an Engine.call: the engine thread owns the model, so
an embedding never computes beside a prefill or decode step over the same buffers, and chat replies being
decoded wait for one input's pass at most, not for a whole batch.

- /v1/embeddings: `input` a string, a list of strings, a list of token ids or a list of such lists;
  `encoding_format` "float" or "base64" (little-endian float32, as OpenAI's clients decode it);
  `dimensions` keeps the first components (Matryoshka) and normalises again. Vectors are unit length, as
  OpenAI's are. An input over the model's context is an error (OpenAI has no truncation).
- /api/embed: `input` a string or a list of strings, `truncate` (default true, as Ollama), `dimensions`,
  `options` and `keep_alive` accepted and ignored; unit-length vectors; Ollama's durations in nanoseconds.
- /api/embeddings (legacy): `prompt` -> `embedding`, not normalised (as Ollama's legacy route).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import embed
from engine.errors import EmbeddingInputError, EmbeddingUnsupportedError
from engine.server import ollama
from engine.server.errors import APIError, invalid
from engine.server.protocol import is_int

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


@dataclass
class EmbedRequest:
    """A parsed embedding request: texts, or token ids (OpenAI's), and how to finish the vectors."""

    model: str
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    normalize: bool = True
    dims: int | None = None
    truncate: bool = False
    base64: bool = False
    field: str = "input"


def _model(body: Any) -> str:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: the id GET /v1/models lists", "model")
    return model


def _dims(body: dict) -> int | None:
    dims = body.get("dimensions")
    if dims is not None and (not is_int(dims) or dims < 1):
        raise invalid(f"'dimensions' must be a positive integer, got {dims!r}", "dimensions")
    return dims


def _count(n: int, what: str) -> None:
    if n == 0:
        raise invalid(f"'{what}' is empty; send at least one input", what, "empty_input")
    if n > MAX_INPUTS:
        raise invalid(f"'{what}' has {n} inputs; at most {MAX_INPUTS} per request", what)


def parse_openai(body: Any) -> EmbedRequest:
    """POST /v1/embeddings' body. Raises APIError (400) naming the field at fault."""
    req = EmbedRequest(model=_model(body), dims=_dims(body))
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise invalid(f"'encoding_format' must be \"float\" or \"base64\", got {fmt!r}", "encoding_format")
    req.base64 = fmt == "base64"
    x = body.get("input")
    if isinstance(x, str):
        req.texts = [x]
    elif isinstance(x, list) and x and all(is_int(t) for t in x):
        req.ids = [list(x)]
    elif isinstance(x, list) and all(isinstance(t, str) for t in x):
        _count(len(x), "input")
        req.texts = list(x)
    elif isinstance(x, list) and all(isinstance(t, list) and all(is_int(i) for i in t) for t in x):
        _count(len(x), "input")
        req.ids = [list(t) for t in x]
    else:
        raise invalid(
            "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "input",
        )
    return req


def parse_ollama(body: Any) -> EmbedRequest:
    """POST /api/embed's body (options and keep_alive are accepted and ignored)."""
    req = EmbedRequest(model=_model(body), dims=_dims(body))
    truncate = body.get("truncate")
    truncate = True if truncate is None else truncate
    if not isinstance(truncate, bool):
        raise invalid("'truncate' must be true or false", "truncate")
    req.truncate = truncate
    if body.get("options") is not None and not isinstance(body.get("options"), dict):
        raise invalid("'options' must be an object", "options")
    x = body.get("input")
    if isinstance(x, str):
        req.texts = [x]
    elif isinstance(x, list) and all(isinstance(t, str) for t in x):
        _count(len(x), "input")
        req.texts = list(x)
    else:
        raise invalid("'input' must be a string or a list of strings", "input")
    return req


def parse_ollama_legacy(body: Any) -> EmbedRequest:
    """POST /api/embeddings' body: one `prompt`, a vector that is not normalised."""
    req = EmbedRequest(model=_model(body), normalize=False, truncate=True, field="prompt")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string", "prompt")
    if body.get("options") is not None and not isinstance(body.get("options"), dict):
        raise invalid("'options' must be an object", "options")
    req.texts = [prompt]
    return req


class EmbeddingRoutes:
    """The embedding handlers over the OpenAI routes' handler object (engine.server.app._Api)."""

    def __init__(self, api):
        self.api = api

    @property
    def lm(self):
        return self.api.lm

    def _token_ids(self, req: EmbedRequest, limit: int) -> list[list[int]]:
        """The ids of req's inputs, checked (on a worker thread)."""
        if req.texts is not None:
            return embed.tokenize(
                self.lm, req.texts, limit=limit, truncate=req.truncate, field_name=req.field
            )
        vocab = self.lm.tokenizer.vocab_size
        for i, ids in enumerate(req.ids):
            if not ids:
                raise EmbeddingInputError(f"input[{i}] holds no token ids", "empty_input")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise EmbeddingInputError(f"input[{i}]: token id {bad} is outside the vocabulary of {vocab}")
            if len(ids) > limit:
                raise EmbeddingInputError(
                    f"input[{i}] is {len(ids)} tokens; this model embeds at most {limit}",
                    "context_length_exceeded",
                )
        return req.ids

    async def compute(self, req: EmbedRequest) -> tuple[list[np.ndarray], list[int]]:
        """The vectors of req's inputs and their token counts.

        Raises:
            APIError: 400 for a model that gives no embeddings or an unusable input (the field named).
        """
        try:
            spec = embed.check_model(self.lm)
            embed.check_dims(self.lm, req.dims)
            limit = embed.context_limit(self.lm, self.api.engine.n_ctx)
            ids = await run_in_threadpool(self._token_ids, req, limit)
        except EmbeddingUnsupportedError as e:
            raise invalid(str(e), "model", "embeddings_not_supported") from e
        except EmbeddingInputError as e:
            raise invalid(str(e), e.field, e.code) from e
        vectors = []
        # one engine call per batch (an encoder's inputs together, a decoder's one by one): replies being
        # decoded go on between them
        for group in embed.batches(ids, embed.BATCH_TOKENS if spec.encoder_only else 0):
            job = functools.partial(embed.embed_many, self.lm, group, normalize=req.normalize, dims=req.dims)
            vectors += await asyncio.wrap_future(self.api.engine.call(job))
        self.api.metrics.prompt_tokens.inc(sum(map(len, ids)))
        return vectors, [len(x) for x in ids]

    # --- OpenAI ---

    async def openai(self, request: Request) -> Response:
        req = parse_openai(await self.api._json(request))
        self.api.check_model(req.model)
        vectors, counts = await self.compute(req)

        def encoded(v: np.ndarray):
            if req.base64:
                return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            return v.tolist()

        data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
        n = sum(counts)
        return JSONResponse({
            "object": "list",
            "data": data,
            "model": req.model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        })

    # --- Ollama ---

    async def ollama_embed(self, request: Request) -> Response:
        started = time.monotonic()
        req = parse_ollama(await self.api._json(request))
        self.api.check_model(req.model)
        vectors, counts = await self.compute(req)
        return JSONResponse({
            "model": req.model,
            "embeddings": [v.tolist() for v in vectors],
            "total_duration": int((time.monotonic() - started) * 1e9),
            "load_duration": int(request.scope.get(ollama.LOAD_S, 0.0) * 1e9),
            "prompt_eval_count": sum(counts),
        })

    async def ollama_embeddings(self, request: Request) -> Response:
        req = parse_ollama_legacy(await self.api._json(request))
        self.api.check_model(req.model)
        if not req.texts[0]:
            return JSONResponse({"embedding": []})  # as Ollama answers an empty prompt
        vectors, _ = await self.compute(req)
        return JSONResponse({"embedding": vectors[0].tolist()})



def refuse_generation(lm, model_name: str) -> None:
    """Raise the 400 a chat or completion request to an embedding-only model (a BERT encoder) gets."""
    spec = getattr(lm, "embedding", None)
    if spec is not None and spec.encoder_only:
        raise APIError(
            400,
            f"{model_name} is an embedding model: it cannot chat or complete text; send its inputs to "
            "POST /v1/embeddings (or Ollama's /api/embed), or serve a chat model",
            "invalid_request_error",
            "model",
            "model_not_supported",
        )
