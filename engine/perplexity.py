"""Sliding-window perplexity: exp(mean negative log-likelihood) of a text's tokens under a model.

`perplexity(model, tokens, ctx, stride)`: windows of `ctx` tokens start every `stride` tokens; each
window is run from an empty KV cache and scores only the tokens no earlier window scored (the first
window scores all but its first token), so every token after the first is predicted exactly once with
up to ctx - 1 tokens of context, at least ctx - stride of it.

`llamacpp_perplexity(model, tokens, ctx)` reproduces llama.cpp's `llama-perplexity` instead: disjoint
chunks of ctx tokens, the first token of each chunk replaced by BOS when the model adds one, and only
the second half of each chunk scored (positions ctx/2 .. ctx-1). Use it to compare with llama.cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.errors import HearthError

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "resources" / "eval" / "default.txt"
DEFAULT_CTX = 512
DEFAULT_STRIDE = 256


class PerplexityError(HearthError):
    """The text is too short for the window, or the parameters are inconsistent."""


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood (nats per token)
    n_scored: int
    n_tokens: int
    ctx: int
    stride: int
    seconds: float = 0.0


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    # logits (n, vocab) float32, targets (n,) -> log p(target) (n,) in float64
    out = np.empty(len(targets), np.float64)
    for i in range(len(targets)):
        row = logits[i].astype(np.float64)
        m = row.max()
        out[i] = row[targets[i]] - m - math.log(np.exp(row - m).sum())
    return out


def _window_nll(model, window: np.ndarray, first_scored: int) -> np.ndarray:
    """-log p(window[j+1] | window[:j+1]) for j in first_scored .. len-2."""
    cache = model.new_cache(len(window))
    logits = model.forward(window, cache, all_logits=True)
    return -_log_softmax_at(logits[first_scored:-1], window[first_scored + 1 :])


def _check(tokens, ctx: int, stride: int) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=np.int64)
    if ctx < 2:
        raise PerplexityError(f"the context must be at least 2 tokens, got {ctx}")
    if not 1 <= stride <= ctx - 1:
        raise PerplexityError(f"the stride must lie in 1..ctx-1 ({ctx - 1}), got {stride}")
    if len(tokens) < 2:
        raise PerplexityError("the text has fewer than 2 tokens; give a longer text")
    return tokens


def perplexity_detail(
    model,
    tokens,
    ctx: int = DEFAULT_CTX,
    stride: int = DEFAULT_STRIDE,
    progress=None,
    bos_id: int | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of `tokens` under `model` (an architecture instance). See module doc.

    Args:
        bos_id: for models that expect BOS at position 0 (Gemma breaks down without it), every window
            after the first gets its first token (context only, never scored) replaced by BOS, as
            llama.cpp does per chunk.
    """
    import time

    t0 = time.perf_counter()
    tokens = _check(tokens, ctx, stride)
    n = len(tokens)
    ctx = min(ctx, n)
    nll = []
    scored_to = 0  # tokens[1..scored_to] are scored
    start = 0
    starts = []
    while True:
        starts.append(start)
        if start + ctx >= n:
            break
        start += stride
    for i, start in enumerate(starts):
        end = min(start + ctx, n)
        window = tokens[start:end]
        if bos_id is not None and start > 0:
            window = window.copy()
            window[0] = bos_id
        first = max(scored_to - start, 0)  # index in window of the last already-scored token
        nll.append(_window_nll(model, window, first))
        scored_to = end - 1
        if progress:
            progress(i + 1, len(starts), f"window {i + 1}/{len(starts)}")
    all_nll = np.concatenate(nll)
    mean = float(all_nll.mean())
    return PerplexityResult(math.exp(mean), mean, len(all_nll), n, ctx, stride, time.perf_counter() - t0)


def perplexity(
    model, tokens, ctx: int = DEFAULT_CTX, stride: int = DEFAULT_STRIDE, bos_id: int | None = None
) -> float:
    """Sliding-window perplexity (windows of ctx tokens every stride tokens; each token scored once).

    Pass the tokenizer's bos_id when the model adds BOS (see perplexity_detail).
    """
    return perplexity_detail(model, tokens, ctx, stride, bos_id=bos_id).ppl


def llamacpp_perplexity(
    model, tokens, ctx: int, bos_id: int | None = None, progress=None
) -> PerplexityResult:
    """llama.cpp's `llama-perplexity` scoring: disjoint ctx-token chunks, BOS first, second half scored."""
    import time

    t0 = time.perf_counter()
    tokens = np.asarray(tokens, dtype=np.int64)
    n_chunks = len(tokens) // ctx
    if n_chunks < 1:
        raise PerplexityError(f"the text has {len(tokens)} tokens, fewer than one {ctx}-token chunk")
    first = ctx // 2
    nll = []
    for c in range(n_chunks):
        window = tokens[c * ctx : (c + 1) * ctx].copy()
        if bos_id is not None:
            window[0] = bos_id
        # llama.cpp scores logits[first .. ctx-2] against tokens[first+1 .. ctx-1]
        nll.append(_window_nll(model, window, first))
        if progress:
            progress(c + 1, n_chunks, f"chunk {c + 1}/{n_chunks}")
    all_nll = np.concatenate(nll)
    mean = float(all_nll.mean())
    return PerplexityResult(
        math.exp(mean), mean, len(all_nll), len(tokens), ctx, ctx, time.perf_counter() - t0
    )


def load_text(path: str | Path | None) -> str:
    """The evaluation text: a user file, or the default text shipped in resources/eval."""
    p = Path(path) if path else DEFAULT_TEXT
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PerplexityError(f"{p}: no such text file") from None
    except UnicodeDecodeError:
        raise PerplexityError(f"{p}: not UTF-8 text") from None


def bos_for(loaded) -> int | None:
    """The BOS id a LoadedModel's windows should start with, or None when it adds no BOS."""
    tok = loaded.tokenizer
    return tok.bos_id if tok.add_bos else None


def text_tokens(loaded, text: str) -> list[int]:
    """Tokens of `text` for a LoadedModel, with BOS when the model adds one."""
    return loaded.tokenizer.encode(text, add_special=True)
