"""The server's scheduler with image ids in prompts: prefill passes and reused prefixes never cut an image.

A fake model carries an ImageTable (engine.vision.tokens) and checks every pass as Gemma 3's forward does
(ImageTable.key_ends refuses a pass that holds part of an image); its logits are zeros. The tokenizer is the
tiny Gemma 3 fixture's, so the engine's sampling, decoding and respelling run for real.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.kv_cache import KVCache
from engine.server.scheduler import Delta, Engine, SeqParams
from engine.vision.tokens import ImageTable

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"
SPAN = 6


class FakeModel:
    """forward / forward_batch over real KV caches (nothing computed), with image ids past the vocabulary."""

    def __init__(self, vocab: int):
        self.cfg = SimpleNamespace(vocab_size=vocab)
        self.images = ImageTable(vocab, hidden=2, bidirectional=True)  # Gemma 3's kind: images whole
        for k in range(4):
            self.images.add(f"image {k}", np.zeros((SPAN, 2), np.float32))
        self.passes: list[list[int]] = []
        self.fail_on: int | None = None  # a token whose pass raises (an image the table no longer holds)

    def image(self, slot: int) -> list[int]:
        return self.images.ids(slot)

    def new_cache(self, n_ctx: int, dtype=np.float32) -> KVCache:
        return KVCache(1, 1, 2, n_ctx, dtype)

    def forward(self, tokens, cache: KVCache) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        self.images.key_ends(tokens, cache.offset)  # ValueError: a pass holding part of an image
        if self.fail_on is not None and self.fail_on in tokens:
            raise KeyError(f"image {self.fail_on} is no longer held")
        self.passes.append(tokens.tolist())
        cache.advance(tokens)
        return np.zeros((len(tokens), self.cfg.vocab_size), np.float32)

    def forward_batch(self, tokens, caches) -> np.ndarray:
        time.sleep(0.002)  # a decode step takes time, so replies overlap
        for t, cache in zip(tokens, caches):
            cache.advance([t])
        return np.zeros((len(tokens), self.cfg.vocab_size), np.float32)


@pytest.fixture(scope="module")
def tokenizer():
    from engine.loader import load_model

    return load_model(TINY / "gemma3").tokenizer


@pytest.fixture
def model(tokenizer):
    return FakeModel(tokenizer.vocab_size)


@pytest.fixture
def text(tokenizer):
    """Ordinary (not special) token ids of a sentence."""
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog and runs", add_special=False)
    assert len(ids) >= 12 and not any(tokenizer.is_special(t) for t in ids)
    return ids


def run(engine: Engine, prompt: list[int], **params) -> list[Delta]:
    """Submit one request and wait for its last Delta."""
    got: queue.Queue[Delta] = queue.Queue()
    engine.submit(SeqParams(prompt_ids=list(prompt), max_tokens=params.pop("max_tokens", 1), temperature=0,
                            **params), got.put)
    deltas = []
    while True:
        d = got.get(timeout=30)
        deltas.append(d)
        if d.finish_reason is not None or d.error is not None:
            return deltas


@pytest.fixture
def engine_of(model, tokenizer):
    engines = []

    def make(prefill_chunk: int = 4, free: list[KVCache] = (), stored: list[KVCache] = ()) -> Engine:
        e = Engine(model, tokenizer, n_ctx=128, max_seqs=4, prefill_chunk=prefill_chunk,
                   prefix_cache_bytes=1 << 20)
        e._free.extend(free)
        for cache in stored:
            e.store.insert(cache)
        e.start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()


def test_prefill_passes_end_at_image_edges(model, engine_of, text):
    a, b = model.image(0), model.image(1)
    prompt = text[:5] + a + b + text[5:8]
    engine = engine_of(prefill_chunk=4)
    last = run(engine, prompt)[-1]
    assert last.error is None and last.finish_reason == "length"
    # 4 text; the 5th alone (4 more would cut image a); a whole (an image starting a pass outgrows the
    # chunk); b whole; the rest
    assert model.passes == [text[:4], text[4:5], a, b, text[5:8]]


def test_a_prompt_ending_in_an_image_recomputes_the_whole_image(model, engine_of, text):
    prompt = text[:3] + model.image(0)
    engine = engine_of(prefill_chunk=64)
    assert run(engine, prompt)[-1].error is None
    model.passes.clear()
    # the same prompt again: its cache is free and holds it all, but the last token is always recomputed
    # (its logits give the reply's first token), and that token is inside the image
    last = run(engine, prompt)[-1]
    assert last.error is None and last.cached_tokens == 3
    assert model.passes == [model.image(0)]


@pytest.mark.parametrize("where", ["free cache", "prefix store"])
def test_a_held_prefix_that_ends_inside_an_image_is_cut_back_to_its_start(model, engine_of, text, where):
    prompt = text[:3] + model.image(0) + text[3:6]
    held = model.new_cache(128)
    held.advance(prompt[:5])  # as if a pass had stopped two rows into the image
    engine = engine_of(prefill_chunk=64, **{"free" if where == "free cache" else "stored": [held]})
    last = run(engine, prompt)[-1]
    assert last.error is None and last.cached_tokens == 3
    assert model.passes == [prompt[3:]]


def test_respelling_stops_at_an_image(model, engine_of, text, tokenizer):
    # a chat's next prompt parts from the held tokens just before an image: the respelling compares the
    # text runs after that point, which must end at the image instead of reading its ids as text
    held_ids = text[:4] + model.image(0) + text[4:6]
    held = model.new_cache(128)
    held.advance(held_ids)
    prompt = text[:2] + text[6:8] + model.image(1) + text[8:10]
    engine = engine_of(prefill_chunk=64, free=[held])
    last = run(engine, prompt, respell=True)[-1]
    assert last.error is None and last.cached_tokens == 2
    assert model.passes == [prompt[2:]]


def test_a_failing_prompt_fails_alone(model, engine_of, text):
    engine = engine_of(prefill_chunk=64)
    got: queue.Queue[Delta] = queue.Queue()
    engine.submit(SeqParams(prompt_ids=text[:3], max_tokens=100, temperature=0, ignore_eos=True), got.put)
    assert got.get(timeout=30).error is None  # decoding
    model.fail_on = model.image(3)[0]
    last = run(engine, text[:2] + model.image(3) + text[2:4])[-1]
    assert last.error is not None and last.error.status == 500 and "no longer held" in last.error.message
    deltas = [got.get(timeout=30)]
    while deltas[-1].finish_reason is None:
        deltas.append(got.get(timeout=30))
    assert all(d.error is None for d in deltas) and deltas[-1].finish_reason == "length"
    assert deltas[-1].generated_tokens == 100


def test_a_request_whose_reuse_fails_is_answered(model, engine_of, text, monkeypatch):
    engine = engine_of()

    def broken(seq):
        raise RuntimeError("unreadable prompt")

    monkeypatch.setattr(engine, "_respell", broken)
    last = run(engine, text[:4], respell=True)[-1]
    assert last.error is not None and "unreadable prompt" in last.error.message
    assert run(engine, text[:4])[-1].error is None  # the engine goes on


def test_a_requests_release_is_called_once_when_its_prompt_is_read(model, engine_of, text):
    engine = engine_of(prefill_chunk=4)
    calls = []
    got: queue.Queue[Delta] = queue.Queue()
    engine.submit(SeqParams(prompt_ids=text[:2] + model.image(0) + text[2:4], max_tokens=100, temperature=0,
                            ignore_eos=True, release=lambda: calls.append("released")), got.put)
    assert got.get(timeout=30).error is None  # the first reply token: the prompt is read
    assert calls == ["released"]  # before the reply ends (its keys and values hold the image now)
    deltas = [got.get(timeout=30)]
    while deltas[-1].finish_reason is None:
        deltas.append(got.get(timeout=30))
    assert calls == ["released"]


@pytest.mark.parametrize("how", ["timed out waiting", "failed prefill", "grammar refused", "server stopping"])
def test_a_requests_release_is_called_when_it_ends_unread(model, engine_of, text, how):
    from engine.server.errors import APIError

    engine = engine_of(prefill_chunk=64)
    calls = []
    prompt = text[:2] + model.image(3) + text[2:4]
    params = dict(max_tokens=2, release=lambda: calls.append(1))
    if how in ("grammar refused", "server stopping"):
        if how == "server stopping":
            engine.stop()
        else:
            params["grammar"] = "this is no grammar {"
        with pytest.raises(APIError):
            engine.submit(SeqParams(prompt_ids=prompt, **params), lambda d: None)
    else:
        if how == "failed prefill":
            model.fail_on = model.image(3)[0]
        else:
            params["timeout_s"] = 0.0  # past its deadline when the engine admits it
        last = run(engine, prompt, **params)[-1]
        assert last.error is not None and last.error.status == (500 if how == "failed prefill" else 504)
        assert not model.passes or how == "failed prefill"
    assert calls == [1]
