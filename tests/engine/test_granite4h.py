"""Granite 4.0-H: Mamba-2 layers beside attention layers without positions (llama.cpp's granitehybrid).

The fixture (tests/fixtures/tiny/granite4-h, scripts/make_tiny_checkpoints.py) has three Mamba-2 layers (8
heads of 16 sharing 2 groups of B and C, a 4-tap convolution) and one attention layer; test_hf_repo checks its
logits and greedy tokens against transformers. Here: the state kept at the cache's end (chunked prefill, trims
to snapshots, chat turns, batched decode), llama.cpp's GGUF both ways, memory estimates and what declines it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.kv_cache import RecurrentKVCache
from engine.loader import load_model
from tests.engine.model_checks import (
    check_batched_decode,
    check_recurrent_regenerate_and_edit_reuse,
    check_recurrent_trims_and_chat_turns,
    chunked_logits,
)

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
GOLDEN = json.loads((TINY / "granite4-h" / "golden.json").read_text())
TOKENS = GOLDEN["tokens"]
REF = np.array(GOLDEN["logits"])
TOL = 1e-4 * np.abs(REF).max()


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY / "granite4-h")


def test_config_and_cache_layout(lm):
    cfg = lm.model.cfg
    assert cfg.architecture == "granitehybrid" and cfg.rope_layers == (False,) * 4
    assert [cfg.is_recurrent(i) for i in range(4)] == [True, False, True, True]
    shape = cfg.mamba
    sizes = (shape.heads, shape.head_dim, shape.state_size, shape.groups, shape.conv_dim)
    assert sizes == (8, 16, 16, 2, 192)
    cache = lm.model.new_cache(32)
    assert isinstance(cache, RecurrentKVCache) and not cache.partial_states
    assert cache.k.shape == (1, 2, 32, 16)
    assert cache.recurrent.shape == (3, 8, 16, 16) and cache.conv_state.shape == (3, 3, 192)


def test_prefill_in_chunks_matches_one_pass(lm):
    np.testing.assert_allclose(chunked_logits(lm.model, TOKENS, (5, 1, 2, 7, 1)), REF, atol=TOL)


def test_trim_steps_back_to_a_snapshot_and_chat_turns_match_a_fresh_cache(lm):
    check_recurrent_trims_and_chat_turns(lm.model, lm.tokenizer, TOKENS, REF, TOL)


def test_chunked_scan_matches_the_token_by_token_one():
    """A prompt's scan in chunks of matrix products (uneven last chunk, several groups) gives the outputs
    and end state of the token-by-token kernel."""
    from engine.arch import mamba2
    from engine.arch.mamba2 import MambaShape

    rng = np.random.default_rng(3)
    shape, n = MambaShape(heads=6, head_dim=8, state_size=12, groups=3, taps=4), mamba2.SCAN_CHUNK + 37
    x = rng.standard_normal((n, 48), dtype=np.float32)
    b, c = (rng.standard_normal((n, 36), dtype=np.float32) for _ in range(2))
    step = rng.random((n, 6), dtype=np.float32)
    neg_a, d = -np.exp(rng.standard_normal(6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    start = rng.standard_normal((6, 8, 12)).astype(np.float32)
    outs, states = [], []
    for scan in (mamba2._scan, mamba2._scan_chunked):
        y, state = np.empty((n, 48), np.float32), start.copy()
        scan(y, x, step, b, c, neg_a, d, state, shape.groups if scan is mamba2._scan else shape)
        outs.append(y)
        states.append(state)
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5 * np.abs(outs[0]).max())
    np.testing.assert_allclose(states[1], states[0], atol=1e-5 * np.abs(states[0]).max())


def test_regenerate_and_edits_reuse_the_snapshots_they_need(lm):
    check_recurrent_regenerate_and_edit_reuse(lm.model, lm.tokenizer, TOL)


def test_batched_decode_matches_one_sequence_at_a_time(lm):
    check_batched_decode(lm.model, ([5, 17, 42], [99, 3, 250, 77, 1], [8]), (8, 120, 33))


def test_memory_estimate_counts_the_fixed_state(lm):
    from engine.memory_guard import estimate, kv_shape_from_config

    shape = kv_shape_from_config(lm.model.cfg)
    cache = lm.model.new_cache(64)
    assert shape.kv_bytes_per_token == cache.bytes_per_token
    assert estimate(10 << 20, shape, 64, available=8 << 30).kv_bytes == 64 * cache.bytes_per_token + (
        cache.state_nbytes
    )


def test_gguf_in_llama_cpps_granitehybrid_layout(lm, tmp_path):
    """Converted as llama.cpp's convert_hf_to_gguf writes Granite 4.0-H: the ssm.* keys, KV heads per layer
    (0 in the Mamba-2 layers), no RoPE (rope.scaling.finetuned false), Granite's scales; A as -exp(A_log) and
    D as (heads, 1), the gated norm as (groups, d_inner / groups), the kernels F32, the shared MLP's gate and
    up split. The file runs as the folder does."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    out = convert(TINY / "granite4-h", "F16", tmp_path / "g.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert g.architecture == "granitehybrid"
    assert list(md["granitehybrid.attention.head_count_kv"]) == [0, 2, 0, 0]
    ssm = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")
    assert [md[f"granitehybrid.ssm.{k}"] for k in ssm] == [4, 16, 2, 8, 128]
    assert md["granitehybrid.rope.scaling.finetuned"] is False and md["granitehybrid.residual_scale"] == 0.5
    shapes = {n: (t.type_name, tuple(t.shape)) for n, t in g.tensors.items() if n.startswith("blk.0.")}
    assert shapes["blk.0.ssm_a"] == ("F32", (8, 1)) and shapes["blk.0.ssm_norm.weight"] == ("F32", (2, 64))
    assert shapes["blk.0.ssm_conv1d.weight"] == ("F32", (192, 4)) and "blk.0.ffn_gate.weight" in shapes
    from engine.memory_guard import kv_shape_from_gguf

    shape, cache = kv_shape_from_gguf(g.metadata), lm.model.new_cache(8)
    assert (shape.kv_bytes_per_token, shape.state_bytes) == (cache.bytes_per_token, cache.state_nbytes)
    from models.fit import kv_bytes_per_token, kv_bytes_per_token_config  # the library's fit estimate

    config = json.loads((TINY / "granite4-h" / "config.json").read_text())
    assert kv_bytes_per_token(g.metadata) == kv_bytes_per_token_config(config) == cache.bytes_per_token
    stored = np.asarray(g.tensors["blk.0.ssm_a"].array()).reshape(-1)
    np.testing.assert_allclose(stored, lm.model.layers[0].mamba.neg_a, rtol=1e-6)
    g.close()
    m = load_model(out).model
    assert m.cfg.mamba == lm.model.cfg.mamba and m.cfg.rope_layers == (False,) * 4
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True), REF, atol=1e-3 * 2.3)


def test_what_declines_it(lm, tmp_path):
    """No fused CPU draft step, no AWQ, no stored prefixes (the state is kept for the cache's end); the CUDA
    decoder declines it (tests/engine/cuda/test_decoder_dry.py). The released configs' layer names read."""
    from engine.backends.cpu.draft import DraftForward
    from engine.errors import UnsupportedArchitectureError
    from engine.hf_repo import config_from_hf
    from engine.prefix_cache import PrefixCache
    from engine.quant.awq import pick_group
    from engine.quant.source import open_source

    assert DraftForward.build(lm.model) is None
    refused = pytest.raises(UnsupportedArchitectureError, match="Mamba-2")
    with open_source(TINY / "granite4-h") as source, refused:
        pick_group(source)
    cache = lm.model.new_cache(32)
    lm.model.forward(TOKENS, cache)
    assert PrefixCache(1 << 20).insert(cache) == 0
    config = json.loads((TINY / "granite4-h" / "config.json").read_text())
    config["layer_types"] = ["mamba", "attention", "mamba", "mamba"]  # the released configs' names
    assert config_from_hf(tmp_path, config) == lm.model.cfg


def test_experts_beside_the_shared_mlp_folder_gguf_and_batched_decode(tmp_path):
    """Granite 4.0-H Tiny / Small's layout: 4 experts (softmax over the chosen 2) beside the shared MLP, their
    shared expert. Converted as llama.cpp writes it: input_linear split into ffn_gate_exps / ffn_up_exps, the
    shared MLP as ffn_*_shexp; Q8_0 experts take the one-token path over the merged tensors."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = json.loads((TINY / "granite4-h-moe" / "golden.json").read_text())
    ref = np.array(golden["logits"])
    folder = load_model(TINY / "granite4-h-moe").model
    moe = folder.layers[1].moe
    assert moe.gate_up_stacked and moe.shared is not None and moe.shared_gate is None
    out = convert(TINY / "granite4-h-moe", "F16", tmp_path / "m.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert (md["granitehybrid.expert_count"], md["granitehybrid.expert_used_count"]) == (4, 2)
    assert md["granitehybrid.expert_shared_feed_forward_length"] == 96
    assert tuple(g.tensors["blk.1.ffn_gate_exps.weight"].shape) == (4, 32, 64)
    assert {"blk.1.ffn_up_exps.weight", "blk.1.ffn_gate_shexp.weight", "blk.1.ffn_down_shexp.weight"} <= set(
        g.tensors
    )
    g.close()
    m = load_model(out).model
    np.testing.assert_allclose(m.forward(golden["tokens"], m.new_cache(32), all_logits=True), ref,
                               atol=1e-3 * np.abs(ref).max())
    q8 = load_model(convert(TINY / "granite4-h-moe", "Q8_0", tmp_path / "q8.gguf").output).model
    assert q8.layers[1].moe.stacks is not None
    check_batched_decode(q8, ([5, 17, 42], [99, 3, 250, 77, 1]), (8, 120))
    check_batched_decode(folder, ([5, 17, 42], [99, 3, 250, 77, 1]), (8, 120))
