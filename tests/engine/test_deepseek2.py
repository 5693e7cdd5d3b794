"""DeepSeek-V2/V3 and GLM-4.7-Flash (llama.cpp's deepseek2): multi-head latent attention over a latent cache,
DeepSeek's mixture of experts, llama.cpp's GGUF layout.

The tiny checkpoints (tests/fixtures/tiny/deepseek_v2, deepseek_v3, glm4_moe_lite; made by
scripts/make_tiny_checkpoints.py) cover: no q LoRA, YaRN with mscale / mscale_all_dim, softmax routing limited
to the best of 4 expert groups (V2); q LoRA, sigmoid routing with a choice bias limited to 2 of 4 groups
(V3); values wider than the keys' unrotated part, two shared experts, mlp_layer_types (GLM-4.7-Flash). Each
has a dense first layer. test_hf_repo.py checks every folder's logits and greedy tokens against transformers;
here: the cache, chunked prefill, chat turns, stored prefixes, batched decode, converted GGUFs, mutations.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import engine.arch.moe as moe_module
from engine.arch.deepseek2 import DeepSeek2Model
from engine.arch.moe import route
from engine.convert import convert
from engine.generate import GenerationParams, generate
from engine.kv_cache import LatentKVCache
from engine.loader import load_model
from engine.memory_guard import kv_shape_from_gguf
from engine.prefix_cache import PrefixCache
from models.formats.gguf import open_gguf
from tests.engine.model_checks import (
    check_batched_decode,
    check_speculation_keeps_greedy,
    chunked_logits,
    greedy_tokens,
    rewrite_gguf,
)

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")


def _golden(family: str) -> dict:
    return json.loads((TINY / family / "golden.json").read_text())


def _tol(ref: np.ndarray) -> float:
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


@pytest.fixture(scope="module")
def models():
    return {family: load_model(TINY / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek2")
    return {
        (family, fmt): convert(TINY / family, fmt, out / f"{family}.{fmt}.gguf").output
        for family in FAMILIES
        for fmt in ("F16", "Q8_0")
    }


def test_configs(models):
    v2, v3, glm = (models[f].model.cfg for f in FAMILIES)
    assert all(c.architecture == "deepseek2" and c.first_dense_layers == 1 for c in (v2, v3, glm))
    assert (v2.q_lora_rank, v3.q_lora_rank, glm.q_lora_rank) == (0, 24, 24)
    assert (v2.expert_gating, v2.expert_groups, v2.expert_groups_used, v2.norm_topk_prob) == ("softmax", 4, 1,
                                                                                                False)
    assert (v3.expert_gating, v3.expert_groups, v3.expert_groups_used, v3.norm_topk_prob) == ("sigmoid", 4, 2,
                                                                                                True)
    assert (glm.expert_gating, glm.shared_expert_intermediate_size, glm.v_head_dim) == ("sigmoid", 64, 24)
    assert v2.rope_scaling.kind == "yarn" and v2.mscale_all_dim == pytest.approx(0.707)
    assert not any(c.rope_neox for c in (v2, v3, glm))  # adjacent pairs
    # the softmax scale: 1/sqrt(nope + rope) times mscale(4, 0.707) squared
    mscale = 0.1 * 0.707 * np.log(4.0) + 1.0
    assert models["deepseek_v2"].model.scale == pytest.approx(mscale**2 / np.sqrt(24), rel=1e-6)
    assert models["deepseek_v3"].model.scale == pytest.approx(1 / np.sqrt(24), rel=1e-6)


def test_the_cache_keeps_one_latent_row_per_layer_and_token(models):
    m = models["deepseek_v3"].model
    cache = m.new_cache(32)
    assert isinstance(cache, LatentKVCache) and cache.v is cache.k
    assert cache.k.shape == (3, 1, 32, 32 + 8)
    assert cache.bytes_per_token == 3 * 40 * 4  # decompressed k and v would take 3 * 2 * 4 * (24 + 16) floats
    assert m.new_cache(32, np.float16).bytes_per_token == 3 * 40 * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_chunks_matches_one_pass(models, family):
    ref = np.array(_golden(family)["logits"])
    tokens = _golden(family)["tokens"]
    np.testing.assert_allclose(chunked_logits(models[family].model, tokens, (5, 1, 2, 7, 1)), ref,
                               atol=_tol(ref))


def test_second_chat_turn_reuses_the_first_and_replies_as_a_fresh_cache(models):
    lm = models["glm4_moe_lite"]
    m, tokens = lm.model, _golden("glm4_moe_lite")["tokens"]
    params = GenerationParams(max_tokens=6, temperature=0.0)
    cache = m.new_cache(128)
    reply = [e.token for e in generate(m, lm.tokenizer, tokens, cache, params)]
    turn2 = list(tokens) + reply + [5, 17, 42, 99]
    second = list(generate(m, lm.tokenizer, turn2, cache, params))
    assert second[-1].cached_tokens == len(tokens) + len(reply) - 1
    fresh = [e.token for e in generate(m, lm.tokenizer, turn2, m.new_cache(128), params)]
    assert [e.token for e in second] == fresh


def test_trim_then_other_tokens_is_exact(models):
    m, tokens = models["deepseek_v2"].model, _golden("deepseek_v2")["tokens"]
    cache = m.new_cache(32)
    m.forward(tokens, cache)
    assert cache.trim(6) == 6
    other = [7, 300, 12]
    got = m.forward(other, cache, all_logits=True)
    want = m.forward(tokens[:10] + other, m.new_cache(32), all_logits=True)[10:]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_speculation_with_rejections_keeps_greedy_output(models):
    """Prompt lookup drafts continuations of a repeated prompt; rejected drafts are trimmed off the latent
    cache and the reply stays the plain greedy one."""
    lm = models["deepseek_v2"]
    tokens = _golden("deepseek_v2")["tokens"]
    events = check_speculation_keeps_greedy(lm.model, lm.tokenizer, tokens[:6] * 3)
    assert events[-1].drafted_tokens > events[-1].accepted_tokens  # some drafts were rejected


def test_restored_prefix_continues_exactly(models):
    m, tokens = models["deepseek_v3"].model, _golden("deepseek_v3")["tokens"]
    ref = np.array(_golden("deepseek_v3")["logits"])
    store = PrefixCache(1 << 20)
    cache = m.new_cache(32)
    m.forward(tokens[:12], cache)
    assert store.insert(cache) == 12 * cache.bytes_per_token
    fresh = m.new_cache(32)
    assert store.restore(tokens[:9] + [77, 78], fresh) == 9
    np.testing.assert_array_equal(fresh.k[:, :, :9], cache.k[:, :, :9])
    np.testing.assert_allclose(m.forward(tokens[9:], fresh, all_logits=True), ref[9:], atol=_tol(ref))


def test_float16_cache_stays_close(models):
    m, tokens = models["deepseek_v3"].model, _golden("deepseek_v3")["tokens"]
    ref = np.array(_golden("deepseek_v3")["logits"])
    cache = m.new_cache(32, np.float16)
    logits = m.forward(tokens[:8], cache, all_logits=True)
    logits = np.concatenate([logits, *(m.forward([t], cache).copy() for t in tokens[8:])])
    assert np.abs(logits - ref).max() < 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("family", ["deepseek_v2", "glm4_moe_lite"])
def test_batched_decode_matches_one_sequence_at_a_time(models, family):
    check_batched_decode(models[family].model, ([5, 17, 42], [99, 3, 250, 77, 1], [8]), (8, 120, 33))


def _count_decompressed(monkeypatch) -> list[int]:
    """Patch DeepSeek2Model._decompressed to record each call's pass size; returns the list it appends to."""
    calls, decompressed = [], DeepSeek2Model._decompressed

    def spy(self, i, m, q3, b, kv):
        calls.append(len(kv))
        return decompressed(self, i, m, q3, b, kv)

    monkeypatch.setattr(DeepSeek2Model, "_decompressed", spy)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_decompressed_prefill_matches_the_absorbed_form(models, family, dtype, monkeypatch):
    """Chunks of at least decompress_min_tokens attend with per-head keys and values decompressed from the
    latent rows (the chunk's and the cached ones), shorter ones absorbed: the logits of a chunked prefill
    are the all-absorbed ones and the golden, and the cache keeps the same rows."""
    m, tokens = models[family].model, _golden(family)["tokens"]
    ref = np.array(_golden(family)["logits"])
    sizes = (5, 1, 2, 7, 1)  # a 5 and a 7 after 8 cached rows go decompressed at 4

    def run(threshold):
        monkeypatch.setattr(m, "decompress_min_tokens", threshold)
        cache = m.new_cache(len(tokens) + 1, dtype)
        rows, start = [], 0
        for size in sizes:
            rows.append(m.forward(tokens[start : start + size], cache, all_logits=True))
            start += size
        return np.concatenate(rows), cache

    calls = _count_decompressed(monkeypatch)
    absorbed, absorbed_cache = run(10**9)
    assert calls == []
    mixed, mixed_cache = run(4)
    layers = m.cfg.num_hidden_layers
    assert calls == [5] * layers + [7] * layers
    tol = _tol(ref) if dtype == np.float32 else 2e-2 * np.abs(ref).max()
    np.testing.assert_allclose(mixed, absorbed, atol=1e-5 if dtype == np.float32 else 1e-3)
    np.testing.assert_allclose(mixed, ref, atol=tol)
    # the first layer's rows come before any attention; the later ones from inputs that differ in rounding
    held = slice(0, len(tokens))
    np.testing.assert_array_equal(mixed_cache.k[0, :, held], absorbed_cache.k[0, :, held])
    np.testing.assert_allclose(mixed_cache.k[:, :, held].astype(np.float32),
                               absorbed_cache.k[:, :, held].astype(np.float32), atol=2e-3)


def test_long_passes_take_the_decompressed_form_and_decode_the_absorbed_one(models, monkeypatch):
    """The default dispatch: a pass of decompress_min_tokens tokens decompresses; one
    token less, a decode step and a batched decode step do not."""
    m = models["deepseek_v3"].model
    calls = _count_decompressed(monkeypatch)
    n = DeepSeek2Model.decompress_min_tokens
    tokens = list(np.random.default_rng(1).integers(3, m.cfg.vocab_size, n + 1))
    cache = m.new_cache(n + 4)
    m.forward(tokens[: n - 1], cache)
    assert calls == []
    m.forward(tokens[n - 1 :], cache)
    m.forward([5], cache)
    other = m.new_cache(n + 4)
    m.forward(tokens[:n], other)
    assert calls == [n] * m.cfg.num_hidden_layers
    m.forward_batch([7, 8], [cache, other])
    assert calls == [n] * m.cfg.num_hidden_layers


def test_group_limited_routing():
    """DeepSeek-V2's groups score by their best probability, V3's by the sum of their two best biased scores;
    experts outside the chosen groups are never picked, however high their own score."""
    logits = np.array([[3.0, -5.0, 2.9, 2.8, 0.0, 0.1]], np.float32)  # groups {0, 1}, {2, 3}, {4, 5}
    experts, _ = route(logits, 2, normalize=False, groups=3, groups_used=1)
    np.testing.assert_array_equal(experts, [[0, 1]])  # group 0 has the best expert: both picks come from it
    experts, _ = route(logits, 2, normalize=False)
    np.testing.assert_array_equal(experts, [[0, 2]])
    experts, w = route(logits, 2, normalize=True, sigmoid=True, groups=3, groups_used=1)
    np.testing.assert_array_equal(experts, [[2, 3]])  # group 1's top two sum highest
    s = 1 / (1 + np.exp(-logits[0, [2, 3]]))
    np.testing.assert_allclose(w[0], s / s.sum(), rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_mutations_miss_the_golden(models, family, monkeypatch):
    """What the golden logits pin down: the RoPE pairs (adjacent, not half-split), routed_scaling_factor, the
    group limit of the routing, V2's YaRN mscale_all_dim in the softmax scale."""
    m = models[family].model
    golden = _golden(family)
    ref = np.array(golden["logits"])

    def err() -> float:
        return float(np.abs(m.forward(golden["tokens"], m.new_cache(64), all_logits=True) - ref).max())

    assert err() < _tol(ref)
    monkeypatch.setattr(m.cfg, "rope_neox", True)
    assert err() > 100 * _tol(ref)
    monkeypatch.undo()
    monkeypatch.setattr(m.cfg, "expert_weights_scale", 1.0)
    assert err() > 100 * _tol(ref)
    monkeypatch.undo()
    if m.cfg.expert_groups > 1:
        monkeypatch.setattr(m.cfg, "expert_groups_used", 0)
        assert err() > 100 * _tol(ref)
        monkeypatch.undo()
    if m.cfg.mscale_all_dim:
        monkeypatch.setattr(m, "scale", np.float32(1 / np.sqrt(m.cfg.qk_head_dim)))
        assert err() > 100 * _tol(ref)


def test_gguf_layout_is_llama_cpps(ggufs):
    """llama.cpp's deepseek2 keys and names: the latent as one KV head (key_length r + rope, value_length
    r) with the per-head sizes in the _mla keys; kv_b_proj split into attn_k_b (transposed per head) and
    attn_v_b; merged experts beside the shared ones; V3's routing keys."""
    g = open_gguf(ggufs["deepseek_v3", "Q8_0"])
    md, t = dict(g.metadata), g.tensors
    a = "deepseek2"
    assert g.architecture == a
    assert (md[f"{a}.attention.head_count"], md[f"{a}.attention.head_count_kv"]) == (4, 1)
    assert (md[f"{a}.attention.q_lora_rank"], md[f"{a}.attention.kv_lora_rank"]) == (24, 32)
    assert (md[f"{a}.attention.key_length"], md[f"{a}.attention.value_length"]) == (40, 32)
    assert (md[f"{a}.attention.key_length_mla"], md[f"{a}.attention.value_length_mla"]) == (24, 16)
    assert md[f"{a}.rope.dimension_count"] == 8
    assert (md[f"{a}.expert_count"], md[f"{a}.expert_used_count"]) == (8, 2)
    assert md[f"{a}.expert_shared_count"] == 1
    assert (md[f"{a}.expert_gating_func"], md[f"{a}.expert_weights_norm"]) == (2, True)
    assert md[f"{a}.expert_weights_scale"] == pytest.approx(2.5)
    assert (md[f"{a}.expert_group_count"], md[f"{a}.expert_group_used_count"]) == (4, 2)
    assert (md[f"{a}.leading_dense_block_count"], md[f"{a}.feed_forward_length"]) == (1, 96)
    assert md[f"{a}.expert_feed_forward_length"] == 32
    shapes = {n: tuple(info.shape) for n, info in t.items()}
    assert shapes["blk.0.attn_q_a.weight"] == (24, 64) and shapes["blk.0.attn_q_b.weight"] == (96, 24)
    assert shapes["blk.0.attn_kv_a_mqa.weight"] == (40, 64) and shapes["blk.0.attn_kv_a_norm.weight"] == (32,)
    assert shapes["blk.0.attn_k_b.weight"] == (4, 32, 16) and shapes["blk.0.attn_v_b.weight"] == (4, 16, 32)
    assert "blk.0.attn_kv_b.weight" not in t and "blk.0.ffn_gate.weight" in t
    assert shapes["blk.1.ffn_gate_exps.weight"] == (8, 32, 64) and shapes["blk.1.exp_probs_b.bias"] == (8,)
    assert shapes["blk.1.ffn_down_shexp.weight"] == (64, 32)
    assert kv_shape_from_gguf(md).kv_bytes_per_token == 3 * 40 * 4
    g.close()
    v2 = open_gguf(ggufs["deepseek_v2", "F16"]).metadata
    assert v2["deepseek2.attention.q_lora_rank"] == 0 and v2["deepseek2.expert_gating_func"] == 1
    assert v2["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_models_give_transformers_logits(ggufs, family, monkeypatch):
    """F16 within 1e-4 of transformers with its greedy tokens; Q8_0, run with the F16 model's expert
    choices (Q8_0's error can flip a close choice), within a few percent."""
    golden = _golden(family)
    ref = np.array(golden["logits"])
    scale = max(1.0, np.abs(ref).max())
    routes = []
    route_f16 = moe_module.route

    def recording(*args):
        routes.append(route_f16(*args))
        return routes[-1]

    m = load_model(ggufs[family, "F16"]).model
    assert isinstance(m, DeepSeek2Model)
    monkeypatch.setattr(moe_module, "route", recording)
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    monkeypatch.setattr(moe_module, "route", route_f16)
    assert np.abs(logits - ref).max() < 1e-4 * scale
    assert greedy_tokens(m, golden["tokens"], len(golden["greedy"])) == golden["greedy"]
    m = load_model(ggufs[family, "Q8_0"]).model
    replay = iter(routes)
    monkeypatch.setattr(moe_module, "route", lambda *args, it=replay: next(it))
    err = np.abs(m.forward(golden["tokens"], m.new_cache(64), all_logits=True) - ref).max(axis=1) / scale
    assert next(replay, None) is None
    # MLA's latent path stacks more quantized matrices per head than the llama attention (q LoRA, kv_a,
    # v_b): measured median 0.020-0.031, max 0.036-0.073
    assert np.median(err) < 4e-2 and err.max() < 9e-2, err


def test_llama_cpps_older_files_with_one_kv_b(ggufs, tmp_path):
    """llama.cpp's files from before the split keep kv_b_proj whole as attn_kv_b (and per-head sizes in
    key_length / value_length): the same model."""
    src = ggufs["glm4_moe_lite", "F16"]
    golden = _golden("glm4_moe_lite")
    g = open_gguf(src)
    a, heads, nope, v, r = "deepseek2", 4, 16, 24, 32
    k_b = {n: np.array(info.array()) for n, info in g.tensors.items() if n.endswith("attn_k_b.weight")}
    v_b = {n: np.array(info.array()) for n, info in g.tensors.items() if n.endswith("attn_v_b.weight")}
    g.close()
    old = tmp_path / "old.gguf"
    rewrite_gguf(src, old, metadata={f"{a}.attention.key_length": nope + 8, f"{a}.attention.value_length": v},
                 drop_keys=(f"{a}.attention.key_length_mla", f"{a}.attention.value_length_mla"))
    # the kv_b rows back together: per head its key rows (k_b transposed), then its value rows
    from engine.quant.gguf_writer import GGUFWriter

    g = open_gguf(old)
    md = {k: val for k, val in g.metadata.items() if k != "general.alignment"}
    specs, data = [], {}
    for name, info in g.tensors.items():
        if name.endswith("attn_v_b.weight"):
            continue
        arr = np.ascontiguousarray(info.raw()).reshape(-1)
        shape = tuple(info.shape)
        if name.endswith("attn_k_b.weight"):
            kv = np.concatenate([k_b[name].transpose(0, 2, 1), v_b[name.replace("k_b", "v_b")]], axis=1)
            name, shape = name.replace("attn_k_b", "attn_kv_b"), (heads * (nope + v), r)
            arr = np.ascontiguousarray(kv.reshape(shape).astype(np.float16)).view(np.uint8).reshape(-1)
        specs.append((name, 1 if name.endswith("attn_kv_b.weight") else info.ggml_type, shape))
        data[name] = arr
    g.close()
    with open(tmp_path / "older.gguf", "wb") as fh:
        w = GGUFWriter(fh, md, specs)
        w.write_header()
        for n, _, _ in specs:
            w.write_tensor(n, data[n])
        w.finish()
    m = load_model(tmp_path / "older.gguf").model
    assert m.cfg.qk_nope_head_dim == nope and m.cfg.v_head_dim == v
    ref = np.array(golden["logits"])
    np.testing.assert_allclose(m.forward(golden["tokens"], m.new_cache(64), all_logits=True), ref,
                               atol=_tol(ref))


def _write_st(path: Path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
    header, off = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + b"".join(d for _, _, d in tensors.values()))


def test_block_fp8_folder_runs_as_its_decoded_weights(tmp_path):
    """DeepSeek-V3's FP8 release layout (F8_E4M3 linears with a weight_scale_inv per 128 x 128 block),
    kv_b_proj included: the same logits as a folder holding the decoded values as F32, also once converted
    to a GGUF."""
    import shutil

    from engine.quant.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
    from engine.weights import float32_of
    from models.formats.safetensors import open_safetensors_repo

    src = TINY / "deepseek_v3"
    st = open_safetensors_repo(src)
    fp8, plain = {}, {}
    for name, info in st.tensors.items():
        x = float32_of(st.array(name), info.dtype == "BF16")
        linear = name.startswith("model.layers.") and x.ndim == 2 and not name.endswith("mlp.gate.weight")
        if linear:
            codes, scale = quantize_fp8_blocks(x)
            fp8[name] = ("F8_E4M3", x.shape, codes.tobytes())
            fp8[name + "_scale_inv"] = ("F32", scale.shape, scale.tobytes())
            x = dequantize_fp8_blocks(codes, scale)
        else:
            fp8[name] = ("F32", x.shape, np.ascontiguousarray(x).tobytes())
        plain[name] = ("F32", x.shape, np.ascontiguousarray(x, np.float32).tobytes())
    st.close()
    config = json.loads((src / "config.json").read_text())
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    for folder, tensors, extra in (
        (tmp_path / "fp8", fp8, {"quantization_config": quantization}),
        (tmp_path / "decoded", plain, {}),
    ):
        folder.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(src / f, folder / f)
        (folder / "config.json").write_text(json.dumps(config | extra))
        _write_st(folder / "model.safetensors", tensors)
    tokens = _golden("deepseek_v3")["tokens"]
    got = load_model(tmp_path / "fp8").model
    assert got.layers[1].mla.v_b.ggml_type == 1003  # FP8_E4M3_BLOCK, computed on as stored
    want = load_model(tmp_path / "decoded").model
    ref = want.forward(tokens, want.new_cache(64), all_logits=True)
    np.testing.assert_allclose(got.forward(tokens, got.new_cache(64), all_logits=True), ref, atol=_tol(ref))
    gguf = load_model(convert(tmp_path / "fp8", "F16", tmp_path / "fp8.gguf").output).model
    np.testing.assert_allclose(gguf.forward(tokens, gguf.new_cache(64), all_logits=True), ref,
                               atol=30 * _tol(ref))  # F16 rounding of the decoded values (measured 15)


def test_requantizing_a_gguf_and_what_is_declined(ggufs, tmp_path):
    """A deepseek2 GGUF re-quantizes (Q4_K_M: attn_k_b's 16-wide rows fall back to a type that takes them);
    AWQ and the FP8 safetensors export decline it with a typed error."""
    from engine.errors import ModelFormatError, UnsupportedArchitectureError

    out = convert(ggufs["deepseek_v3", "F16"], "Q4_K_M", tmp_path / "v3.Q4_K_M.gguf").output
    m = load_model(out).model
    golden = _golden("deepseek_v3")
    ref = np.array(golden["logits"])
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    assert np.abs(logits - ref).max() < 0.8 * np.abs(ref).max()  # 4-bit weights on a tiny random model
    with pytest.raises(UnsupportedArchitectureError, match="latent attention"):
        convert(TINY / "deepseek_v3", "awq", tmp_path / "awq")
    with pytest.raises(ModelFormatError, match="deepseek2"):
        convert(TINY / "deepseek_v3", "fp8", tmp_path / "fp8")


def test_the_server_engine_batches_and_reuses_latent_caches(models):
    """`hearth serve`'s engine: three greedy requests decode in shared steps over latent caches, then a
    request extending the first prompt reuses what the engine kept of it; each reply is the one a lone
    greedy run gives."""
    import threading

    from engine.server.scheduler import Engine, SeqParams

    lm = models["deepseek_v3"]
    m, ends = lm.model, sorted(lm.tokenizer.eot_ids)
    engine = Engine(m, lm.tokenizer, n_ctx=64, max_seqs=4, prefix_cache_bytes=1 << 20)

    def run(prompts):
        replies = [[] for _ in prompts]
        done = [threading.Event() for _ in prompts]
        for i, ids in enumerate(prompts):
            def emit(delta, i=i):
                replies[i].append(delta)
                if delta.finish_reason or delta.error:
                    done[i].set()

            engine.submit(SeqParams(prompt_ids=ids, max_tokens=6, temperature=0.0, ignore_eos=True), emit)
        assert all(ev.wait(120) for ev in done)
        return replies

    def alone(ids):
        cache, out = m.new_cache(64), []
        step = m.forward(ids, cache)
        for _ in range(6):  # greedy; never end-of-turn tokens (ignore_eos) nor the padded vocabulary rows
            row = step[-1].copy()
            row[ends] = -np.inf
            row[lm.tokenizer.vocab_size :] = -np.inf
            out.append(int(np.argmax(row)))
            step = m.forward([out[-1]], cache)
        return out

    prompts = [[5, 17, 42, 8, 3], [99, 3, 250, 77, 1], [8, 9, 10, 11]]
    engine.start()
    try:
        first = run(prompts)
        seen = engine.max_batch_seen
        again = prompts[0] + [7, 12]
        (second,) = run([again])
    finally:
        engine.stop()
    assert seen >= 2
    for ids, deltas in zip([*prompts, again], [*first, second], strict=True):
        assert deltas[-1].error is None
        assert [d.token for d in deltas if d.token is not None] == alone(ids)
    assert second[-1].cached_tokens >= len(prompts[0])


@pytest.mark.parametrize("family", ["glm4_moe_lite", "glm4", "glm4moe"])
def test_glm_tokenizers_are_named_glm4_in_a_gguf(tmp_path, family):
    """GLM-4.7-Flash's, GLM-4-0414's and GLM-4.5's tokenizer.json split as Llama 3 does; llama.cpp's converter
    names that glm4 (merges applied, no BOS), and so does Hearth's."""
    import shutil

    from engine.tokenizer import _LLAMA3

    folder = tmp_path / "glm"
    shutil.copytree(TINY / family, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    out = convert(folder, "F16", tmp_path / "glm.gguf").output
    assert open_gguf(out).metadata["tokenizer.ggml.pre"] == "glm4"


@pytest.mark.parametrize(("change", "message"), [
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"attention_bias": True}, "linear biases"),
    ({"topk_method": "sinkhorn"}, "sinkhorn"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "dense layers must come first"),
])
def test_configs_hearth_cannot_run_are_refused_by_name(tmp_path, change, message):
    import shutil

    from engine.errors import UnsupportedArchitectureError

    folder = tmp_path / "m"
    shutil.copytree(TINY / "glm4_moe_lite", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UnsupportedArchitectureError, match=message):
        load_model(folder)
