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
