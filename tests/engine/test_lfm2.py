"""LFM2 (Liquid): gated short convolutions in place of attention in most layers; LFM2-MoE adds experts.

The fixtures (tests/fixtures/tiny/lfm2 and lfm2moe, scripts/make_tiny_checkpoints.py) have layers conv,
attention, conv, conv; test_hf_repo checks their logits and greedy tokens against transformers. Here: the
cache that keeps each convolution layer's inputs per position (chunked prefill, trim, restored prefixes,
float16, batched decode, speculation), llama.cpp's GGUF layout, memory estimates, and what declines it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.kv_cache import ShortConvKVCache
from engine.loader import load_model
from engine.prefix_cache import PrefixCache
from tests.engine.model_checks import check_batched_decode, check_speculation_keeps_greedy, chunked_logits

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
GOLDEN = json.loads((TINY / "lfm2" / "golden.json").read_text())
TOKENS = GOLDEN["tokens"]
REF = np.array(GOLDEN["logits"])


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY / "lfm2")


def _tol(logits: np.ndarray) -> float:
    return 1e-4 * max(1.0, float(np.abs(logits).max()))


def test_config_and_cache_layout(lm):
    cfg = lm.model.cfg
    assert cfg.layer_types == ("conv", "full_attention", "conv", "conv") and cfg.conv_taps == 3
    assert cfg.intermediate_size == 64  # 2/3 of 96, rounded up to a multiple of 32
    assert [cfg.cache_slot(i) for i in range(4)] == [0, 0, 1, 2]
    cache = lm.model.new_cache(32)
    assert isinstance(cache, ShortConvKVCache)
    assert cache.k.shape == (1, 2, 32, 16) and cache.conv.shape == (3, 1, 32, 64)
    # per token: one attention layer's keys and values, three layers' 64-wide convolution inputs
    assert cache.bytes_per_token == (2 * 2 * 16 + 3 * 64) * 4


def test_prefill_in_chunks_matches_one_pass(lm):
    """Chunks cut the convolution's three-position window at every offset."""
    np.testing.assert_allclose(chunked_logits(lm.model, TOKENS, (5, 1, 2, 7, 1)), REF, atol=_tol(REF))


def test_trim_then_other_tokens_is_exact(lm):
    """Speculation's rollback and regenerate: trimming needs no convolution state restored."""
    m = lm.model
    cache = m.new_cache(32)
    m.forward(TOKENS, cache)
    cache.trim(6)
    other = [7, 300, 12]
    got = m.forward(other, cache, all_logits=True)
    fresh = m.new_cache(32)
    want = m.forward(TOKENS[:10] + other, fresh, all_logits=True)[10:]
    np.testing.assert_array_equal(got, want)


def test_restored_prefix_continues_exactly(lm):
    m = lm.model
    store = PrefixCache(1 << 20)
    cache = m.new_cache(32)
    m.forward(TOKENS[:12], cache)
    assert store.insert(cache) == 12 * cache.bytes_per_token
    fresh = m.new_cache(32)
    assert store.restore(TOKENS[:9] + [77, 78], fresh) == 9  # a branch that leaves the stored one
    np.testing.assert_array_equal(fresh.conv[:, :, :9], cache.conv[:, :, :9])
    got = m.forward(TOKENS[9:], fresh, all_logits=True)
    np.testing.assert_allclose(got, REF[9:], atol=_tol(REF))


def test_float16_cache_stays_close(lm):
    m = lm.model
    cache = m.new_cache(32, np.float16)
    assert cache.conv.dtype == np.float16
    logits = m.forward(TOKENS[:8], cache, all_logits=True)
    logits = np.concatenate([logits, *(m.forward([t], cache).copy() for t in TOKENS[8:])])
    assert np.abs(logits - REF).max() < 2e-2 * np.abs(REF).max()


def test_batched_decode_matches_one_sequence_at_a_time(lm):
    check_batched_decode(lm.model, ([5, 17, 42], [99, 3, 250, 77, 1], [8]), (8, 120, 33))


def test_speculation_with_rejections_keeps_greedy_output(lm):
    """Prompt lookup proposes continuations of a repeated prompt; the target rejects most of them, each
    rejection trims the cache, and the reply stays the plain greedy one."""
    events = check_speculation_keeps_greedy(lm.model, lm.tokenizer, TOKENS[:6] * 3)
    assert events[-1].drafted_tokens > events[-1].accepted_tokens  # some drafts were rejected


def test_gguf_in_llama_cpps_layout(lm, tmp_path):
    """Converted: llama.cpp's keys (KV heads per layer, 0 in the convolution layers; shortconv.l_cache) and
    names (shortconv.*, the final norm as token_embd_norm), the kernels (hidden, taps) in F32 whatever the
    format; the file runs as the folder does."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    out = convert(TINY / "lfm2", "F16", tmp_path / "lfm2.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert g.architecture == "lfm2"
    assert list(md["lfm2.attention.head_count_kv"]) == [0, 2, 0, 0]
    assert (md["lfm2.shortconv.l_cache"], md["lfm2.feed_forward_length"]) == (3, 64)
    conv = g.tensors["blk.0.shortconv.conv.weight"]
    assert conv.type_name == "F32" and tuple(conv.shape) == (64, 3)
    assert "token_embd_norm.weight" in g.tensors and "output_norm.weight" not in g.tensors
    assert "blk.0.attn_q.weight" not in g.tensors and "blk.1.attn_q_norm.weight" in g.tensors
    g.close()
    m = load_model(out).model
    assert m.cfg.layer_types == lm.model.cfg.layer_types
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True), REF, atol=1e-3 * 4.5)
    q4 = convert(TINY / "lfm2", "Q4_K_M", tmp_path / "q4.gguf").result.tensor_types
    assert q4["blk.0.shortconv.conv.weight"] == "F32"


def test_memory_estimates_count_the_convolution_inputs(lm, tmp_path):
    from engine.convert import convert
    from engine.memory_guard import kv_shape_from_config, kv_shape_from_gguf
    from models.fit import kv_bytes_per_token, kv_bytes_per_token_config

    per_token = lm.model.new_cache(8).bytes_per_token
    md = load_model(convert(TINY / "lfm2", "F16", tmp_path / "f16.gguf").output).metadata
    assert kv_shape_from_gguf(md).kv_bytes_per_token == per_token
    f16_per_token = lm.model.new_cache(8, np.float16).bytes_per_token
    assert kv_shape_from_gguf(md).kv_bytes_per_token_at(2) == f16_per_token
    assert kv_shape_from_config(lm.model.cfg).kv_bytes_per_token == per_token
    assert kv_bytes_per_token(md) == per_token
    assert kv_bytes_per_token_config(json.loads((TINY / "lfm2" / "config.json").read_text())) == per_token


def test_lfm2_pre_tokenizer_is_llama3s_split():
    from engine.tokenizer import _PRE_ALIASES

    assert _PRE_ALIASES["lfm2"] == _PRE_ALIASES["llama-bpe"]


def test_awq_and_the_fused_draft_step_decline(lm):
    from engine.backends.cpu.draft import DraftForward
    from engine.errors import UnsupportedArchitectureError
    from engine.quant.awq import pick_group
    from engine.quant.source import open_source

    assert DraftForward.build(lm.model) is None
    with open_source(TINY / "lfm2") as source, pytest.raises(UnsupportedArchitectureError, match="LFM2"):
        pick_group(source)


def test_lfm2_moe_gguf_and_batched_decode(tmp_path):
    """LFM2-MoE (LFM2-8B-A1B's layout: a dense first layer, then sigmoid-routed experts with a choice bias)
    as llama.cpp's lfm2moe GGUF, and the server's batched step over its convolution and expert layers."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = json.loads((TINY / "lfm2moe" / "golden.json").read_text())
    ref = np.array(golden["logits"])
    out = convert(TINY / "lfm2moe", "F16", tmp_path / "moe.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert list(md["lfm2moe.attention.head_count_kv"]) == [0, 2, 0, 0]
    assert md["lfm2moe.shortconv.l_cache"] == 3
    assert (md["lfm2moe.expert_gating_func"], md["lfm2moe.leading_dense_block_count"]) == (2, 1)
    assert (md["lfm2moe.expert_feed_forward_length"], md["lfm2moe.feed_forward_length"]) == (48, 96)
    assert g.tensors["blk.1.exp_probs_b.bias"].type_name == "F32"
    assert "blk.1.ffn_gate_exps.weight" in g.tensors
    g.close()
    m = load_model(out).model
    assert m.layers[0].moe is None and m.layers[1].moe.score_bias is not None and m.layers[0].conv is not None
    np.testing.assert_allclose(m.forward(golden["tokens"], m.new_cache(32), all_logits=True), ref,
                               atol=1e-3 * np.abs(ref).max())
    check_batched_decode(m, ([5, 17, 42], [99, 3, 250, 77, 1]), (8, 120))


def test_released_lfm2_config(tmp_path):
    """LFM2-1.2B's config.json as released (transformers 4.54's keys: block_ff_dim, full_attn_idxs, no
    layer_types or intermediate_size): 16 layers of which 6 attend, an FFN of 8192, and memory estimates that
    count 10 convolution layers."""
    from engine.hf_repo import config_from_hf
    from engine.memory_guard import kv_shape_from_config
    from models.fit import kv_bytes_per_token_config

    config = {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "block_auto_adjust_ff_dim": True,
        "block_dim": 2048, "block_ff_dim": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
        "conv_L_cache": 3, "conv_bias": False, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 2048,
        "max_position_embeddings": 128000, "norm_eps": 1e-05, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "rope_theta": 1000000.0, "vocab_size": 65536,
    }
    cfg = config_from_hf(tmp_path, config)
    assert cfg.intermediate_size == 8192 and cfg.n_conv_layers == 10 and cfg.rms_norm_eps == 1e-5
    assert [i for i in range(16) if not cfg.is_conv(i)] == [2, 5, 8, 10, 12, 14]
    assert cfg.rope_neox and cfg.rope_theta == 1e6 and cfg.conv_taps == 3
    per_token = (6 * 8 * 64 * 2 + 10 * 2048) * 4
    assert kv_shape_from_config(cfg).kv_bytes_per_token == per_token
    assert kv_bytes_per_token_config(config) == per_token
