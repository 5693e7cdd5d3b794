"""Qwen3-Next: Qwen3.5-MoE's forerunner, on the Qwen3.5 paths (engine/arch/deltanet.py and llama.py).

The fixture (tests/fixtures/tiny/qwen3_next, scripts/make_tiny_checkpoints.py) has three DeltaNet layers
(their input projections fused per key head: in_proj_qkvz, in_proj_ba) and one gated attention layer, experts
beside a gated shared expert in layers 0, 2 and 3 and a dense MLP in layer 1 (mlp_only_layers); test_hf_repo
checks the folder's logits and greedy tokens against transformers. Here: the cache (chunked prefill, trims,
chat turns, batched decode), llama.cpp's qwen3next GGUF both ways, and that the fused projections' order
matters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.arch import deltanet
from engine.convert import convert
from engine.errors import UnsupportedArchitectureError
from engine.hf_repo import config_from_hf
from engine.loader import load_model
from models.formats.gguf import open_gguf
from tests.engine.model_checks import (
    block_fp8_twins,
    check_batched_decode,
    check_recurrent_regenerate_and_edit_reuse,
    check_recurrent_trims_and_chat_turns,
    chunked_logits,
    rewrite_gguf,
)

FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3_next"
GOLDEN = json.loads((FOLDER / "golden.json").read_text())
TOKENS = GOLDEN["tokens"]
REF = np.array(GOLDEN["logits"])
TOL = 1e-4 * np.abs(REF).max()
CONFIG = json.loads((FOLDER / "config.json").read_text())


@pytest.fixture(scope="module")
def lm():
    return load_model(FOLDER)


@pytest.fixture(scope="module")
def f16(tmp_path_factory):
    return convert(FOLDER, "F16", tmp_path_factory.mktemp("qwen3next") / "f16.gguf").output


def _greedy(model, n: int = 8) -> list[int]:
    cache = model.new_cache(64)
    step, out = model.forward(TOKENS, cache), []
    for _ in range(n):
        out.append(int(np.argmax(step[-1])))
        step = model.forward([out[-1]], cache)
    return out


def test_config_layers_and_cache(lm):
    cfg = lm.model.cfg
    assert cfg.architecture == "qwen3next" and cfg.attn_output_gate and cfg.rotary_dim == 4
    assert [cfg.is_recurrent(i) for i in range(4)] == [True, True, True, False]
    assert not cfg.delta.tiled and (cfg.delta.k_heads, cfg.delta.v_heads, cfg.delta.conv_dim) == (2, 4, 64)
    assert cfg.dense_layers == (1,) and cfg.dense_intermediate_size == 96 and cfg.intermediate_size == 48
    layers = lm.model.layers
    assert [lay.moe is None for lay in layers] == [False, True, False, False]
    assert layers[1].w_gate.rows == 96 and all(layers[i].moe.shared_gate is not None for i in (0, 2, 3))
    assert layers[0].delta.in_qkvz.rows == 96 and layers[0].delta.in_ba.rows == 8
    assert layers[0].delta.in_qkv is None and layers[0].delta.in_b is None
    cache = lm.model.new_cache(32)
    assert cache.recurrent.shape == (3, 4, 8, 8) and cache.conv_state.shape == (3, 3, 64)
    assert cache.bytes_per_token == 2 * 2 * 16 * 4  # the attention layer's keys and values only


def test_dense_layers_from_decoder_sparse_step(tmp_path):
    """transformers' rule: a layer runs experts unless mlp_only_layers names it or (layer + 1) is not a
    multiple of decoder_sparse_step; other families keep refusing dense layers between sparse ones."""
    cfg = config_from_hf(tmp_path, {**CONFIG, "mlp_only_layers": [3], "decoder_sparse_step": 2})
    assert cfg.dense_layers == (0, 2, 3)
    assert [cfg.has_experts(i) for i in range(4)] == [False, True, False, False]
    assert config_from_hf(tmp_path, {**CONFIG, "mlp_only_layers": []}).dense_layers == ()
    qwen2moe = {**CONFIG, "model_type": "qwen2_moe"}
    with pytest.raises(UnsupportedArchitectureError, match="mlp_only_layers"):
        config_from_hf(tmp_path, qwen2moe)


def test_prefill_in_chunks_matches_one_pass(lm):
    np.testing.assert_allclose(chunked_logits(lm.model, TOKENS, (5, 1, 2, 7, 1)), REF, atol=TOL)


def test_trims_and_chat_turns(lm):
    check_recurrent_trims_and_chat_turns(lm.model, lm.tokenizer, TOKENS, REF, TOL)


def test_regenerate_and_edits_reuse_the_snapshots_they_need(lm):
    check_recurrent_regenerate_and_edit_reuse(lm.model, lm.tokenizer, TOL)


def test_batched_decode_matches_one_sequence_at_a_time(lm):
    check_batched_decode(lm.model, ([5, 17, 42], [99, 3, 250, 77, 1], [8]), (8, 120, 33))


@pytest.mark.parametrize("order", ["qkvz", "ba"])
def test_the_fused_projections_order_matters(monkeypatch, order):
    """Read as Qwen3.5's separate tensors would be (all q rows, then all k, v, z; all b, then all a), the
    fused projections miss the golden: the split per key head is what makes it match."""

    def blocks(x, shape, axis, sizes):
        return np.split(x, np.cumsum(sizes)[:-1], axis=axis)

    if order == "qkvz":
        wrong = lambda x, s, axis=0: blocks(x, s, axis, (s.conv_dim, s.value_dim))  # noqa: E731
    else:
        wrong = lambda x, s, axis=0: blocks(x, s, axis, (s.v_heads, s.v_heads))  # noqa: E731
    monkeypatch.setattr(deltanet, f"split_{order}", wrong)
    m = load_model(FOLDER).model
    logits = m.forward(TOKENS, m.new_cache(32), all_logits=True)
    assert np.abs(logits - REF).max() > 100 * TOL


def test_gguf_in_llama_cpps_qwen3next_layout(lm, f16):
    """As llama.cpp's convert_hf_to_gguf (Qwen3NextModel) writes it: in_proj_qkvz split into attn_qkv (q, k,
    v of every head) and attn_gate (z), in_proj_ba kept as ssm_ba, the value heads grouped by key head (not
    Qwen3.5's tiled order), norms as 1 + w but the gated one, A_log as -exp(A_log), plain RoPE (no sections);
    the dense layer's FFN under llama's names with Hearth's mlp_only_layers key. Logits at every position and
    greedy tokens match transformers."""
    g = open_gguf(f16)
    md = dict(g.metadata)
    assert g.architecture == "qwen3next" and md["qwen3next.full_attention_interval"] == 4
    assert (md["qwen3next.ssm.group_count"], md["qwen3next.ssm.time_step_rank"]) == (2, 4)
    ssm = ("state_size", "inner_size", "conv_kernel")
    assert tuple(md[f"qwen3next.ssm.{k}"] for k in ssm) == (8, 32, 4)
    assert md["qwen3next.rope.dimension_count"] == 4 and "qwen3next.rope.dimension_sections" not in md
    assert (md["qwen3next.expert_feed_forward_length"], md["qwen3next.feed_forward_length"]) == (48, 96)
    assert md["qwen3next.expert_shared_feed_forward_length"] == 64
    assert list(md["qwen3next.mlp_only_layers"]) == [1]
    names = set(g.tensors)
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_ba.weight", "blk.0.ssm_a"} <= names
    assert "blk.0.ssm_in.weight" not in names and "blk.3.post_attention_norm.weight" in names
    assert {"blk.1.ffn_gate.weight", "blk.1.ffn_down.weight"} <= names
    assert "blk.1.ffn_gate_inp.weight" not in names
    assert g.tensors["blk.0.ssm_conv1d.weight"].type_name == "F32"
    stored = np.asarray(g.tensors["blk.0.ssm_a"].raw()).view(np.float32).reshape(-1)
    np.testing.assert_allclose(stored, lm.model.layers[0].delta.neg_a, rtol=1e-6)  # grouped, as HF
    g.close()
    m = load_model(f16).model
    assert m.cfg.delta == lm.model.cfg.delta and m.cfg.dense_layers == (1,)
    logits = m.forward(TOKENS, m.new_cache(32), all_logits=True)
    assert np.abs(logits - REF).max() < 1e-3 * np.abs(REF).max()
    assert np.array_equal(logits.argmax(1), REF.argmax(1)) and _greedy(m) == GOLDEN["greedy"]
    check_batched_decode(m, ([5, 17, 42], [99, 3, 250, 77, 1]), (8, 120))


def test_older_gguf_with_ssm_in_runs_the_same(f16, tmp_path):
    """llama.cpp's first qwen3next GGUFs keep in_proj_qkvz whole (ssm_in, HF's rows per key head); its
    loader still takes them. Rebuilt here from attn_qkv and attn_gate, the file gives the same logits."""
    g = open_gguf(f16)
    hk, k_heads, v_heads, hv = 8, 2, 4, 8
    rv = v_heads // k_heads * hv
    fused = {}
    for name, t in g.tensors.items():
        if name.endswith("attn_qkv.weight"):
            qkv = np.asarray(t.array()).reshape(t.shape)
            gate = g.tensors[name.replace("attn_qkv", "attn_gate")]
            z = np.asarray(gate.array()).reshape(gate.shape)
            q, k, v = np.split(qkv, [k_heads * hk, 2 * k_heads * hk])
            heads = [np.concatenate([q[i * hk : (i + 1) * hk], k[i * hk : (i + 1) * hk],
                                     v[i * rv : (i + 1) * rv], z[i * rv : (i + 1) * rv]])
                     for i in range(k_heads)]
            rows = np.concatenate(heads)
            fused[name.replace("attn_qkv", "ssm_in")] = (t.ggml_type, rows.shape, rows.view(np.uint8))
    g.close()
    split = ("attn_qkv.weight", "attn_gate.weight")
    rewrite_gguf(f16, tmp_path / "old.gguf", rename=lambda n: () if n.endswith(split) else n, extra=fused)
    m = load_model(tmp_path / "old.gguf").model
    assert m.layers[0].delta.in_qkvz is not None
    new = load_model(f16).model
    np.testing.assert_allclose(m.forward(TOKENS, m.new_cache(32), all_logits=True),
                               new.forward(TOKENS, new.new_cache(32), all_logits=True), atol=1e-5)


def test_q8_0_gguf(tmp_path):
    """Q8_0 through the quantizer registry (the convolution kernels F32, experts and routers as the other
    mixtures of experts). These tiny random DeltaNet models amplify weight rounding along the sequence
    (Qwen3.5's fixtures do too, more): the first positions stay close, the whole within 15% RMS, and nearly
    every argmax holds."""
    out = convert(FOLDER, "Q8_0", tmp_path / "q8.gguf")
    types = out.result.tensor_types
    assert types["blk.0.attn_qkv.weight"] == "Q8_0" and types["blk.0.ssm_ba.weight"] == "Q8_0"
    assert types["blk.0.ssm_conv1d.weight"] == "F32" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    m = load_model(out.output).model
    logits = m.forward(TOKENS, m.new_cache(32), all_logits=True)
    err = np.abs(logits - REF)
    assert err[:4].max() < 0.05 * np.abs(REF).max()
    assert np.sqrt((err**2).mean() / (REF**2).mean()) < 0.15
    assert (logits.argmax(1) == REF.argmax(1)).sum() >= len(TOKENS) - 2


def test_block_fp8_folder(tmp_path):
    """Qwen3-Next-80B-A3B's FP8 releases (block-wise FP8 linears with weight_scale_inv, the fused DeltaNet
    projections included; routers and the shared expert's gate kept wider) load through the FP8 loader and
    give the logits of the same folder with those weights decoded to float32."""
    from engine.backends.cpu.fpquant import FP8_E4M3_BLOCK

    def linear(name: str) -> bool:
        return ".layers." in name and (name.endswith("proj.weight") or "in_proj_" in name)

    fp8, dense = block_fp8_twins(FOLDER, tmp_path, linear)
    config = dict(CONFIG, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                               "weight_block_size": [128, 128]})
    (fp8 / "config.json").write_text(json.dumps(config))
    got, want = load_model(fp8).model, load_model(dense).model
    delta = got.layers[0].delta
    assert delta.in_qkvz.ggml_type == delta.in_ba.ggml_type == FP8_E4M3_BLOCK
    assert got.layers[0].moe.down[3].ggml_type == got.layers[1].w_gate.ggml_type == FP8_E4M3_BLOCK
    a = got.forward(TOKENS, got.new_cache(32), all_logits=True)
    b = want.forward(TOKENS, want.new_cache(32), all_logits=True)
    assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()


def test_memory_estimates_count_the_fixed_state(lm, f16):
    from engine.memory_guard import kv_shape_from_config, kv_shape_from_gguf
    from models.fit import kv_bytes_per_token, kv_bytes_per_token_config

    cache = lm.model.new_cache(8)
    g = open_gguf(f16)
    for shape in (kv_shape_from_config(lm.model.cfg), kv_shape_from_gguf(g.metadata)):
        assert (shape.kv_bytes_per_token, shape.state_bytes) == (cache.bytes_per_token, cache.state_nbytes)
    # the published configs give full_attention_interval, not layer_types
    published = {k: v for k, v in CONFIG.items() if k != "layer_types"} | {"full_attention_interval": 4}
    assert kv_bytes_per_token(g.metadata) == kv_bytes_per_token_config(published) == cache.bytes_per_token
    g.close()
