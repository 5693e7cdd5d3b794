"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): routing, GGUF conversion and loading, against
transformers' outputs for the tiny checkpoints of tests/fixtures/tiny (scripts/make_tiny_checkpoints.py).

The safetensors folders themselves are checked by test_hf_repo.py (every family with a golden.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.arch.moe import route
from engine.backends import cpu
from engine.convert import convert
from engine.errors import ModelFormatError
from engine.loader import load_model
from models.formats.gguf import open_gguf
from tests.engine.model_checks import greedy_tokens

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
FAMILIES = {"qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "mixtral": "llama"}  # fixture -> GGUF arch
EXPERT_FF = {"qwen3moe": 48, "qwen2moe": 48, "mixtral": 96}


def test_route_picks_the_largest_logits_and_weighs_them():
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, -1.0, 0.0]], np.float32)
    experts, w = route(logits, 2, normalize=True)
    np.testing.assert_array_equal(experts, [[1, 2], [0, 1]])  # a tie: the lower index first
    e3, e2 = np.exp(3.0), np.exp(2.0)
    np.testing.assert_allclose(w[0], [e3 / (e3 + e2), e2 / (e3 + e2)], rtol=1e-6)
    np.testing.assert_allclose(w[1], [0.5, 0.5], rtol=1e-6)
    _, raw = route(logits, 2, normalize=False)  # the softmax over all experts, taken at the chosen two
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(raw[0], p[[1, 2]], rtol=1e-6)
    assert w.dtype == np.float32 and raw.sum() < w.sum()


def _golden(family: str) -> dict:
    return json.loads((TINY / family / "golden.json").read_text())


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("moe")
    return {
        (family, fmt): convert(TINY / family, fmt, out / f"{family}.{fmt}.gguf").output
        for family in FAMILIES
        for fmt in ("F16", "Q8_0")
    }


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_layout_is_llama_cpps(ggufs, family):
    g = open_gguf(ggufs[family, "Q8_0"])
    arch = FAMILIES[family]
    assert g.architecture == arch
    md = g.metadata
    assert (md[f"{arch}.expert_count"], md[f"{arch}.expert_used_count"]) == (4, 2)
    if family != "mixtral":
        assert md[f"{arch}.expert_feed_forward_length"] == 48 and md[f"{arch}.feed_forward_length"] == 96
    assert md[f"{arch}.expert_weights_norm"] == (family != "qwen2moe")
    ff = EXPERT_FF[family]
    t = g.tensors
    assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (4, ff, 64)
    assert tuple(t["blk.1.ffn_up_exps.weight"].shape) == (4, ff, 64)
    assert tuple(t["blk.1.ffn_down_exps.weight"].shape) == (4, 64, ff)
    assert t["blk.1.ffn_gate_exps.weight"].type_name == "Q8_0"  # (Qwen's 48-column down rows: F16)
    router = t["blk.1.ffn_gate_inp.weight"]
    assert tuple(router.shape) == (4, 64) and router.type_name == "F32"
    assert not any(n.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")) for n in t)
    if family == "qwen2moe":  # the shared expert, under llama.cpp's names; its one-row gate stays F32
        assert md["qwen2moe.expert_shared_feed_forward_length"] == 64
        for kind, shape in (("gate", (64, 64)), ("up", (64, 64)), ("down", (64, 64))):
            shexp = t[f"blk.1.ffn_{kind}_shexp.weight"]
            assert tuple(shexp.shape) == shape and shexp.type_name == "Q8_0"
        gate = t["blk.1.ffn_gate_inp_shexp.weight"]
        assert tuple(gate.shape) == (1, 64) and gate.type_name == "F32"
    else:
        assert not any("shexp" in n for n in t)
    g.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_models_give_transformers_logits(ggufs, family, monkeypatch):
    import engine.arch.moe as moe_module

    golden = _golden(family)
    ref = np.array(golden["logits"])
    scale = max(1.0, np.abs(ref).max())
    routes = []  # the F16 model's routing, layer by layer, replayed in the Q8_0 model (below)
    route_f16 = moe_module.route

    def recording(*args):
        routes.append(route_f16(*args))
        return routes[-1]

    for fmt in ("F16", "Q8_0"):
        lm = load_model(ggufs[family, fmt])
        m = lm.model
        assert m.cfg.num_experts == 4 and m.cfg.num_experts_per_tok == 2
        assert m.cfg.norm_topk_prob == (family != "qwen2moe")
        assert all((layer.moe.shared is not None) == (family == "qwen2moe") for layer in m.layers)
        assert all(layer.moe is not None and layer.w_gate is None for layer in m.layers)
        if fmt == "Q8_0":
            # Q8_0's error can flip a close second/third expert choice (Qwen2-MoE's fixture: one token in
            # layer 0, which every later position then attends to); with the F16 model's routing the
            # remaining error is Q8_0's alone
            replay = iter(routes)
            monkeypatch.setattr(moe_module, "route", lambda *args, it=replay: next(it))
            err = np.abs(m.forward(golden["tokens"], m.new_cache(64), all_logits=True) - ref).max(axis=1)
            assert next(replay, None) is None
            assert np.median(err / scale) < 3e-2 and (err / scale).max() < 5e-2, err / scale
            continue
        monkeypatch.setattr(moe_module, "route", recording)
        logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
        monkeypatch.setattr(moe_module, "route", route_f16)
        assert len(routes) == m.cfg.num_hidden_layers
        assert np.abs(logits - ref).max() / scale < 1e-4
        assert np.array_equal(logits.argmax(1), ref.argmax(1))
        # greedy, one token a step through the KV cache
        assert greedy_tokens(m, golden["tokens"], len(golden["greedy"])) == golden["greedy"]


def test_decode_runs_only_the_chosen_experts(ggufs, monkeypatch):
    m = load_model(ggufs["qwen3moe", "Q8_0"]).model
    cache = m.new_cache(32)
    m.forward([5, 17, 42], cache)
    experts = {id(w): (i, kind) for i, layer in enumerate(m.layers)
               for kind in ("gate", "up", "down") for w in getattr(layer.moe, kind)}
    ran = []
    linear = cpu.linear

    def counting(out, w, x):
        if id(w) in experts:
            ran.append(experts[id(w)])
        linear(out, w, x)

    monkeypatch.setattr(cpu, "linear", counting)
    m.forward([99], cache)
    for i in range(len(m.layers)):  # 2 experts of 4 a token: 2 gate, 2 up and 2 down matrices a layer
        assert sorted(k for layer, k in ran if layer == i) == ["down"] * 2 + ["gate"] * 2 + ["up"] * 2


def test_moe_models_have_no_fused_draft_step_and_no_safetensors_export(ggufs, tmp_path):
    from engine.backends.cpu.draft import DraftForward

    assert DraftForward.build(load_model(ggufs["mixtral", "F16"]).model) is None
    with pytest.raises(ModelFormatError, match="mixture-of-experts"):
        convert(ggufs["mixtral", "F16"], "safetensors", tmp_path / "out")


def test_block_fp8_experts_load_from_safetensors(tmp_path):
    """A Qwen3-MoE folder stored as Qwen3-30B-A3B-FP8 is (block-wise FP8 linears, experts included)
    gives the logits of the same folder with those weights decoded to float32 (the reference decoder)."""
    from engine.backends.cpu.fpquant import FP8_E4M3_BLOCK
    from tests.engine.model_checks import block_fp8_twins

    src = TINY / "qwen3moe"
    block_fp8_twins(src, tmp_path, lambda name: ".layers." in name and name.endswith("proj.weight"))
    # the Hub's Qwen3-MoE configs (transformers 4) name the expert count num_experts
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    tokens = _golden("qwen3moe")["tokens"]
    got, want = (load_model(tmp_path / f).model for f in ("fp8", "dense"))
    assert got.layers[1].moe.down[3].ggml_type == FP8_E4M3_BLOCK
    a = got.forward(tokens, got.new_cache(32), all_logits=True)
    b = want.forward(tokens, want.new_cache(32), all_logits=True)
    assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()


def test_moe_with_dense_layers_between_is_refused(tmp_path):
    import shutil

    from engine.errors import UnsupportedArchitectureError

    shutil.copytree(TINY / "qwen3moe", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["mlp_only_layers"] = [0]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="mlp_only_layers"):
        load_model(tmp_path / "m")


def test_mixtral_gguf_with_one_tensor_per_expert(ggufs, tmp_path):
    """GGUF files from before llama.cpp merged the experts (early Mixtral uploads) hold one tensor per
    expert, blk.N.ffn_gate.E.weight: the same model."""
    from engine.quant.gguf_writer import GGUFWriter

    src = open_gguf(ggufs["mixtral", "Q8_0"])
    specs, data = [], {}
    for name, t in src.tensors.items():
        if "_exps." in name:
            rows = t.raw().reshape(t.shape[0], -1, t.raw().shape[1])
            for e in range(t.shape[0]):
                split = name.replace("_exps.weight", f".{e}.weight")
                specs.append((split, t.ggml_type, tuple(t.shape[1:])))
                data[split] = rows[e]
        else:
            specs.append((name, t.ggml_type, tuple(t.shape)))
            data[name] = t.raw()
    path = tmp_path / "split.gguf"
    with open(path, "wb") as fh:
        w = GGUFWriter(fh, dict(src.metadata), specs)
        w.write_header()
        for name, _, _ in specs:
            w.write_tensor(name, np.ascontiguousarray(data[name]).reshape(-1))
        w.finish()
    src.close()
    assert "blk.0.ffn_down.3.weight" in open_gguf(path).tensors
    tokens = _golden("mixtral")["tokens"]
    a, b = load_model(path).model, load_model(ggufs["mixtral", "Q8_0"]).model
    got = a.forward(tokens, a.new_cache(32), all_logits=True)
    np.testing.assert_array_equal(got, b.forward(tokens, b.new_cache(32), all_logits=True))


@pytest.mark.parametrize("t", sorted(cpu.experts.GATHER_TYPES))
def test_linear_experts_gives_each_expert_its_own_matvec_bits(t):
    """k experts of a stacked tensor in one pass, with one shared input and with one input each: the
    bits cpu.linear gives on each expert alone (the same dot kernel on the same int16 activations)."""
    import gguf

    from tests.engine.test_cpu_kernels import make_weight

    rng = np.random.default_rng(t)
    n_experts, rows, cols = 6, 10, 256  # 10 rows: two groups of four and a clamped tail
    stack, _ = make_weight(gguf.GGMLQuantizationType(t), n_experts * rows, cols, rng)
    chosen = np.array([4, 1, 5])
    for n_x in (1, 3):
        x = rng.standard_normal((n_x, cols)).astype(np.float32)
        out = np.full((3, rows), np.nan, np.float32)
        cpu.linear_experts(out, stack, x, chosen * rows, rows)
        for j, e in enumerate(chosen):
            one = np.empty((1, rows), np.float32)
            cpu.linear(one, stack.row_block(e * rows, (e + 1) * rows), x[j % n_x : j % n_x + 1])
            np.testing.assert_array_equal(out[j], one[0])
    with pytest.raises(ValueError, match="outside"):
        cpu.linear_experts(out, stack, x, np.array([0, 1, 6]) * rows, rows)


def test_one_token_over_merged_experts_keeps_the_expert_by_expert_bits(ggufs):
    """Mixtral's Q8_0 experts go through cpu.linear_experts a step at a time: the logits of the expert-by-
    expert path bit for bit, and a 3-token pass (a speculative verify) gives each token what decode gives."""
    fast, slow = (load_model(ggufs["mixtral", "Q8_0"]).model for _ in range(2))
    assert all(layer.moe.stacks is not None for layer in fast.layers)
    for layer in slow.layers:
        layer.moe.stacks = None
    prompt, steps = [5, 17, 42, 99, 3], [250, 77, 1]
    caches = [m.new_cache(16) for m in (fast, slow, fast)]
    for m, cache in zip((fast, slow), caches, strict=False):
        m.forward(prompt, cache)
    decoded = []
    for tok in steps:
        a = fast.forward([tok], caches[0]).copy()
        np.testing.assert_array_equal(a, slow.forward([tok], caches[1]))
        decoded.append(a[0])
    fast.forward(prompt, caches[2])
    np.testing.assert_array_equal(fast.forward(steps, caches[2], all_logits=True), np.array(decoded))
    # Qwen's 48-column down rows are F16 in its Q8_0 file: no merged path, expert by expert
    assert load_model(ggufs["qwen3moe", "Q8_0"]).model.layers[0].moe.stacks is None


def test_qwen2moe_gguf_as_llama_cpp_writes_it(ggufs, tmp_path):
    """llama.cpp's Qwen2-MoE GGUFs carry no expert_weights_norm key (its graph never renormalizes) and may
    hold the shared expert's gate as a vector (n_embd,): the same model as Hearth's own file."""
    from engine.quant.gguf_writer import GGUFWriter

    src = open_gguf(ggufs["qwen2moe", "Q8_0"])
    metadata = {k: v for k, v in src.metadata.items() if k != "qwen2moe.expert_weights_norm"}
    specs = [(n, t.ggml_type, (64,) if n.endswith("inp_shexp.weight") else tuple(t.shape))
             for n, t in src.tensors.items()]
    path = tmp_path / "llama-cpp.gguf"
    with open(path, "wb") as fh:
        w = GGUFWriter(fh, metadata, specs)
        w.write_header()
        for name, _, _ in specs:
            w.write_tensor(name, np.ascontiguousarray(src.tensors[name].raw()).reshape(-1))
        w.finish()
    src.close()
    a, b = load_model(path).model, load_model(ggufs["qwen2moe", "Q8_0"]).model
    assert not a.cfg.norm_topk_prob and a.layers[0].moe.shared_gate.shape == (64,)
    tokens = _golden("qwen2moe")["tokens"]
    np.testing.assert_array_equal(a.forward(tokens, a.new_cache(32), all_logits=True),
                                  b.forward(tokens, b.new_cache(32), all_logits=True))


def test_qwen2moe_decode_steps_match_a_verify_pass(ggufs):
    """The shared expert's gate logit is summed in one order for a row alone or in a batch: each token of a
    3-token pass (a speculative verify) gets the bits decode gives it."""
    m = load_model(ggufs["qwen2moe", "Q8_0"]).model
    prompt, steps = [5, 17, 42, 99, 3], [250, 77, 1]
    cache = m.new_cache(16)
    m.forward(prompt, cache)
    decoded = [m.forward([tok], cache)[0].copy() for tok in steps]
    cache = m.new_cache(16)
    m.forward(prompt, cache)
    np.testing.assert_array_equal(m.forward(steps, cache, all_logits=True), np.array(decoded))


def test_mxfp4_moe_conversion_writes_llama_cpps_mxfp4_experts(tmp_path):
    """`hearth convert FOLDER MXFP4_MOE`: every expert tensor in MXFP4 with the bytes gguf-py's (llama.cpp's)
    encoder writes, the other matrices Q8_0, the router F32; the model runs close to transformers."""
    import gguf

    from engine.quant.source import open_source

    out = convert(TINY / "mixtral", "MXFP4_MOE", tmp_path / "m.gguf").output
    g = open_gguf(out)
    assert g.metadata["general.file_type"] == 38
    types = {n: t.type_name for n, t in g.tensors.items()}
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.1.ffn_up_exps.weight"] == "MXFP4"
    assert types["blk.1.attn_q.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"
    with open_source(TINY / "mixtral") as src:
        x = src.tensor("blk.1.ffn_gate_exps.weight")
    want = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(g.tensors["blk.1.ffn_gate_exps.weight"].raw().reshape(want.shape), want)
    g.close()
    golden = _golden("mixtral")
    ref = np.array(golden["logits"])
    m = load_model(out).model
    err = np.abs(m.forward(golden["tokens"], m.new_cache(32), all_logits=True) - ref).max(axis=1)
    assert np.median(err) < 0.2 * np.abs(ref).max()  # 4-bit experts: Q4_0 gives 0.26 of the scale here


def test_glm45_moe_in_gguf_with_llama_cpps_keys_and_nextn_layers(tmp_path):
    """GLM-4.5 (the fixture: a dense first layer, then sigmoid-routed experts with a choice bias, scaled by
    2.5, beside an ungated shared expert) as a glm4moe GGUF: llama.cpp's keys; block_count that counts a
    next-token-prediction layer (nextn_predict_layers), whose tensors are not run; the pre-FFN norm under
    llama.cpp's name post_attention_norm (or ffn_norm). Group-limited routing (DeepSeek-V3) is refused."""
    from tests.engine.model_checks import rewrite_gguf

    golden = _golden("glm4moe")
    out = convert(TINY / "glm4moe", "F16", tmp_path / "glm.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert g.architecture == "glm4moe"
    assert (md["glm4moe.expert_gating_func"], md["glm4moe.leading_dense_block_count"]) == (2, 1)
    assert (md["glm4moe.expert_shared_count"], md["glm4moe.expert_weights_scale"]) == (1, 2.5)
    assert "blk.0.ffn_gate.weight" in g.tensors and "blk.1.ffn_gate_exps.weight" in g.tensors
    assert g.tensors["blk.1.exp_probs_b.bias"].type_name == "F32"
    assert "blk.1.post_attention_norm.weight" in g.tensors and "blk.1.ffn_norm.weight" not in g.tensors
    # llama.cpp's file: one more block (the MTP layer, a copy of the last here); and Hearth's conversions
    # before 2026-12 named the pre-FFN norm ffn_norm
    g.close()

    def rename(name):
        name = name.replace("post_attention_norm.weight", "ffn_norm.weight")
        return (name, name.replace("blk.2.", "blk.3.")) if name.startswith("blk.2.") else name

    rewrite_gguf(out, tmp_path / "llama-cpp.gguf", rename,
                 {"glm4moe.block_count": 4, "glm4moe.nextn_predict_layers": 1})
    ref = np.array(golden["logits"])
    for path in (out, tmp_path / "llama-cpp.gguf"):
        m = load_model(path).model
        assert m.cfg.num_hidden_layers == 3 and m.layers[0].moe is None
        assert m.layers[1].moe.shared is not None and m.layers[1].moe.shared_gate is None
        err = np.abs(m.forward(golden["tokens"], m.new_cache(32), all_logits=True) - ref).max()
        assert err < 1e-3 * np.abs(ref).max(), err  # F16 weights
    config = json.loads((TINY / "glm4moe" / "config.json").read_text())
    import shutil

    shutil.copytree(TINY / "glm4moe", tmp_path / "grouped")
    (tmp_path / "grouped" / "config.json").write_text(json.dumps(config | {"n_group": 2, "topk_group": 1}))
    grouped = load_model(tmp_path / "grouped").model.cfg  # group-limited routing (moe.route)
    assert (grouped.expert_groups, grouped.expert_groups_used) == (2, 1)


def test_sigmoid_routing_chooses_by_biased_score_and_weighs_by_score():
    logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)
    bias = np.array([3.0, 0.0, 0.0, 0.0], np.float32)
    experts, w = route(logits, 2, normalize=True, sigmoid=True, bias=bias, scale=2.5)
    s = 1 / (1 + np.exp(-logits[0]))
    np.testing.assert_array_equal(experts, [[0, 1]])  # expert 0 chosen by its bias, not its score
    np.testing.assert_allclose(w[0], 2.5 * s[[0, 1]] / s[[0, 1]].sum(), rtol=1e-6)


def test_glm45_batched_decode_matches_one_sequence_at_a_time():
    """The server's batched step on GLM-4.5 (dense first layer with its own FFN length, sigmoid-routed
    experts): each sequence's logits as its own decode step gives them."""
    from tests.engine.model_checks import check_batched_decode

    check_batched_decode(load_model(TINY / "glm4moe").model, ([5, 17, 42], [99, 3, 250, 77]), (8, 120))


def test_softmax_routing_with_a_choice_bias_weighs_by_probability():
    """ERNIE 4.5 MoE: the k largest of softmax probability + bias are chosen, weighted by their probabilities
    alone, renormalized (the sum held at least moe_norm_min)."""
    logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, -0.5, 0.9], np.float32)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    experts, w = route(logits, 2, normalize=True, bias=bias)
    np.testing.assert_array_equal(experts, [[3, 1]])  # expert 3 by its bias, expert 2 left out by its own
    np.testing.assert_allclose(w[0], p[[3, 1]] / p[[3, 1]].sum(), rtol=1e-6)
    _, raw = route(logits, 2, normalize=False, bias=bias)
    np.testing.assert_allclose(raw[0], p[[3, 1]], rtol=1e-6)
    tiny = np.array([[-60.0, -60.0, 60.0, -60.0]], np.float32)  # chosen probabilities that sum to ~0
    _, w = route(tiny, 2, normalize=True, bias=np.array([1.0, 1.0, -2.0, 0.0], np.float32))
    assert np.isfinite(w).all() and w.max() < 1e-20
    with pytest.raises(ValueError, match="group-limited"):
        route(logits, 2, normalize=True, bias=bias, groups=2, groups_used=1)


def test_ernie45_moe_layers_experts_and_shared_experts_from_its_config():
    """The fixture (ERNIE-4.5-21B-A3B's layout, scaled down): a dense first layer (moe_layer_start_index 1),
    experts every other layer after it (moe_layer_interval 2: layers 1 and 3), 6 experts, 3 a token, their
    choice bias read from moe_statics (1, experts), and 2 shared experts of 32 as one ungated SwiGLU of 64.
    moe_layer_end_index short of the last layer leaves the layers after it dense (in a GGUF: Hearth's
    mlp_only_layers beside llama.cpp's keys); keys a config leaves out take transformers' defaults (start 1,
    interval 1, end the last layer)."""
    m = load_model(TINY / "ernie4_5_moe").model
    cfg = m.cfg
    assert (cfg.architecture, cfg.rope_neox) == ("ernie4_5-moe", False)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (6, 3, 32)
    assert (cfg.dense_intermediate_size, cfg.shared_expert_intermediate_size) == (96, 64)
    assert [layer.moe is not None for layer in m.layers] == [False, True, False, True]
    assert m.layers[2].w_gate.rows == 96 and m.layers[1].moe.shared_gate is None
    assert m.layers[1].moe.shared[0].rows == 64 and m.layers[1].moe.score_bias.shape == (6,)
    assert m.layers[1].moe.score_bias.any()
    from engine.arch.llama import LlamaConfig
    from engine.hf_repo import config_from_hf
    from engine.quant.hf_meta import metadata_from_hf

    config = json.loads((TINY / "ernie4_5_moe" / "config.json").read_text())
    cut = config_from_hf(TINY / "ernie4_5_moe", config | {"moe_layer_end_index": 2})
    assert [cut.has_experts(i) for i in range(4)] == [False, True, False, False]
    # in a GGUF: llama.cpp's keys imply layer 2 dense, Hearth's mlp_only_layers adds layer 3
    md = metadata_from_hf(TINY / "ernie4_5_moe", config, cut)
    assert md["ernie4_5-moe.mlp_only_layers"] == [3] and md["ernie4_5-moe.interleave_moe_layer_step"] == 2
    back = LlamaConfig.from_gguf(md, 320)
    assert [back.has_experts(i) for i in range(4)] == [False, True, False, False]
    assert (back.dense_intermediate_size, back.shared_expert_intermediate_size) == (96, 64)
    for key in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"):
        del config[key]
    defaults = config_from_hf(TINY / "ernie4_5_moe", config)
    assert [defaults.has_experts(i) for i in range(4)] == [False, True, True, True]


def test_ernie45_moe_golden_needs_the_choice_bias_and_shared_experts():
    """The fixture's golden tells the routing apart: without the choice bias, with it in the weights too, or
    without the shared experts, the logits leave transformers' by far more than the golden test allows."""
    import engine.arch.moe as moe_module

    golden = _golden("ernie4_5_moe")
    ref = np.array(golden["logits"])

    def error(model) -> float:
        return np.abs(model.forward(golden["tokens"], model.new_cache(32), all_logits=True) - ref).max()

    tolerance = 1e-4 * np.abs(ref).max()
    assert error(load_model(TINY / "ernie4_5_moe").model) < tolerance
    m = load_model(TINY / "ernie4_5_moe").model
    for layer in m.layers[1::2]:
        layer.moe.score_bias = None
    assert error(m) > 100 * tolerance
    m = load_model(TINY / "ernie4_5_moe").model
    for layer in m.layers[1::2]:
        layer.moe.shared = None
    assert error(m) > 100 * tolerance
    route_ = moe_module.route

    def biased_weights(logits, k, normalize, sigmoid, bias, *rest):
        top, _ = route_(logits, k, normalize, sigmoid, bias, *rest)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        w = np.take_along_axis(p / p.sum(axis=1, keepdims=True) + bias, top, axis=1)
        return top, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)

    m = load_model(TINY / "ernie4_5_moe").model
    moe_module.route = biased_weights
    try:
        assert error(m) > 100 * tolerance
    finally:
        moe_module.route = route_


def test_ernie45_moe_gguf_round_trip_with_llama_cpps_keys(tmp_path, monkeypatch):
    """`hearth convert` writes llama.cpp's ernie4_5-moe layout (its keys for the leading dense layers, the
    expert layers' step and the shared experts; the choice bias squeezed to (experts,) as its converter does)
    and the F32 file gives transformers' logits and greedy tokens; a Q8_0 file, with the F32 file's routing
    replayed, stays within Q8_0's error. A file as llama.cpp's converter writes it (the shared experts'
    length as intermediate_size // num_key_value_heads, 48 here) with the bias unsqueezed loads the same
    model."""
    import engine.arch.moe as moe_module
    from tests.engine.model_checks import rewrite_gguf

    golden = _golden("ernie4_5_moe")
    ref = np.array(golden["logits"])
    scale = np.abs(ref).max()
    out = convert(TINY / "ernie4_5_moe", "F32", tmp_path / "e.gguf").output
    g = open_gguf(out)
    md, a = dict(g.metadata), "ernie4_5-moe"
    assert g.architecture == a
    assert (md[f"{a}.expert_count"], md[f"{a}.expert_used_count"]) == (6, 3)
    assert (md[f"{a}.leading_dense_block_count"], md[f"{a}.interleave_moe_layer_step"]) == (1, 2)
    assert (md[f"{a}.feed_forward_length"], md[f"{a}.expert_feed_forward_length"]) == (96, 32)
    assert (md[f"{a}.expert_shared_count"], md[f"{a}.expert_shared_feed_forward_length"]) == (2, 64)
    assert f"{a}.mlp_only_layers" not in md and f"{a}.expert_gating_func" not in md
    t = g.tensors
    assert "blk.0.ffn_gate.weight" in t and "blk.2.ffn_down.weight" in t and "blk.3.ffn_up_exps.weight" in t
    assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (6, 32, 64)
    assert tuple(t["blk.3.ffn_down_shexp.weight"].shape) == (64, 64)
    assert tuple(t["blk.1.exp_probs_b.bias"].shape) == (6,) and "output.weight" not in t  # tied
    g.close()
    routes = []
    route_ = moe_module.route
    monkeypatch.setattr(moe_module, "route", lambda *args: routes.append(route_(*args)) or routes[-1])
    m = load_model(out).model
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    assert np.abs(logits - ref).max() < 1e-4 * scale and len(routes) == 2
    monkeypatch.setattr(moe_module, "route", route_)
    assert greedy_tokens(m, golden["tokens"], len(golden["greedy"])) == golden["greedy"]
    # llama.cpp's converter's file: its shared length, the bias as (1, experts)
    bias = {}
    for i in (1, 3):
        raw = open_gguf(out).tensors[f"blk.{i}.exp_probs_b.bias"].raw()
        bias[f"blk.{i}.exp_probs_b.bias"] = (0, (1, 6), np.array(raw))
    llama_cpp = rewrite_gguf(out, tmp_path / "llama-cpp.gguf", lambda n: () if "exp_probs_b" in n else n,
                             {f"{a}.expert_shared_feed_forward_length": 48}, extra=bias)
    other = load_model(llama_cpp).model
    same = other.forward(golden["tokens"], other.new_cache(64), all_logits=True)
    np.testing.assert_array_equal(same, logits)
    # Q8_0, routed as the F32 file routes
    replay = iter(routes)
    monkeypatch.setattr(moe_module, "route", lambda *args: next(replay))
    q8 = load_model(convert(TINY / "ernie4_5_moe", "Q8_0", tmp_path / "q8.gguf").output).model
    assert q8.layers[1].moe.gate[0].ggml_type == 8  # Q8_0
    err = np.abs(q8.forward(golden["tokens"], q8.new_cache(64), all_logits=True) - ref).max(axis=1) / scale
    assert next(replay, None) is None
    assert np.median(err) < 3e-2 and err.max() < 8e-2, err  # Q8_0 embeddings (tied) and linears
    monkeypatch.setattr(moe_module, "route", route_)


def test_ernie45_moe_folders_in_f32_f16_and_block_fp8(tmp_path):
    """The fixture (BF16) written in F32 and in F16 gives transformers' logits; with its layers' linears in
    block-wise FP8 (experts and shared experts included; the router and its bias stay F32) it gives the
    logits of the same folder with those weights decoded to float32."""
    import shutil

    from engine.backends.cpu.fpquant import FP8_E4M3_BLOCK
    from models.formats.safetensors import open_safetensors
    from tests.engine.model_checks import block_fp8_twins
    from tests.engine.test_fpquant import _write_st

    src = TINY / "ernie4_5_moe"
    golden = _golden("ernie4_5_moe")
    ref = np.array(golden["logits"])
    st = open_safetensors(src / "model.safetensors")
    bf16 = {name: np.array(st.array(name)) for name in st.tensors}
    st.close()
    for dtype, np_type in (("F32", np.float32), ("F16", np.float16)):
        folder = tmp_path / dtype
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        tensors = {}
        for name, a in bf16.items():
            x = (a.astype(np.uint32) << 16).view(np.float32).astype(np_type)
            tensors[name] = (dtype, x.shape, x.tobytes())
        _write_st(folder / "model.safetensors", tensors)
        m = load_model(folder).model
        assert m.layers[1].moe.gate[0].ggml_type == (0 if dtype == "F32" else 1)
        logits = m.forward(golden["tokens"], m.new_cache(32), all_logits=True)
        assert np.abs(logits - ref).max() < 1e-4 * np.abs(ref).max(), dtype
    block_fp8_twins(src, tmp_path, lambda name: ".layers." in name and name.endswith("proj.weight"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    got, want = (load_model(tmp_path / f).model for f in ("fp8", "dense"))
    assert got.layers[1].moe.down[5].ggml_type == got.layers[3].moe.shared[2].ggml_type == FP8_E4M3_BLOCK
    a = got.forward(golden["tokens"], got.new_cache(32), all_logits=True)
    b = want.forward(golden["tokens"], want.new_cache(32), all_logits=True)
    assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()


def test_ernie45_moe_batched_decode_matches_one_sequence_at_a_time():
    """The server's batched step on ERNIE 4.5 MoE (dense layers of their own FFN length between the expert
    layers): each sequence's logits as its own decode step gives them."""
    from tests.engine.model_checks import check_batched_decode

    check_batched_decode(load_model(TINY / "ernie4_5_moe").model, ([5, 17, 42], [99, 3, 250, 77]), (8, 120))
