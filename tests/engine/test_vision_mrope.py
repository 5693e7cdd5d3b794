"""M-RoPE positions kept with the cache (engine.vision.qwen35.MRopeTrack, KVCache.track): every pass's
positions equal a scan of the whole history (Qwen35ImageTable.positions) after prefill in passes that cut
images, decode steps, trims into and past images, a reused cache's next turn, a restored stored prefix and
batched decode; a decode step never reads the history."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.generate import prefill
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.prefix_cache import PrefixCache
from engine.vision import encode_with_images, prepare_messages
from engine.vision.qwen35 import MRopeTrack

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
FOLDERS = {"qwen3_5": TINY / "qwen3_5-vision", "qwen3_vl": TINY / "qwen3_vl-vision"}


def golden_prompt(lm, folder: Path) -> list[int]:
    """The ids of a vision fixture's golden prompt (its golden_vision.json messages with their images)."""
    golden = json.loads((folder / "golden_vision.json").read_text())
    images = iter((folder / n).read_bytes() for n in golden["images"])
    messages = [dict(m) for m in golden["messages"]]
    messages[-1]["content"] = [
        {"type": "image", "image": next(images)} if part["type"] == "image" else part
        for part in messages[-1]["content"]
    ]
    template_messages, data = prepare_messages(lm, messages)
    text = lm.template.render(template_messages, add_generation_prompt=True)
    return list(encode_with_images(lm, text, data))


def _load(name: str):
    """The model of FOLDERS[name] and its golden prompt's ids (two images of 4 x 6 and 7 x 4 rows)."""
    lm = load_model(FOLDERS[name])
    return lm.model, golden_prompt(lm, FOLDERS[name])


@pytest.fixture(scope="module")
def q35():
    return _load("qwen3_5")


@pytest.fixture(scope="module")
def q3vl():
    return _load("qwen3_vl")


def _checked(model, monkeypatch) -> list[int]:
    """Make every pass check its positions against a scan of its cache's history; returns the pass sizes."""
    table, passes = model.images, []
    kept = table.cache_positions

    def cache_positions(cache, ids):
        got = kept(cache, ids)
        np.testing.assert_array_equal(got, table.positions(cache.tokens, ids))
        passes.append(len(ids))
        return got

    monkeypatch.setattr(table, "cache_positions", cache_positions)
    return passes


def _next_text_matches(model, cache) -> None:
    """The offset the track holds (made now if the cache has none) is the scan's for a text token appended
    now."""
    np.testing.assert_array_equal(model.images.cache_positions(cache, [5]),
                                  model.images.positions(cache.tokens, [5]))
    assert isinstance(cache.track, MRopeTrack)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_vl"])
def test_positions_follow_prefill_decode_trim_and_a_second_turn(name, q35, q3vl, monkeypatch):
    model, ids = q35 if name == "qwen3_5" else q3vl
    passes = _checked(model, monkeypatch)
    (a0, a1), (b0, b1) = model.images.runs(np.array(ids))
    cache = model.new_cache(256)
    prefill(model, cache, ids, 7)  # passes that cut both images
    for t in (5, 9, 11):
        model.forward([t], cache)
    _next_text_matches(model, cache)
    # into the second image (a DeltaNet model's cache steps back to a pass's start), then past both
    for keep in (b0 + 5, a0 + 3, a1 + 2):
        cache.trim(cache.offset - keep)
        assert cache.offset <= keep
        _next_text_matches(model, cache)
        prefill(model, cache, ids[cache.offset :], 5)
        model.forward([7], cache)
        _next_text_matches(model, cache)
    # a second turn: the cache reused up to its common prefix with a longer prompt
    turn2 = ids + [7, 8, 9] + ids[a0:a1] + [12, 13]
    cache.trim(cache.offset - cache.common_prefix(turn2))
    prefill(model, cache, turn2[cache.offset :], 9)
    model.forward([4], cache)
    _next_text_matches(model, cache)
    assert passes and 1 in passes


def test_positions_after_a_restored_prefix_and_in_batched_decode(q3vl, monkeypatch):
    model, ids = q3vl
    passes = _checked(model, monkeypatch)
    (a0, a1), (b0, b1) = model.images.runs(np.array(ids))
    store = PrefixCache(64 << 20)
    cache = model.new_cache(256)
    prefill(model, cache, ids, 256)
    store.insert(cache)
    live = model.new_cache(256)
    prefill(model, live, ids[: a1 + 4], 256)  # its own track, then the stored rest copied in after a trim
    assert store.restore(ids[: b0 + 10] + [3, 4], live) == b0 + 10
    _next_text_matches(model, live)
    fresh = model.new_cache(256)  # no track yet: made from one scan of what the store put there
    assert store.restore(ids, fresh) == len(ids)
    _next_text_matches(model, fresh)
    text = model.new_cache(256)
    prefill(model, text, [5, 6, 7], 256)
    n = len(passes)
    for step in range(3):
        model.forward_batch([5 + step, 9, 11], [live, fresh, text])
    assert len(passes) == n + 9  # each sequence's decode position from its own cache
    for c in (live, fresh, text):
        _next_text_matches(model, c)


def test_a_decode_step_does_not_read_the_history(q35, monkeypatch):
    model, ids = q35
    cache = model.new_cache(256)
    prefill(model, cache, ids, 256)
    model.forward([5], cache)
    reads = []
    tokens = KVCache.tokens

    def counted(self):
        reads.append(self)
        return tokens.fget(self)

    monkeypatch.setattr(KVCache, "tokens", property(counted))
    for t in (5, 6, 7):
        model.forward([t], cache)
    other = model.new_cache(256)
    other.advance([1, 2])
    model.forward_batch([8, 9], [cache, other])  # `other` gets its track from one scan, `cache` keeps its own
    assert reads == [other]
