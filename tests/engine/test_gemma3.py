"""Gemma 3 wiring on tiny random models, against a plain-numpy float64 reference (tiny_gemma3.py).

The window is 4 positions and the sequence 14 tokens, so sliding layers drop keys while global
layers keep them all; prefill, chunked prefill across the window edge, decode and trim all run.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch import model_class
from engine.arch.gemma3 import FULL, SLIDING, Gemma3Config, Gemma3Model
from engine.errors import MissingTensorError, ModelFormatError
from engine.loader import load_model
from tests.engine.tiny_gemma3 import T, TinyGemmaSpec, reference_logits, write_tiny_gemma3

TOKENS = [258, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]

SPECS = {
    "f32-default-pattern": TinyGemmaSpec(),  # 6 layers: 5 sliding + 1 global
    "pattern2-mha": TinyGemmaSpec(layers=4, pattern=2, kv_heads=4, window=3, seed=1),
    "gqa4-window5": TinyGemmaSpec(layers=6, heads=8, kv_heads=2, head_dim=16, window=5, seed=2),
    "rope-scaling-local-base": TinyGemmaSpec(pattern=3, rope_linear=4.0, local_theta=500.0, seed=3),
    "softcaps": TinyGemmaSpec(pattern=2, layers=4, final_softcap=3.0, attn_softcap=2.0, seed=4),
    "q8_0": TinyGemmaSpec(matrix_type=T.Q8_0, seed=5),
    "window-longer-than-text": TinyGemmaSpec(window=64, seed=6),
}


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _load(tmp_path, spec):
    path = tmp_path / "tiny-gemma3.gguf"
    stored = write_tiny_gemma3(path, spec)
    return load_model(path).model, reference_logits(spec, stored, TOKENS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_prefill_decode_and_chunks_match_reference(name, tmp_path):
    spec = SPECS[name]
    model, ref = _load(tmp_path, spec)
    assert isinstance(model, Gemma3Model)
    assert [t == SLIDING for t in model.cfg.layer_types] == [spec.sliding(i) for i in range(spec.layers)]

    cache = model.new_cache(32)
    got = model.forward(TOKENS, cache, all_logits=True)
    assert got.shape == ref.shape
    # up to 16 tokens run the small-batch kernels, which quantize activations to int16 per 32 for
    # block types (as the matvec does); longer prompts dequantize weights for BLAS
    exact = 1e-4 if spec.matrix_type == T.F32 else 5e-4
    assert _rel_err(got, ref) < exact, name
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))

    # decode one token at a time past the window (quantized activations for block types)
    tol = 1e-4 if spec.matrix_type == T.F32 else 3e-2
    cache = model.new_cache(32)
    model.forward(TOKENS[:2], cache)
    for i in range(2, len(TOKENS)):
        step = model.forward([TOKENS[i]], cache)[0]
        assert _rel_err(step, ref[i]) < tol, (name, i)

    # chunks that start inside, straddle and lie past the window
    cache = model.new_cache(32)
    chunks = []
    for a, b in ((0, 3), (3, 8), (8, 9), (9, 14)):
        chunks.append(model.forward(TOKENS[a:b], cache, all_logits=True).copy())
    assert _rel_err(np.concatenate(chunks), ref) < exact, name

    # trim and re-run the tail (what prefix reuse and regenerate do)
    cache.trim(6)
    again = model.forward(TOKENS[-6:], cache, all_logits=True)
    assert _rel_err(again, ref[-6:]) < exact
    assert cache.offset == len(TOKENS)


def test_window_really_drops_old_keys(tmp_path):
    """Changing a token older than the window changes global layers only: with every layer
    sliding (no global layer among 3 with period 6), the last position cannot see it."""
    spec = TinyGemmaSpec(layers=3, window=3)
    path = tmp_path / "m.gguf"
    write_tiny_gemma3(path, spec)
    model = load_model(path).model
    # three sliding layers of window 3 reach back 3 * 2 = 6 positions from the last token
    a = model.forward(TOKENS, model.new_cache(32), all_logits=True)[-1].copy()
    changed = [TOKENS[0], 200, *TOKENS[2:]]
    b = model.forward(changed, model.new_cache(32), all_logits=True)[-1]
    assert np.array_equal(a, b)
    c = model.forward([*TOKENS[:-3], 200, *TOKENS[-2:]], model.new_cache(32), all_logits=True)[-1]
    assert not np.allclose(a, c)


def test_registered_and_config_from_metadata():
    assert model_class("gemma3") is Gemma3Model
    meta = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": 640,
        "gemma3.feed_forward_length": 2048,
        "gemma3.block_count": 18,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512,
        "gemma3.context_length": 32768,
    }
    cfg = Gemma3Config.from_gguf(meta, vocab_size=262144)
    assert cfg.head_dim == 256 and cfg.q_dim == 1024 and cfg.kv_dim == 256 and cfg.n_rep == 4
    assert cfg.query_pre_attn_scalar == 256.0
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [5, 11, 17]
    assert cfg.rope_local_base_freq == 10000.0 and cfg.sliding_window == 512
    assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
    # 27B: query_pre_attn_scalar = hidden / heads, as in its HF config
    big = dict(meta)
    big.update({"gemma3.block_count": 62, "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32})
    assert Gemma3Config.from_gguf(big, vocab_size=8).query_pre_attn_scalar == 168.0
    per_layer = dict(meta, **{"gemma3.attention.sliding_window_pattern": [True, False] * 9})
    assert Gemma3Config.from_gguf(per_layer, vocab_size=8).layer_types[:3] == [SLIDING, FULL, SLIDING]
    with pytest.raises(ValueError, match="value_length"):
        Gemma3Config.from_gguf(dict(meta, **{"gemma3.attention.value_length": 128}), vocab_size=8)
    with pytest.raises(KeyError, match="feed_forward_length"):
        Gemma3Config.from_gguf({k: v for k, v in meta.items() if "feed_forward" not in k}, vocab_size=8)


def test_missing_gemma_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gemma3(path, TinyGemmaSpec(), omit=("blk.2.post_ffw_norm.weight",))
    with pytest.raises(MissingTensorError, match="blk.2.post_ffw_norm.weight"):
        load_model(path)


def test_missing_hyper_parameter_is_a_format_error(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_uint32("gemma3.block_count", 1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "c"])
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="gemma3"):
        load_model(path)
