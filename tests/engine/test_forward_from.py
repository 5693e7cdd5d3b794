"""Decoder.forward_from (the CPU half of partial GPU offload): layers k.. from the residual stream.

The first k layers run through a copy of the model cut to k layers (its own cache of k layers);
their residual stream handed to forward_from with a cache of the remaining layers must give the
whole model's logits, for prefill and for the decode steps after it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from engine.arch.base import Scratch
from engine.kv_cache import KVCache
from engine.loader import load_model
from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf


def _tiny_model(tmp_path, family: str):
    path = tmp_path / f"{family}.gguf"
    if family == "gemma3":
        write_tiny_gemma3(path, TinyGemmaSpec(matrix_type=T.Q8_0))
    else:
        write_tiny_gguf(path, TinySpec(matrix_type=T.Q8_0, layers=3))
    return load_model(path).model


def _head_hidden(model, k: int, tokens, cache) -> np.ndarray:
    """Residual stream after the first k layers, caching their k/v in `cache` (k layers)."""
    head = copy.copy(model)
    head.layers = model.layers[:k]
    s = Scratch(model.cfg, len(tokens))
    pos0 = cache.offset
    s.positions[:] = np.arange(pos0, pos0 + len(tokens))
    gemma = hasattr(model, "_attend")

    def attend(i, attn3, q3, k3, v3, window=None):
        kc, vc = cache.update_and_fetch(i, k3, v3)
        if gemma:
            model._attend(attn3, q3, kc, vc, pos0, window)
        else:
            from engine.backends import cpu

            cpu.attention(attn3, q3, kc, vc, pos0, model.scale)

    head._layers(s, np.asarray(tokens, np.int64), attend)
    cache.advance(tokens)
    return s.x.copy()


@pytest.mark.parametrize("family, k", [("llama", 1), ("gemma3", 2), ("gemma3", 5)])
def test_forward_from_continues_the_first_layers(tmp_path, family, k):
    model = _tiny_model(tmp_path, family)
    cfg = model.cfg
    full = model.new_cache(64)
    head = KVCache(k, cfg.num_key_value_heads, cfg.head_dim, 64)
    tail = KVCache(cfg.num_hidden_layers - k, cfg.num_key_value_heads, cfg.head_dim, 64)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    want = model.forward(prompt, full, all_logits=True).copy()
    got = model.forward_from(k, _head_hidden(model, k, prompt, head), prompt, tail, all_logits=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    token = int(np.argmax(want[-1]))
    for _ in range(3):
        want = model.forward([token], full).copy()
        got = model.forward_from(k, _head_hidden(model, k, [token], head), [token], tail)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        token = int(np.argmax(want[-1]))
    assert tail.tokens == full.tokens


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_forward_batch_from_continues_the_first_layers(tmp_path, family):
    model = _tiny_model(tmp_path, family)
    cfg, k = model.cfg, 2
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    fulls = [model.new_cache(64) for _ in prompts]
    heads = [KVCache(k, cfg.num_key_value_heads, cfg.head_dim, 64) for _ in prompts]
    tails = [KVCache(cfg.num_hidden_layers - k, cfg.num_key_value_heads, cfg.head_dim, 64) for _ in prompts]
    for p, f, h, t in zip(prompts, fulls, heads, tails):
        model.forward(p, f)
        model.forward_from(k, _head_hidden(model, k, p, h), p, t)
    want = model.forward_batch([9, 10], fulls).copy()
    hidden = np.concatenate([_head_hidden(model, k, [tok], h) for tok, h in zip([9, 10], heads)])
    got = model.forward_batch_from(k, hidden, [9, 10], tails)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [t.tokens for t in tails] == [f.tokens for f in fulls]
