"""Generation: prefill what the cache lacks, then decode token by token, yielding typed events."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.errors import ContextOverflowError
from engine.harmony import reply_decoder
from engine.kv_cache import KVCache
from engine.memory import peak_rss_mb
from engine.sampling import check_sampling, make_sampler, repetition_penalty
from engine.tokenizer import Tokenizer
from engine.vision.tokens import chunk_end, safe_prefix


@dataclass
class GenerationParams:
    """What to generate. temperature 0 is greedy."""

    max_tokens: int = 512
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    prefill_chunk: int = 512

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition penalty must be > 0")
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)


@dataclass
class GenerationEvent:
    """One step of a reply. `text` may be empty while a possible stop string is held back.

    finish_reason is None until the last event: "stop" (end-of-turn token or stop string),
    "length" (max_tokens) or "context" (the context window is full).
    """

    text: str
    token: int | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the KV cache, not prefilled again
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory_mb: float = 0.0


def prefill(model, cache: KVCache, ids: Sequence[int], chunk: int = 512) -> tuple[np.ndarray, int]:
    """Bring the cache to hold exactly `ids`, computing only what it does not hold already.

    Returns:
        (logits (vocab,) of the last token — a copy, number of tokens reused from the cache).
    """
    if not ids:
        raise ValueError("cannot generate from an empty prompt")
    if len(ids) > cache.n_ctx:
        raise ContextOverflowError(len(ids), cache.n_ctx)
    # recompute at least the last token for its logits; never keep part of an image (engine.vision.tokens)
    reused = safe_prefix(model, ids, min(cache.common_prefix(ids), len(ids) - 1))
    cache.trim(cache.offset - reused)
    reused = cache.offset  # a recurrent model's cache may step back further (RecurrentKVCache.trim)
    logits = None
    start = reused
    while start < len(ids):
        end = chunk_end(model, ids, start, chunk)
        logits = model.forward(ids[start:end], cache)
        start = end
    return logits[-1].copy(), reused


class _StopMatcher:
    """Holds back text that might be the start of a stop string; reports a completed match. `matched`: the
    stop string that ended the text (the one starting first; of those, the shortest), else None."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was completed)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [(i, len(s), s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, _, self.matched = min(hits)
            out = self.pending[:at]
            self.pending = ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _mask_from(logits: np.ndarray, start: int) -> np.ndarray:
    logits[start:] = -np.inf
    return logits


def device_steps(model, params: GenerationParams, rows: int, vocab: int, history: list[int] | None = None):
    """The model's own decode-and-pick step, when it has one (a CUDA decoder: greedy_step / sample_step)
    and the sampling settings fit it: step(token, cache) -> next token, and only the token leaves the
    device instead of the logits. None: decode with forward() and sample on the host (a top-k wider
    than the device sampler takes, a CPU model). rows: the logits' length; vocab: the tokenizer's
    (fewer when the embedding is padded: those rows are never picked); history: the tokens so far (the
    caller appends each one before its step), whose last repeat_last_n the repetition penalty takes."""
    greedy, sample = getattr(model, "greedy_step", None), getattr(model, "sample_step", None)
    if greedy is None or sample is None:
        return None
    limit = vocab if vocab < rows else None
    pen = None  # the repetition penalty's (factor, recent tokens) at each step
    if params.repetition_penalty != 1.0:
        last, seen = params.repeat_last_n, history if history is not None else []
        pen = lambda: (params.repetition_penalty, seen[-last:] if last else [])  # noqa: E731
    if params.temperature == 0:
        return lambda token, cache: greedy(token, cache, vocab=limit, penalty=pen and pen())
    if not 0 <= params.top_k <= getattr(model, "sample_max_k", 0):  # 0: top-k off
        return None
    # the device draws with uniforms from a stream of its own (the host's sampler took the first token)
    rng = np.random.default_rng(None if params.seed is None else [params.seed, 1])
    t, k, p, m = params.temperature, params.top_k, params.top_p, params.min_p
    return lambda token, cache: sample(
        token, cache, t, k, p, float(rng.random()), min_p=m, vocab=limit, penalty=pen and pen()
    )


def generate(
    model, tokenizer: Tokenizer, prompt_ids: Sequence[int], cache: KVCache, params: GenerationParams
) -> Iterator[GenerationEvent]:
    """Stream a reply to prompt_ids, reusing whatever prefix of it the cache already holds.

    The cache ends up holding the prompt and every generated token except a final end-of-turn
    token, so the next turn of a chat reuses it.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    if len(prompt_ids) >= cache.n_ctx:
        raise ContextOverflowError(len(prompt_ids) + 1, cache.n_ctx)
    sample = make_sampler(params.temperature, params.top_k, params.top_p, params.min_p, params.seed)
    processors = []
    if params.repetition_penalty != 1.0:
        processors.append(repetition_penalty(params.repetition_penalty, params.repeat_last_n))
    stop_ids = tokenizer.eot_ids
    # After a turn marker the reply starts a new text (a SentencePiece prefix space is dropped); a
    # completion continues the prompt's text, so its first word keeps its space.
    decoder = reply_decoder(tokenizer, prompt_ids)
    matcher = _StopMatcher(params.stop)

    t0 = time.perf_counter()
    logits, reused = prefill(model, cache, prompt_ids, params.prefill_chunk)
    if len(logits) > tokenizer.vocab_size:
        # padded embedding rows (e.g. Qwen: 151936 rows, 151665 tokens) stand for no text: never sample them
        processors.insert(0, lambda tokens, logits: _mask_from(logits, tokenizer.vocab_size))
    t_prefill = time.perf_counter() - t0
    stats = GenerationEvent(
        text="",
        token=None,
        prompt_tokens=len(prompt_ids),
        cached_tokens=reused,
        ttft_s=t_prefill,
        prompt_tps=(len(prompt_ids) - reused) / t_prefill if t_prefill > 0 else 0.0,
    )
    history = list(prompt_ids)
    step = device_steps(model, params, len(logits), tokenizer.vocab_size, history)
    t_decode = time.perf_counter()
    finish = None
    picked = None  # the device step's pick (the first token is sampled here, from the prefill's logits)
    while finish is None:
        if picked is None:
            for process in processors:
                logits = process(history, logits)
            token = sample(logits)
        else:
            token = picked
        stats.generated_tokens += 1
        if token in stop_ids:
            finish = "stop"
            text = ""
        else:
            history.append(token)
            text = decoder.push(token)
        text, stopped = matcher.feed(text)
        if stopped:
            finish = "stop"
        elif finish is None and stats.generated_tokens >= params.max_tokens:
            finish = "length"
        elif finish is None and cache.offset >= cache.n_ctx:
            finish = "context"
        if finish is None and step is not None:
            picked = step(token, cache)
        elif finish is None:
            logits = model.forward([token], cache)[-1]
        elif not stopped:
            # the reply ends here: release what the decoder and the stop matcher held back
            tail, stopped = matcher.feed(decoder.flush())
            text += tail if stopped else tail + matcher.flush()
        elapsed = time.perf_counter() - t_decode
        yield GenerationEvent(
            text=text,
            token=token,
            finish_reason=finish,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_tokens,
            generated_tokens=stats.generated_tokens,
            ttft_s=stats.ttft_s,
            prompt_tps=stats.prompt_tps,
            # the first token came from the prefill pass; rate the decode passes only
            generation_tps=(stats.generated_tokens - 1) / elapsed
            if stats.generated_tokens > 1 and elapsed
            else 0.0,
            peak_memory_mb=peak_rss_mb() if finish else 0.0,
        )
