"""Nemotron-H (dense): blocks of one mixer each, Mamba-2, attention without positions or a squared-ReLU MLP.

The fixture (tests/fixtures/tiny/nemotron_h, scripts/make_tiny_checkpoints.py) has the pattern "M-*M-": two
Mamba-2 blocks (8 heads of 16, 2 groups), two MLP blocks and one attention block; test_hf_repo checks its
logits and greedy tokens against transformers. Here: the cache (chunked prefill, trims, chat turns, batched
decode), llama.cpp's nemotron_h GGUF both ways, memory estimates and what declines it.
"""

from __future__ import annotations

import dataclasses
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
GOLDEN = json.loads((TINY / "nemotron_h" / "golden.json").read_text())
TOKENS = GOLDEN["tokens"]
REF = np.array(GOLDEN["logits"])
TOL = 1e-4 * np.abs(REF).max()


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY / "nemotron_h")


def test_config_and_cache_layout(lm):
    cfg = lm.model.cfg
    assert cfg.kinds == ("mamba", "mlp", "attention", "mamba", "mlp")
    cache = lm.model.new_cache(32)
    assert isinstance(cache, RecurrentKVCache) and not cache.partial_states
    assert cache.k.shape == (1, 2, 32, 16)
    assert cache.recurrent.shape == (2, 8, 16, 16) and cache.conv_state.shape == (2, 3, 192)


def test_prefill_in_chunks_trims_and_chat_turns(lm):
    np.testing.assert_allclose(chunked_logits(lm.model, TOKENS, (5, 1, 2, 7, 1)), REF, atol=TOL)
    check_recurrent_trims_and_chat_turns(lm.model, lm.tokenizer, TOKENS, REF, TOL)


def test_regenerate_and_edits_reuse_the_snapshots_they_need(lm):
    check_recurrent_regenerate_and_edit_reuse(lm.model, lm.tokenizer, TOL)


def test_batched_decode_matches_one_sequence_at_a_time(lm):
    check_batched_decode(lm.model, ([5, 17, 42], [99, 3, 250, 77, 1], [8]), (8, 120, 33))


def test_gguf_in_llama_cpps_nemotron_h_layout_and_memory_estimates(lm, tmp_path):
    """Converted as llama.cpp's convert_hf_to_gguf writes Nemotron-H: KV heads and FFN lengths per layer (0
    but in attention and MLP blocks), the ssm.* keys, each block's norm as attn_norm, Mamba-2's tensors in
    llama.cpp's shapes, the MLP's up as it is (no gate). The file runs as the folder does; the memory guard
    and the library's fit estimate read the file and the folder alike."""
    from engine.convert import convert
    from engine.memory_guard import kv_shape_from_config, kv_shape_from_gguf
    from models.fit import kv_bytes_per_token, kv_bytes_per_token_config
    from models.formats.gguf import open_gguf

    out = convert(TINY / "nemotron_h", "F16", tmp_path / "n.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert g.architecture == "nemotron_h"
    assert list(md["nemotron_h.attention.head_count_kv"]) == [0, 0, 2, 0, 0]
    assert list(md["nemotron_h.feed_forward_length"]) == [0, 96, 0, 0, 96]
    assert md["nemotron_h.ssm.inner_size"] == 128 and md["nemotron_h.ssm.group_count"] == 2
    assert tuple(g.tensors["blk.0.ssm_a"].shape) == (8, 1) and "blk.1.ffn_gate.weight" not in g.tensors
    cache = lm.model.new_cache(8)
    shape = kv_shape_from_gguf(g.metadata)
    assert (shape.kv_bytes_per_token, shape.state_bytes) == (cache.bytes_per_token, cache.state_nbytes)
    assert kv_shape_from_config(lm.model.cfg).kv_bytes_per_token == cache.bytes_per_token
    config = json.loads((TINY / "nemotron_h" / "config.json").read_text())
    assert kv_bytes_per_token(g.metadata) == kv_bytes_per_token_config(config) == cache.bytes_per_token
    g.close()
    m = load_model(out).model
    assert dataclasses.replace(m.cfg, rms_norm_eps=lm.model.cfg.rms_norm_eps) == lm.model.cfg  # eps: float32
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True), REF, atol=1e-3 * 6.1)


def test_what_declines_it(lm, tmp_path):
    """No fused CPU draft step, no AWQ, no stored prefixes; the CUDA decoder declines it
    (tests/engine/cuda/test_decoder_dry.py); the older configs' hybrid_override_pattern reads; the mixtures of
    experts (Nemotron 3) are refused with a message."""
    from engine.backends.cpu.draft import DraftForward
    from engine.errors import UnsupportedArchitectureError
    from engine.hf_repo import config_from_hf
    from engine.prefix_cache import PrefixCache
    from engine.quant.awq import pick_group
    from engine.quant.source import open_source

    assert DraftForward.build(lm.model) is None
    refused = pytest.raises(UnsupportedArchitectureError, match="Mamba")
    with open_source(TINY / "nemotron_h") as source, refused:
        pick_group(source)
    cache = lm.model.new_cache(32)
    lm.model.forward(TOKENS, cache)
    assert PrefixCache(1 << 20).insert(cache) == 0
    config = json.loads((TINY / "nemotron_h" / "config.json").read_text())
    old = {k: v for k, v in config.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "M-*M-"}
    assert config_from_hf(tmp_path, old) == lm.model.cfg
    with pytest.raises(UnsupportedArchitectureError, match="mixtures of experts"):
        config_from_hf(tmp_path, old | {"hybrid_override_pattern": "ME*M-"})
