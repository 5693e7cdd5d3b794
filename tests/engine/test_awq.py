"""AWQ: AutoAWQ's packing, the Q4_1 repacking, scale folding, the search against RTN, the AutoAWQ loader."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.convert import convert
from engine.errors import UnsupportedArchitectureError
from engine.quant import awq
from engine.quant.awq_pack import (
    dequantize_groups,
    fake_quantize,
    from_awq_tensors,
    pack_columns,
    q4_1_rows,
    quantize_groups,
    to_awq_tensors,
    unpack_columns,
)
from engine.quant.encode import dequantize
from engine.quant.registry import lookup
from engine.quant.source import open_source
from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3
from tests.engine.tiny_models import TinySpec, write_tiny_gguf

TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "def f(x):\n    return x * 2 + 1\n\nNumbers: 3.14159, 2.71828, 1.41421. "
) * 3


def _reference_pack(a: np.ndarray) -> np.ndarray:
    """AutoAWQ's packing, from its description: word c of a row holds columns 8c..8c+7, the value of
    column 8c + order[i] in bits 4i..4i+3, order = [0, 2, 4, 6, 1, 3, 5, 7]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    n, m = a.shape
    out = np.zeros((n, m // 8), np.int64)
    for r in range(n):
        for c in range(m // 8):
            word = 0
            for i in range(8):
                word |= int(a[r, 8 * c + order[i]]) << (4 * i)
            out[r, c] = word - (1 << 32) if word >= 1 << 31 else word
    return out.astype(np.int32)


def test_packing_matches_autoawq_order_and_round_trips():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 16, (6, 32), dtype=np.uint8)
    packed = pack_columns(a)
    assert packed.dtype == np.int32 and packed.shape == (6, 4)
    np.testing.assert_array_equal(packed, _reference_pack(a))
    np.testing.assert_array_equal(unpack_columns(packed), a)
    # one word by hand: columns 0..7 = 1..8 -> nibbles (low first) 1, 3, 5, 7, 2, 4, 6, 8
    word = pack_columns(np.arange(1, 9, dtype=np.uint8).reshape(1, 8))[0, 0]
    assert int(word) & 0xFFFFFFFF == 0x86427531


def test_awq_tensors_layout_and_dequantization():
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.1, (16, 256)).astype(np.float32)  # (out, in)
    q, scales, zeros = quantize_groups(w, 128)
    t = to_awq_tensors(q, scales, zeros)
    assert t["qweight"].shape == (256, 2) and t["qweight"].dtype == np.int32
    assert t["qzeros"].shape == (2, 2) and t["scales"].shape == (2, 16) and t["scales"].dtype == np.float16
    # AutoAWQ's dequantization, written out: w[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]
    qi = unpack_columns(t["qweight"]).astype(np.float32)  # (in, out)
    zi = unpack_columns(t["qzeros"]).astype(np.float32)  # (in // g, out)
    ref = (qi - np.repeat(zi, 128, axis=0)) * np.repeat(t["scales"].astype(np.float32), 128, axis=0)
    np.testing.assert_array_equal(dequantize_groups(q, scales, zeros), ref.T)
    assert np.abs(ref.T - w).max() <= scales.astype(np.float32).max() * 0.51
    q2, s2, z2 = from_awq_tensors(t["qweight"], t["qzeros"], t["scales"])
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(z2, zeros)
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(fake_quantize(w, 128), dequantize_groups(q, scales, zeros))


def test_q4_1_repacking_matches_group_dequantization():
    rng = np.random.default_rng(2)
    w = (rng.normal(0, 0.05, (8, 256)) + rng.normal(0, 0.02, (8, 1))).astype(np.float32)
    q, scales, zeros = quantize_groups(w, 64)
    raw = q4_1_rows(q, scales, zeros)
    assert raw.shape == (8, 256 // 32 * 20)
    got = dequantize("Q4_1", raw, 256)
    want = dequantize_groups(q, scales, zeros)
    # exact but for m = -s * z rounded to float16: at most half an f16 ulp of 15 * s
    s = np.repeat(scales.astype(np.float32), 64, axis=1)
    assert np.all(np.abs(got - want) <= 15 * s * 2.0**-11 + 1e-12)
    assert np.abs(got - want).max() > 0 or np.all(zeros == 0)


def _outlier_source(path, spec_kind="llama"):
    """A tiny model whose norm weights make a few input channels large, as real LLMs have them."""
    if spec_kind == "llama":
        write_tiny_gguf(path, TinySpec(hidden=128, ffn=256, heads=4, kv_heads=2, seed=3))
    else:
        write_tiny_gemma3(path, TinyGemmaSpec(hidden=64, ffn=96, seed=3))
    src = open_source(path)
    base = src._loader

    def load(name):
        x = base(name)
        if name.endswith(("attn_norm.weight", "ffn_norm.weight")):
            x = x.copy()
            x[:3] *= 8.0
        return x

    return dataclasses.replace(src, _loader=load)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_folded_scales_keep_the_float_model(tmp_path, kind):
    src = _outlier_source(tmp_path / "tiny.gguf", kind)
    res = awq.awq_transform(src, lambda name, w: fake_quantize(w, 32), TEXT, clip=False, clip_group=32)
    assert max(res.alphas.values()) > 0  # the scales are not all 1
    scaled = res.overlay(src)
    assert not np.allclose(scaled.tensor("blk.0.attn_q.weight"), src.tensor("blk.0.attn_q.weight"))
    tokens = np.arange(40, 80)
    a = awq.float_model(src)
    b = awq.float_model(scaled)
    la = a.forward(tokens, a.new_cache(64), all_logits=True).copy()
    lb = b.forward(tokens, b.new_cache(64), all_logits=True)
    np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-4 * np.abs(la).max())


def test_awq_error_below_rtn_on_a_layer_with_outlier_channels():
    rng = np.random.default_rng(4)
    d, rows, n = 512, 256, 2048
    gain = np.ones(d, np.float32)
    gain[rng.choice(d, 8, replace=False)] = 30.0
    x = (rng.normal(0, 1, (n, d)) * gain).astype(np.float32)
    w = rng.normal(0, 0.05, (rows, d)).astype(np.float32)
    stats = awq._Stats(d)
    stats.add(x)
    qdq = lambda name, m: fake_quantize(m, 128)  # noqa: E731
    s, alpha, e_rtn, e_awq = awq.search_scale({"w": w}, stats, qdq)
    assert alpha > 0 and e_awq < 0.8 * e_rtn
    # the errors are real output errors: check the best one on the activations themselves
    y = x @ w.T
    err_awq = float(((x @ (qdq("w", w * s) / s).T - y) ** 2).sum() / n)
    err_rtn = float(((x @ qdq("w", w).T - y) ** 2).sum() / n)
    assert err_awq < 0.8 * err_rtn
    # clipping never makes a group's error larger than no clipping
    g = stats.g / np.outer(s, s)
    clipped = awq.search_clip("w", w * s, g, qdq, 128)
    e_clip = awq._error(w * s - qdq("w", clipped), g)
    assert e_clip <= awq._error(w * s - qdq("w", w * s), g) * (1 + 1e-6)


def _reference_folder_logits(folder, tokens):
    """Logits of an AutoAWQ folder with every linear dequantized to float32 in numpy (no Q4_1)."""
    from engine.arch import model_class
    from engine.hf_repo import HFWeights, config_from_hf, read_json
    from engine.weights import Weight
    from models.formats.safetensors import open_safetensors_repo

    cfg = config_from_hf(folder, read_json(folder / "config.json"))
    st = open_safetensors_repo(folder)

    class Dequantized(HFWeights):
        def matrix(self, name, rows, cols):
            if name not in self.awq:
                return super().matrix(name, rows, cols)
            p = self.awq[name]
            q, s, z = from_awq_tensors(
                st.array(p + "qweight"), st.array(p + "qzeros"), st.array(p + "scales")
            )
            w = np.ascontiguousarray(dequantize_groups(q, s, z), np.float32)
            return Weight(0, w.view(np.uint8), rows, cols)

    model = model_class(cfg.architecture)(cfg, Dequantized(st, folder, cfg.architecture))
    return model.forward(tokens, model.new_cache(64), all_logits=True).copy()


@pytest.mark.parametrize("fmt", ["awq", "int4:g128"])
def test_awq_folder_loads_through_the_autoawq_loader(tmp_path, fmt):
    from engine.loader import load_model

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, TinySpec(hidden=128, ffn=256, heads=4, kv_heads=2, seed=5))
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT, encoding="utf-8")
    out = convert(gguf_path, fmt, tmp_path / "out", options={"calibration": str(calib)})
    folder = out.output
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    loaded = load_model(folder)
    layer = loaded.model.layers[0]
    assert layer.wq.ggml_type == 3 and layer.w_down.ggml_type == 3  # Q4_1
    tokens = np.arange(60, 80)
    got = loaded.model.forward(tokens, loaded.model.new_cache(64), all_logits=True)
    want = _reference_folder_logits(folder, tokens)
    # Q4_1's m = -s * z is rounded to float16 and the small-batch kernels round activations
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 1e-2 * scale and np.abs(got - want).mean() < 1e-3 * scale
    # the folder converts back to a GGUF: every group decoded to float (through its Q4_1 blocks), q/k rows
    # permuted for GGUF's RoPE as for a float folder
    back = convert(folder, "F16", tmp_path / "back.gguf").output
    again = load_model(back).model
    got = again.forward(tokens, again.new_cache(64), all_logits=True)
    assert np.abs(got - want).max() < 1e-2 * scale and np.abs(got - want).mean() < 1e-3 * scale


def test_awq_gguf_targets_and_names(tmp_path):
    from engine.loader import load_model

    assert lookup("awq")[0].container == "safetensors"
    assert lookup("AWQ:Q4_K")[0].container == "gguf"
    assert lookup("int4:g64")[0].name == "int4:g64"
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, TinySpec(hidden=128, ffn=256, heads=4, kv_heads=2, seed=6))
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT, encoding="utf-8")
    out = convert(gguf_path, "awq:q4_0", options={"calibration": str(calib)})
    assert out.output.name == "tiny.awq-q4_0.gguf"
    assert out.result.tensor_types["blk.0.attn_q.weight"] == "Q4_0"
    assert out.result.extra["awq_error"] <= out.result.extra["rtn_error"]
    loaded = load_model(out.output)
    logits = loaded.model.forward(np.arange(50, 60), loaded.model.new_cache(16))
    assert np.isfinite(logits).all()


def test_bad_calibration_and_shapes(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, TinySpec(hidden=128, ffn=256, heads=4, kv_heads=2))
    with pytest.raises(awq.CalibrationError, match="no such calibration"):
        convert(gguf_path, "awq", tmp_path / "a", options={"calibration": str(tmp_path / "missing.txt")})
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    with pytest.raises(awq.CalibrationError, match="at least 64"):
        convert(gguf_path, "awq", tmp_path / "b", options={"calibration": str(short)})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    odd = tmp_path / "odd.gguf"
    write_tiny_gguf(odd, TinySpec(hidden=48, ffn=96, heads=4, kv_heads=2))
    with pytest.raises(UnsupportedArchitectureError, match="INT4 groups"):
        convert(odd, "int4:g128", tmp_path / "c")
    wide = tmp_path / "wide.gguf"
    write_tiny_gguf(wide, TinySpec(hidden=64 * 3, ffn=128 * 3, heads=4, kv_heads=2))
    with open_source(wide) as src:
        assert awq.pick_group(src) == 64  # 192-wide rows: groups of 64, as SmolLM2's 576
