"""Qwen3-VL (dense and MoE) through llama.cpp's file layout: the text GGUF (general.architecture qwen3vl /
qwen3vlmoe, n_deepstack_layers, rope.dimension_sections) and the mmproj (projector qwen3vl_merger, the
deepstack mergers as v.deepstack.<vision block>.*, flagged in clip.vision.is_deepstack_layers) that
`hearth convert` writes, read back against transformers' golden outputs; and Qwen3-VL-MoE folders, whose
experts are fused (gate_up_proj, down_proj), run as Qwen3-MoE with the same tower.

Fixtures: tests/fixtures/tiny/qwen3_vl-vision (deepstack after vision blocks 0 and 1) and qwen3_vl_moe-vision
(after blocks 1 and 2, so a merger's index and its block's differ), both made by
`/work/venv-golden/bin/python scripts/make_tiny_checkpoints.py qwen3_vl-vision qwen3_vl_moe-vision`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from engine.convert import convert
from engine.generate import GenerationParams, generate
from engine.loader import load_model
from engine.quant.gguf_writer import GGUFWriter
from engine.vision.qwen35 import Qwen35Vision
from models.formats.gguf import open_gguf
from tests.engine.test_vision import IMAGE_TOKEN, _prompt, _with_images

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"
DENSE, MOE = TINY / "qwen3_vl-vision", TINY / "qwen3_vl_moe-vision"
# the vision blocks each fixture's deepstack mergers follow (its deepstack_visual_indexes)
BLOCKS = {DENSE: (0, 1), MOE: (1, 2)}


def _golden(folder: Path) -> tuple[dict, list[bytes], np.ndarray]:
    golden = json.loads((folder / "golden_vision.json").read_text())
    return golden, [(folder / name).read_bytes() for name in golden["images"]], np.array(golden["logits"])


def _logits(lm, folder: Path) -> tuple[list[int], np.ndarray]:
    golden, images, _ = _golden(folder)
    ids = _prompt(lm, _with_images(golden, images))
    return ids, lm.model.forward(ids, lm.model.new_cache(256), all_logits=True)


def _greedy(lm, ids: list[int]) -> list[int]:
    params = GenerationParams(max_tokens=8, temperature=0.0)
    return [e.token for e in generate(lm.model, lm.tokenizer, ids, lm.model.new_cache(256), params)
            if e.token is not None]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[Path, tuple[Path, Path]]:
    """folder -> (F16 text GGUF, its mmproj), converted once for the module."""
    out = {}
    for folder in (DENSE, MOE):
        done = convert(folder, "F16", tmp_path_factory.mktemp(folder.name) / "qwen3vl.gguf")
        assert done.mmproj is not None
        out[folder] = (done.output, done.mmproj)
    return out


def test_moe_folder_rows_logits_and_greedy_match_transformers():
    """A Qwen3-VL-MoE folder: Qwen3-MoE text layers (fused experts), the tower, its deepstack and M-RoPE."""
    golden, images, ref = _golden(MOE)
    lm = load_model(MOE)
    assert lm.model.cfg.architecture == "qwen3vlmoe" and lm.model.cfg.num_experts == 4
    assert isinstance(lm.vision, Qwen35Vision) and lm.vision.shape.deepstack == BLOCKS[MOE]
    width = lm.model.cfg.hidden_size
    for k, data in enumerate(images):
        rows = lm.vision.encode(lm.vision.pixels(data))
        sets = [golden["image_rows"][k]] + [level[k] for level in golden["deepstack_rows"]]
        for level, want in enumerate(sets):
            want = np.array(want)
            got = rows[:, level * width : (level + 1) * width]
            np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    ids, logits = _logits(lm, MOE)
    assert [IMAGE_TOKEN if t >= lm.model.images.base else t for t in ids] == golden["tokens"]
    print(f"qwen3_vl_moe folder: max |logit - golden| {np.abs(logits - ref).max():.3g}, max |golden| "
          f"{np.abs(ref).max():.3g}")
    np.testing.assert_allclose(logits, ref, atol=1e-4 * np.abs(ref).max())
    assert _greedy(lm, ids) == golden["greedy"]


def _transposed_experts(src: Path, dst: Path) -> None:
    """dst: a copy of folder src whose fused expert tensors are stored as Qwen's own checkpoints keep them,
    transposed ((experts, hidden, 2 ff) and (experts, ff, hidden); transformers 5 writes them rows first)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    blob = (src / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    data, out, offset, moved = blob[8 + n :], {}, 0, 0
    chunks = []
    for name, info in header.items():
        if name == "__metadata__":
            out[name] = info
            continue
        lo, hi = info["data_offsets"]
        raw = data[lo:hi]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert info["dtype"] == "BF16"
            array = np.frombuffer(raw, np.uint16).reshape(info["shape"])
            raw = np.ascontiguousarray(array.swapaxes(1, 2)).tobytes()
            info = dict(info, shape=[info["shape"][0], info["shape"][2], info["shape"][1]])
            moved += 1
        out[name] = dict(info, data_offsets=[offset, offset + len(raw)])
        chunks.append(raw)
        offset += len(raw)
    assert moved == 4  # two layers, two tensors each
    text = json.dumps(out).encode()
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def test_moe_folder_with_qwens_transposed_experts_reads_the_same(tmp_path):
    folder = tmp_path / "transposed"
    _transposed_experts(MOE, folder)
    _, _, ref = _golden(MOE)
    _, logits = _logits(load_model(folder), folder)
    np.testing.assert_allclose(logits, ref, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("folder", [DENSE, MOE], ids=["dense", "moe"])
def test_converted_gguf_and_mmproj_are_llama_cpps_layout(converted, folder):
    text, mmproj = converted[folder]
    moe = folder == MOE
    arch = "qwen3vlmoe" if moe else "qwen3vl"
    with open_gguf(text) as gguf:
        meta, tensors = gguf.metadata, gguf.tensors
        assert meta["general.architecture"] == arch
        assert meta[f"{arch}.n_deepstack_layers"] == 2
        assert list(meta[f"{arch}.rope.dimension_sections"]) == [3, 3, 2, 0]
        assert meta[f"{arch}.embedding_length"] == 64  # the text model's own width (llama.cpp widens it)
        assert not any(n.startswith(("v.", "mm.")) for n in tensors)
        assert "blk.1.attn_q_norm.weight" in tensors and "blk.1.attn_k_norm.weight" in tensors
        if moe:
            assert meta[f"{arch}.expert_count"] == 4 and meta[f"{arch}.expert_feed_forward_length"] == 48
            assert tuple(tensors["blk.1.ffn_gate_exps.weight"].shape) == (4, 48, 64)
            assert tuple(tensors["blk.1.ffn_up_exps.weight"].shape) == (4, 48, 64)
            assert tuple(tensors["blk.1.ffn_down_exps.weight"].shape) == (4, 64, 48)
            assert tuple(tensors["blk.1.ffn_gate_inp.weight"].shape) == (4, 64)
    with open_gguf(mmproj) as gguf:
        meta, tensors = gguf.metadata, gguf.tensors
        assert meta["clip.projector_type"] == "qwen3vl_merger" and meta["clip.vision.block_count"] == 3
        flags = [bool(f) for f in meta["clip.vision.is_deepstack_layers"]]
        assert flags == [i in BLOCKS[folder] for i in range(3)]
        deep = sorted(n for n in tensors if n.startswith("v.deepstack."))
        assert deep == sorted(f"v.deepstack.{b}.{part}.{kind}" for b in BLOCKS[folder]
                              for part in ("norm", "fc1", "fc2") for kind in ("weight", "bias"))
        assert tuple(tensors[f"v.deepstack.{BLOCKS[folder][0]}.fc1.weight"].shape) == (128, 128)
        assert tuple(tensors[f"v.deepstack.{BLOCKS[folder][0]}.fc2.weight"].shape) == (64, 128)


@pytest.mark.parametrize("folder", [DENSE, MOE], ids=["dense", "moe"])
def test_names_and_key_types_are_gguf_pys(converted, folder):
    """Against gguf-py (llama.cpp's own constants and reader): the architecture's tensor names, the deepstack
    tensors' and keys' names, and value types llama.cpp's loaders take (u32 count, bool flags)."""
    import gguf

    text, mmproj = converted[folder]
    arch = gguf.MODEL_ARCH.QWEN3VLMOE if folder == MOE else gguf.MODEL_ARCH.QWEN3VL
    name = gguf.MODEL_ARCH_NAMES[arch]
    reader = gguf.GGUFReader(text)
    assert reader.fields["general.architecture"].contents() == name
    known = {gguf.TENSOR_NAMES[t].format(bid=b) for t in gguf.MODEL_TENSORS[arch] for b in range(2)}
    assert {t.name.rsplit(".", 1)[0] for t in reader.tensors} <= known
    count = reader.fields[gguf.Keys.LLM.NUM_DEEPSTACK_LAYERS.format(arch=name)]
    assert count.types == [gguf.GGUFValueType.UINT32] and count.contents() == 2
    sections = reader.fields[gguf.Keys.Rope.DIMENSION_SECTIONS.format(arch=name)]
    assert sections.types[0] == gguf.GGUFValueType.ARRAY and len(sections.contents()) == 4
    reader = gguf.GGUFReader(mmproj)
    assert reader.fields["clip.projector_type"].contents() == gguf.VisionProjectorType.QWEN3VL
    flags = reader.fields[gguf.Keys.ClipVision.IS_DEEPSTACK_LAYERS]
    assert flags.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL]
    parts = (gguf.MODEL_TENSOR.V_DS_NORM, gguf.MODEL_TENSOR.V_DS_FC1, gguf.MODEL_TENSOR.V_DS_FC2)
    deep = {gguf.TENSOR_NAMES[t].format(bid=b) for t in parts for b in BLOCKS[folder]}
    assert {t.name.rsplit(".", 1)[0] for t in reader.tensors if t.name.startswith("v.deepstack.")} == deep


@pytest.mark.parametrize("folder", [DENSE, MOE], ids=["dense", "moe"])
def test_converted_gguf_with_its_mmproj_matches_transformers(converted, folder):
    golden, _, ref = _golden(folder)
    lm = load_model(converted[folder][0])
    assert lm.model.cfg.architecture == ("qwen3vlmoe" if folder == MOE else "qwen3vl")
    assert lm.model.cfg.deepstack_layers == 2
    assert isinstance(lm.vision, Qwen35Vision) and not lm.vision_notice
    assert lm.vision.shape.deepstack == BLOCKS[folder]
    ids, logits = _logits(lm, folder)
    print(f"{folder.name} GGUF + mmproj: max |logit - golden| {np.abs(logits - ref).max():.3g}, max |golden| "
          f"{np.abs(ref).max():.3g}")
    np.testing.assert_allclose(logits, ref, atol=1e-4 * np.abs(ref).max())
    assert _greedy(lm, ids) == golden["greedy"]


def _rewrite(src: Path, dst: Path, metadata: dict | None = None, rename=lambda name: name) -> None:
    """dst: GGUF src with `metadata` overriding its keys (None values drop them) and each tensor renamed by
    rename(name) (None drops it)."""
    with open_gguf(src) as gguf:
        meta = {k: v for k, v in {**gguf.metadata, **(metadata or {})}.items() if v is not None}
        kept = [(rename(n), t) for n, t in gguf.tensors.items() if rename(n) is not None]
        specs = [(n, t.ggml_type, tuple(t.shape)) for n, t in kept]
        with open(dst, "wb") as fh:
            writer = GGUFWriter(fh, meta, specs)
            writer.write_header()
            for name, t in kept:
                writer.write_tensor(name, np.ascontiguousarray(t.raw()).reshape(-1))
            writer.finish()


def _beside(converted, folder: Path, tmp_path: Path, text_meta=None, mmproj_meta=None, rename=lambda n: n):
    """A text GGUF and an mmproj beside it in tmp_path, rewritten from the converted pair."""
    text, mmproj = converted[folder]
    _rewrite(text, tmp_path / "qwen3vl.gguf", text_meta)
    _rewrite(mmproj, tmp_path / "mmproj-qwen3vl-f16.gguf", mmproj_meta, rename)
    return tmp_path / "qwen3vl.gguf"


def test_deepstack_read_by_block_name_is_what_matches(converted, tmp_path):
    """Mutation: the MoE mmproj's two mergers swapped (block 1's read as block 2's) still loads, and misses
    the golden; without the deepstack sets the GGUF's logits miss it too."""
    _, _, ref = _golden(MOE)
    tol = 1e-4 * np.abs(ref).max()

    def swap(name: str) -> str:
        for a, b in (("v.deepstack.1.", "v.deepstack.2."), ("v.deepstack.2.", "v.deepstack.1.")):
            if name.startswith(a):
                return b + name[len(a) :]
        return name

    lm = load_model(_beside(converted, MOE, tmp_path, rename=swap))
    assert lm.vision is not None and not lm.vision_notice
    _, logits = _logits(lm, MOE)
    assert np.abs(logits - ref).max() > 10 * tol
    lm = load_model(converted[MOE][0])
    lm.model.images.deepstack = 0  # the sets stay in the rows but are never added
    _, logits = _logits(lm, MOE)
    assert np.abs(logits - ref).max() > 10 * tol


def _dropped(name: str) -> str | None:
    return None if name.startswith("v.deepstack.") else name


@pytest.mark.parametrize("case", ["no deepstack", "count", "flags", "missing", "qwen3.5"])
def test_mismatched_mmproj_leaves_images_off_with_a_reason(converted, tmp_path, case):
    """A Qwen3-VL mmproj that does not fit its text GGUF loads the model text-only, the notice saying why."""
    arch = "qwen3vlmoe"
    kwargs, reason = {
        # llama.cpp's Qwen3.5 layout: no deepstack, beside a text model that takes two sets
        "no deepstack": (dict(mmproj_meta={"clip.vision.is_deepstack_layers": [False] * 3}, rename=_dropped),
                         "gives 0 deepstack sets but the language model takes 2"),
        "count": (dict(text_meta={f"{arch}.n_deepstack_layers": 3}),
                  "gives 2 deepstack sets but the language model takes 3"),
        "flags": (dict(mmproj_meta={"clip.vision.is_deepstack_layers": [False, True, True, False]}),
                  "has 4 flags for 3 vision blocks"),
        "missing": (dict(rename=lambda n: None if n.startswith("v.deepstack.2.fc2") else n),
                    "v.deepstack.2.fc2.weight"),
        # a Qwen3.5-style text model (no n_deepstack_layers) beside a Qwen3-VL tower
        "qwen3.5": (dict(text_meta={f"{arch}.n_deepstack_layers": None}),
                    "gives 2 deepstack sets but the language model takes 0"),
    }[case]
    lm = load_model(_beside(converted, MOE, tmp_path, **kwargs))
    assert lm.vision is None
    assert lm.vision_notice.startswith("images are off: ") and reason in lm.vision_notice, lm.vision_notice
    assert lm.model.images is None and lm.model.mrope is None  # left text-only, untouched
    text = json.loads((MOE / "golden.json").read_text())  # a text prompt still runs as transformers does
    logits = lm.model.forward(text["tokens"], lm.model.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, text["logits"], atol=1e-4 * np.abs(text["logits"]).max())
