import numpy as np
import pytest

from engine.errors import ContextOverflowError
from engine.kv_cache import KVCache


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
