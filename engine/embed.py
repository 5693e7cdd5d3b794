"""Embeddings: a loaded model's final hidden states pooled into one vector per input.

How a model pools, in the order looked at:
  * a GGUF's `{arch}.pooling_type` (llama.cpp: 0 none, 1 mean, 2 cls, 3 last, 4 rank);
  * a Hugging Face folder's sentence-transformers files: modules.json naming a Pooling module whose
    config (1_Pooling/config.json) sets pooling_mode_cls_token / _mean_tokens / _lasttoken, a Normalize
    module, sentence_bert_config.json's max_seq_length, config_sentence_transformers.json's prompts;
  * otherwise mean pooling, for an encoder and for any chat model alike (Hearth's choice: a generic
    decoder has no embedding head, and the mean of its last layer is what Ollama's and LM Studio's users
    get from llama.cpp's mean pooling). Pooling "none" (per-token vectors) is read as mean too: the APIs
    return one vector per input; "rank" (a reranker's classifier) is refused.

Vectors are L2-normalised by default (Ollama's /api/embed does; OpenAI's models return unit vectors);
`dims` keeps the first dims components (Matryoshka models: Qwen3-Embedding, mxbai, nomic) and normalises
again. An input longer than the model takes is an EmbeddingInputError unless truncation is asked, which
keeps the text's first tokens and the closing special tokens the tokenizer adds ([SEP], <|endoftext|>).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.errors import EmbeddingInputError, EmbeddingUnsupportedError

POOLINGS = ("mean", "cls", "last")
# the most tokens an encoder embeds in one pass (its inputs' rows laid end to end: engine/arch/encoder.py);
# past a few hundred rows BLAS gains little more, and activations stay a few MB for a 1024-wide model
BATCH_TOKENS = 2048
# the prompts a family's model card asks for, used when the model names none itself (sentence-transformers'
# prompts win): nomic-embed-text v1/v1.5 (arch nomic-bert) wants its task written before each text
FAMILY_TASK_PROMPTS = {"nomic-bert": {"query": "search_query: ", "document": "search_document: "}}
# sentence-transformers prompt names that mean a task: e5-style configs call a document a "passage"
TASK_PROMPT_NAMES = {"query": ("query",), "document": ("document", "passage")}
_ST_MODES = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"
}


@dataclass
class EmbeddingSpec:
    """How a model turns hidden states into an embedding.

    Attributes:
        pooling: "mean", "cls" or "last".
        dedicated: the model says it is an embedding model (a pooling in its metadata or
            sentence-transformers files, or an encoder); capabilities list "embedding" for these only.
        encoder_only: it cannot generate text (BERT).
        max_tokens: the most tokens one input may have (0: the context the caller gives).
        prompts: sentence-transformers' named prompts ({"query": "Instruct: ...\\nQuery:"}).
        default_prompt: the prompt name applied when none is asked for (None: no prompt).
        source: where the pooling was read, for messages.
    """

    pooling: str
    dedicated: bool = False
    encoder_only: bool = False
    max_tokens: int = 0
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    source: str = "default"


def _json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_sentence_transformers(folder: Path, spec: EmbeddingSpec) -> None:
    """Fill spec from a folder's sentence-transformers files (those absent change nothing)."""
    modules = _json(folder / "modules.json")
    if isinstance(modules, list):
        for m in modules:
            if not isinstance(m, dict) or not str(m.get("type", "")).endswith("models.Pooling"):
                continue
            config = _json(folder / str(m.get("path", "1_Pooling")) / "config.json") or {}
            modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
            other = [
                k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES
            ]
            if other or len(modes) > 1:
                raise EmbeddingUnsupportedError(
                    f"{folder}: sentence-transformers pooling {', '.join(other or modes)} is not supported "
                    "(Hearth pools by mean, CLS token or last token, one of them)"
                )
            if modes:
                spec.pooling, spec.dedicated, spec.source = modes[0], True, "sentence-transformers"
    bert_config = _json(folder / "sentence_bert_config.json")
    if isinstance(bert_config, dict) and isinstance(bert_config.get("max_seq_length"), int):
        spec.max_tokens = bert_config["max_seq_length"]
    st_config = _json(folder / "config_sentence_transformers.json")
    if isinstance(st_config, dict):
        prompts = st_config.get("prompts")
        if isinstance(prompts, dict):
            spec.prompts = {str(k): str(v) for k, v in prompts.items()}
        name = st_config.get("default_prompt_name")
        spec.default_prompt = name if isinstance(name, str) and name in spec.prompts else None


def embedding_spec(path: Path, metadata: dict, model) -> EmbeddingSpec:
    """The pooling of a loaded model (see the module's docstring).

    Args:
        path: the GGUF file or Hugging Face folder.
        metadata: its GGUF metadata (a folder's: the few keys the loader makes).
        model: the architecture instance (an encoder has `encoder_only`).

    Raises:
        EmbeddingUnsupportedError: a reranker (pooling "rank") or a pooling Hearth does not compute.
    """
    encoder = bool(getattr(model, "encoder_only", False))
    spec = EmbeddingSpec(pooling="mean", dedicated=encoder, encoder_only=encoder)
    arch = metadata.get("general.architecture")
    pooling_type = metadata.get(f"{arch}.pooling_type")
    if pooling_type is not None:
        kind = {0: "mean", 1: "mean", 2: "cls", 3: "last", 4: "rank"}.get(int(pooling_type))
        if kind not in POOLINGS:
            raise EmbeddingUnsupportedError(
                f"{path}: pooling type {int(pooling_type)} ({kind or 'unknown'}) is not supported: a "
                "reranker's "
                "classifier head gives scores, not embeddings"
            )
        spec.pooling, spec.dedicated, spec.source = kind, True, f"{arch}.pooling_type"
    elif Path(path).is_dir():
        read_sentence_transformers(Path(path), spec)
    return spec


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """One vector (hidden_size,) float32 from a sequence's hidden states (n, hidden_size)."""
    if pooling == "cls":
        return hidden[0].copy()
    if pooling == "last":
        return hidden[-1].copy()
    return hidden.mean(axis=0, dtype=np.float64).astype(np.float32)


def finish_vector(v: np.ndarray, normalize: bool = True, dims: int | None = None) -> np.ndarray:
    """v's first `dims` components (Matryoshka truncation; None: all), L2-normalised when asked."""
    if dims is not None:
        v = v[:dims]
    v = v.astype(np.float32, copy=True)
    if normalize:
        norm = float(np.linalg.norm(v.astype(np.float64)))
        if norm > 0.0:
            v /= np.float32(norm)
    return v


def check_model(lm) -> EmbeddingSpec:
    """lm's embedding spec, once its model can give hidden states.

    Raises:
        EmbeddingUnsupportedError: the family (or the device it runs on) has no hidden-states path.
    """
    if getattr(lm.model, "hidden_states", None) is None:
        arch = lm.metadata.get("general.architecture", "?")
        raise EmbeddingUnsupportedError(
            f"{lm.name} ({arch}) cannot give embeddings in this version of Hearth: embeddings come from "
            "encoders (BERT, XLM-RoBERTa, nomic-bert, ModernBERT) and the Llama / Qwen family of decoders on "
            "the CPU (load it with --device cpu if it runs on a GPU)"
        )
    if lm.embedding is None:  # a LoadedModel put together elsewhere: read its pooling now
        lm.embedding = embedding_spec(lm.path, lm.metadata, lm.model)
    return lm.embedding


def context_limit(lm, n_ctx: int | None = None) -> int:
    """The most tokens one input may have: the model's own limit (an encoder's positions,
    sentence_bert_config's max_seq_length), capped at n_ctx when given."""
    spec = check_model(lm)
    limits = [int(lm.model.cfg.max_position_embeddings)]
    if spec.max_tokens:
        limits.append(spec.max_tokens)
    if n_ctx and not spec.encoder_only:
        limits.append(int(n_ctx))
    return min(limits)


def _tail(tokenizer, ids: list[int]) -> int:
    """How many closing special tokens the tokenizer put at the end of ids ([SEP], <|endoftext|>)."""
    closing = tokenizer.encode_embedding("")
    n = 0
    while n < min(len(ids), len(closing)) and ids[-1 - n] == closing[-1 - n]:
        if not tokenizer.is_control(ids[-1 - n]):
            break
        n += 1
    return n


def tokenize(lm, texts: list[str], *, limit: int, truncate: bool = False, prompt: str = "",
             field_name: str = "input") -> list[list[int]]:
    """The token ids of each text to embed (the prompt text before each), checked against `limit`.

    Raises:
        EmbeddingInputError: an input that is empty or longer than limit without truncate.
    """
    tok = lm.tokenizer
    out = []
    for i, text in enumerate(texts):
        ids = tok.encode_embedding(prompt + text)
        if not ids:
            raise EmbeddingInputError(f"{field_name}[{i}] encodes to no tokens", "empty_input", field_name)
        if len(ids) > limit:
            if not truncate:
                raise EmbeddingInputError(
                    f"{field_name}[{i}] is {len(ids)} tokens; this model embeds at most {limit} "
                    "(shorten it, or ask for truncation: Ollama's \"truncate\": true, "
                    "hearth embed --truncate)",
                    "context_length_exceeded",
                    field_name,
                )
            tail = _tail(tok, ids)
            ids = ids[: limit - tail] + (ids[len(ids) - tail :] if tail else [])
        out.append(ids)
    return out


def embed_one(lm, ids: list[int], *, normalize: bool = True, dims: int | None = None) -> np.ndarray:
    """The embedding (hidden_size or dims,) float32 of one tokenized input (call on the thread that owns
    the model: the server's engine thread)."""
    spec = check_model(lm)
    hidden = lm.model.hidden_states(np.asarray(ids, dtype=np.int64))
    return finish_vector(pool(hidden, spec.pooling), normalize, dims)


def batches(inputs: list[list[int]], budget: int = BATCH_TOKENS) -> list[list[list[int]]]:
    """inputs cut, in order, into groups of at most `budget` tokens (an input longer than that alone; budget
    0: one input per group)."""
    groups: list[list[list[int]]] = []
    total = budget
    for ids in inputs:
        if total + len(ids) > budget:
            groups.append([])
            total = 0
        groups[-1].append(ids)
        total += len(ids)
    return groups


def embed_many(lm, inputs: list[list[int]], *, normalize: bool = True,
               dims: int | None = None) -> list[np.ndarray]:
    """embed_one of each tokenized input; an encoder runs them all in one pass (hidden_states_batch: its
    linears over every input's rows at once), a decoder one at a time. Callers keep a pass's size in bounds
    with `batches`."""
    spec = check_model(lm)
    run_batch = getattr(lm.model, "hidden_states_batch", None)
    if run_batch is None:
        return [embed_one(lm, ids, normalize=normalize, dims=dims) for ids in inputs]
    return [finish_vector(pool(h, spec.pooling), normalize, dims) for h in run_batch(inputs)]


def check_dims(lm, dims: int | None, field_name: str = "dimensions") -> None:
    """dims must be None or 1..hidden_size. Raises EmbeddingInputError."""
    size = int(lm.model.cfg.hidden_size)
    if dims is not None and not 1 <= dims <= size:
        raise EmbeddingInputError(
            f"{field_name} must be between 1 and the model's {size} dimensions, got {dims}", "invalid_value",
            field_name,
        )


def task_prompt(lm, task: str) -> str:
    """The text a model wants before an input of a search `task` ("query" or "document"): its
    sentence-transformers prompt of that name ("passage" for a document too, as e5-style configs name it),
    else its family's (FAMILY_TASK_PROMPTS: nomic-bert's "search_query: "), else "" (no guessing for a
    model that names none).

    Raises:
        ValueError: an unknown task.
    """
    if task not in TASK_PROMPT_NAMES:
        raise ValueError(f"task must be one of {', '.join(TASK_PROMPT_NAMES)}, got {task!r}")
    spec = check_model(lm)
    for name in TASK_PROMPT_NAMES[task]:
        if name in spec.prompts:
            return spec.prompts[name]
    if spec.prompts:  # the model names its prompts, and none for this task: it wants none
        return ""
    return FAMILY_TASK_PROMPTS.get(lm.metadata.get("general.architecture"), {}).get(task, "")


def embed_texts(lm, texts: list[str], *, normalize: bool = True, dims: int | None = None,
                truncate: bool = False, prompt_name: str | None = None,
                n_ctx: int | None = None, task: str | None = None) -> tuple[np.ndarray, list[int]]:
    """Embeddings of texts, one row each, and each input's token count.

    Args:
        lm: a loaded model (engine.loader.LoadedModel).
        texts: the inputs.
        normalize: L2-normalise each vector.
        dims: keep the first dims components (then normalise).
        truncate: cut inputs longer than the model takes instead of refusing them.
        prompt_name: one of the model's sentence-transformers prompts (None: its default, if any).
        n_ctx: a context cap for decoders (the model's trained context otherwise).
        task: "query" or "document": the model's prompt for that search task (task_prompt) when no
            prompt_name is given.

    Raises:
        EmbeddingInputError, EmbeddingUnsupportedError.
    """
    spec = check_model(lm)
    check_dims(lm, dims)
    name = prompt_name if prompt_name is not None else spec.default_prompt
    if name is not None and name not in spec.prompts:
        known = ", ".join(sorted(spec.prompts)) or "none"
        raise EmbeddingInputError(
            f"no prompt named {name!r} (this model has: {known})", "invalid_value", "prompt"
        )
    prompt = spec.prompts.get(name, "") if name is not None else ""
    if task is not None and prompt_name is None:
        prompt = task_prompt(lm, task)
    ids = tokenize(lm, texts, limit=context_limit(lm, n_ctx), truncate=truncate, prompt=prompt)
    rows = [v for group in batches(ids) for v in embed_many(lm, group, normalize=normalize, dims=dims)]
    width = dims or int(lm.model.cfg.hidden_size)
    return (np.stack(rows) if rows else np.empty((0, width), np.float32)), [len(x) for x in ids]
