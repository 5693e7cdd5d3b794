"""FP8 (E4M3, per-channel or 128 x 128 block scales) and NVFP4 (E2M1 + E4M3 per 16 + FP32 global): codecs,
kernels, files.

References: hand-computed E4M3/E2M1 values, ml_dtypes' float8_e4m3fn / float4_e2m1fn casts (an
independent implementation of the OCP formats), ModelOpt's NVFP4 recipe written out here with
ml_dtypes, and the reference decoders (engine/quant/fp8.py, nvfp4.py) as the kernels' oracle.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

import engine  # noqa: F401  (Numba cache location before kernels compile)
from engine.backends import cpu
from engine.backends.cpu import fpquant
from engine.errors import ModelFormatError
from engine.quant.fp8 import (
    E4M3_VALUES,
    dequantize_fp8,
    dequantize_fp8_blocks,
    e4m3_decode,
    e4m3_encode,
    quantize_fp8,
    quantize_fp8_blocks,
)
from engine.quant.nvfp4 import (
    E2M1_VALUES,
    dequantize_nvfp4,
    e2m1_encode,
    pack_nibbles,
    quantize_nvfp4,
    unpack_nibbles,
)
from engine.weights import Weight
from models.formats.safetensors import open_safetensors

ml_dtypes = pytest.importorskip("ml_dtypes")
NAN_CODES = (0x7F, 0xFF)


# ------------------------------------------------------------------------------------------------
# Codecs
# ------------------------------------------------------------------------------------------------


def test_e4m3_table_all_256_codes():
    hand = {0x00: 0.0, 0x01: 2**-9, 0x07: 7 * 2**-9, 0x08: 2**-6, 0x0F: 1.875 * 2**-6, 0x38: 1.0,
            0x39: 1.125, 0x40: 2.0, 0x77: 1.875 * 2**7, 0x7E: 448.0, 0x80: -0.0, 0x81: -(2**-9),
            0xB8: -1.0, 0xFE: -448.0}
    for code, value in hand.items():
        assert E4M3_VALUES[code] == np.float32(value), hex(code)
    assert np.signbit(E4M3_VALUES[0x80]) and np.isnan(E4M3_VALUES[list(NAN_CODES)]).all()
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(E4M3_VALUES, ref)  # NaNs compare equal here
    np.testing.assert_array_equal(fpquant.E4M3_LUT, ref)


def test_e4m3_encode_rounds_to_nearest_even_and_saturates():
    rng = np.random.default_rng(0)
    finite = E4M3_VALUES[np.isfinite(E4M3_VALUES)]
    pos = np.sort(np.unique(finite[finite >= 0]))
    mids = (pos[:-1] + pos[1:]) / 2  # exact ties: half to even
    x = np.concatenate([
        *(rng.standard_normal(20000).astype(np.float32) * s for s in (1e-4, 1e-2, 1, 30, 300)),
        finite, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 1000),
    ]).astype(np.float32)
    ref = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(e4m3_encode(x), ref)
    assert e4m3_encode(np.float32(1.0625)) == 0x38  # tie between 1 and 1.125 -> even mantissa
    assert e4m3_encode(np.float32(1.1875)) == 0x3A  # tie between 1.125 and 1.25 -> even
    assert list(e4m3_encode(np.array([460, 1e6, -1e30, np.inf], np.float32))) == [0x7E, 0x7E, 0xFE, 0x7E]
    assert e4m3_encode(np.float32(np.nan)) & 0x7F == 0x7F
    np.testing.assert_array_equal(e4m3_decode(e4m3_encode(finite)), finite)


def test_e2m1_codes_and_rounding():
    assert list(E2M1_VALUES[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    np.testing.assert_array_equal(E2M1_VALUES[8:], -E2M1_VALUES[:8])
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    assert list(e2m1_encode(ties)) == [0, 2, 2, 4, 4, 6, 6]  # to the even code
    assert list(e2m1_encode(-ties)) == [8, 10, 10, 12, 12, 14, 14]
    assert list(e2m1_encode(np.array([7, 100, -9], np.float32))) == [7, 7, 15]
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(50000) * 3, ties, -ties, np.nextafter(ties, 0)])
    x = x.astype(np.float32)
    x = x[x != 0]
    ref = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(e2m1_encode(x), ref)


def test_nibble_order_low_first():
    codes = np.array([[1, 2, 15, 8]], np.uint8)
    assert list(pack_nibbles(codes)[0]) == [0x21, 0x8F]
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_fp8_per_channel_matches_compressed_tensors_recipe():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((33, 80)).astype(np.float32) * rng.uniform(0.01, 3, (33, 1)).astype(np.float32)
    w[5] = 0.0
    codes, scale = quantize_fp8(w)
    # compressed-tensors: scale = max|row| / 448 (symmetric min-max), q = clamp(w / scale) -> e4m3
    ref_scale = np.abs(w).max(axis=1) / np.float32(448)
    ref_scale[5] = 1.0
    np.testing.assert_array_equal(scale, ref_scale.astype(np.float32))
    ref = np.clip(w / ref_scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(codes, ref)
    deq = dequantize_fp8(codes, scale)
    assert (np.abs(deq - w) <= scale[:, None] * 16).all()  # half a step of the top binade (32)
    assert np.linalg.norm(deq - w) / np.linalg.norm(w) < 0.03
    nonzero = np.abs(w).max(axis=1) > 0
    assert ((codes & 0x7F).max(axis=1)[nonzero] == 0x7E).all()  # each row's max lands on 448


def test_nvfp4_matches_modelopt_recipe_and_search_only_helps():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 128)).astype(np.float32)
    w[:, 16:32] = 0.0  # an all-zero block gets scale 1.0
    w[3, 40:56] *= 50.0
    packed, scales, g = quantize_nvfp4(w, search=False)
    # ModelOpt NVFP4QTensor: scale_2 = amax / (6 * 448); block scale = fp8(block_amax / 6 / scale_2);
    # q = e2m1(w / (fp8 scale * scale_2)); two codes per byte, element 2i in the low nibble
    ref_g = np.float32(np.abs(w).max() / (6 * 448))
    bmax = np.abs(w.reshape(24, 8, 16)).max(axis=2)
    want = np.where(bmax > 0, bmax / 6 / ref_g, 1.0).astype(np.float32)
    ref_scales = want.astype(ml_dtypes.float8_e4m3fn)
    d = ref_scales.astype(np.float32) * ref_g
    q = np.clip(w.reshape(24, 8, 16) / d[:, :, None], -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    q = (q & 0xF).reshape(24, 128)
    q[(w == 0)] = 0
    assert g == ref_g
    np.testing.assert_array_equal(scales, ref_scales.view(np.uint8))
    np.testing.assert_array_equal(packed, q[:, 0::2] | (q[:, 1::2] << 4))
    plain = dequantize_nvfp4(packed, scales, g)
    best = dequantize_nvfp4(*quantize_nvfp4(w))
    err = lambda a: ((a - w) ** 2).reshape(24, 8, 16).sum(axis=2)  # noqa: E731
    assert (err(best) <= err(plain) + 1e-12).all() and err(best).sum() < err(plain).sum()
    rest = np.arange(24) != 3  # the row with the x50 block has a coarse global step
    assert np.linalg.norm((best - w)[rest]) / np.linalg.norm(w[rest]) < 0.1


def test_encoders_refuse_bad_input():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(np.ones((2, 24), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8(np.full((2, 4), np.nan, np.float32))


# ------------------------------------------------------------------------------------------------
# Kernels against the reference decoders
# ------------------------------------------------------------------------------------------------


def _random_fp8(rows, cols, rng):
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[np.isin(codes, NAN_CODES)] = 0x38  # NaN codes are no weights
    scale = rng.uniform(1e-3, 1e-1, rows).astype(np.float32)
    return Weight(fpquant.FP8_E4M3, codes, rows, cols, scale), dequantize_fp8(codes, scale).astype(np.float64)


def _random_fp8_blocks(rows, cols, rng):
    # a scale per 128 x 128 block, repeated per row as the loader keeps it
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[np.isin(codes, NAN_CODES)] = 0x38
    blocks = rng.uniform(1e-3, 1e-1, (-(-rows // 128), -(-cols // 128))).astype(np.float32)
    w = Weight(fpquant.FP8_E4M3_BLOCK, codes, rows, cols, fpquant.block_scales_per_row(blocks, rows))
    return w, dequantize_fp8_blocks(codes, blocks).astype(np.float64)


def _random_nvfp4(rows, cols, rng):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (rows, cols // 16), dtype=np.uint8)  # all positive non-NaN codes
    g = float(rng.uniform(1e-3, 1e-2))
    w = Weight(fpquant.NVFP4, packed, rows, cols, scales, g)
    return w, dequantize_nvfp4(packed, scales, g).astype(np.float64)


MAKERS, MAKER_IDS = [_random_fp8, _random_nvfp4, _random_fp8_blocks], ["fp8", "nvfp4", "fp8b"]


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
@pytest.mark.parametrize("n_tok", [1, 3, 16, 40])
def test_linear_matches_oracle(make, n_tok):
    rng = np.random.default_rng(n_tok)
    # a 3-row tail after the four-row groups; block FP8: 2 x 3 blocks, the last one 64 columns
    rows, cols = (67, 320) if make is not _random_fp8_blocks else (131, 320)
    w, oracle = make(rows, cols, rng)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    out = np.empty((n_tok, rows), np.float32)
    cpu.linear(out, w, x)
    ref = x.astype(np.float64) @ oracle.T
    bound = np.abs(x).astype(np.float64) @ np.abs(oracle).T
    assert (np.abs(out - ref) <= 2e-6 * bound + 1e-30).all()
    if 1 < n_tok <= cpu.SMALL_BATCH_MAX and w.ggml_type != fpquant.NVFP4:
        one = np.empty((1, rows), np.float32)
        for t in (0, n_tok - 1):
            cpu.linear(one, w, x[t : t + 1])
            np.testing.assert_array_equal(one[0], out[t])  # a batch gives each token the decode bits
    if 2 < n_tok <= cpu.SMALL_BATCH_MAX:
        two = np.empty((2, rows), np.float32)
        cpu.linear(two, w, x[n_tok - 2 :])
        np.testing.assert_array_equal(two, out[n_tok - 2 :])  # a token's bits do not depend on the batch


@pytest.mark.parametrize("make", [_random_fp8, _random_fp8_blocks], ids=["fp8", "fp8b"])
@pytest.mark.parametrize("n_tok", [1, 6])
@pytest.mark.parametrize("cols", [77, 269])
def test_fp8_rows_off_the_vector_width(make, n_tok, cols):
    # 77 columns: four 16-lane vectors and a 13-column tail; 269: 2 full blocks of 128, 13 more columns
    # (the tail alone in the third block); 5 rows: a group of four and a clamped one
    rng = np.random.default_rng(cols + n_tok)
    w, oracle = make(5, cols, rng)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    out = np.empty((n_tok, 5), np.float32)
    cpu.linear(out, w, x)
    ref = x.astype(np.float64) @ oracle.T
    bound = np.abs(x).astype(np.float64) @ np.abs(oracle).T
    assert (np.abs(out - ref) <= 2e-6 * bound + 1e-30).all()


def test_fp8_blocks_codec():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    w[:, 256:] *= 1e-3  # the third column block: small values, a scale of their own
    w[128:, :128] = 0.0  # an all-zero block: scale 1, codes 0
    codes, scale = quantize_fp8_blocks(w)
    assert codes.shape == (200, 300) and scale.shape == (2, 3) and scale.dtype == np.float32
    assert scale[1, 0] == 1.0 and not codes[128:, :128].any()
    np.testing.assert_allclose(scale[0, 2], np.abs(w[:128, 256:]).max() / 448, rtol=1e-6)
    back = dequantize_fp8_blocks(codes, scale)
    # E4M3 keeps 3 mantissa bits: every normal value within 1/16 of itself, relative to its block
    err = np.abs(back - w)
    amax = np.repeat(np.repeat(scale * 448, 128, 0)[:200], 128, 1)[:, :300]
    assert (err <= np.maximum(np.abs(w) / 16, amax * 2.0**-9 / 448 * 2)).all()
    assert np.abs(back[:, 256:]).max() < 1e-2  # small block not flushed by the big ones
    assert np.count_nonzero(back[:, 256:]) > 0.9 * back[:, 256:].size


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_get_rows_and_row_block_exact(make):
    rng = np.random.default_rng(7)
    w, oracle = make(29, 64, rng)
    ids = np.array([0, 28, 5, 5])
    out = np.empty((4, 64), np.float32)
    cpu.get_rows(out, w, ids)
    np.testing.assert_array_equal(out, oracle[ids].astype(np.float32))
    part = w.row_block(8, 20)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    a, b = np.empty((1, 12), np.float32), np.empty((1, 29), np.float32)
    cpu.linear(a, part, x)
    cpu.linear(b, w, x)
    np.testing.assert_array_equal(a[0], b[0, 8:20])
    assert w.nbytes == w.raw.nbytes + w.scales.nbytes
    with pytest.raises(ValueError, match="ids must lie"):
        cpu.get_rows(out, w, np.array([0, 1, 2, 29]))


def test_malformed_weights_are_refused():
    bad = Weight(fpquant.NVFP4, np.zeros((4, 8), np.uint8), 4, 16, np.zeros((4, 2), np.uint8), 1.0)
    with pytest.raises(ValueError, match="NVFP4 weight 4x16"):
        cpu.linear(np.empty((1, 4), np.float32), bad, np.zeros((1, 16), np.float32))
    no_scale = Weight(fpquant.FP8_E4M3, np.zeros((4, 16), np.uint8), 4, 16)
    with pytest.raises(ValueError, match="FP8_E4M3"):
        cpu.get_rows(np.empty((1, 16), np.float32), no_scale, np.array([0]))


# ------------------------------------------------------------------------------------------------
# Hub checkpoints: tensors laid out as compressed-tensors / ModelOpt write them
# ------------------------------------------------------------------------------------------------


def _write_st(path: Path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
    header, off, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(blobs))


def _bf16(a) -> bytes:
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def test_hub_layouts_load_as_weights(tmp_path):
    from engine.quant.fp_load import fp_matrix

    rng = np.random.default_rng(11)
    rows, cols = 8, 32
    e4m3 = rng.integers(0, 0x7E, (rows, cols), dtype=np.uint8)
    fp4 = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    bscale = rng.integers(0x20, 0x50, (rows, cols // 16), dtype=np.uint8)
    vals8 = e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes4 = np.stack([fp4 & 0xF, fp4 >> 4], axis=2).reshape(rows, cols)  # low nibble first
    vals4 = codes4.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    bs = np.repeat(bscale.view(ml_dtypes.float8_e4m3fn).astype(np.float32), 16, axis=1)
    _write_st(tmp_path / "m.safetensors", {
        # compressed-tensors FP8, per-tensor scale in BF16 with shape [1]
        "a.weight": ("F8_E4M3", (rows, cols), e4m3.tobytes()),
        "a.weight_scale": ("BF16", (1,), _bf16([0.5])),
        "a.input_scale": ("BF16", (1,), _bf16([0.1])),
        # compressed-tensors FP8, per-channel scale (rows, 1) F32
        "b.weight": ("F8_E4M3", (rows, cols), e4m3.tobytes()),
        "b.weight_scale": ("F32", (rows, 1), np.arange(1, rows + 1, dtype=np.float32).tobytes()),
        # ModelOpt NVFP4: scalar weight_scale_2 multiplies
        "c.weight": ("U8", (rows, cols // 2), fp4.tobytes()),
        "c.weight_scale": ("F8_E4M3", (rows, cols // 16), bscale.tobytes()),
        "c.weight_scale_2": ("F32", (), np.float32(0.25).tobytes()),
        "c.input_scale": ("F32", (), np.float32(3.0).tobytes()),
        # compressed-tensors NVFP4: weight_packed + weight_global_scale that divides
        "d.weight_packed": ("U8", (rows, cols // 2), fp4.tobytes()),
        "d.weight_scale": ("F8_E4M3", (rows, cols // 16), bscale.tobytes()),
        "d.weight_global_scale": ("F32", (1,), np.float32(4.0).tobytes()),
        # block-wise FP8 (DeepSeek / Qwen3): weight_scale_inv per 128 x 128 (one block here), BF16
        "e.weight": ("F8_E4M3", (rows, cols), e4m3.tobytes()),
        "e.weight_scale_inv": ("BF16", (1, 1), _bf16([0.5])),
        # ... with scales for blocks of 64 (refused: the kernels take 128) and with a NaN scale
        "g.weight": ("F8_E4M3", (rows, cols), e4m3.tobytes()),
        "g.weight_scale_inv": ("F32", (1, 2), np.ones(2, np.float32).tobytes()),
        "h.weight": ("F8_E4M3", (rows, cols), e4m3.tobytes()),
        "h.weight_scale_inv": ("F32", (1, 1), np.float32(np.nan).tobytes()),
        # per-channel scale of the wrong shape
        "f.weight": ("F8_E4M3", (rows, cols), e4m3.tobytes()),
        "f.weight_scale": ("F32", (2, 2), np.ones(4, np.float32).tobytes()),
    })
    st = open_safetensors(tmp_path / "m.safetensors")
    expect = {
        "a.weight": vals8 * 0.5,
        "b.weight": vals8 * np.arange(1, rows + 1, dtype=np.float32)[:, None],
        "c.weight": vals4 * bs * 0.25,
        "d.weight_packed": vals4 * bs / 4.0,
        "e.weight": vals8 * 0.5,
    }
    for name, ref in expect.items():
        w = fp_matrix(st, tmp_path, name, rows, cols)
        out = np.empty((rows, cols), np.float32)
        cpu.get_rows(out, w, np.arange(rows))
        np.testing.assert_allclose(out, ref, rtol=1e-6, err_msg=name)
    assert fp_matrix(st, tmp_path, "e.weight", rows, cols).ggml_type == fpquant.FP8_E4M3_BLOCK
    with pytest.raises(ModelFormatError, match="blocks of 128 x 128"):
        fp_matrix(st, tmp_path, "g.weight", rows, cols)
    with pytest.raises(ModelFormatError, match="NaN or infinite"):
        fp_matrix(st, tmp_path, "h.weight", rows, cols)
    with pytest.raises(ModelFormatError, match="per-channel"):
        fp_matrix(st, tmp_path, "f.weight", rows, cols)
    with pytest.raises(ModelFormatError, match="NVFP4 needs"):
        fp_matrix(st, tmp_path, "c.weight", rows, cols * 2)
    st.close()


# ------------------------------------------------------------------------------------------------
# The starter model converted, loaded back through the Hugging Face path, and run
# ------------------------------------------------------------------------------------------------

_CODE = [Path(__file__).parents[2] / "engine" / p for p in ("quant/fp8.py", "quant/nvfp4.py", "export.py")]


def _converted(src: Path, fmt: str) -> Path:
    from engine.convert import convert
    from tests.conftest import TEST_MODELS

    h = hashlib.sha256(str(src).encode())
    for p in _CODE:
        h.update(p.read_bytes())
    out = TEST_MODELS / "converted" / f"fp-{h.hexdigest()[:12]}" / f"{src.name}-{fmt.replace(':', '-')}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(src, fmt, out)
    return out


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path):
    from tests.engine.quant_fixtures import cached_conversion

    return cached_conversion(smollm2_path, "safetensors")


def _greedy(m, prompt: str, n: int, forced: list[int] | None = None) -> list[int]:
    """n greedy tokens after prompt; with `forced`, the argmax at each step while feeding `forced`."""
    ids = m.tokenizer.encode(prompt, add_special=True)
    cache = m.model.new_cache(len(ids) + n)
    logits = m.model.forward(ids, cache)
    out = []
    for i in range(n):
        t = int(np.argmax(logits[-1]))
        out.append(t)
        logits = m.model.forward([forced[i] if forced else t], cache)
    return out


def test_smollm2_fp8_and_nvfp4_folders_load_and_run(smollm2_hf):
    from engine.loader import load_model
    from engine.perplexity import load_text, perplexity

    text = load_text(None)
    base = load_model(smollm2_hf)
    tokens = base.tokenizer.encode(text, add_special=True)[:320]
    ppl = {"f16": perplexity(base.model, tokens, 160, 80)}
    prompt = "The three primary colors are"
    greedy = {"f16": _greedy(base, prompt, 8)}
    formats = (("fp8", fpquant.FP8_E4M3), ("fp8:block", fpquant.FP8_E4M3_BLOCK), ("nvfp4", fpquant.NVFP4))
    for fmt, ggml_type in formats:
        folder = _converted(smollm2_hf, fmt)
        cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        header_dtypes = _header_dtypes(folder / "model.safetensors")
        q = "model.layers.0.self_attn.q_proj"
        if fmt == "fp8":
            assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "float-quantized"
            assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
            assert header_dtypes[q + ".weight"] == ("F8_E4M3", [576, 576])
            assert header_dtypes[q + ".weight_scale"] == ("F32", [576, 1])
        elif fmt == "fp8:block":  # DeepSeek-V3 / Qwen3-FP8's layout
            assert (cfg["quant_method"], cfg["weight_block_size"]) == ("fp8", [128, 128])
            assert header_dtypes[q + ".weight"] == ("F8_E4M3", [576, 576])
            assert header_dtypes[q + ".weight_scale_inv"] == ("F32", [5, 5])
            down = "model.layers.0.mlp.down_proj"
            assert header_dtypes[down + ".weight_scale_inv"] == ("F32", [5, 12])
        else:
            assert (cfg["quant_method"], cfg["quant_algo"], cfg["group_size"]) == ("modelopt", "NVFP4", 16)
            hq = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
            assert hq["quant_algo"] == "NVFP4" and hq["exclude_modules"] == ["lm_head"]
            assert header_dtypes[q + ".weight"] == ("U8", [576, 288])
            assert header_dtypes[q + ".weight_scale"] == ("F8_E4M3", [576, 36])
            assert header_dtypes[q + ".weight_scale_2"] == ("F32", [])
        assert header_dtypes["model.embed_tokens.weight"][0] == "F16"
        m = load_model(folder)
        layer = m.model.layers[0]
        assert {w.ggml_type for w in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_down)} == {ggml_type}
        if fmt == "fp8:block":  # the loaded rows are the reference decoder's (tensors read by `safetensors`)
            safetensors = pytest.importorskip("safetensors")
            with safetensors.safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
                scale = f.get_tensor(down + ".weight_scale_inv")
            codes = open_safetensors(folder / "model.safetensors")
            ref = dequantize_fp8_blocks(np.array(codes.array(down + ".weight")), scale)
            codes.close()
            rows = np.empty(ref.shape, np.float32)
            cpu.get_rows(rows, layer.w_down, np.arange(ref.shape[0]))
            np.testing.assert_array_equal(rows, ref)
        ppl[fmt] = perplexity(m.model, tokens, 160, 80)
        greedy[fmt] = _greedy(m, prompt, 8, forced=greedy["f16"] if fmt != "nvfp4" else None)
        assert m.file_size < base.file_size * (0.65 if fmt != "nvfp4" else 0.48)
    # FP8 loses ~1% on this text, NVFP4 more; both far from a broken model (ppl in the hundreds)
    assert ppl["f16"] < ppl["fp8"] < ppl["f16"] * 1.05, ppl
    assert ppl["f16"] < ppl["fp8:block"] < ppl["f16"] * 1.05, ppl
    assert ppl["fp8"] < ppl["nvfp4"] < ppl["f16"] * 1.4, ppl
    # teacher-forced on F16's greedy reply, FP8 picks the same next token almost everywhere
    for fmt in ("fp8", "fp8:block"):
        assert sum(a == b for a, b in zip(greedy[fmt], greedy["f16"], strict=True)) >= 6, greedy
    assert len(set(greedy["nvfp4"])) > 2 and base.tokenizer.decode(greedy["nvfp4"]).strip(), greedy


def test_fp_folders_convert_back_to_gguf(smollm2_hf, tmp_path):
    """`hearth convert` reads FP8 (both layouts) and NVFP4 folders: each linear decoded to float32 as the
    reference decoders decode its tensors, and a GGUF written from them gives the folder's logits."""
    from engine.convert import convert
    from engine.loader import load_model
    from engine.quant.nvfp4 import dequantize_nvfp4
    from engine.quant.source import open_source

    down = "model.layers.1.mlp.down_proj"
    tokens = [1, 504, 2512, 6093, 314, 30, 28, 17, 4512]
    formats = (("fp8", fpquant.FP8_E4M3), ("fp8:block", fpquant.FP8_E4M3_BLOCK), ("nvfp4", fpquant.NVFP4))
    for fmt, t in formats:
        folder = _converted(smollm2_hf, fmt)
        st = open_safetensors(folder / "model.safetensors")
        codes = np.array(st.array(down + ".weight"))
        scales = {n: np.array(st.array(n)) for n in st.tensors if n.startswith(down + ".weight_scale")}
        st.close()
        if fmt == "fp8":
            ref = dequantize_fp8(codes, scales[down + ".weight_scale"])
        elif fmt == "fp8:block":
            ref = dequantize_fp8_blocks(codes, scales[down + ".weight_scale_inv"])
        else:
            g = float(scales[down + ".weight_scale_2"])
            ref = dequantize_nvfp4(codes, scales[down + ".weight_scale"], g)
        with open_source(folder) as src:
            assert src.source_types["blk.1.ffn_down.weight"] == t
            assert src.shapes["blk.1.ffn_down.weight"] == (576, 1536) == ref.shape
            np.testing.assert_array_equal(src.tensor("blk.1.ffn_down.weight"), ref)
        back = load_model(convert(folder, "F16", tmp_path / f"{t}.gguf").output).model
        model = load_model(folder).model
        want = model.forward(tokens, model.new_cache(16), all_logits=True)
        got = back.forward(tokens, back.new_cache(16), all_logits=True)
        # F16 rounding of the decoded weights (FP8 x a float32 scale needs more than 11 bits)
        assert np.abs(got - want).max() < 2e-2 * np.abs(want).max(), fmt
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8, fmt


def _header_dtypes(path: Path) -> dict[str, tuple[str, list]]:
    # read with the `safetensors` package where it can (it has no numpy float8) and by hand otherwise
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(path), framework="numpy") as f:
        names = set(f.keys())
        for n in names:
            if n.endswith("weight_scale_2"):
                assert f.get_tensor(n).shape == ()
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    assert set(header) == names
    return {k: (v["dtype"], v["shape"]) for k, v in header.items()}

