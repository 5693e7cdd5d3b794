"""Gemma 4 (text): windowed and global layers of different head shapes, shared-KV layers, per-layer
embeddings, and the 26B-A4B experts beside the MLP.

The fixtures (tests/fixtures/tiny/gemma4 and gemma4-moe, scripts/make_tiny_checkpoints.py) are E2B-style
(per-layer embeddings, the last 2 of 5 layers reusing earlier keys and values with double-wide MLPs) and
26B-A4B-style (4 experts beside each MLP, global values from the key projection); test_hf_repo checks
their logits and greedy tokens against transformers. Here: the grouped cache (chunked prefill, trim,
stored prefixes, speculation, batched decode), llama.cpp's gemma4 GGUF both ways, its tokenizer model,
memory estimates, and what declines the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.kv_cache import GroupedKVCache
from engine.loader import load_model
from engine.prefix_cache import PrefixCache
from tests.engine.model_checks import check_batched_decode, check_speculation_keeps_greedy, chunked_logits

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


def _golden(family: str) -> tuple[list[int], np.ndarray]:
    golden = json.loads((TINY / family / "golden.json").read_text())
    return golden["tokens"], np.array(golden["logits"])


TOKENS, REF = _golden("gemma4")
TOL = 1e-4 * np.abs(REF).max()


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY / "gemma4")


@pytest.fixture(scope="module")
def moe():
    return load_model(TINY / "gemma4-moe")


def test_config_and_cache_layout(lm, moe):
    """Windowed layers: 2 KV heads of 16; global: 32 wide. Layers 3 and 4 read layers 1's and 2's keys and
    values (the last earlier layer of their kind) and keep none; their MLPs are twice as wide."""
    cfg = lm.model.cfg
    assert cfg.architecture == "gemma4" and cfg.kv_sources == [0, 1, 2, 1, 2]
    assert cfg.intermediate_sizes == [96, 96, 96, 192, 192]
    cache = lm.model.new_cache(32)
    assert isinstance(cache, GroupedKVCache) and cache.partial_states
    assert [k.shape for k, _ in cache.groups] == [(2, 2, 32, 16), (1, 2, 32, 32)]
    assert cache.slots == [(0, 0), (0, 1), (1, 0)]
    assert cache.bytes_per_token == 2 * (2 * 2 * 16 + 2 * 32) * 4
    layers = moe.model.layers
    assert (layers[2].kv_heads, layers[2].head_dim) == (1, 32)
    assert layers[2].wv is None and layers[0].wv is not None  # the global layer's values are its keys
    assert moe.model.cfg.num_experts == 4 and layers[0].moe.gate_up_stacked


def test_prompt_pass_for_the_last_logits_runs_shared_layers_on_the_last_row(lm):
    """forward without all_logits computes the shared-KV layers for the last token only: same logits."""
    m = lm.model
    last = m.forward(TOKENS, m.new_cache(32))[-1]
    np.testing.assert_allclose(last, REF[-1], atol=TOL)


@pytest.mark.parametrize("family", ["gemma4", "gemma4-moe"])
def test_prefill_in_chunks_matches_one_pass(family, lm, moe):
    m = (lm if family == "gemma4" else moe).model
    tokens, ref = _golden(family)
    np.testing.assert_allclose(chunked_logits(m, tokens, (5, 1, 2, 7, 1)), ref, atol=1e-4 * np.abs(ref).max())


def test_trim_restored_prefix_and_float16_cache(lm):
    m = lm.model
    cache = m.new_cache(32)
    m.forward(TOKENS[:12], cache)
    assert cache.trim(4) == 4
    np.testing.assert_allclose(m.forward(TOKENS[8:], cache, all_logits=True), REF[8:], atol=TOL)
    store = PrefixCache(1 << 20)
    assert store.insert(cache) == 16 * cache.bytes_per_token
    fresh = m.new_cache(32)
    assert store.restore(TOKENS[:9] + [77, 78], fresh) == 9
    np.testing.assert_allclose(m.forward(TOKENS[9:], fresh, all_logits=True), REF[9:], atol=TOL)
    half = m.new_cache(32, np.float16)
    assert half.groups[1][0].dtype == np.float16
    assert np.abs(m.forward(TOKENS, half, all_logits=True) - REF).max() < 2e-2 * np.abs(REF).max()


@pytest.mark.parametrize("family", ["gemma4", "gemma4-moe"])
def test_batched_decode_matches_one_sequence_at_a_time(family, lm, moe):
    m = (lm if family == "gemma4" else moe).model
    check_batched_decode(m, ([5, 17, 42], [99, 3, 250, 77, 1], [8]), (8, 120, 33))


def test_speculation_with_rejections_keeps_greedy_output(lm):
    events = check_speculation_keeps_greedy(lm.model, lm.tokenizer, TOKENS[:6] * 3)
    assert events[-1].drafted_tokens > 0


def test_gguf_in_llama_cpps_gemma4_layout(lm, tmp_path):
    """Converted as llama.cpp's convert_hf_to_gguf writes Gemma 4: head sizes, KV heads and FFN lengths per
    layer kind, the window flags, shared-KV layers, per-layer embeddings; norms as they are (w, not 1 + w),
    the global RoPE as rope_freqs (1 for the 4 turning frequencies, 1e30 for the other 12); no keys or values
    in the shared layers. The file runs as the folder does."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    out = convert(TINY / "gemma4", "F16", tmp_path / "g.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert list(md["gemma4.feed_forward_length"]) == [96, 96, 96, 192, 192]
    assert list(md["gemma4.attention.sliding_window_pattern"]) == [True, True, False, True, False]
    assert (md["gemma4.attention.key_length"], md["gemma4.attention.key_length_swa"]) == (32, 16)
    assert (md["gemma4.attention.shared_kv_layers"], md["gemma4.embedding_length_per_layer_input"]) == (2, 8)
    assert md["gemma4.final_logit_softcapping"] == 30.0
    freqs = np.asarray(g.tensors["rope_freqs.weight"].array())
    assert list(freqs[:4]) == [1.0] * 4 and (freqs[4:] == np.float32(1e30)).all()
    assert {"per_layer_token_embd.weight", "blk.4.inp_gate.weight", "blk.4.layer_output_scale.weight"} <= set(
        g.tensors
    )
    assert "blk.3.attn_k.weight" not in g.tensors and "blk.2.attn_v.weight" in g.tensors
    norm = np.asarray(g.tensors["blk.0.attn_norm.weight"].array())
    np.testing.assert_allclose(norm, lm.model.layers[0].attn_norm)
    g.close()
    m = load_model(out).model
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True), REF, atol=1e-3 * 5.1)


def test_moe_gguf_keeps_merged_experts_and_runs(moe, tmp_path):
    """26B-A4B's layout: ffn_gate_up_exps (experts, 2 ff, hidden), the router's scale as ffn_gate_inp.scale
    and its per-expert scale as ffn_down_exps.scale (llama.cpp's names); KV heads per layer. Q8_0 experts
    take the one-token path over the merged tensor, which gives the grouped path's logits."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    tokens, ref = _golden("gemma4-moe")
    out = convert(TINY / "gemma4-moe", "F16", tmp_path / "m.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert list(md["gemma4.attention.head_count_kv"]) == [2, 2, 1]
    experts = ("expert_count", "expert_used_count", "expert_feed_forward_length")
    assert tuple(md[f"gemma4.{k}"] for k in experts) == (4, 2, 32)
    assert tuple(g.tensors["blk.0.ffn_gate_up_exps.weight"].shape) == (4, 64, 64)
    assert {"blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale", "blk.0.pre_ffw_norm_2.weight"} <= set(
        g.tensors
    )
    g.close()
    m = load_model(out).model
    np.testing.assert_allclose(m.forward(tokens, m.new_cache(32), all_logits=True), ref,
                               atol=1e-3 * np.abs(ref).max())
    q8 = load_model(convert(TINY / "gemma4-moe", "Q8_0", tmp_path / "q8.gguf").output).model
    assert q8.layers[0].moe.stacks is not None
    cache = q8.new_cache(32)
    q8.forward(tokens[:-1], cache)
    step = q8.forward(tokens[-1:], cache)[0]
    np.testing.assert_allclose(step, q8.forward(tokens, q8.new_cache(32), all_logits=True)[-1], atol=1e-4)


def test_gemma4_tokenizer_model_reads_its_merges():
    """llama.cpp's "gemma4" vocabulary: SentencePiece-style BPE ranked by stored merges (U+2581 for spaces,
    <0xXX> byte fallback, no space prefix), with <turn|> ending a turn. Encoding matches the same BPE run by
    the tokenizers library."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers

    from engine.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, Tokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>"]
    chars = ["\u2581", "h", "e", "l", "o", "w", "r", "d"]
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("\u2581", "w"), ("o", "r")]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + chars + [a + b for a, b in merges]
    types = [TOKEN_CONTROL] * 5 + [TOKEN_USER_DEFINED] + [TOKEN_BYTE] * 256
    types += [TOKEN_NORMAL] * (len(chars) + len(merges))
    metadata = {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.pre": "gemma4", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok = Tokenizer.from_gguf_metadata(metadata)
    vocab = {t: i for i, t in enumerate(tokens)}
    ref = HFTokenizer(models.BPE(vocab, merges, byte_fallback=True))
    ref.normalizer = normalizers.Replace(" ", "\u2581")
    for text in ("hello world", "hello", " hello wörld", "held"):
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|turn>hello<turn|>", add_special=True)[:2] == [2, 3]
    assert tok.decode(tok.encode("<|channel>hello")) == "<|channel>hello"  # a visible token
    assert vocab["<turn|>"] in tok.eot_ids
    del metadata["tokenizer.ggml.merges"]
    from engine.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_gguf_metadata(metadata)


def test_memory_estimates_count_both_head_shapes(lm, tmp_path):
    from engine.convert import convert
    from engine.memory_guard import kv_shape_from_config, kv_shape_from_gguf
    from models.fit import kv_bytes_per_token, kv_bytes_per_token_config
    from models.formats.gguf import open_gguf

    per_token = lm.model.new_cache(8).bytes_per_token
    assert kv_shape_from_config(lm.model.cfg).kv_bytes_per_token == per_token
    assert kv_bytes_per_token_config(json.loads((TINY / "gemma4" / "config.json").read_text())) == per_token
    g = open_gguf(convert(TINY / "gemma4", "F16", tmp_path / "g.gguf").output)
    assert kv_shape_from_gguf(g.metadata).kv_bytes_per_token == per_token
    assert kv_bytes_per_token(g.metadata) == per_token
    g.close()


def test_released_multimodal_config_and_what_declines_it(lm, tmp_path):
    """A Gemma4ForConditionalGeneration config.json (text_config with global_head_dim and
    num_global_key_value_heads, as released) reads as its language model; no fused CPU draft step, no AWQ
    (the CUDA decoder declines it: tests/engine/cuda/test_decoder_dry.py)."""
    from engine.backends.cpu.draft import DraftForward
    from engine.errors import UnsupportedArchitectureError
    from engine.hf_repo import config_from_hf
    from engine.quant.awq import pick_group
    from engine.quant.source import open_source

    text = json.loads((TINY / "gemma4" / "config.json").read_text())
    text.pop("per_layer_config")
    text |= {"global_head_dim": 32, "num_global_key_value_heads": 2}
    cfg = config_from_hf(tmp_path, {"model_type": "gemma4", "text_config": text, "vision_config": {}})
    assert cfg == lm.model.cfg
    assert DraftForward.build(lm.model) is None
    with open_source(TINY / "gemma4") as source, pytest.raises(UnsupportedArchitectureError, match="Gemma 4"):
        pick_group(source)


def test_multimodal_folder_converts_as_its_language_model(tmp_path):
    """Gemma4ForConditionalGeneration (the released layout): the model.language_model.* tensors convert, the
    vision tower's are left out; the file gives the folder's golden logits (test_hf_repo: the folder's)."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    tokens, ref = _golden("gemma4-mm")
    out = convert(TINY / "gemma4-mm", "F16", tmp_path / "mm.gguf").output
    g = open_gguf(out)
    assert g.architecture == "gemma4" and not any("vision" in n or n.startswith("v.") for n in g.tensors)
    g.close()
    m = load_model(out).model
    np.testing.assert_allclose(m.forward(tokens, m.new_cache(32), all_logits=True), ref,
                               atol=1e-3 * np.abs(ref).max())
