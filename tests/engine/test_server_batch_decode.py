"""forward_batch: B sequences, each with its own cache and position, through one pass of the weights.

Checked against forward() run sequence by sequence: B == 1 is bit-identical (the same kernels),
B > 1 goes through the multi-row linear path and agrees to float32/quantization tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ContextOverflowError
from engine.loader import load_model
from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3
from tests.engine.tiny_models import T, TinySpec, write_tiny_gguf

PROMPTS = [[72, 101, 108], [108, 111, 44, 32, 119, 111, 114, 108, 100], [33], [10, 9, 200, 3, 77, 5]]
STEPS = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]

MODELS = {
    "llama-f32": lambda p: write_tiny_gguf(p, TinySpec()),
    "llama-q4_1-gqa4": lambda p: write_tiny_gguf(
        p, TinySpec(matrix_type=T.Q4_1, heads=8, kv_heads=2, seed=6)
    ),
    "qwen2-bias-neox": lambda p: write_tiny_gguf(p, TinySpec(arch="qwen2", qkv_bias=True, seed=2, theta=1e6)),
    "gemma3-window3": lambda p: write_tiny_gemma3(p, TinyGemmaSpec(layers=4, pattern=2, window=3, seed=1)),
    "gemma3-softcaps": lambda p: write_tiny_gemma3(
        p, TinyGemmaSpec(pattern=2, layers=4, final_softcap=3.0, attn_softcap=2.0, seed=4)
    ),
}


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batched_steps_match_sequential_decode(name, tmp_path):
    path = tmp_path / f"{name}.gguf"
    MODELS[name](path)
    model = load_model(path).model
    tol = 3e-2 if "q4" in name else 1e-3

    ref_caches = [model.new_cache(64) for _ in PROMPTS]
    caches = [model.new_cache(64) for _ in PROMPTS]
    for prompt, ref, cache in zip(PROMPTS, ref_caches, caches):
        model.forward(prompt, ref)
        model.forward(prompt, cache)
    for step in range(3):
        tokens = [s[step] for s in STEPS]
        got = model.forward_batch(tokens, caches).copy()
        assert got.shape == (len(PROMPTS), model.cfg.vocab_size)
        for b, ref in enumerate(ref_caches):
            want = model.forward([tokens[b]], ref)[0]
            assert _rel_err(got[b], want) < tol, (name, step, b)
    for ref, cache in zip(ref_caches, caches):
        assert cache.tokens == ref.tokens
        n = cache.offset
        assert np.allclose(cache.k[:, :, :n], ref.k[:, :, :n], atol=1e-2 if "q4" in name else 1e-4)


@pytest.mark.parametrize("name", ["llama-q4_1-gqa4", "gemma3-window3"])
def test_batch_of_one_is_bit_identical_to_forward(name, tmp_path):
    path = tmp_path / f"{name}.gguf"
    MODELS[name](path)
    model = load_model(path).model
    a, b = model.new_cache(32), model.new_cache(32)
    model.forward(PROMPTS[1], a)
    model.forward(PROMPTS[1], b)
    for t in STEPS[0]:
        want = model.forward([t], a)[0].copy()
        got = model.forward_batch([t], [b])[0]
        assert np.array_equal(got, want)


def test_batch_rejects_shared_caches_mismatches_and_full_caches(tmp_path):
    path = tmp_path / "m.gguf"
    MODELS["llama-f32"](path)
    model = load_model(path).model
    c = model.new_cache(4)
    with pytest.raises(ValueError, match="own KV cache"):
        model.forward_batch([1, 2], [c, c])
    with pytest.raises(ValueError, match="2 tokens for 1 caches"):
        model.forward_batch([1, 2], [c])
    model.forward([1, 2, 3, 4], c)
    with pytest.raises(ContextOverflowError):
        model.forward_batch([1, 2], [c, model.new_cache(4)])
