import mmap

import numpy as np
import pytest

from engine.errors import ContextOverflowError
from engine.kv_cache import KVCache, RecurrentKVCache


def test_update_trim_and_prefix():
    cache = KVCache(n_layers=2, n_kv_heads=3, head_dim=4, n_ctx=8)
    k = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    kc, vc = cache.update_and_fetch(1, k, -k)
    cache.advance([5, 6])
    assert cache.offset == 2
    np.testing.assert_array_equal(kc[:, :2, :], k.transpose(1, 0, 2))
    np.testing.assert_array_equal(vc[:, :2, :], -k.transpose(1, 0, 2))
    assert cache.common_prefix([5, 6, 7]) == 2
    assert cache.common_prefix([5, 9]) == 1
    assert cache.trim(5) == 2 and cache.offset == 0


def test_overflow_is_typed():
    cache = KVCache(1, 1, 2, n_ctx=4)
    cache.advance([1, 2, 3])
    cache.check_room(1)
    with pytest.raises(ContextOverflowError, match="needs 5 tokens but the context holds 4"):
        cache.check_room(2)


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="Linux-only memory advice")
def test_memory_is_committed_per_position_not_per_context():
    from engine.memory import rss_mb

    before = rss_mb()
    cache = KVCache(n_layers=30, n_kv_heads=3, head_dim=64, n_ctx=8192)  # 377 MiB if fully committed
    one = np.ones((1, 3, 64), np.float32)
    for layer in range(30):
        cache.update_and_fetch(layer, one, one)
    cache.advance([1])
    assert rss_mb() - before < 32
    assert cache.k[0, 0, 0, 0] == 1.0 and cache.k[0, 0, 1, 0] == 0.0


def test_recurrent_snapshots_stay_within_their_slots_and_return_exact_states():
    """Past MAX_SNAPSHOTS a new snapshot takes the oldest one's arrays, after a trim the dropped ones':
    never more than MAX_SNAPSHOTS state copies exist (state_nbytes), and each trim lands on the state its
    snapshot saw."""
    cache = RecurrentKVCache(1, 1, 4, 64, np.float32, 2, (3, 4), (2, 5))
    n = RecurrentKVCache.MAX_SNAPSHOTS
    arrays = set()
    for step in range(1, n + 4):
        cache.advance([step] * 3)
        cache.recurrent[:] = step
        cache.conv_state[:] = -step
        cache.snapshot()
        arrays |= {id(a) for pair in cache._snapshots.values() for a in pair}
        assert len(cache._snapshots) == min(step, n)
    assert len(arrays) == 2 * n  # the copies made, recurrent and conv each: no more than the slots
    assert sorted(cache._snapshots) == [3 * s for s in range(4, n + 4)]
    assert cache.trim(5) == 6 and cache.offset == 3 * (n + 1)  # back to the snapshot two passes ago
    assert (cache.recurrent == n + 1).all() and (cache.conv_state == -(n + 1)).all()
    cache.advance([0] * 2)
    cache.recurrent[:] = 50
    cache.snapshot()  # into a dropped snapshot's arrays
    assert {id(a) for pair in cache._snapshots.values() for a in pair} <= arrays
    assert cache.trim(1) == 2 and (cache.recurrent == n + 1).all()
    cache.recurrent[:] = 7
    assert cache.trim(cache.offset) == 3 * (n + 1) and (cache.recurrent == 0).all() and cache.offset == 0


def test_recurrent_passes_keep_their_end_minus_one_and_turn_boundaries_outlive_chunks():
    """A pass keeps the state one token before its end (the recurrent layers run the last row apart) and the
    one at its start, unless it continues the previous pass; at MAX_SNAPSHOTS the snapshots inside a prompt
    go first, so a prompt of many chunks keeps the turn boundaries before it, within the same copies."""
    cache = RecurrentKVCache(1, 1, 4, 256, np.float32, 2, (3,), (2,))
    arrays = set()

    def run(rows, conv_state, state):  # states that count the tokens seen
        state += len(rows[0])
        conv_state -= len(rows[0])
        return np.zeros((len(rows[0]), 1), np.float32)

    def forward(n: int) -> None:
        if n > 1:
            cache.start_pass(n)
        for slot in range(2):
            assert len(cache.mix(slot, run, [np.zeros((n, 5), np.float32)])) == n
        cache.advance([0] * n)
        if n > 1:
            cache.end_pass()
        arrays.update(id(a) for pair in cache._snapshots.values() for a in pair)

    forward(8)  # a first prompt, then its reply
    for _ in range(3):
        forward(1)
    assert sorted(cache._snapshots) == [7]
    for _ in range(10):  # the next prompt in ten chunks: it starts at the reply's end
        forward(4)
    assert sorted(cache._snapshots) == [7, 11, 38, 42, 46, 50]
    assert len(arrays) == 2 * RecurrentKVCache.MAX_SNAPSHOTS
    for pos, (state, conv) in cache._snapshots.items():
        assert (state == pos).all() and (conv == -pos).all()
    assert cache.trim(cache.offset - 12) == 40 and (cache.recurrent == 11).all()  # an edit of that prompt
    assert cache.trim(cache.offset - 9) == 4 and (cache.recurrent == 7).all()  # the first one regenerated
