"""Qwen2.5-VL's images (engine.vision.qwen25): its windowed tower and its language model's M-RoPE in sections
one after another, through the Hugging Face folder and through the GGUF + mmproj that `hearth convert` writes.

tests/fixtures/tiny/qwen2_5_vl-vision (scripts/make_tiny_checkpoints.py) is a Qwen2.5-VL with Qwen2 text
layers (QKV biases, 8 rotary pairs turned by M-RoPE sections [2, 3, 3] in a row) and a 3-block tower over 4 px
patches, merged 2x2, whose blocks 0 and 2 attend within windows of 16 px (2 x 2 merged rows) and block 1 over
the whole image; golden_vision.json holds, from transformers' Qwen2_5_VLForConditionalGeneration and its PIL
image processor, a chat prompt with two images (32 x 48 and 56 x 32 px after smart_resize: 4 x 6 and 7 x 4
merged rows, so 6 and 8 windows, some narrower), its logits at every position, 8 greedy tokens and each
image's merged rows.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.convert import convert
from engine.generate import GenerationParams, generate, prefill
from engine.loader import load_model
from engine.vision.qwen25 import Qwen25Vision, periodic_blocks, window_order
from engine.vision.qwen35 import mrope_masks
from tests.engine.test_vision import IMAGE_TOKEN, _prompt, _with_images

Q25 = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen2_5_vl-vision"
GOLDEN = json.loads((Q25 / "golden_vision.json").read_text())
REF = np.array(GOLDEN["logits"])
TOL = 1e-4 * np.abs(REF).max()
IMAGES = [(Q25 / name).read_bytes() for name in GOLDEN["images"]]


@pytest.fixture(scope="module")
def q25():
    return load_model(Q25)


@pytest.fixture(scope="module")
def q25_ids(q25):
    return _prompt(q25, _with_images(GOLDEN, IMAGES))


def _rows_error(tower) -> float:
    """The largest |row - golden| over both images' merged rows, relative to the golden's largest."""
    errors = []
    for data, ref in zip(IMAGES, GOLDEN["image_rows"], strict=True):
        ref = np.array(ref)
        errors.append(np.abs(tower.encode(tower.pixels(data)) - ref).max() / np.abs(ref).max())
    return max(errors)


def _logits_error(lm, ids) -> float:
    logits = lm.model.forward(ids, lm.model.new_cache(256), all_logits=True)
    return float(np.abs(logits - REF).max())


def test_window_order_takes_windows_row_by_row():
    # a 3 x 5 merged grid in windows of 2 x 2: three windows on the first two rows, three narrower below
    order, spans = window_order(3, 5, 2)
    assert order.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    assert spans == [(0, 4), (4, 8), (8, 10), (10, 12), (12, 14), (14, 15)]


def test_sections_in_a_row_are_not_interleaved():
    np.testing.assert_array_equal(np.argmax(mrope_masks((2, 3, 3), 8, interleaved=False), 0),
                                  [0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(np.argmax(mrope_masks((2, 3, 3), 8), 0), [0, 1, 2, 0, 1, 2, 0, 1])


def test_qwen25_image_rows_match_transformers(q25):
    assert isinstance(q25.vision, Qwen25Vision)
    assert (q25.vision.shape.window_rows, q25.vision.shape.full_blocks) == (2, (1,))
    for data, (_, gh, gw) in zip(IMAGES, GOLDEN["grids"], strict=True):
        assert q25.vision.pixels(data).shape[1:] == (gh * 4, gw * 4)
    error = _rows_error(q25.vision)
    print(f"qwen2_5_vl: max |row - golden| / max |golden| {error:.3g}")
    assert error < 1e-4


def test_qwen25_golden_depends_on_the_windows(q25, monkeypatch):
    """Full attention in every block, or windows in every block, misses transformers' rows."""
    tower = q25.vision
    monkeypatch.setattr(tower, "shape", replace(tower.shape, full_blocks=(0, 1, 2)))
    assert _rows_error(tower) > 100 * 1e-4
    monkeypatch.setattr(tower, "shape", replace(tower.shape, full_blocks=()))
    assert _rows_error(tower) > 100 * 1e-4


def test_qwen25_prompt_logits_and_greedy_match_transformers(q25, q25_ids):
    base = q25.model.images.base
    assert q25.model.cfg.architecture == "qwen2vl" and q25.model.layers[0].bq is not None
    assert [IMAGE_TOKEN if t >= base else t for t in q25_ids] == GOLDEN["tokens"]
    text = q25.tokenizer.decode([t if t < base else IMAGE_TOKEN for t in q25_ids])
    assert "<|vision_start|>" + "<|image_pad|>" * 24 + "<|vision_end|>" in text
    assert "<|vision_start|>" + "<|image_pad|>" * 28 + "<|vision_end|>" in text
    error = _logits_error(q25, q25_ids)
    print(f"qwen2_5_vl: max |logit - golden| {error:.3g}, max |golden| {np.abs(REF).max():.3g}")
    assert error < TOL
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(q25.model, q25.tokenizer, q25_ids, q25.model.new_cache(256), params)
           if e.token is not None]
    assert out == GOLDEN["greedy"]


def test_qwen25_golden_depends_on_sections_in_a_row(q25, q25_ids, monkeypatch):
    """Interleaved sections (Qwen3-VL's layout), or the cache's index as every position, miss the golden."""
    np.testing.assert_array_equal(q25.model.mrope, mrope_masks((2, 3, 3), 8, interleaved=False))
    monkeypatch.setattr(q25.model, "mrope", mrope_masks((2, 3, 3), 8, interleaved=True))
    assert _logits_error(q25, q25_ids) > 10 * TOL
    monkeypatch.setattr(q25.model, "mrope", None)
    assert _logits_error(q25, q25_ids) > 10 * TOL


def test_qwen25_positions_continue_after_each_image_from_its_largest(q25, q25_ids):
    table = q25.model.images
    ids = np.array(q25_ids)
    (a0, a1), (b0, b1) = table.runs(ids)
    axes = table.positions([], ids)
    assert (axes[:, a1] == a0 + 6).all()  # 4 x 6 rows: the largest position a0 + 5, then the text
    assert (axes[:, b1] == b0 + (a0 + 6 - a1) + 7).all()  # 7 x 4 rows: b0's position + 7
    assert axes[:, b1 - 1].tolist() == [axes[0, b0], axes[0, b0] + 6, axes[0, b0] + 3]


@pytest.mark.parametrize("chunk", [3, 7, 40, 256])
def test_qwen25_chunked_prefill_matches_one_pass(q25, q25_ids, chunk):
    last, _ = prefill(q25.model, q25.model.new_cache(256), q25_ids, chunk)  # passes that cut images
    np.testing.assert_allclose(last, REF[-1], atol=TOL)


def test_qwen25_gguf_with_its_mmproj_matches_transformers(tmp_path):
    """The text GGUF as llama.cpp's qwen2vl (rope.dimension_sections) and the mmproj as its converter writes
    Qwen2.5-VL's (projector qwen2.5vl_merger: q, k, v apart, the gated MLP, the full-attention period in
    n_wa_pattern), read back side by side."""
    from models.formats.gguf import open_gguf

    out = convert(Q25, "F16", tmp_path / "q25.gguf")
    assert out.mmproj == tmp_path / "mmproj-q25-f16.gguf"
    with open_gguf(out.output) as gguf:
        assert gguf.metadata["general.architecture"] == "qwen2vl"
        assert list(gguf.metadata["qwen2vl.rope.dimension_sections"]) == [2, 3, 3, 0]
    with open_gguf(out.mmproj) as gguf:
        meta, tensors = gguf.metadata, gguf.tensors
        assert meta["general.architecture"] == "clip" and meta["clip.projector_type"] == "qwen2.5vl_merger"
        assert meta["clip.use_silu"] and meta["clip.has_vision_encoder"]
        assert (meta["clip.vision.n_wa_pattern"], meta["clip.vision.window_size"]) == (2, 16)
        assert (meta["clip.vision.image_min_pixels"], meta["clip.vision.image_max_pixels"]) == (256, 1920)
        for key in ("patch_size", "embedding_length", "feed_forward_length", "block_count", "projection_dim",
                    "attention.head_count", "attention.layer_norm_epsilon", "spatial_merge_size",
                    "image_mean", "image_std"):
            assert f"clip.vision.{key}" in meta
        assert tuple(tensors["v.patch_embd.weight"].shape) == tuple(tensors["v.patch_embd.weight.1"].shape)
        for name in ("v.blk.2.attn_q.weight", "v.blk.2.attn_k.bias", "v.blk.2.attn_v.weight",
                     "v.blk.2.attn_out.bias", "v.blk.2.ln1.weight", "v.blk.2.ln2.weight",
                     "v.blk.2.ffn_gate.bias", "v.blk.2.ffn_up.weight", "v.blk.2.ffn_down.bias",
                     "v.post_ln.weight", "mm.0.weight", "mm.2.bias"):
            assert name in tensors, name
        for name in ("v.patch_embd.bias", "v.position_embd.weight", "v.blk.0.attn_qkv.weight",
                     "v.blk.0.ln1.bias", "v.post_ln.bias"):
            assert name not in tensors, name
    lm = load_model(out.output)
    assert isinstance(lm.vision, Qwen25Vision) and not lm.vision_notice
    assert lm.vision.shape.full_blocks == (1,) and not lm.vision.shape.mrope_interleaved
    assert _rows_error(lm.vision) < 1e-3  # F16 matrices
    ids = _prompt(lm, _with_images(GOLDEN, IMAGES))
    error = _logits_error(lm, ids)
    print(f"qwen2_5_vl GGUF + mmproj: max |logit - golden| {error:.3g}, max |golden| {np.abs(REF).max():.3g}")
    assert error < TOL
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out_tokens = [e.token for e in generate(lm.model, lm.tokenizer, ids, lm.model.new_cache(256), params)
                  if e.token is not None]
    assert out_tokens == GOLDEN["greedy"]


def test_qwen25_broken_mmproj_leaves_images_off_with_a_notice(tmp_path):
    out = convert(Q25, "F16", tmp_path / "q25.gguf")
    data = out.mmproj.read_bytes()
    out.mmproj.write_bytes(data[: len(data) // 2])  # a truncated download
    lm = load_model(out.output)
    assert lm.vision is None and "images are off" in lm.vision_notice
    assert lm.model.forward([1, 2, 3], lm.model.new_cache(8)).shape[1] == lm.model.cfg.vocab_size


def _published(folder: Path, tmp_path: Path) -> Path:
    """The fixture with its config.json as Qwen's published ones lay it out: the text fields at the top level,
    the M-RoPE sections in rope_scaling {"type": "mrope"}, a sliding window that is off."""
    copy = tmp_path / "published"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config |= {k: v for k, v in text.items() if k != "model_type"}
    config |= {"rope_theta": rope["rope_theta"],
               "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
               "sliding_window": 32768, "use_sliding_window": False}  # as Qwen2.5-VL-7B-Instruct's
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_qwen25_published_config_layout_matches_transformers(tmp_path):
    from models.formats.gguf import open_gguf

    folder = _published(Q25, tmp_path)
    lm = load_model(folder)
    assert isinstance(lm.vision, Qwen25Vision) and lm.model.cfg.architecture == "qwen2vl"
    assert lm.vision.shape.mrope_section == (2, 3, 3)
    assert _logits_error(lm, _prompt(lm, _with_images(GOLDEN, IMAGES))) < TOL
    out = convert(folder, "F16", tmp_path / "published.gguf")
    with open_gguf(out.output) as gguf:
        assert list(gguf.metadata["qwen2vl.rope.dimension_sections"]) == [2, 3, 3, 0]
    converted = load_model(out.output)
    assert _logits_error(converted, _prompt(converted, _with_images(GOLDEN, IMAGES))) < TOL


def test_qwen25_full_attention_blocks_no_period_describes_get_no_mmproj(tmp_path):
    """llama.cpp's mmproj gives the full-attention blocks as every n-th; other sets are written text only."""
    folder = tmp_path / "irregular"
    shutil.copytree(Q25, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["fullatt_block_indexes"] = [0, 1]  # a period of 1 would make block 2 full too
    (folder / "config.json").write_text(json.dumps(config))
    out = convert(folder, "F16", tmp_path / "irregular.gguf")
    assert out.mmproj is None and out.output.is_file()


# Qwen2-VL (tests/fixtures/tiny/qwen2_vl-vision): the same text layers and M-RoPE; a tower of 2 LayerNorm
# blocks with quick-GELU MLPs attending over the whole image, a LayerNorm merger; the same two images
Q2 = Q25.parent / "qwen2_vl-vision"
Q2_GOLDEN = json.loads((Q2 / "golden_vision.json").read_text())


def test_qwen2_vl_rows_prompt_logits_and_greedy_match_transformers(monkeypatch):
    lm = load_model(Q2)
    assert isinstance(lm.vision, Qwen25Vision) and not lm.vision.shape.gated
    assert lm.model.cfg.architecture == "qwen2vl"
    for data, ref in zip(IMAGES, Q2_GOLDEN["image_rows"], strict=True):
        ref = np.array(ref)
        rows = lm.vision.encode(lm.vision.pixels(data))
        np.testing.assert_allclose(rows, ref, atol=1e-4 * np.abs(ref).max())
    ids = _prompt(lm, _with_images(Q2_GOLDEN, IMAGES))
    assert [IMAGE_TOKEN if t >= lm.model.images.base else t for t in ids] == Q2_GOLDEN["tokens"]
    ref = np.array(Q2_GOLDEN["logits"])
    tol = 1e-4 * np.abs(ref).max()
    logits = lm.model.forward(ids, lm.model.new_cache(256), all_logits=True)
    print(f"qwen2_vl: max |logit - golden| {np.abs(logits - ref).max():.3g}, max |golden| "
          f"{np.abs(ref).max():.3g}")
    np.testing.assert_allclose(logits, ref, atol=tol)
    last, _ = prefill(lm.model, lm.model.new_cache(256), ids, 7)  # passes that cut images
    np.testing.assert_allclose(last, ref[-1], atol=tol)
    params = GenerationParams(max_tokens=8, temperature=0.0)
    out = [e.token for e in generate(lm.model, lm.tokenizer, ids, lm.model.new_cache(256), params)
           if e.token is not None]
    assert out == Q2_GOLDEN["greedy"]
    # RMSNorms in place of its LayerNorms (Qwen2.5-VL's) miss the golden rows
    for block in lm.vision.blocks:
        monkeypatch.setattr(block, "ln1", (block.ln1[0], None))
    rows = lm.vision.encode(lm.vision.pixels(IMAGES[0]))
    assert np.abs(rows - np.array(Q2_GOLDEN["image_rows"][0])).max() > 0.01


def test_qwen2_vl_gguf_with_its_mmproj_matches_transformers(tmp_path):
    """The mmproj as llama.cpp's converter writes Qwen2-VL's (projector qwen2vl_merger: LayerNorm biases,
    ffn_up / ffn_down, no activation key: llama.cpp's quick GELU), beside the qwen2vl text GGUF."""
    from models.formats.gguf import open_gguf

    out = convert(Q2, "F16", tmp_path / "q2.gguf")
    with open_gguf(out.mmproj) as gguf:
        meta, tensors = gguf.metadata, gguf.tensors
        assert meta["clip.projector_type"] == "qwen2vl_merger"
        for key in ("clip.use_silu", "clip.use_gelu", "clip.vision.n_wa_pattern"):
            assert key not in meta, key
        for name in ("v.blk.1.attn_q.weight", "v.blk.1.ln1.bias", "v.blk.1.ln2.bias", "v.blk.1.ffn_up.bias",
                     "v.blk.1.ffn_down.weight", "v.post_ln.bias", "mm.0.weight", "mm.2.bias",
                     "v.patch_embd.weight.1"):
            assert name in tensors, name
        assert "v.blk.1.ffn_gate.weight" not in tensors
    lm = load_model(out.output)
    assert isinstance(lm.vision, Qwen25Vision) and not lm.vision.shape.gated and not lm.vision_notice
    ids = _prompt(lm, _with_images(Q2_GOLDEN, IMAGES))
    ref = np.array(Q2_GOLDEN["logits"])
    logits = lm.model.forward(ids, lm.model.new_cache(256), all_logits=True)
    print(f"qwen2_vl GGUF + mmproj: max |logit - golden| {np.abs(logits - ref).max():.3g}")
    np.testing.assert_allclose(logits, ref, atol=1e-4 * np.abs(ref).max())


def test_qwen25_mmproj_keys_llama_cpp_leaves_out_take_its_defaults(tmp_path):
    """llama.cpp's converter writes no window size (its runtime takes 112 px) and no pixel bounds; the full-
    attention blocks follow n_wa_pattern (8 for the released models: blocks 7, 15, 23, 31 of 32); a text model
    without M-RoPE sections beside it is refused (the loader turns that into images off)."""
    from engine.errors import ModelFormatError
    from engine.vision.load import GGUF_READERS, _GGUFSource
    from engine.vision.qwen25 import QWEN25_MAX_PIXELS, QWEN25_MIN_PIXELS
    from models.formats.gguf import open_gguf

    out = convert(Q25, "F16", tmp_path / "q25.gguf")
    with open_gguf(out.output) as text:
        text_meta = dict(text.metadata)
    gguf = open_gguf(out.mmproj)
    left_out = ("clip.vision.window_size", "clip.vision.image_min_pixels", "clip.vision.image_max_pixels")
    meta = {k: v for k, v in gguf.metadata.items() if k not in left_out}
    read = GGUF_READERS["qwen2.5vl_merger"]
    shape = read(out.mmproj, meta, _GGUFSource(gguf), text_meta).shape
    assert (shape.window, shape.min_pixels, shape.max_pixels) == (112, QWEN25_MIN_PIXELS, QWEN25_MAX_PIXELS)
    assert shape.mrope_section == (2, 3, 3) and not shape.mrope_interleaved
    assert shape.full_blocks == periodic_blocks(2, 3) == (1,)
    assert periodic_blocks(8, 32) == (7, 15, 23, 31)  # the released models' fullatt_block_indexes
    with pytest.raises(ModelFormatError, match="M-RoPE sections"):
        read(out.mmproj, meta, _GGUFSource(gguf), {"general.architecture": "qwen2"})
    gguf.close()
