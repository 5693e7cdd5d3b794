"""Qwen3.5 (dense text): gated DeltaNet layers beside gated full attention.

The fixture (tests/fixtures/tiny/qwen3_5, scripts/make_tiny_checkpoints.py) has three DeltaNet layers and
one attention layer; test_hf_repo checks its logits and greedy tokens against transformers. Here: the cache
that keeps each DeltaNet layer's state at its end (chunked prefill, trims that step back to a snapshot,
chat turns, regenerate, batched decode), what cannot use it (stored prefixes, speculation, drafting) and
what declines the model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from engine.generate import GenerationParams, generate
from engine.kv_cache import RecurrentKVCache
from engine.loader import load_model
from engine.prefix_cache import PrefixCache
from tests.engine.model_checks import (
    check_batched_decode,
    check_recurrent_regenerate_and_edit_reuse,
    chunked_logits,
)

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
GOLDEN = json.loads((TINY / "qwen3_5" / "golden.json").read_text())
TOKENS = GOLDEN["tokens"]
REF = np.array(GOLDEN["logits"])
TOL = 1e-4 * np.abs(REF).max()


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY / "qwen3_5")


def test_config_and_cache_layout(lm):
    cfg = lm.model.cfg
    assert cfg.architecture == "qwen35" and cfg.attn_output_gate and cfg.rotary_dim == 4
    assert [cfg.is_recurrent(i) for i in range(4)] == [True, True, True, False]
    assert (cfg.delta.k_heads, cfg.delta.v_heads, cfg.delta.conv_dim) == (2, 4, 64)
    cache = lm.model.new_cache(32)
    assert isinstance(cache, RecurrentKVCache) and not cache.partial_states
    assert cache.k.shape == (1, 2, 32, 16)
    assert cache.recurrent.shape == (3, 4, 8, 8) and cache.conv_state.shape == (3, 3, 64)
    assert cache.bytes_per_token == 2 * 2 * 16 * 4  # the attention layer's keys and values only


def test_prefill_in_chunks_matches_one_pass(lm):
    np.testing.assert_allclose(chunked_logits(lm.model, TOKENS, (5, 1, 2, 7, 1)), REF, atol=TOL)


def test_trim_steps_back_to_a_snapshot_and_recomputes(lm):
    """A trim lands on the latest snapshot at or before the target (a pass's start, or one token before its
    end) or on 0, which may drop more than asked; continuing from offset gives the exact logits."""
    m = lm.model
    cache = m.new_cache(32)
    m.forward(TOKENS[:6], cache)
    m.forward(TOKENS[6:12], cache)  # continues the first pass: snapshots at 5 and 11, none at 6
    for t in TOKENS[12:]:
        m.forward([t], cache)
    assert sorted(cache._snapshots) == [5, 11]
    assert cache.trim(3) == 5 and cache.offset == 11  # back to one token before the second pass's end
    np.testing.assert_allclose(m.forward(TOKENS[11:14], cache, all_logits=True), REF[11:14], atol=TOL)
    assert sorted(cache._snapshots) == [5, 11, 13]  # that pass started at a snapshot: it keeps its end - 1
    assert cache.trim(5) == 9 and cache.offset == 5  # 9 lies between the snapshots 5 and 11
    np.testing.assert_allclose(m.forward(TOKENS[5:9], cache, all_logits=True), REF[5:9], atol=TOL)
    assert cache.trim(5) == 9 and cache.offset == 0  # before every snapshot: the empty state
    np.testing.assert_allclose(m.forward(TOKENS[:4], cache, all_logits=True), REF[:4], atol=TOL)


@pytest.mark.parametrize("n", [1, 4])
def test_a_pass_that_fails_part_way_leaves_the_cache_whole(lm, monkeypatch, n):
    """A pass (a decode step, a prompt chunk) that fails after its first DeltaNet layer moved that layer's
    state on (out of memory, an interrupt) is not advanced, and the cache goes back to its latest snapshot:
    continuing from its offset gives the exact logits, not ones from a half-updated state."""
    m = lm.model
    cache = m.new_cache(32)
    m.forward(TOKENS[:6], cache)  # snapshots at 0 and 5
    m.forward(TOKENS[6:8], cache)  # continues it: snapshot at 7
    real, calls = type(m)._recurrent_mix, []

    def failing(self, i, *args):
        calls.append(i)
        if len(calls) == 2:
            raise MemoryError("out of memory in layer 1")
        return real(self, i, *args)

    monkeypatch.setattr(type(m), "_recurrent_mix", failing)
    with pytest.raises(MemoryError):
        m.forward(TOKENS[8 : 8 + n], cache)
    monkeypatch.undo()
    assert cache.offset == 7 and cache.tokens == TOKENS[:7] and sorted(cache._snapshots) == [5, 7]
    np.testing.assert_allclose(m.forward(TOKENS[7 : 8 + n], cache, all_logits=True), REF[7 : 8 + n], atol=TOL)


def test_a_batched_step_that_fails_part_way_leaves_every_cache_whole(lm, monkeypatch):
    """A batched decode step (the server's) that fails after its first DeltaNet layer moved both sequences'
    states on: neither cache is advanced, each goes back to its latest snapshot, and the sequences continue
    from there with the exact logits."""
    m = lm.model
    caches = [m.new_cache(32), m.new_cache(32)]
    m.forward(TOKENS[:6], caches[0])  # snapshots at 0 and 5
    m.forward(TOKENS[:3], caches[1])  # at 0 and 2
    m.forward_batch([TOKENS[6], TOKENS[3]], caches)  # decode steps keep no snapshots
    real, calls = type(m)._recurrent_mix, []

    def failing(self, i, *args):
        calls.append(i)
        if len(calls) == 3:  # layer 1 of the first sequence, after layer 0 of both
            raise MemoryError("out of memory in layer 1")
        return real(self, i, *args)

    monkeypatch.setattr(type(m), "_recurrent_mix", failing)
    with pytest.raises(MemoryError):
        m.forward_batch([TOKENS[7], TOKENS[4]], caches)
    monkeypatch.undo()
    assert [c.offset for c in caches] == [5, 2] and [c.tokens for c in caches] == [TOKENS[:5], TOKENS[:2]]
    for cache, start in zip(caches, (5, 2)):
        np.testing.assert_allclose(m.forward(TOKENS[start:9], cache, all_logits=True), REF[start:9], atol=TOL)


def test_chat_turns_reuse_and_regenerate_match_a_fresh_cache(lm):
    m, tok = lm.model, lm.tokenizer
    params = GenerationParams(max_tokens=6, temperature=0.0)
    cache = m.new_cache(128)
    first = list(generate(m, tok, TOKENS, cache, params))
    reply = [e.token for e in first]
    turn2 = TOKENS + reply + [5, 17, 42, 99]
    second = list(generate(m, tok, turn2, cache, params))
    assert second[-1].cached_tokens == len(TOKENS) + len(reply) - 1  # the whole cache was reused
    fresh = [e.token for e in generate(m, tok, turn2, m.new_cache(128), params)]
    assert [e.token for e in second] == fresh
    again = list(generate(m, tok, turn2, cache, params))  # regenerate: from the prompt's end - 1
    assert [e.token for e in again] == fresh and again[-1].cached_tokens == len(turn2) - 1


def test_regenerate_and_edits_reuse_the_snapshots_they_need(lm):
    check_recurrent_regenerate_and_edit_reuse(lm.model, lm.tokenizer, TOL)


def test_chat_runner_regenerates_one_token_and_edits_from_the_turns_start():
    """Through the worker's chunked prefill (batches of 8 tokens): a regenerate computes the prompt's last
    token only, and an edit of a second message that took many passes restarts where that turn began."""
    from engine.client import LoadOptions
    from engine.worker import ChatRunner

    runner = ChatRunner.load(TINY / "qwen3_5", LoadOptions(n_ctx=512, batch_size=8, prefix_cache_mb=0))
    params = GenerationParams(max_tokens=5, temperature=0.0)

    def chat(messages):
        events = list(runner.chat(messages, params))
        return "".join(e.text for e in events), events[-1]

    first = [{"role": "user", "content": "the cat"}]
    reply, turn1 = chat(first)
    again, regenerated = chat(first)
    assert again == reply and regenerated.cached_tokens == turn1.prompt_tokens - 1
    history = [*first, {"role": "assistant", "content": reply}]
    turn2 = chat([*history, {"role": "user", "content": "a dog " * 30}])[1]
    # the tiny tokenizer does not spell the reply back: the turn starts a token before the first prompt's end
    assert turn2.cached_tokens >= turn1.prompt_tokens - 1
    assert turn2.prompt_tokens - turn2.cached_tokens > 6 * 8  # in more passes than MAX_SNAPSHOTS
    edited = chat([*history, {"role": "user", "content": "a bird"}])[1]
    assert edited.cached_tokens == turn2.cached_tokens


def test_batched_decode_matches_one_sequence_at_a_time(lm):
    check_batched_decode(lm.model, ([5, 17, 42], [99, 3, 250, 77, 1], [8]), (8, 120, 33))


def test_no_stored_prefixes_and_no_speculation(lm):
    """Stored prefixes need every position's state, speculation takes back rejected drafts: neither works
    on a state kept for the cache's end. The prefix store skips such caches, speculative_generate decodes
    plainly (same reply, no speculation figures) and such a model cannot draft."""
    from engine.lookup import PromptLookup
    from engine.speculative import DraftModel, IncompatibleDraftError, SpeculativeEvent, speculative_generate

    m, tok = lm.model, lm.tokenizer
    store = PrefixCache(1 << 20)
    cache = m.new_cache(32)
    m.forward(TOKENS, cache)
    assert store.insert(cache) == 0 and store.restore(TOKENS, m.new_cache(32)) == 0
    params = GenerationParams(max_tokens=8, temperature=0.0)
    prompt = TOKENS[:6] * 3
    plain = [e.token for e in generate(m, tok, prompt, m.new_cache(64), params)]
    events = list(speculative_generate(m, tok, prompt, m.new_cache(64), params, PromptLookup(), k=4))
    assert [e.token for e in events] == plain
    assert not any(isinstance(e, SpeculativeEvent) for e in events)
    llama = load_model(TINY / "llama")
    with pytest.raises(IncompatibleDraftError, match="recurrent"):
        DraftModel(m, tok, 64).check_compatible(llama.model, llama.tokenizer)


def test_memory_estimate_counts_the_fixed_state(lm):
    from engine.memory_guard import estimate, kv_shape_from_config

    shape = kv_shape_from_config(lm.model.cfg)
    cache = lm.model.new_cache(64)
    assert shape.kv_bytes_per_token == cache.bytes_per_token
    assert shape.state_bytes == cache.state_nbytes
    kv = estimate(10 << 20, shape, 64, available=8 << 30).kv_bytes
    assert kv == 64 * cache.bytes_per_token + cache.state_nbytes


def test_gguf_in_llama_cpps_qwen35_layout(lm, tmp_path):
    """Converted as llama.cpp's convert_hf_to_gguf writes Qwen3.5: its ssm.* keys, full_attention_interval
    and rope sections; norms as 1 + w (not the DeltaNet's gated norm), A_log as -exp(A_log); the value heads
    in tiled order in every tensor indexed by them; the convolution kernels F32. The file runs as the
    folder does (the tiled heads read as such)."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    out = convert(TINY / "qwen3_5", "F16", tmp_path / "q.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert (md["qwen35.full_attention_interval"], md["qwen35.ssm.conv_kernel"]) == (4, 3 + 1)
    assert (md["qwen35.ssm.group_count"], md["qwen35.ssm.time_step_rank"]) == (2, 4)
    assert (md["qwen35.ssm.state_size"], md["qwen35.ssm.inner_size"]) == (8, 32)
    assert list(md["qwen35.rope.dimension_sections"]) == [1, 1, 0, 0]
    assert md["qwen35.rope.dimension_count"] == 4
    conv = g.tensors["blk.0.ssm_conv1d.weight"]
    assert conv.type_name == "F32" and tuple(conv.shape) == (64, 4)
    assert "blk.3.post_attention_norm.weight" in g.tensors and "blk.3.attn_q.weight" in g.tensors
    stored = np.asarray(g.tensors["blk.0.ssm_a"].raw()).view(np.float32).reshape(-1)
    grouped = lm.model.layers[0].delta.neg_a  # -exp(A_log) from the folder: [K0v0, K0v1, K1v0, K1v1]
    np.testing.assert_allclose(stored, grouped[[0, 2, 1, 3]], rtol=1e-6)  # tiled: [K0v0, K1v0, K0v1, K1v1]
    from engine.memory_guard import kv_shape_from_gguf

    shape, cache = kv_shape_from_gguf(g.metadata), lm.model.new_cache(8)
    assert (shape.kv_bytes_per_token, shape.state_bytes) == (cache.bytes_per_token, cache.state_nbytes)
    from models.fit import kv_bytes_per_token, kv_bytes_per_token_config  # the library's fit estimate

    config = json.loads((TINY / "qwen3_5" / "config.json").read_text())
    assert kv_bytes_per_token(g.metadata) == kv_bytes_per_token_config(config) == cache.bytes_per_token
    g.close()
    m = load_model(out).model
    assert m.cfg.delta.tiled and m.cfg.delta == dataclasses.replace(lm.model.cfg.delta, tiled=True)
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True), REF, atol=1e-3 * 8.2)
    q8 = convert(TINY / "qwen3_5", "Q8_0", tmp_path / "q8.gguf")
    assert q8.result.tensor_types["blk.0.ssm_conv1d.weight"] == "F32"
    assert q8.result.tensor_types["blk.0.attn_qkv.weight"] == "Q8_0"


def test_what_declines_it(lm, tmp_path):
    """No fused CPU draft step, no AWQ: typed errors or None (CUDA runs it: cuda/test_families_cuda.py)."""
    from engine.backends.cpu.draft import DraftForward
    from engine.errors import UnsupportedArchitectureError
    from engine.hf_repo import config_from_hf
    from engine.quant.awq import pick_group
    from engine.quant.source import open_source

    assert DraftForward.build(lm.model) is None
    refused = pytest.raises(UnsupportedArchitectureError, match="DeltaNet")
    with open_source(TINY / "qwen3_5") as source, refused:
        pick_group(source)
    text = json.loads((TINY / "qwen3_5" / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "text_config": text}  # the multimodal folder's config
    assert config_from_hf(tmp_path, wrapped).delta == lm.model.cfg.delta


def test_qwen35_moe_folder_gguf_and_batched_decode(tmp_path):
    """Qwen3.5-MoE (35B-A3B's layout: every layer's FFN 4 routed experts, renormalized, beside a gated
    shared expert): the folder (golden in test_hf_repo), llama.cpp's qwen35moe GGUF, the batched step."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = json.loads((TINY / "qwen3_5_moe" / "golden.json").read_text())
    ref = np.array(golden["logits"])
    out = convert(TINY / "qwen3_5_moe", "F16", tmp_path / "moe.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert g.architecture == "qwen35moe" and md["qwen35moe.full_attention_interval"] == 4
    assert (md["qwen35moe.expert_count"], md["qwen35moe.expert_used_count"]) == (4, 2)
    assert md["qwen35moe.expert_feed_forward_length"] == 48
    assert md["qwen35moe.expert_shared_feed_forward_length"] == 64
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ssm_a"} <= set(g.tensors)
    g.close()
    m = load_model(out).model
    assert m.cfg.delta.tiled and m.layers[0].moe.shared_gate is not None and m.cfg.norm_topk_prob
    np.testing.assert_allclose(m.forward(golden["tokens"], m.new_cache(32), all_logits=True), ref,
                               atol=1e-3 * np.abs(ref).max())
    check_batched_decode(m, ([5, 17, 42], [99, 3, 250, 77, 1]), (8, 120))
