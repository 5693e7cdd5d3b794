"""Prefix store: radix-tree bookkeeping on small arrays, then reuse across chats on SmolLM2 (greedy)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.client import LoadOptions
from engine.generate import GenerationParams
from engine.kv_cache import KVCache
from engine.prefix_cache import PrefixCache

L, H, D = 2, 1, 4
PER_TOKEN = 2 * L * H * D * 4  # bytes of k and v per position


def _filled(tokens: list[int], n_ctx: int = 64) -> KVCache:
    """A cache holding `tokens` whose k/v values encode (token, position) so copies can be checked."""
    cache = KVCache(L, H, D, n_ctx)
    for pos, tok in enumerate(tokens):
        cache.k[:, :, pos, :] = tok * 1000 + pos
        cache.v[:, :, pos, :] = -(tok * 1000 + pos)
    cache.advance(tokens)
    return cache


def test_restore_copies_only_the_missing_positions():
    store = PrefixCache(1 << 20)
    a = [1, 2, 3, 4, 5, 6]
    store.insert(_filled(a))
    assert store.nbytes == len(a) * PER_TOKEN
    live = _filled([1, 2, 9])
    live.k[:, :, 0, :] = 7.0  # a marker: position 0 already matches and must not be rewritten
    assert store.restore([1, 2, 3, 4, 8], live) == 4
    assert live.tokens == [1, 2, 3, 4]
    assert np.all(live.k[:, :, 0, :] == 7.0)
    for pos, tok in enumerate(a[:4]):
        if pos:
            assert np.all(live.k[:, :, pos, :] == tok * 1000 + pos)
            assert np.all(live.v[:, :, pos, :] == -(tok * 1000 + pos))


def test_shared_prefix_is_stored_once_and_split_correctly():
    store = PrefixCache(1 << 20)
    store.insert(_filled([1, 2, 3, 4]))
    store.insert(_filled([1, 2, 7, 8, 9]))
    assert store.nbytes == 7 * PER_TOKEN  # [1,2] shared, [3,4] and [7,8,9] branches
    assert store.n_tokens == 7
    assert store.match([1, 2, 3, 4, 5]) == 4
    assert store.match([1, 2, 7, 8]) == 4
    assert store.match([5]) == 0
    live = KVCache(L, H, D, 64)
    assert store.restore([1, 2, 7, 8, 9, 10], live) == 5
    assert np.all(live.k[:, :, 4, :] == 9 * 1000 + 4)


def test_stored_sequence_follows_the_match_then_the_latest_branch():
    store = PrefixCache(1 << 20)
    store.insert(_filled([1, 2, 3, 4]))
    store.insert(_filled([1, 2, 3, 4, 5, 6]))
    store.insert(_filled([1, 2, 7, 8, 9]))
    assert store.stored_sequence([5, 1]) == []
    # parts inside the edge [3, 4, 5, 6]: the rest of that edge
    assert store.stored_sequence([1, 2, 3, 0]) == [1, 2, 3, 4, 5, 6]
    # parts at the fork after [1, 2]: the branch used last
    assert store.stored_sequence([1, 2, 0]) == [1, 2, 7, 8, 9]
    store.restore([1, 2, 3, 4], KVCache(L, H, D, 64))  # touches the [3, 4] branch
    assert store.stored_sequence([1, 2, 0]) == [1, 2, 3, 4, 5, 6]
    assert store.stored_sequence([1, 2, 7, 8, 9, 10]) == [1, 2, 7, 8, 9]


def test_lru_eviction_respects_the_byte_budget():
    store = PrefixCache(10 * PER_TOKEN)
    store.insert(_filled([1, 1, 1, 1]))
    store.insert(_filled([2, 2, 2, 2]))
    store.match([1, 1])  # a lookup alone does not count as use; a restore does
    store.restore([1, 1, 1, 1], KVCache(L, H, D, 64))
    store.insert(_filled([3, 3, 3, 3]))  # over budget: the least recently used ([2,...]) goes
    assert store.nbytes <= 10 * PER_TOKEN
    assert store.match([2, 2, 2, 2]) == 0
    assert store.match([1, 1, 1, 1]) == 4
    assert store.match([3, 3, 3, 3]) == 4


def test_state_larger_than_budget_keeps_its_beginning():
    store = PrefixCache(3 * PER_TOKEN)
    store.insert(_filled([5, 6, 7, 8, 9]))
    assert store.match([5, 6, 7, 8, 9]) == 3
    assert store.nbytes == 3 * PER_TOKEN
    assert PrefixCache(0).insert(_filled([1])) == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from engine.worker import ChatRunner

    return ChatRunner.load(smollm2_path, LoadOptions(n_ctx=1024, batch_size=64, prefix_cache_mb=64))


def _reply(runner, messages, **kw):
    tokens, last = [], None
    for event in runner.chat(messages, GenerationParams(max_tokens=12, temperature=0.0), **kw):
        if event.token is not None:
            tokens.append(event.token)
        last = event
    text = runner.lm.tokenizer.decode([t for t in tokens if t not in runner.lm.tokenizer.eot_ids])
    return tokens, text, last


def test_switching_chats_restores_from_the_store_and_matches_a_cold_run(runner):
    chat_a = [{"role": "user", "content": "Name three rivers in Europe."}]
    chat_b = [{"role": "user", "content": "What is the boiling point of water at sea level?"}]
    _, reply_a, first = _reply(runner, chat_a)
    assert first.cached_tokens == 0 and first.to_prefill == first.prompt_tokens
    _reply(runner, chat_b)  # the live cache now holds chat B
    chat_a += [{"role": "assistant", "content": reply_a}, {"role": "user", "content": "Which is longest?"}]
    warm_tokens, _, warm = _reply(runner, chat_a)
    # chat A's first turn (prompt and reply) came back from the store, not from a re-prefill;
    # the live cache still held the part chat B shares (the template's default system prompt)
    assert warm.cached_tokens == first.context_after
    assert warm.restored_tokens > 0
    assert warm.to_prefill == warm.prompt_tokens - first.context_after
    print(f"\nswitch back: {warm.restored_tokens} restored, {warm.to_prefill}/{warm.prompt_tokens} prefilled")
    cold_tokens, _, cold = _reply(runner, chat_a, reuse=False)
    assert cold.cached_tokens == 0 and cold.to_prefill == cold.prompt_tokens
    assert warm_tokens == cold_tokens
