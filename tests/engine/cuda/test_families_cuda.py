"""Model families beyond plain llama and Gemma 3 on the CUDA backend, without a GPU: the tiny checkpoints of
tests/fixtures/tiny (whose golden logits come from transformers) through the whole CUDA decoder, its kernels
on host threads (tests/engine/cuda/simt.py, over test_decoder_dry's stand-in CuPy), against the CPU model:
gpt-oss (attention sinks, a sliding window on every other layer, biases on every linear, YaRN, MXFP4
experts with biases and the clamped SwiGLU), Gemma 2 (soft-capped attention and logits), Mistral's sliding
window on every layer, EXAONE 4 (no input norms, norms of the branch outputs, windowed layers with RoPE and
full ones without), GLM-4 (input and output norms, partial RoPE), Granite (embedding, residual and logit
multipliers), SmolLM3 (every fourth layer without RoPE), OLMo 2 (q/k norms over the whole projections,
output norms only), OLMo 3 (OLMo 2 with windowed layers on plain RoPE, the full ones on YaRN), Ministral 3
(queries sharpened past its original context), Phi-4-mini's LongRoPE (a partly rotated head whose
rotated dims take the attention factor), Command R7B / Command A (attention and the FFN side by side
from one LayerNorm, scaled logits, windowed layers that alone rotate), Command R+ (LayerNorms of each q and k
head), Qwen3.5 / Qwen3-Next (DeltaNet layers), LFM2 / LFM2-MoE (short convolutions) and Granite 4.0-H (Mamba-2
layers beside attention without positions; its MoE models' experts and shared MLP under the residual
multiplier) and Nemotron-H (blocks of one branch each: Mamba-2, attention without positions, or a relu^2 MLP).
"""
# ruff: noqa: F811 - the stand-in CuPy fixtures are imported from test_decoder_dry

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from tests.engine.cuda.test_decoder_dry import (  # noqa: F401 - fixtures
    FULL_SIMT,
    STATE,
    _rel,
    check_decoder_against_cpu,
    fake,
    ptx_params,
    simt,
)

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
PROMPT = [1, 2, 3, 40, 41, 42, 7]  # longer than the tiny models' windows of 4


def test_gpt_oss_on_the_gpu_computes_the_cpu_models_logits_on_host_threads(fake, simt):
    """The tiny gpt-oss folder: sinks and the window in prefill and decode attention, the output
    projection's bias, the router's bias, each expert's gate|up and down biases around the clamped SwiGLU
    (decode: one activation launch for the B x k slots; prefill: each expert's rows), MXFP4 experts on
    integer dot products; prefill, graph steps, the GPU argmax, a batch and partial offload."""
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(TINY / "gpt-oss").model
    assert model.cfg.window(0) == 4 and model.layers[0].sinks is not None and model.layers[0].bo is not None
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert [L["window"] for L in dec.layers] == [4, 0]
    assert dec.layers[0]["moe"]["gu_bias"].shape == (4, 2 * model.cfg.intermediate_size)
    steps = check_decoder_against_cpu(fake, model, dec, PROMPT)
    assert {"glu", "moe_route", "matvec_qb_experts", "moe_combine", "add_inplace"} <= set(steps)
    assert fake.fused.unsupported_reason(dec) == "mixture-of-experts layers"


# what sets each family apart on the GPU, and why the fused step declines it
NO_ROPE = "layers without RoPE (SmolLM3, EXAONE 4)"
WINDOWED_ROPE = [16, 16, 16, 0]  # three windowed layers that rotate, a full one that does not
NO_INPUT_NORMS = "branches without input norms (EXAONE 4, OLMo 2)"
MAMBA = "Mamba-2 layers (Granite 4.0-H, Nemotron-H)"
NEMOTRON_BRANCHES = [(True, None), (False, "relu2"), (True, None), (True, None), (False, "relu2")]
ROPE_SCALES = "a partly rotated head's RoPE attention factor (Phi-4-mini) or query temperature (Ministral 3)"
FAMILIES = {
    "gemma2": (lambda dec: dec.softcap > 0, "attention soft-capping (Gemma 2)"),
    "exaone4": (lambda dec: dec.layers[0]["attn_norm"] is None and _rotated(dec) == WINDOWED_ROPE
                and _windows(dec) == [4, 4, 4, 0], NO_ROPE),
    "granite": (lambda dec: (dec.residual, dec.embed_scale) == (0.3, 6.0), "a residual multiplier (Granite)"),
    "mistral-swa": (lambda dec: all(L["window"] == 4 for L in dec.layers), None),
    "glm4": (lambda dec: dec.layers[0]["post_ffn_norm"] is not None and dec.n_rot < 16,
             "norms of the branch outputs (GLM-4)"),
    "smollm3": (lambda dec: _rotated(dec) == WINDOWED_ROPE, NO_ROPE),
    "olmo2": (lambda dec: dec.layers[0]["qk_rows"] is not None, NO_INPUT_NORMS),
    "olmo3": (lambda dec: len({L["scale"] for L in dec.layers}) == 2 and _windows(dec) == [4, 4, 4, 0],
              "attention scales that differ between layers (OLMo 3)"),
    "ministral3": (lambda dec: dec.rope_scales[1] == (0.5, 4), ROPE_SCALES),
    "phi3-longrope": (lambda dec: dec.rope_scales[0] > 1.0 and dec.n_rot == 12, ROPE_SCALES),
    "qwen3_5": (lambda dec: dec.delta is not None and dec.gated and (dec.n_rec, dec.n_attn) == (3, 1),
                "DeltaNet layers and gated attention (Qwen3.5)"),
    "lfm2": (lambda dec: (dec.n_conv, dec.n_attn) == (3, 1), "short-convolution layers (LFM2)"),
    "granite4-h": (lambda dec: dec.mamba is not None and (dec.n_rec, dec.n_attn) == (3, 1)
                   and _rotated(dec) == [0] * 4 and dec.residual == 0.5, MAMBA),
    # blocks M - * M -: Mamba-2 and attention blocks without an FFN, MLP blocks without a mixer
    "nemotron_h": (lambda dec: (dec.n_rec, dec.n_attn) == (2, 1) and _branches(dec) == NEMOTRON_BRANCHES
                   and [L["slot"] for L in dec.layers if L["mixer"]] == [0, 0, 1], MAMBA),
    "granite4-h-moe": (lambda dec: dec.mamba is not None and dec.moe == (4, 2, 32, 96)
                       and dec.residual == 0.5, "mixture-of-experts layers"),
    "cohere": (lambda dec: dec.parallel and dec.layers[0]["qk_heads"] is not None,
               "Cohere's parallel blocks"),
    "cohere2": (lambda dec: dec.parallel and _windows(dec) == [4, 4, 4, 0] and _rotated(dec) == WINDOWED_ROPE,
                "Cohere's parallel blocks"),
}


def _rotated(dec) -> list[int]:
    return [L["n_rot"] for L in dec.layers]


def _windows(dec) -> list[int]:
    return [L["window"] for L in dec.layers]


def _branches(dec) -> list[tuple]:
    return [(L["mixer"], L["ffn"]) for L in dec.layers]


@pytest.mark.parametrize(
    "family", [  # CI
        "gemma2", "exaone4", "granite", "olmo3", "ministral3", "cohere2", "qwen3_5", "lfm2", "cohere",
        "granite4-h", "granite4-h-moe", "nemotron_h",
    ] + [
        pytest.param(f, marks=pytest.mark.skipif(not FULL_SIMT, reason="set HEARTH_CUDA_SIMT=1"))
        for f in ("mistral-swa", "glm4", "smollm3", "olmo2", "phi3-longrope")
    ],
)
def test_family_computes_the_cpu_models_logits_on_host_threads(fake, simt, family):
    """Each family's tiny checkpoint through the whole decoder (prefill, graph steps, the GPU argmax, a
    batch, partial offload) against the CPU model."""
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(TINY / family).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    sets_apart, fused_reason = FAMILIES[family]
    assert sets_apart(dec)
    assert fake.fused.unsupported_reason(dec) == fused_reason
    check_decoder_against_cpu(fake, model, dec, PROMPT)


@pytest.mark.parametrize("family, launch", [("olmo2", "convert"), ("lfm2", "short_conv")])
def test_captured_prefill_of_a_family_on_host_threads(fake, simt, monkeypatch, family, launch):
    """OLMo 2's prefill (the residual stream converted to the GEMMs' input without a norm, q/k norms over
    the whole projections in place, output norms) and LFM2's (its convolutions reading the pass's position
    from device memory) captured as a CUDA graph for a new chat's prompt and replayed for the next one: the
    CPU model's logits each time."""
    from engine.loader import load_model

    STATE.simt = simt
    monkeypatch.delenv("HEARTH_CUDA_PREFILL_GRAPHS", raising=False)
    model = load_model(TINY / family).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=64, prefill_dtype="float32")
    cache = dec.new_cache(64, np.float32)
    captures = fake.cp.cuda.Stream.captures
    for prompt, captured in (([1, 2, 3], 0), ([4, 5, 6, 7, 8], 2), ([9, 3, 7], 0)):  # begin + end: 2
        cache.trim(cache.offset)  # a new chat
        before = len(captures)
        got = dec.forward(prompt, cache)[-1]
        assert _rel(got, model.forward(prompt, model.new_cache(64))[-1]) < 1e-3
        assert len(captures) - before == captured, dec.prefill_graph_error
    assert launch in fake.launches


def fail_at_call(monkeypatch, owner, name: str, at: int, run) -> None:
    """run(), which must raise the MemoryError owner.name raises at its call number `at` (an out-of-memory
    part way through a pass)."""
    real, calls = getattr(owner, name), []

    def fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise MemoryError("out of memory")
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(owner, name, fail)
        with pytest.raises(MemoryError):
            run()


@pytest.mark.parametrize("family, gpu_layers", [("qwen3_5", None), ("granite4-h", None), ("granite4-h", 1),
                                                ("qwen3_5", 3), ("nemotron_h", None), ("nemotron_h", 1)])
def test_recurrent_states_snapshot_and_trim_as_the_cpu_cache_on_host_threads(fake, simt, monkeypatch, family,
                                                                           gpu_layers):
    """Qwen3.5's DeltaNet and Granite 4.0-H's and Nemotron-H's Mamba-2 states on the GPU, wholly or with
    the first layers on it (partial offload; Qwen3.5's CPU half then holds attention only), follow
    RecurrentKVCache's rules as the CPU cache does: a prompt keeps the states of its start and of its
    end - 1, decode steps (captured graphs) advance them, a trim (a regenerate, a new turn, a new chat)
    returns to the latest snapshot at or before its target, a pass that fails part way (a prompt on the GPU; a
    prompt or a decode step on the CPU half) leaves the cache at a snapshot, and what comes after gives
    the CPU model's logits each time. The last prompt is long enough for the CPU's Mamba-2 to scan it in
    chunks (mamba2.CHUNKED_MIN_TOKENS), the GPU's token by token."""
    from engine.arch import deltanet, mamba2
    from engine.backends import cpu as cpu_ops
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(TINY / family).model
    nemotron = family == "nemotron_h"
    if gpu_layers is None:
        dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
        # the second recurrent layer fails, after the first moved its state on
        fails = (dec, "_delta_mix" if dec.delta is not None else "_mamba_mix", 2)
    else:
        dec = fake.hybrid.HybridDecoder(model, gpu_layers, n_ctx=32, prefill_dtype="float32")
        # the CPU half's first layer, after the GPU's ran (Nemotron-H's first CPU block is an MLP)
        fails = (cpu_ops, "linear", 1) if nemotron else (type(model), "_dense_ffn", 1)
    cpu, gpu = model.new_cache(32), dec.new_cache(32, np.float32)
    halves = [gpu] if gpu_layers is None else [gpu.gpu, gpu.cpu]

    def both(tokens):
        ref = model.forward(tokens, cpu)
        assert _rel(dec.forward(tokens, gpu), ref) < 1e-3
        assert all(h.offset == cpu.offset and sorted(h._snapshots) == sorted(cpu._snapshots) for h in halves)

    fail_in = functools.partial(fail_at_call, monkeypatch)

    def failing(tokens):  # the same pass failing on both: each cache back at the same snapshot
        fail_in(*fails, lambda: dec.forward(tokens, gpu))
        mixer = deltanet if getattr(model.cfg, "delta", None) is not None else mamba2
        fail_in(mixer, "mix", 2, lambda: model.forward(tokens, cpu))
        assert all(h.offset == cpu.offset and sorted(h._snapshots) == sorted(cpu._snapshots) for h in halves)

    both([1, 2, 3, 4, 5])
    both([6])
    both([7])
    assert gpu.trim(3) == cpu.trim(3) == 3  # a regenerate: back to the prompt's end - 1, which stays
    both([5, 8])
    assert gpu.trim(gpu.offset - 2) == cpu.trim(cpu.offset - 2)  # a new turn from an earlier place
    both([9, 10, 11])
    both([12])
    if gpu_layers is not None:  # (the GPU's decode step is a graph: it runs whole or not at all)
        failing([13])
    failing([13, 14, 15])
    both([13, 14])
    assert gpu.trim(gpu.offset) == cpu.trim(cpu.offset)  # a new chat
    both([4, 5, 6])
    assert gpu.trim(gpu.offset) == cpu.trim(cpu.offset)
    both([(7 * t) % 300 + 3 for t in range(mamba2.CHUNKED_MIN_TOKENS + 4)])


def padded_moe_folder(family: str, dst: Path, ff: int = 64) -> Path:
    """The tiny `family` folder in float32 with its experts' intermediate size padded with zeros to ff (a
    multiple of 32, as the CUDA kernels take and real checkpoints have): the same model, zero rows of gate
    and up feeding zero columns of down."""
    import json
    import shutil
    import struct

    from safetensors.numpy import save_file

    src = TINY / family
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    raw = (src / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        assert t["dtype"] == "BF16", (name, t["dtype"])
        bits = np.frombuffer(data[lo:hi], np.uint16).astype(np.uint32) << 16
        a = bits.view(np.float32).reshape(t["shape"])
        if ".experts." in name:  # gate/up (ff, d): zero rows; down (d, ff): zero columns
            down = "down_proj" in name or name.endswith(".w2.weight")  # LFM2's w1, w3 and w2
            a = np.pad(a, [(0, 0), (0, ff - a.shape[1])] if down else [(0, ff - a.shape[0]), (0, 0)])
        tensors[name] = np.ascontiguousarray(a)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(moe_intermediate_size=ff, dtype="float32")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "family", ["qwen3_next"] + [  # CI; Qwen3.5-MoE with HEARTH_CUDA_SIMT=1
        pytest.param("qwen3_5_moe", marks=pytest.mark.skipif(not FULL_SIMT, reason="set HEARTH_CUDA_SIMT=1"))
    ],
)
def test_deltanet_moe_folder_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path, family):
    """Qwen3-Next (its fused q|k|v|z and b|a projections, 4 experts beside a gated shared expert) and
    Qwen3.5-MoE as
    float32 Hugging Face folders (experts padded to 64): DeltaNet layers, gated attention and float experts
    (the float kernels' expert matvecs) on the GPU against the CPU model of the same folder."""
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(padded_moe_folder(family, tmp_path / family)).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert dec.delta is not None and dec.moe is not None and dec.gated
    assert (model.layers[0].delta.in_qkvz is not None) == (family == "qwen3_next")  # fused, regrouped
    steps = check_decoder_against_cpu(fake, model, dec, PROMPT)
    assert {"delta_conv", "delta_rule", "matvec_f32_experts", "moe_combine"} <= set(steps)


def test_qwen3_5_q8_0_gguf_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path):
    """Qwen3.5 as users run it: a Q8_0 GGUF (llama.cpp's tiled value-head order, integer-dot matvecs and
    the hand-off of activation records into and out of the DeltaNet layers' projections) against the CPU
    model of the same file."""
    from engine.convert import convert
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(convert(TINY / "qwen3_5", "Q8_0", tmp_path / "q8.gguf").output).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert dec.delta.tiled and dec.layers[0]["delta"]["proj"][0].ggml_type == 8  # Q8_0
    plan, _ = dec._handoff_plan()
    assert any(p["qkv"] for p, L in zip(plan, dec.layers) if L["delta"] is not None)
    # the CPU model's own Q8_0 decode step (int16 activations) is ~1.4e-3 from exact here: the GPU's float
    # dot products of the dequantized weights (int_dot=False) differ from it by that much too
    check_decoder_against_cpu(fake, model, dec, PROMPT, tol=3e-3)


def test_granite4_h_q8_0_gguf_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path):
    """Granite 4.0-H as users run it: a Q8_0 GGUF (llama.cpp's granitehybrid names: A as -exp(A_log), the
    norm's weight by group, the skip D as (heads, 1); integer-dot matvecs, no records handed past its scaled
    branches) against the CPU model of the same file."""
    from engine.convert import convert
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(convert(TINY / "granite4-h", "Q8_0", tmp_path / "q8.gguf").output).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert dec.layers[0]["mamba"]["in"].ggml_type == 8  # Q8_0
    plan, head_handed = dec._handoff_plan()
    assert not head_handed and not any(p["qkv"] or p["gu"] for p in plan)  # the residual multiplier
    steps = check_decoder_against_cpu(fake, model, dec, PROMPT, tol=3e-3)
    assert {"delta_conv", "ssm_scan", "rmsnorm"} <= set(steps)


def test_lfm2_moe_folder_computes_the_cpu_models_logits_on_host_threads(fake, simt, tmp_path):
    """LFM2-MoE (LFM2-8B-A1B's layout) as a float32 folder, experts padded to 64: convolution layers
    beside an attention layer, a dense first FFN, then sigmoid-routed experts with a choice bias; the whole
    decoder and partial offload (the CPU side's cache keeping its convolution layers' inputs) against the
    CPU model."""
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(padded_moe_folder("lfm2moe", tmp_path / "lfm2moe")).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert (dec.n_conv, dec.n_attn) == (3, 1) and dec.moe is not None
    assert dec.layers[0]["moe"] is None and dec.layers[1]["moe"]["score_bias"] is not None
    steps = check_decoder_against_cpu(fake, model, dec, PROMPT)
    assert {"short_conv", "moe_route", "matvec_f32_experts", "moe_combine"} <= set(steps)


def test_lfm2_q8_0_gguf_with_float16_caches_on_host_threads(fake, simt, tmp_path):
    """LFM2 as users run it: a Q8_0 GGUF (integer-dot matvecs, the residual stream's records handed into
    the convolution layers' in_proj) and float16 caches, so the convolution inputs are kept rounded to
    halves, also those of the pass itself: a prompt, decode steps (captured graphs), a regenerate (a trim)
    and a stored prefix written back, against the CPU model of the same file with its float16 cache."""
    from engine.convert import convert
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(convert(TINY / "lfm2", "Q8_0", tmp_path / "q8.gguf").output).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    plan, _ = dec._handoff_plan()
    assert any(p["qkv"] for p, L in zip(plan, dec.layers) if L["conv"] is not None)
    cpu, gpu = model.new_cache(32, np.float16), dec.new_cache(32, np.float16)
    assert gpu.conv.dtype == np.float16 and gpu.conv.shape == cpu.conv.shape

    def both(tokens, tol=3e-3):  # the CPU model's own Q8_0 path rounds activations to int16 (see Qwen3.5's)
        ref = model.forward(tokens, cpu)
        assert _rel(dec.forward(tokens, gpu), ref) < tol

    both(PROMPT)
    both([5])
    both([6])
    assert gpu.trim(2) == cpu.trim(2) == 2
    both([9])
    saved = gpu.read(0, gpu.offset)
    assert [a.shape for a in saved] == [a.shape for a in cpu.read(0, cpu.offset)]
    fresh = dec.new_cache(32, np.float16)
    fresh.write(0, *saved)
    fresh.advance(gpu.tokens)
    ref = model.forward([11], cpu)
    assert _rel(dec.forward([11], fresh), ref) < 3e-3


def test_nemotron_h_q8_0_gguf_computes_the_cpu_models_logits_on_host_threads(fake, simt, monkeypatch,
                                                                           tmp_path):
    """Nemotron-H as users run it: a Q8_0 GGUF (llama.cpp's nemotron_h names and per-layer head and FFN
    counts) on integer-dot matvecs, the residual stream's records handed from each block's last matvec to
    the next block's first (a mixer's or an MLP's), the up projection handing relu(up x)^2 on to down
    (EMIT_RELU2), against the CPU model of the same file; without the hand-off (down's integer-dot input
    quantized from relu^2 of up's floats: prologue 6); then two GPU blocks of five (partial offload: the CPU
    half starts at the attention block)."""
    from engine.convert import convert
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(convert(TINY / "nemotron_h", "Q8_0", tmp_path / "q8.gguf").output).model
    dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    assert dec.layers[1]["w_up"].ggml_type == 8 and _branches(dec) == NEMOTRON_BRANCHES  # Q8_0
    plan, head_handed = dec._handoff_plan()
    # block 0 reads the embedding; the others read what the block before them hands on
    assert [p["qkv"] for p in plan] == [False, False, True, True, False]
    assert [p["gu"] for p in plan] == [False, True, False, False, True] and head_handed
    assert all(p["down"] == (L["ffn"] == "relu2") for p, L in zip(plan, dec.layers))
    steps = check_decoder_against_cpu(fake, model, dec, PROMPT, tol=3e-3)
    assert {"ssm_scan", "delta_conv", "matvec_qb"} <= set(steps)
    monkeypatch.setenv("HEARTH_CUDA_HANDOFF", "0")
    plain = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
    cpu_cache, cache = model.new_cache(32), plain.new_cache(32, np.float32)
    for tokens in (PROMPT, [5]):
        assert _rel(plain.forward(tokens, cache), model.forward(tokens, cpu_cache)) < 3e-3
    monkeypatch.delenv("HEARTH_CUDA_HANDOFF")
    hyb = fake.hybrid.HybridDecoder(model, 2, n_ctx=32, prefill_dtype="float32")
    assert (hyb.gpu.n_rec, hyb.gpu.n_attn) == (1, 0)
    cpu_cache, cache = model.new_cache(32), hyb.new_cache(32, np.float32)
    assert (cache.cpu.k.shape[0], cache.cpu.recurrent.shape[0]) == (1, 1)
    for tokens in (PROMPT, [5], [9]):
        assert _rel(hyb.forward(tokens, cache), model.forward(tokens, cpu_cache)) < 3e-3


@pytest.mark.parametrize("gpu_layers", [None, 1])
def test_a_batched_step_that_fails_part_way_rewinds_recurrent_caches_on_host_threads(fake, simt, monkeypatch,
                                                                                    gpu_layers):
    """The server's batched decode step over two Granite 4.0-H sequences, failing in its warm-up run (the
    first step of a new batch runs once before its capture) after the first Mamba-2 layer moved the first
    sequence's state on: each cache (both halves of a partial offload) goes back to its latest snapshot, as
    the CPU model's caches do under the same failure, and the sequences continue from there with the CPU
    model's logits. So does a new chat's first decode step that fails in its capture's warm-up."""
    from engine.arch import mamba2
    from engine.loader import load_model

    STATE.simt = simt
    model = load_model(TINY / "granite4-h").model
    if gpu_layers is None:
        dec = fake.decoder.CudaDecoder(model, n_ctx=32, prefill_dtype="float32")
        gpu_mixer = dec
    else:
        dec = fake.hybrid.HybridDecoder(model, gpu_layers, n_ctx=32, prefill_dtype="float32")
        gpu_mixer = dec.gpu
    cpu, gpu = [model.new_cache(32) for _ in range(2)], [dec.new_cache(32, np.float32) for _ in range(2)]
    for prompt, c, g in (([1, 2, 3, 4], cpu[0], gpu[0]), ([5, 6], cpu[1], gpu[1])):
        assert _rel(dec.forward(prompt, g), model.forward(prompt, c)) < 1e-3
    assert _rel(dec.forward_batch([7, 8], gpu), model.forward_batch([7, 8], cpu)) < 1e-3

    fail_at = functools.partial(fail_at_call, monkeypatch)

    # a new batch (the second sequence first) captures a new step: its warm-up fails at the second mix
    fail_at(gpu_mixer, "_mamba_mix", 2, lambda: dec.forward_batch([9, 10], gpu[::-1]))
    fail_at(mamba2, "mix", 2, lambda: model.forward_batch([9, 10], cpu[::-1]))
    halves = gpu if gpu_layers is None else [h for g in gpu for h in (g.gpu, g.cpu)]
    refs = cpu if gpu_layers is None else [c for c in cpu for _ in range(2)]
    assert [h.offset for h in halves] == [r.offset for r in refs] == [3, 3, 1, 1][:: 1 if gpu_layers else 2]
    assert all(sorted(h._snapshots) == sorted(r._snapshots) for h, r in zip(halves, refs))
    for c, g in zip(cpu, gpu):
        tail = [11, 12, 13][: 5 - c.offset]
        assert _rel(dec.forward(tail, g), model.forward(tail, c)) < 1e-3
    assert _rel(dec.forward_batch([14, 15], gpu), model.forward_batch([14, 15], cpu)) < 1e-3
    if gpu_layers is None:  # a chat's first decode step on the GPU (greedy_step, sample_step) as well
        for pick in (lambda c: dec.greedy_step(16, c), lambda c: dec.sample_step(16, c, 0.8, 5, 0.9, 0.3)):
            fresh, ref = dec.new_cache(32, np.float32), model.new_cache(32)
            assert _rel(dec.forward([1, 2, 3], fresh), model.forward([1, 2, 3], ref)) < 1e-3
            fail_at(gpu_mixer, "_mamba_mix", 2, lambda p=pick, c=fresh: p(c))  # its capture's warm-up
            assert fresh.offset == 2 and fresh.tokens == [1, 2]  # the prompt's end - 1
            assert _rel(dec.forward([3, 4], fresh), model.forward([4], ref)) < 1e-3
