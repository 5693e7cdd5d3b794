"""Finding and opening a model's vision tower: from its Hugging Face folder or an mmproj GGUF beside it.

llama.cpp keeps a vision model's tower in a second GGUF, its "mmproj" file (general.architecture "clip",
clip.* keys, v.* and mm.* tensors), published next to the language model's GGUFs; Hearth takes one from the
model file's folder. A Hugging Face folder holds the tower in its safetensors (transformers' vision_tower.*
and multi_modal_projector.* names), read by the same names as the mmproj's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from engine.errors import MissingTensorError, ModelFormatError
from engine.loader import GGUFWeights
from engine.vision.gemma3 import Gemma3Vision, Gemma3VisionShape, pool_of
from engine.vision.gemma4 import Gemma4Vision, Gemma4VisionShape
from engine.vision.pixtral import PixtralShape, PixtralVision
from engine.vision.qwen25 import (
    QWEN25_MAX_PIXELS,
    QWEN25_MIN_PIXELS,
    Qwen25Vision,
    Qwen25VisionShape,
    periodic_blocks,
)
from engine.vision.qwen35 import Qwen35Vision, Qwen35VisionShape
from engine.vision.siglip import SiglipShape
from engine.weights import FLOAT_DTYPES, Weight, float32_of
from models.formats.gguf import open_gguf

# transformers' names (after dropping a leading "model." and SigLIP's "vision_model.") -> mmproj names
_HF_NAMES = [
    (re.compile(r"vision_tower\.embeddings\.patch_embedding\.(weight|bias)"), r"v.patch_embd.\1"),
    (re.compile(r"vision_tower\.embeddings\.position_embedding\.weight"), "v.position_embd.weight"),
    (re.compile(r"vision_tower\.post_layernorm\.(weight|bias)"), r"v.post_ln.\1"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.layer_norm([12])\.(weight|bias)"),
     r"v.blk.\1.ln\2.\3"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)"),
     r"v.blk.\1.attn_\2.\3"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.self_attn\.out_proj\.(weight|bias)"),
     r"v.blk.\1.attn_out.\2"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.mlp\.fc1\.(weight|bias)"), r"v.blk.\1.ffn_up.\2"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.mlp\.fc2\.(weight|bias)"), r"v.blk.\1.ffn_down.\2"),
    (re.compile(r"multi_modal_projector\.mm_input_projection_weight"), "mm.input_projection.weight"),
    (re.compile(r"multi_modal_projector\.mm_soft_emb_norm\.weight"), "mm.soft_emb_norm.weight"),
    # Mistral 3's Pixtral tower and projector
    (re.compile(r"vision_tower\.patch_conv\.weight"), "v.patch_embd.weight"),
    (re.compile(r"vision_tower\.ln_pre\.weight"), "v.pre_ln.weight"),
    (re.compile(r"vision_tower\.transformer\.layers\.(\d+)\.attention\.([qkv])_proj\.weight"),
     r"v.blk.\1.attn_\2.weight"),
    (re.compile(r"vision_tower\.transformer\.layers\.(\d+)\.attention\.o_proj\.weight"),
     r"v.blk.\1.attn_out.weight"),
    (re.compile(r"vision_tower\.transformer\.layers\.(\d+)\.attention_norm\.weight"), r"v.blk.\1.ln1.weight"),
    (re.compile(r"vision_tower\.transformer\.layers\.(\d+)\.ffn_norm\.weight"), r"v.blk.\1.ln2.weight"),
    (re.compile(r"vision_tower\.transformer\.layers\.(\d+)\.feed_forward\.(gate|up|down)_proj\.weight"),
     r"v.blk.\1.ffn_\2.weight"),
    (re.compile(r"multi_modal_projector\.norm\.weight"), "mm.input_norm.weight"),
    (re.compile(r"multi_modal_projector\.patch_merger\.merging_layer\.weight"), "mm.patch_merger.weight"),
    (re.compile(r"multi_modal_projector\.linear_([12])\.(weight|bias)"), r"mm.\1.\2"),
]

# Gemma 4's tower and projector (transformers' names after dropping "model.") -> mmproj-style names, for
# Hearth only: llama.cpp's own Gemma 4 mmproj layout is not checked; no mmproj is written or read for it
_GEMMA4_NAMES = [
    (re.compile(r"vision_tower\.patch_embedder\.input_proj\.weight"), "v.patch_embd.weight"),
    (re.compile(r"vision_tower\.patch_embedder\.position_embedding_table"), "v.position_embd.weight"),
    (re.compile(r"vision_tower\.std_(bias|scale)"), r"v.std_\1"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(?:linear\.)?(\w+)"),
     r"v.blk.\1.attn_\2.\3"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.self_attn\.o_proj\.(?:linear\.)?(\w+)"),
     r"v.blk.\1.attn_out.\2"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight"),
     r"v.blk.\1.attn_\2_norm.weight"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.(?:linear\.)?(\w+)"),
     r"v.blk.\1.ffn_\2.\3"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.input_layernorm\.weight"), r"v.blk.\1.ln1.weight"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.post_attention_layernorm\.weight"),
     r"v.blk.\1.attn_post_norm.weight"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.pre_feedforward_layernorm\.weight"),
     r"v.blk.\1.ln2.weight"),
    (re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.post_feedforward_layernorm\.weight"),
     r"v.blk.\1.ffn_post_norm.weight"),
    (re.compile(r"embed_vision\.embedding_projection\.weight"), "mm.input_projection.weight"),
]


def _gemma4_name(hf_name: str) -> str | None:
    name = hf_name.removeprefix("model.")
    for pattern, repl in _GEMMA4_NAMES:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    return None


# model types whose Hugging Face folders' vision towers hf_vision runs (models.library keeps a copy)
VISION_MODEL_TYPES = (
    "gemma3", "gemma4", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl",
    "qwen3_vl_moe",
)


def mmproj_name(hf_name: str) -> str | None:
    """The mmproj name of a transformers vision tensor, None for others (the language model, SigLIP's
    pooling head, which Gemma 3 does not use)."""
    name = hf_name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
    for pattern, repl in _HF_NAMES:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    return None


class _Source:
    """has / shape / matrix / vector / floats / floats_any by mmproj name."""

    path: Path

    def floats_any(self, name: str, *shapes: tuple[int, ...]) -> np.ndarray:
        """A float32 tensor in whichever of `shapes` the file has it."""
        have = self.shape(name)
        if have not in shapes:
            raise MissingTensorError(self.path, f"tensor {name!r} has shape {have}, expected one of {shapes}")
        return self.floats(name, have)


class _GGUFSource(GGUFWeights, _Source):
    def __init__(self, gguf):
        super().__init__(gguf)
        self.path = gguf.path

    def shape(self, name: str) -> tuple[int, ...]:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise MissingTensorError(self.path, f"tensor {name!r} is missing from the mmproj file")
        return tuple(info.shape)


class _HFSource(_Source):
    def __init__(self, st, folder: Path, rename=mmproj_name):
        self.st, self.path = st, folder
        self.names = {g: hf for hf in st.tensors if (g := rename(hf))}

    def has(self, name: str) -> bool:
        return name in self.names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensor(name).shape)

    def _tensor(self, name: str):
        hf = self.names.get(name)
        if hf is None:
            raise MissingTensorError(
                self.path, f"vision tensor for {name!r} is missing from the safetensors files"
            )
        t = self.st.tensors[hf]
        if t.dtype not in FLOAT_DTYPES:
            raise ModelFormatError(
                self.path, f"vision tensor {hf!r} is {t.dtype}; Hearth reads F32, F16 and BF16"
            )
        return t

    def _array(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
        t = self._tensor(name)
        if tuple(t.shape) != shape:
            raise MissingTensorError(
                self.path, f"vision tensor {t.name!r} has shape {tuple(t.shape)}, expected {shape}"
            )
        return self.st.array(t.name), t.dtype

    def matrix(self, name: str, rows: int, cols: int) -> Weight:
        array, dtype = self._array(name, (rows, cols))
        return Weight(FLOAT_DTYPES[dtype], np.ascontiguousarray(array).view(np.uint8), rows, cols)

    def vector(self, name: str, n: int) -> np.ndarray:
        return self.floats(name, (n,))

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array, dtype = self._array(name, shape)
        values = float32_of(array, dtype == "BF16").reshape(shape)
        if name == "mm.soft_emb_norm.weight":  # Gemma's RMSNorm multiplies by 1 + w; mmproj files store 1 + w
            values = values + np.float32(1.0)
        return values


def hf_vision(
    folder: Path, config: dict, st
) -> Gemma3Vision | Gemma4Vision | PixtralVision | Qwen35Vision | None:
    """The vision tower of a Gemma 3, Gemma 4, Mistral 3, Qwen3.5 (dense or MoE), Qwen3-VL (dense or MoE),
    Qwen2.5-VL or Qwen2-VL multimodal folder (None: no vision config or no tower tensors)."""
    vision = config.get("vision_config")
    if config.get("model_type") == "gemma3n" and isinstance(vision, dict):
        raise ModelFormatError(folder / "config.json", "Hearth runs Gemma 3n's language model only, not its "
                               "vision and audio towers: it reads text")
    if config.get("model_type") not in VISION_MODEL_TYPES or not isinstance(vision, dict):
        return None
    if config["model_type"] == "gemma4":
        return _hf_gemma4(folder, config, vision, st)
    if config["model_type"] in ("qwen3_5", "qwen3_5_moe", *_QWEN3_VL):  # Qwen3-VL's adds deepstack mergers
        return _hf_qwen35(folder, config, vision, st)
    if config["model_type"] in ("qwen2_5_vl", "qwen2_vl"):
        return _hf_qwen25(folder, config, vision, st)
    source = _HFSource(st, folder)
    if not source.has("v.patch_embd.weight"):
        return None
    if config["model_type"] == "mistral3":
        return _hf_pixtral(folder, config, vision, source)
    text_hidden = int((config.get("text_config") or {}).get("hidden_size", 2560))
    encoder = SiglipShape(
        hidden=int(vision.get("hidden_size", 1152)),
        ff=int(vision.get("intermediate_size", 4304)),
        layers=int(vision.get("num_hidden_layers", 27)),
        heads=int(vision.get("num_attention_heads", 16)),
        image_size=int(vision.get("image_size", 896)),
        patch=int(vision.get("patch_size", 14)),
        eps=float(vision.get("layer_norm_eps", 1e-6)),
    )
    pre = _preprocessor(folder)
    shape = Gemma3VisionShape(
        encoder=encoder,
        text_hidden=text_hidden,
        pool=pool_of(encoder.side, int(config.get("mm_tokens_per_image", 256))),
        **pre,
    )
    return Gemma3Vision(shape, source, folder)


def _hf_gemma4(folder: Path, config: dict, vision: dict, st) -> Gemma4Vision | None:
    from engine.hf_repo import read_json

    source = _HFSource(st, folder, _gemma4_name)
    if not source.has("v.patch_embd.weight"):
        return None
    text = config.get("text_config") or {}
    if vision.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelFormatError(folder, f"the vision MLP's activation {vision['hidden_activation']!r} is not "
                               "one Hearth runs")
    rope = vision.get("rope_parameters") or {}
    pre = {}
    if (folder / "preprocessor_config.json").is_file():
        pre = read_json(folder / "preprocessor_config.json")
    elif (folder / "processor_config.json").is_file():  # transformers 5 keeps it in the processor's
        pre = read_json(folder / "processor_config.json").get("image_processor") or {}
    heads = int(vision.get("num_attention_heads", 16))
    hidden = int(vision.get("hidden_size", 768))
    defaults = Gemma4VisionShape.__dataclass_fields__

    def token(name: str) -> int:
        value = config.get(name)
        return int(value) if value is not None else defaults[name].default

    shape = Gemma4VisionShape(
        hidden=hidden,
        ff=int(vision.get("intermediate_size", 3072)),
        layers=int(vision.get("num_hidden_layers", 16)),
        heads=heads,
        kv_heads=int(vision.get("num_key_value_heads") or heads),
        head_dim=int(vision.get("head_dim") or hidden // heads),
        patch=int(vision.get("patch_size", 16)),
        pool=int(vision.get("pooling_kernel_size", 3)),
        positions=int(vision.get("position_embedding_size", 10240)),
        text_hidden=int(text.get("hidden_size", 1536)),
        max_soft_tokens=int(pre.get("max_soft_tokens", 280)),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        eps=float(vision.get("rms_norm_eps", 1e-6)),
        standardize=bool(vision.get("standardize", False)),
        bidirectional=text.get("use_bidirectional_attention") == "vision",
        image_token_id=token("image_token_id"),
        boi_token_id=token("boi_token_id"),
        eoi_token_id=token("eoi_token_id"),
        pad_token_id=int(text.get("pad_token_id") or 0),
    )
    return Gemma4Vision(shape, source, folder)


def _hf_pixtral(folder: Path, config: dict, vision: dict, source) -> PixtralVision:
    from engine.hf_repo import read_json

    text = config.get("text_config") or {}
    layer = config.get("vision_feature_layer", -1)
    if layer not in (-1, [-1]):
        raise ModelFormatError(
            folder, f"vision_feature_layer {layer!r}: Hearth reads the last layer's features"
        )
    rope = vision.get("rope_parameters") or {}
    pre_path = folder / "preprocessor_config.json"
    pre = read_json(pre_path) if pre_path.is_file() else {}
    longest = (pre.get("size") or {}).get("longest_edge") or vision.get("image_size", 1540)
    shape = PixtralShape(
        hidden=int(vision.get("hidden_size", 1024)),
        ff=int(vision.get("intermediate_size", 4096)),
        layers=int(vision.get("num_hidden_layers", 24)),
        heads=int(vision.get("num_attention_heads", 16)),
        patch=int(vision.get("patch_size", 14)),
        longest_edge=int(longest),
        text_hidden=int(text.get("hidden_size", 5120)),
        merge=int(config.get("spatial_merge_size", 2)),
        rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
        act=str(vision.get("hidden_act", "silu")),
        projector_eps=float(text.get("rms_norm_eps", 1e-5)),
        **_preprocessor(folder),
    )
    if config.get("projector_hidden_act", "gelu") != "gelu":
        raise ModelFormatError(folder, f"projector_hidden_act {config['projector_hidden_act']!r} is not gelu")
    return PixtralVision(shape, source, folder)


# Qwen3.5's tower (transformers' names after dropping "model.") -> llama.cpp's qwen3vl_merger mmproj names
_QWEN35_NAMES = [
    (re.compile(r"visual\.patch_embed\.proj\.(weight|bias)"), r"v.patch_embd.\1"),
    (re.compile(r"visual\.pos_embed\.weight"), "v.position_embd.weight"),
    (re.compile(r"visual\.blocks\.(\d+)\.norm([12])\.(weight|bias)"), r"v.blk.\1.ln\2.\3"),
    (re.compile(r"visual\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)"), r"v.blk.\1.attn_qkv.\2"),
    (re.compile(r"visual\.blocks\.(\d+)\.attn\.proj\.(weight|bias)"), r"v.blk.\1.attn_out.\2"),
    (re.compile(r"visual\.blocks\.(\d+)\.mlp\.linear_fc1\.(weight|bias)"), r"v.blk.\1.ffn_up.\2"),
    (re.compile(r"visual\.blocks\.(\d+)\.mlp\.linear_fc2\.(weight|bias)"), r"v.blk.\1.ffn_down.\2"),
    (re.compile(r"visual\.merger\.norm\.(weight|bias)"), r"v.post_ln.\1"),
    (re.compile(r"visual\.merger\.linear_fc1\.(weight|bias)"), r"mm.0.\1"),
    (re.compile(r"visual\.merger\.linear_fc2\.(weight|bias)"), r"mm.2.\1"),
    # Qwen2.5-VL's gated MLP (Qwen2-VL's plain one) and its merger (a norm, then an MLP as a Sequential)
    (re.compile(r"visual\.blocks\.(\d+)\.mlp\.(gate|up|down)_proj\.(weight|bias)"), r"v.blk.\1.ffn_\2.\3"),
    (re.compile(r"visual\.blocks\.(\d+)\.mlp\.fc1\.(weight|bias)"), r"v.blk.\1.ffn_up.\2"),
    (re.compile(r"visual\.blocks\.(\d+)\.mlp\.fc2\.(weight|bias)"), r"v.blk.\1.ffn_down.\2"),
    (re.compile(r"visual\.merger\.ln_q\.(weight|bias)"), r"v.post_ln.\1"),
    (re.compile(r"visual\.merger\.mlp\.([02])\.(weight|bias)"), r"mm.\1.\2"),
]
# Qwen3-VL's deepstack mergers (transformers' list index, part, weight or bias)
_DEEPSTACK_NAME = re.compile(
    r"visual\.deepstack_merger_list\.(\d+)\.(norm|linear_fc1|linear_fc2)\.(weight|bias)"
)
_DEEPSTACK_PART = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
# the wrapper model types of Qwen3-VL (dense, MoE): Qwen3.5's tower with deepstack mergers
_QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe")


def qwen35_namer(deepstack: tuple[int, ...] = ()):
    """name(hf_name): the mmproj name of a transformers Qwen3.5 or Qwen3-VL vision tensor, None for others.

    Args:
        deepstack: Qwen3-VL's deepstack_visual_indexes. Its k-th deepstack merger is named after the vision
            block it follows, v.deepstack.<deepstack[k]>.{norm,fc1,fc2}, as llama.cpp's converter names it.
    """

    def name(hf_name: str) -> str | None:
        plain = hf_name.removeprefix("model.")
        m = _DEEPSTACK_NAME.fullmatch(plain)
        if m:
            k = int(m.group(1))
            block = deepstack[k] if k < len(deepstack) else None
            if block is None:
                return None
            return f"v.deepstack.{block}.{_DEEPSTACK_PART[m.group(2)]}.{m.group(3)}"
        for pattern, repl in _QWEN35_NAMES:
            if pattern.fullmatch(plain):
                return pattern.sub(repl, plain)
        return None

    return name


def _hf_qwen35(folder: Path, config: dict, vision: dict, st) -> Qwen35Vision | None:
    # transformers' defaults for what the config leaves out: Qwen3.5's sections; Qwen3-VL's, and its blocks
    deepstack, default_sections = (), (11, 11, 10)
    if config["model_type"] in _QWEN3_VL:
        deepstack = tuple(int(v) for v in vision.get("deepstack_visual_indexes", (8, 16, 24)))
        default_sections = (24, 20, 20)
    source = _HFSource(st, folder, qwen35_namer(deepstack))
    if not source.has("v.patch_embd.weight"):
        return None
    text = config.get("text_config") or {}
    # Qwen3-VL's published configs keep the sections in rope_scaling
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not rope.get("mrope_interleaved", True):
        raise ModelFormatError(folder, "M-RoPE with sections in a row (mrope_interleaved false) is not one "
                               "Hearth runs")
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelFormatError(folder, f"the vision MLP's activation {vision['hidden_act']!r} is not one "
                               "Hearth runs")
    defaults = Qwen35VisionShape.__dataclass_fields__
    merge = int(vision.get("spatial_merge_size", 2))
    patch = int(vision.get("patch_size", 16))
    bounds = defaults["min_pixels"].default, defaults["max_pixels"].default
    pre = _qwen_preprocessor(folder, patch, merge, *bounds)
    shape = Qwen35VisionShape(
        hidden=int(vision.get("hidden_size", 1152)),
        ff=int(vision.get("intermediate_size", 4304)),
        layers=int(vision.get("depth", 27)),
        heads=int(vision.get("num_heads", 16)),
        patch=patch,
        text_hidden=int(vision.get("out_hidden_size", text.get("hidden_size", 3584))),
        positions=int(vision.get("num_position_embeddings", 2304)),
        mrope_section=tuple(int(v) for v in rope.get("mrope_section") or default_sections),
        deepstack=deepstack,
        merge=merge,
        temporal=int(vision.get("temporal_patch_size", 2)),
        rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        **pre,
    )
    return Qwen35Vision(shape, source, folder)


def _qwen_preprocessor(folder: Path, patch: int, merge: int, min_pixels: int, max_pixels: int) -> dict:
    """The Qwen image processor's pixel bounds (min_pixels, max_pixels: the given ones when the folder has
    none) and its mean / std, as Qwen35VisionShape fields.

    Raises:
        ModelFormatError: the processor's patch or merge size is not the model's.
    """
    from engine.hf_repo import read_json

    pre = {}
    if (folder / "preprocessor_config.json").is_file():
        pre = read_json(folder / "preprocessor_config.json")
    elif (folder / "processor_config.json").is_file():  # transformers 5 keeps it in the processor's
        pre = read_json(folder / "processor_config.json").get("image_processor") or {}
    if int(pre.get("merge_size", merge)) != merge or int(pre.get("patch_size", patch)) != patch:
        raise ModelFormatError(folder, "the image processor's patch or merge size differs from the model's")
    size = pre.get("size") or {}
    out = {
        "min_pixels": int(size.get("shortest_edge") or pre.get("min_pixels") or min_pixels),
        "max_pixels": int(size.get("longest_edge") or pre.get("max_pixels") or max_pixels),
    }
    for key, field in (("image_mean", "mean"), ("image_std", "std")):
        value = pre.get(key)
        if isinstance(value, list) and len(value) == 3:
            out[field] = tuple(float(v) for v in value)
    return out


def _hf_qwen25(folder: Path, config: dict, vision: dict, st) -> Qwen25Vision | None:
    """Qwen2.5-VL's tower, or Qwen2-VL's (its width is embed_dim, its hidden_size the language model's, its
    MLP mlp_ratio times wider; no windows); the language model's M-RoPE sections from text_config
    (transformers 5) or from the top level, where the published configs keep them (rope_scaling)."""
    source = _HFSource(st, folder, qwen35_namer())
    if not source.has("v.patch_embd.weight"):
        return None
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    qwen2 = config["model_type"] == "qwen2_vl"
    act = "quick_gelu" if qwen2 else "silu"
    if vision.get("hidden_act", act) != act:
        raise ModelFormatError(folder, f"the vision MLP's activation {vision['hidden_act']!r} is not one "
                               "Hearth runs")
    merge = int(vision.get("spatial_merge_size", 2))
    patch = int(vision.get("patch_size", 14))
    layers = int(vision.get("depth", 32))
    if qwen2:
        hidden = int(vision.get("embed_dim", 1280))
        sizes = dict(hidden=hidden, ff=hidden * int(vision.get("mlp_ratio", 4)),
                     text_hidden=int(vision.get("hidden_size", text.get("hidden_size", 3584))),
                     full_blocks=tuple(range(layers)), gated=False)
    else:
        sizes = dict(hidden=int(vision.get("hidden_size", 1280)),
                     ff=int(vision.get("intermediate_size", 3420)),
                     text_hidden=int(vision.get("out_hidden_size", text.get("hidden_size", 3584))),
                     full_blocks=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
                     window=int(vision.get("window_size", 112)))
    shape = Qwen25VisionShape(
        layers=layers,
        heads=int(vision.get("num_heads", 16)),
        patch=patch,
        positions=0,
        mrope_section=tuple(int(v) for v in rope.get("mrope_section", (16, 24, 24))),
        mrope_interleaved=False,
        merge=merge,
        temporal=int(vision.get("temporal_patch_size", 2)),
        rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        **sizes,
        **_qwen_preprocessor(folder, patch, merge, QWEN25_MIN_PIXELS, QWEN25_MAX_PIXELS),
    )
    return Qwen25Vision(shape, source, folder)


def _preprocessor(folder: Path) -> dict:
    """mean / std from preprocessor_config.json (Gemma 3's are 0.5; its size is the vision config's)."""
    from engine.hf_repo import read_json

    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return {}
    pre = read_json(path)
    out = {}
    for key, field in (("image_mean", "mean"), ("image_std", "std")):
        value = pre.get(key)
        if isinstance(value, list) and len(value) == 3:
            out[field] = tuple(float(v) for v in value)
    return out


def find_mmproj(model_path: Path) -> Path | None:
    """The mmproj GGUF beside a model file: mmproj*.gguf in its folder (one; with several, the one whose
    name shares the most with the model's, F16 / BF16 / F32 before quantized ones on a tie)."""
    found = sorted(
        p for p in model_path.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p != model_path
    )
    if not found:
        return None

    def score(p: Path) -> tuple[int, int]:
        common = len(_common_prefix(p.name.lower().replace("mmproj-", ""), model_path.name.lower()))
        return common, int(any(t in p.name.lower() for t in ("f16", "bf16", "f32")))

    return max(found, key=score)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def gguf_vision(path: Path, text_meta: dict | None = None):
    """The vision tower in an mmproj GGUF (llama.cpp's clip files), by its projector type (GGUF_READERS).

    Args:
        path: the mmproj file.
        text_meta: the language model's GGUF metadata (Qwen3.5's M-RoPE sections are there), if known.

    Raises:
        ModelFormatError: not an mmproj file, or one of a projector type Hearth does not run.
    """
    gguf = open_gguf(path)
    meta = gguf.metadata
    if meta.get("general.architecture") != "clip":
        raise ModelFormatError(path, "not an mmproj (clip) file")
    kind = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
    reader = GGUF_READERS.get(kind)
    if reader is None:
        raise ModelFormatError(
            path, f"its vision projector is {kind!r}; Hearth runs {', '.join(sorted(GGUF_READERS))}"
        )
    return reader(path, meta, _GGUFSource(gguf), text_meta or {})


def clip_key(path: Path, meta: dict):
    """key(name, default) -> clip.vision.<name>; a missing key without a default is a format error."""

    def key(name, default=None):
        value = meta.get(f"clip.vision.{name}", default)
        if value is None:
            raise ModelFormatError(path, f"clip.vision.{name} is missing")
        return value

    return key


def clip_stats(meta: dict) -> dict:
    """mean / std of an mmproj's image normalization, where it has them."""
    pre = {}
    for name, field in (("image_mean", "mean"), ("image_std", "std")):
        value = meta.get(f"clip.vision.{name}")
        if value is not None and len(value) == 3:
            pre[field] = tuple(float(v) for v in value)
    return pre


def _pixtral_gguf(path: Path, meta: dict, source, text_meta: dict) -> PixtralVision:
    key = clip_key(path, meta)
    if not source.has("mm.patch_merger.weight"):
        raise ModelFormatError(path, "a pixtral mmproj without a patch merger (Pixtral 12B) is not supported")
    shape = PixtralShape(
        hidden=int(key("embedding_length")),
        ff=int(key("feed_forward_length")),
        layers=int(key("block_count")),
        heads=int(key("attention.head_count")),
        patch=int(key("patch_size")),
        longest_edge=int(key("image_size")),
        text_hidden=int(source.shape("mm.1.weight")[0]),
        merge=int(meta.get("clip.vision.spatial_merge_size", 2)),
        act="gelu" if meta.get("clip.use_gelu") and not meta.get("clip.use_silu") else "silu",
        projector_eps=float(key("attention.layer_norm_epsilon", 1e-5)),
        **clip_stats(meta),
    )
    return PixtralVision(shape, source, path)


def _gemma3_gguf(path: Path, meta: dict, source, text_meta: dict) -> Gemma3Vision:
    key = clip_key(path, meta)
    encoder = SiglipShape(
        hidden=int(key("embedding_length")),
        ff=int(key("feed_forward_length")),
        layers=int(key("block_count")),
        heads=int(key("attention.head_count")),
        image_size=int(key("image_size")),
        patch=int(key("patch_size")),
        eps=float(key("attention.layer_norm_epsilon", 1e-6)),
    )
    proj = source.shape("mm.input_projection.weight")
    text_hidden = proj[1] if proj[0] == encoder.hidden else proj[0]
    side = encoder.side
    pool = int(meta.get("clip.vision.projector.scale_factor", 4))  # llama.cpp's default for Gemma 3
    if side % pool:
        raise ModelFormatError(path, f"a {side}-patch side does not pool by {pool}")
    return Gemma3Vision(Gemma3VisionShape(encoder, int(text_hidden), pool, **clip_stats(meta)), source, path)


# Qwen3.5's image processor's pixel bounds, for an mmproj without clip.vision.image_{min,max}_pixels
QWEN35_MIN_PIXELS, QWEN35_MAX_PIXELS = 256 * 256, 4096 * 4096


def _mrope_sections(path: Path, text_meta: dict, family: str) -> tuple[int, int, int]:
    """The t, h, w sections of the language model's M-RoPE (its GGUF's rope.dimension_sections).

    Raises:
        ModelFormatError: the language model beside the mmproj has none.
    """
    arch = text_meta.get("general.architecture")
    sections = text_meta.get(f"{arch}.rope.dimension_sections")
    if sections is None or len(sections) < 3:
        raise ModelFormatError(path, "the language model beside it has no M-RoPE sections "
                               f"(rope.dimension_sections); use the mmproj with its {family} model")
    return tuple(int(v) for v in list(sections)[:3])


def _qwen35_gguf(path: Path, meta: dict, source, text_meta: dict) -> Qwen35Vision:
    """Qwen3.5's or Qwen3-VL's tower (projector qwen3vl_merger); Qwen3-VL's deepstack mergers follow the
    vision blocks clip.vision.is_deepstack_layers flags, as v.deepstack.<block>.* tensors."""
    key = clip_key(path, meta)
    layers = int(key("block_count"))
    flags = [bool(f) for f in meta.get("clip.vision.is_deepstack_layers", ())]
    if flags and len(flags) != layers:
        raise ModelFormatError(path, f"clip.vision.is_deepstack_layers has {len(flags)} flags for {layers} "
                               "vision blocks; the file is damaged or not from llama.cpp's converter")
    hidden = int(key("embedding_length"))
    shape = Qwen35VisionShape(
        hidden=hidden,
        ff=int(key("feed_forward_length")),
        layers=layers,
        deepstack=tuple(i for i, deep in enumerate(flags) if deep),
        heads=int(key("attention.head_count")),
        patch=int(key("patch_size")),
        text_hidden=int(source.shape("mm.2.weight")[0]),
        positions=int(source.shape("v.position_embd.weight")[0]),
        mrope_section=_mrope_sections(path, text_meta, "Qwen3.5 or Qwen3-VL"),
        merge=int(key("spatial_merge_size", 2)),
        temporal=2 if source.has("v.patch_embd.weight.1") else 1,
        min_pixels=int(key("image_min_pixels", QWEN35_MIN_PIXELS)),
        max_pixels=int(key("image_max_pixels", QWEN35_MAX_PIXELS)),
        eps=float(key("attention.layer_norm_epsilon", 1e-6)),
        **clip_stats(meta),
    )
    return Qwen35Vision(shape, source, path)


def _qwen25_gguf(path: Path, meta: dict, source, text_meta: dict) -> Qwen25Vision:
    """llama.cpp's qwen2.5vl_merger: the full-attention blocks every n_wa_pattern-th, windows of
    clip.vision.window_size pixels (llama.cpp's 112 when absent); or its qwen2vl_merger (LayerNorms,
    quick-GELU MLPs, no windows; its feed_forward_length is not the MLP's, so the tensor's rows are read);
    their text model (qwen2vl) turns M-RoPE sections in a row."""
    key = clip_key(path, meta)
    layers = int(key("block_count"))
    gated = meta.get("clip.projector_type") == "qwen2.5vl_merger"
    period = int(key("n_wa_pattern")) if gated else 1
    if period < 1:
        raise ModelFormatError(path, f"clip.vision.n_wa_pattern {period} is not a block period")
    if bool(meta.get("clip.use_silu")) != gated or meta.get("clip.use_gelu"):
        raise ModelFormatError(path, "its vision MLP's activation is not the one its projector type runs")
    shape = Qwen25VisionShape(
        hidden=int(key("embedding_length")),
        ff=int(source.shape("v.blk.0.ffn_up.weight")[0]),
        layers=layers,
        heads=int(key("attention.head_count")),
        patch=int(key("patch_size")),
        text_hidden=int(source.shape("mm.2.weight")[0]),
        positions=0,
        mrope_section=_mrope_sections(path, text_meta, "Qwen2.5-VL"),
        mrope_interleaved=text_meta.get("general.architecture") != "qwen2vl",
        merge=int(key("spatial_merge_size", 2)),
        temporal=2 if source.has("v.patch_embd.weight.1") else 1,
        min_pixels=int(key("image_min_pixels", QWEN25_MIN_PIXELS)),
        max_pixels=int(key("image_max_pixels", QWEN25_MAX_PIXELS)),
        eps=float(key("attention.layer_norm_epsilon", 1e-6)),
        window=int(key("window_size", 112)),
        full_blocks=periodic_blocks(period, layers),
        gated=gated,
        **clip_stats(meta),
    )
    return Qwen25Vision(shape, source, path)


# mmproj projector type (clip.projector_type) -> reader(path, metadata, weight source, the language model's
# metadata) -> tower
GGUF_READERS = {
    "gemma3": _gemma3_gguf, "pixtral": _pixtral_gguf, "qwen3vl_merger": _qwen35_gguf,
    "qwen2.5vl_merger": _qwen25_gguf, "qwen2vl_merger": _qwen25_gguf,
}
