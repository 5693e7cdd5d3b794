"""Mixture-of-experts layers on the CUDA backend, without a GPU: the routing, expert and combination kernels
on host threads (tests/engine/cuda/simt.py, over test_decoder_dry's stand-in CuPy) against engine.arch.moe
and the CPU model of the same tiny GGUF (Qwen3-MoE's and Mixtral's softmax routing, Qwen2-MoE's shared
expert with its sigmoid gate and unnormalized weights, GLM-4.5's sigmoid routing with a choice bias).
"""
# ruff: noqa: F811 - the stand-in CuPy fixtures are imported from test_decoder_dry

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.arch.moe import route
from tests.engine.cuda.test_decoder_dry import (  # noqa: F401 - fixtures
    FULL_SIMT,
    STATE,
    _rel,
    check_decoder_against_cpu,
    fake,
    ptx_params,
    simt,
)
from tests.engine.tiny_models import T, TinySpec, make_weights, write_byte_tokenizer

EXPERTS, USED, EXPERT_FF, SHARED_FF = 4, 2, 64, 32


def write_tiny_moe_gguf(path, arch: str = "qwen3moe", shared: bool = False, layers: int = 2, seed: int = 0,
                        types=(T.Q8_0, T.Q4_0, T.Q8_0)):
    """A tiny MoE model: the tiny llama's attention (hidden 64, 2 heads of 32, one KV head), each layer's
    FFN replaced by EXPERTS SwiGLU experts of EXPERT_FF (USED a token) in llama.cpp's merged tensors, gate,
    up and down of `types`, an F32 router, and with `shared` a Qwen2-MoE shared expert of SHARED_FF
    (quantized Q8_0) with its one-row gate."""
    spec = TinySpec(arch=arch, heads=2, kv_heads=1, layers=layers, seed=seed)
    weights = {k: v for k, v in make_weights(spec).items() if ".ffn_" not in k or "norm" in k}
    rng = np.random.default_rng(seed + 1)
    d = spec.hidden
    for i in range(layers):
        p = f"blk.{i}."
        weights[p + "ffn_gate_inp.weight"] = rng.normal(0, 0.3, (EXPERTS, d))
        weights[p + "ffn_gate_exps.weight"] = rng.normal(0, 0.15, (EXPERTS, EXPERT_FF, d))
        weights[p + "ffn_up_exps.weight"] = rng.normal(0, 0.15, (EXPERTS, EXPERT_FF, d))
        weights[p + "ffn_down_exps.weight"] = rng.normal(0, 0.15, (EXPERTS, d, EXPERT_FF))
        if shared:
            weights[p + "ffn_gate_shexp.weight"] = rng.normal(0, 0.15, (SHARED_FF, d))
            weights[p + "ffn_up_shexp.weight"] = rng.normal(0, 0.15, (SHARED_FF, d))
            weights[p + "ffn_down_shexp.weight"] = rng.normal(0, 0.15, (d, SHARED_FF))
            weights[p + "ffn_gate_inp_shexp.weight"] = rng.normal(0, 0.3, (1, d))
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", layers), ("context_length", spec.ctx), ("embedding_length", d),
                       ("attention.head_count", spec.heads), ("attention.head_count_kv", spec.kv_heads),
                       ("expert_count", EXPERTS), ("expert_used_count", USED),
                       ("expert_feed_forward_length", EXPERT_FF), ("feed_forward_length", EXPERT_FF)):
        writer.add_uint32(f"{arch}.{key}", value)
    if shared:
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", SHARED_FF)
    writer.add_float32(f"{arch}.rope.freq_base", spec.theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.eps)
    write_byte_tokenizer(writer)
    kinds = dict(zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), types))
    for name, value in weights.items():
        value = value.astype(np.float32)
        kind = name.split(".")[-2]
        routers = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # F32, as llama.cpp keeps them
        qtype = kinds.get(kind, T.Q8_0) if value.ndim >= 2 and kind not in routers else T.F32
        data = value if qtype == T.F32 else gguf.quants.quantize(value, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "E, k, sigmoid, normalize, bias, scale",
    [(4, 2, False, True, False, 1.0), (200, 6, False, False, False, 1.0), (60, 4, False, True, True, 1.0),
     (160, 8, True, True, True, 2.5), (128, 8, True, False, False, 1.0)],
)
def test_routing_kernel_chooses_and_weighs_as_moe_route_on_host_threads(fake, simt, E, k, sigmoid, normalize,
                                                                        bias, scale):
    """moe_route over 5 tokens (and a tie: the lower expert first) gives moe.route's experts and weights for
    softmax and sigmoid gating, with and without a choice bias and renormalization, widths that are not
    multiples of 32 included."""
    STATE.simt = simt
    cp, ops = fake.cp, fake.ops
    rng = np.random.default_rng(E + k)
    logits = rng.normal(0, 2, (5, E)).astype(np.float32)
    logits[4, :] = 0.0
    logits[4, [3, 1]] = 1.0  # a tie between experts 1 and 3
    b = rng.uniform(-0.2, 0.2, E).astype(np.float32) if bias else None
    ids, wts = cp.empty((5, k), cp.int32), cp.empty((5, k), cp.float32)
    on_gpu_bias = None if b is None else cp.asarray(b)
    ops.moe_route(ids, wts, cp.asarray(logits), k, sigmoid, normalize, scale, on_gpu_bias)
    want_ids, want_w = route(logits, k, normalize, sigmoid, b, scale)
    np.testing.assert_array_equal(ids.get(), want_ids)
    np.testing.assert_allclose(wts.get(), want_w, rtol=1e-5, atol=1e-7)
    assert fake.launches == ["moe_route"]


def test_expert_matvecs_and_combination_on_host_threads(fake, simt, tmp_path):
    """matvec_qb_experts over 2 tokens x 2 chosen experts reads each slot's expert from the ids on the GPU
    (gate Q8_0 | up Q4_0 rows, then down), and moe_combine adds the weighted sum and a gated shared output:
    each slot equals the CPU's product of that expert alone."""
    from engine.backends import cpu
    from engine.loader import load_model

    STATE.simt = simt
    cp, ops = fake.cp, fake.ops
    model = load_model(write_tiny_moe_gguf(tmp_path / "moe.gguf", layers=1)).model
    moe = model.layers[0].moe
    dec = fake.decoder.CudaDecoder(model, n_ctx=16, prefill_dtype="float32")
    experts = dec.layers[0]["moe"]["experts"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    chosen = np.array([[3, 0], [1, 3]], np.int32)
    gu = cp.empty((4, 2 * EXPERT_FF), cp.float32)
    ops.matvec_experts(gu, experts, "gate_up", cp.asarray(x), cp.asarray(chosen.reshape(-1)), 2,
                       cp.asarray(norm), 1e-5, prologue=1)
    y = cp.empty((2, 2, 64), cp.float32)
    ops.matvec_experts(y.reshape(4, 64), experts, "down", gu, cp.asarray(chosen.reshape(-1)), 1, prologue=2)
    for s, e in enumerate(chosen.reshape(-1)):
        h = x[s // 2] / np.sqrt(np.mean(x[s // 2] ** 2) + 1e-5) * norm
        ref_gu = np.empty((1, 2 * EXPERT_FF), np.float32)
        cpu.linear(ref_gu[:, :EXPERT_FF], moe.gate[e], h[None])
        cpu.linear(ref_gu[:, EXPERT_FF:], moe.up[e], h[None])
        assert _rel(gu.get()[s], ref_gu[0]) < 2e-3, f"slot {s} (expert {e}) gate|up"
        act = (gu.get()[s, :EXPERT_FF] / (1 + np.exp(-gu.get()[s, :EXPERT_FF])) * gu.get()[s, EXPERT_FF:])
        ref_y = np.empty((1, 64), np.float32)
        cpu.linear(ref_y, moe.down[e], act[None].astype(np.float32))
        assert _rel(y.get()[s // 2, s % 2], ref_y[0]) < 2e-3, f"slot {s} (expert {e}) down"
    w = rng.uniform(0, 1, (2, 2)).astype(np.float32)
    ys, sg = rng.standard_normal((2, 64)).astype(np.float32), np.array([0.3, -1.2], np.float32)
    base = rng.standard_normal((2, 64)).astype(np.float32)
    out = cp.asarray(base)
    ops.moe_combine(out, y, cp.asarray(w), cp.asarray(ys), cp.asarray(sg))
    gate = 1 / (1 + np.exp(-sg))
    want = base + np.einsum("tk,tkd->td", w, y.get()) + gate[:, None] * ys
    np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "arch, shared",
    [("qwen2moe", True)]  # CI: the shared expert and unnormalized weights; the others with HEARTH_CUDA_SIMT=1
    + [pytest.param(a, False, marks=pytest.mark.skipif(not FULL_SIMT, reason="set HEARTH_CUDA_SIMT=1"))
       for a in ("qwen3moe", "llama")],
)
def test_moe_decoder_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path, arch, shared):
    """A tiny two-layer MoE model through the whole CUDA decoder: prefill (tokens grouped by expert),
    captured decode steps that route on the GPU, the GPU argmax, a batched step of two sequences and partial
    offload (1 of 2 layers) give the CPU model's logits; Qwen2-MoE's shared expert and unnormalized weights
    included."""
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(write_tiny_moe_gguf(tmp_path / f"{arch}.gguf", arch, shared)).model
    assert model.layers[1].moe is not None and (model.layers[1].moe.shared is not None) == shared
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert dec.moe == (EXPERTS, USED, EXPERT_FF, SHARED_FF if shared else 0)
    assert dec.decode_path == "graphs" and not dec.prefill_graphs
    steps = check_decoder_against_cpu(fake, model, dec, [1, 2, 3, 40, 41])
    assert {"moe_route", "matvec_qb_experts", "moe_combine"} <= set(steps)


def test_moe_vram_estimate_and_decode_bytes_count_the_experts(fake, tmp_path):
    """The estimate holds every expert (all of them are uploaded) and a decode step's bytes only the router
    and the k chosen experts (the bench's bandwidth figure)."""
    from engine.loader import load_model

    model = load_model(write_tiny_moe_gguf(tmp_path / "moe.gguf", shared=True)).model
    moe = model.layers[0].moe
    expert_bytes = sum(w.nbytes for w in [*moe.gate, *moe.up, *moe.down])
    dense = fake.decoder.estimate_vram(model, 32)
    assert dense > 2 * expert_bytes
    dec = fake.decoder.CudaDecoder(model, n_ctx=32)
    per_layer = moe.router.nbytes + USED * expert_bytes // EXPERTS + sum(w.nbytes for w in moe.shared)
    attention = sum(getattr(model.layers[0], a).nbytes for a in ("wq", "wk", "wv", "wo"))
    embd_row = model.token_embd.nbytes // model.token_embd.rows
    tied = model.output is model.token_embd
    head = model.output.nbytes + (0 if tied else embd_row)
    assert dec.decode_weight_bytes == 2 * (per_layer + attention) + head


def test_moe_models_the_kernels_do_not_take_stay_on_the_cpu(fake, tmp_path):
    """Float gate and up experts of different types (or a float one beside a quantized one), per-expert
    scales and group-limited routing are refused, saying why; float experts of one type per kind run."""

    from engine.loader import load_model

    mixed = load_model(write_tiny_moe_gguf(tmp_path / "mixed.gguf", types=(T.F16, T.Q8_0, T.F16))).model
    with pytest.raises(fake.decoder.UnsupportedCudaModelError, match="float gate and up"):
        fake.decoder.CudaDecoder(mixed, n_ctx=32)
    floats = load_model(write_tiny_moe_gguf(tmp_path / "f16.gguf", types=(T.F16, T.F16, T.BF16))).model
    assert fake.decoder.CudaDecoder(floats, n_ctx=32).moe is not None  # float experts run
    model = load_model(write_tiny_moe_gguf(tmp_path / "moe.gguf")).model
    model.cfg.expert_groups, model.cfg.expert_groups_used = 2, 1
    with pytest.raises(fake.decoder.UnsupportedCudaModelError, match="group-limited"):
        fake.decoder.CudaDecoder(model, n_ctx=32)
    model.cfg.expert_groups = 1
    model.layers[1].moe.expert_scale = np.ones(EXPERTS, np.float32)
    with pytest.raises(fake.decoder.UnsupportedCudaModelError, match="per-expert scales"):
        fake.decoder.CudaDecoder(model, n_ctx=32)
