"""The source side of a conversion: a GGUF file or a Hugging Face folder as float32 tensors + GGUF metadata.

`open_source(path)` gives a `SourceModel` whatever the input is:
  * tensors by canonical GGUF name, in a stable order, decoded to float32 on demand (one at a time, so
    memory stays at one tensor's worth);
  * `metadata`: a GGUF-style key/value dict (architecture, hyper-parameters, tokenizer.ggml.*, the chat
    template) that a GGUF writer can copy as is; for a GGUF source it is the file's own, for a folder it
    is built from config.json / tokenizer.json / tokenizer_config.json (engine/quant/hf_meta.py).

Layout differences between the two worlds are undone here, so converters see GGUF conventions only:
llama-family q/k rows are permuted for GGUF's interleaved RoPE, Gemma norms are stored as 1 + w.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.weights import FLOAT_DTYPES, float32_of
from models.errors import ModelNotFoundError
from models.formats.ggml_types import PLAIN_DTYPES, type_name
from models.formats.gguf import GGUFFile, open_gguf

# architectures whose GGUF stores q/k for interleaved (non-NeoX) RoPE: HF rows are permuted on the way in
PERMUTED_QK = frozenset({"llama", "mistral3", "smollm3", "granite", "granitehybrid", "nemotron_h"})
# architectures with Mamba-2 layers (llama.cpp's shapes for A, D and the gated norm: _mamba_shape)
MAMBA_ARCHS = frozenset({"granitehybrid", "nemotron_h"})
GEMMA_NORM_OFFSET = frozenset({"gemma3", "gemma2"})
SUPPORTED_ARCHS = frozenset(
    {"llama", "mistral3", "smollm3", "granite", "glm4", "olmo2", "ernie4_5", "ernie4_5-moe", "qwen2",
     "qwen2moe", "qwen3", "qwen3moe", "glm4moe", "exaone4", "seed_oss", "lfm2", "lfm2moe", "qwen35",
     "qwen35moe", "qwen3next", "gemma3", "gemma2", "gemma4", "gemma3n", "gpt-oss", "granitehybrid",
     "nemotron_h", "qwen3vl", "qwen3vlmoe", "qwen2vl", "deepseek2", "command-r",
     "cohere2"}
)
_F32, _BF16, _Q4_1 = 0, 30, 3


@dataclass
class SourceModel:
    """A model to convert. Use `tensor(name)` for float32 data, `metadata` for everything else.

    Attributes:
        path: the file or folder.
        kind: "gguf" or "safetensors".
        architecture: general.architecture ("llama", "gemma3", ...).
        metadata: GGUF key -> value (Python scalars, str lists, numpy arrays).
        names: canonical tensor names in write order.
        shapes: name -> numpy shape.
        source_types: name -> ggml type id as stored in the source (F16 for an F16 safetensors tensor).
    """

    path: Path
    kind: str
    architecture: str
    metadata: dict[str, Any]
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    source_types: dict[str, int]
    _loader: Any = field(repr=False, default=None)
    _closer: Any = field(repr=False, default=None)

    def tensor(self, name: str) -> np.ndarray:
        """float32 array of tensor `name` in numpy shape (a new array; the source is never written)."""
        return self._loader(name)

    @property
    def n_layers(self) -> int:
        return int(self.metadata[f"{self.architecture}.block_count"])

    @property
    def source_bytes(self) -> int:
        """Size of the source on disk."""
        if self.path.is_dir():
            return sum(p.stat().st_size for p in self.path.glob("*.safetensors"))
        return self.path.stat().st_size

    def close(self) -> None:
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> SourceModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows (half-split RoPE) -> GGUF llama rows (interleaved pairs), per head."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of permute_qk: GGUF llama q/k rows -> HF rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_source(path: Path) -> SourceModel:
    from engine.quant.encode import dequantize

    g: GGUFFile = open_gguf(path)
    arch = g.architecture
    if arch not in SUPPORTED_ARCHS:
        g.close()
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} cannot be converted yet "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})"
        )

    def load(name: str) -> np.ndarray:
        info = g.tensors[name]
        if info.ggml_type in PLAIN_DTYPES:
            return float32_of(info.array(), info.ggml_type == _BF16)
        try:
            flat = dequantize(info.ggml_type, info.raw(), info.dims[0])
        except Exception as e:
            raise ModelFormatError(
                path, f"tensor {name!r} is {info.type_name}, which cannot be decoded for conversion ({e})"
            ) from e
        return flat.reshape(info.shape)

    return SourceModel(
        path=path,
        kind="gguf",
        architecture=arch,
        metadata=dict(g.metadata),
        names=list(g.tensors),
        shapes={n: tuple(t.shape) for n, t in g.tensors.items()},
        source_types={n: t.ggml_type for n, t in g.tensors.items()},
        _loader=load,
        _closer=g.close,
    )


def _hf_source(folder: Path) -> SourceModel:
    from engine.hf_repo import (
        ENCODER_TYPES,
        HFWeights,
        config_from_hf,
        conv_kernel_2d,
        conv_kernel_shape,
        language_config,
        read_json,
    )
    from engine.quant.hf_meta import metadata_from_hf
    from models.formats.safetensors import open_safetensors_repo

    config = read_json(folder / "config.json")
    if config.get("model_type") in ENCODER_TYPES:  # an encoder: quant/bert_source.py
        from engine.quant.bert_source import bert_source

        return bert_source(folder, config)
    cfg = config_from_hf(folder, config)
    arch = cfg.architecture
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"{folder}: {arch} models cannot be converted yet "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})"
        )
    st = open_safetensors_repo(folder)
    weights = HFWeights(st, folder, arch)
    # gguf name -> hf name, without layers past num_hidden_layers (GLM-4.5's next-token-prediction layer)
    names_map = {g: hf for g, hf in weights.names.items() if _layer_of(g) < cfg.num_hidden_layers}
    metadata = metadata_from_hf(folder, language_config(config), cfg)
    n_head = cfg.num_attention_heads
    n_kv = cfg.num_key_value_heads
    try:
        quantized = _quantized_linears(st, folder, weights)
        quantized = {g: v for g, v in quantized.items() if _layer_of(g) < cfg.num_hidden_layers}
    except ModelFormatError:
        st.close()
        raise
    for g_name, hf_name in names_map.items():
        dtype = st.tensors[hf_name].dtype
        if dtype not in FLOAT_DTYPES and g_name not in quantized:
            st.close()
            raise ModelFormatError(
                folder,
                f"tensor {hf_name!r} is {dtype}; conversion reads F32, F16 and BF16 safetensors weights "
                "and FP8 / NVFP4 / AWQ linear layers",
            )

    # mixture of experts: HF's per-expert matrices (HFWeights names T.0, T.1, ...) become GGUF's one
    # (experts, rows, cols) tensor T
    stacks: dict[str, list[str]] = {}
    for g_name in set(names_map) | set(quantized):
        if _EXPERT_NAME.fullmatch(g_name):
            stacks.setdefault(g_name.rsplit(".", 1)[0], []).append(g_name)
    for experts in stacks.values():
        experts.sort(key=lambda n: int(n.rsplit(".", 1)[1]))
    fused = _fused_experts(weights, cfg)  # gpt-oss: name -> (shape, type, loader)
    fused |= _split_gate_up(st, names_map, arch)
    if arch == "gemma4":
        fused |= _gemma4_rope_freqs(cfg)
    if arch == "deepseek2":
        fused |= _split_kv_b(weights, st, names_map, quantized, cfg)
    if arch == "gemma3n":
        fused |= _gemma3n_per_layer_table(st, names_map, cfg)

    def load_one(name: str) -> np.ndarray:
        if name in quantized:
            return _dequantized(weights, name, *quantized[name][1])
        hf_name = names_map[name]
        return conv_kernel_2d(name, float32_of(st.array(hf_name), st.tensors[hf_name].dtype == "BF16"))

    def shape_of(name: str) -> tuple[int, ...]:
        if name in fused:
            return fused[name][0]
        if name in stacks:
            return (len(stacks[name]), *shape_of(stacks[name][0]))
        if name in quantized:
            return quantized[name][1]
        shape = conv_kernel_shape(name, st.tensors[names_map[name]].shape)
        if name.endswith("exp_probs_b.bias"):  # ERNIE 4.5 MoE's (1, experts), squeezed as llama.cpp writes it
            return shape[-1:]
        return _mamba_shape(name, shape, cfg.mamba) if arch in MAMBA_ARCHS else shape

    def load(name: str) -> np.ndarray:
        if name in fused:
            return fused[name][2]()
        x = np.stack([load_one(e) for e in stacks[name]]) if name in stacks else load_one(name)
        if arch in PERMUTED_QK and name.endswith("attn_q.weight"):
            x = permute_qk(x, n_head)
        elif arch in PERMUTED_QK and name.endswith("attn_k.weight"):
            x = permute_qk(x, n_kv)
        if arch in ("qwen35", "qwen35moe", "qwen3next"):
            x = _qwen35_layout(name, x, cfg.delta, tiled=arch != "qwen3next")
        if arch in MAMBA_ARCHS:  # llama.cpp's Mamba-2 shapes, A_log as -exp(A_log)
            x = x.reshape(shape_of(name))
            if name.endswith(".ssm_a"):
                x = -np.exp(x)
        if arch in GEMMA_NORM_OFFSET and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if name.endswith("exp_probs_b.bias"):
            x = x.reshape(shape_of(name))
        return np.ascontiguousarray(x)

    def type_of(name: str) -> int:
        if name in fused:
            return fused[name][1]
        name = stacks[name][0] if name in stacks else name
        return quantized[name][0] if name in quantized else FLOAT_DTYPES[st.tensors[names_map[name]].dtype]

    singles = {n for n in set(names_map) | set(quantized) if not _EXPERT_NAME.fullmatch(n)}
    if arch == "qwen3next":  # its in_proj_qkvz as llama.cpp's converter writes it: attn_qkv and attn_gate
        fused |= _split_qkvz(singles, cfg, load_one, type_of)
        singles = {n for n in singles if not n.endswith(".ssm_in.weight")}
    order = sorted(singles | set(stacks) | set(fused), key=_tensor_order)
    return SourceModel(
        path=folder,
        kind="safetensors",
        architecture=arch,
        metadata=metadata,
        names=order,
        shapes={n: tuple(shape_of(n)) for n in order},
        source_types={n: type_of(n) for n in order},
        _loader=load,
        _closer=st.close,
    )


def _layer_of(gguf_name: str) -> int:
    """The block index of a GGUF tensor name ("blk.N."), -1 for the others."""
    return int(gguf_name.split(".", 2)[1]) if gguf_name.startswith("blk.") else -1


# HFWeights' name of one expert (or of one of Gemma 3n's AltUp stream projections, stacked the same way)
_EXPERT_NAME = re.compile(r"(?:blk\.\d+\.ffn_\w+_exps|altup_(?:unembd_)?proj)\.weight\.\d+")


# GGUF architectures whose files keep gate and up fused in one ffn_up (llama.cpp's Phi-3 and GLM-4)
_FUSED_GATE_UP = frozenset({"phi3", "glm4"})
# architectures whose MLPs have no gate (Nemotron-H's squared ReLU): their ffn_up is only up
_UNGATED = frozenset({"nemotron_h"})


def _qwen35_layout(name: str, x: np.ndarray, shape, tiled: bool = True) -> np.ndarray:
    """A Qwen3.5 tensor as llama.cpp's qwen35 GGUF stores it: norms as 1 + w (not the DeltaNet's gated norm),
    A_log as -exp(A_log), and everything indexed by value head in tiled order (engine.arch.deltanet); a
    Qwen3-Next one as its qwen3next GGUF does (tiled False: the value heads stay grouped)."""
    from engine.arch.deltanet import tile_value_heads

    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        return x + np.float32(1.0)
    if name.endswith(".ssm_a"):
        x = -np.exp(x)
    if not tiled:
        return x
    kd = 2 * shape.key_dim
    if name.endswith((".ssm_a", "ssm_dt.bias", "ssm_beta.weight", "ssm_alpha.weight")):
        return tile_value_heads(x, shape, 1)
    if name.endswith("attn_gate.weight"):
        return tile_value_heads(x, shape, shape.head_v)
    if name.endswith("ssm_out.weight"):
        return tile_value_heads(x, shape, shape.head_v, axis=1)
    if name.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):  # q and k rows stay; v rows are tiled
        return np.concatenate([x[:kd], tile_value_heads(x[kd:], shape, shape.head_v)])
    return x


def _split_qkvz(names, cfg, load_one, type_of) -> dict[str, tuple[tuple[int, ...], int, Any]]:
    """Qwen3-Next's fused ssm_in (in_proj_qkvz) among `names` as the attn_qkv and attn_gate llama.cpp's
    qwen3next converter writes (engine.arch.deltanet.split_qkvz): name -> (shape, source type, float32
    loader)."""
    from engine.arch.deltanet import split_qkvz

    shape, out = cfg.delta, {}
    for name in [n for n in names if n.endswith(".ssm_in.weight")]:
        prefix = name[: -len("ssm_in.weight")]
        for i, (part, rows) in enumerate((("attn_qkv", shape.conv_dim), ("attn_gate", shape.value_dim))):
            load = functools.partial(lambda n, i: split_qkvz(load_one(n), shape)[i], name, i)
            out[f"{prefix}{part}.weight"] = ((rows, cfg.hidden_size), type_of(name), load)
    return out


def _split_gate_up(st, names_map: dict[str, str], arch: str) -> dict[str, tuple[tuple[int, ...], int, Any]]:
    """A fused gate|up (gate rows then up rows: Granite 4.0's shared MLP as ffn_up, as ffn_up_shexp beside
    experts; Granite 4.0-H's experts as ffn_gate_up_exps) as the separate gate and up tensors llama.cpp's
    other architectures read: name -> (shape, source type, float32 loader). Takes the fused names out of
    names_map. Gemma 4's GGUFs keep the experts' merged tensor."""
    out = {}
    if arch in _FUSED_GATE_UP or arch in _UNGATED:
        return out
    pairs = {".ffn_up.weight": ".ffn_gate.weight", ".ffn_up_shexp.weight": ".ffn_gate_shexp.weight"}
    if arch == "granitehybrid":
        pairs[".ffn_gate_up_exps.weight"] = ".ffn_gate_exps.weight"
    for name in list(names_map):
        suffix = next((s for s in pairs if name.endswith(s)), None)
        if suffix is None:
            continue
        gate = name[: -len(suffix)] + pairs[suffix]
        up = name.replace("ffn_gate_up_exps", "ffn_up_exps")
        if gate in names_map:
            continue
        hf_name = names_map.pop(name)
        info = st.tensors[hf_name]
        axis = len(info.shape) - 2  # the rows: of the matrix, or of each expert's
        rows = info.shape[axis] // 2
        shape = tuple(rows if i == axis else n for i, n in enumerate(info.shape))
        for part, lo in ((gate, 0), (up, rows)):
            load = functools.partial(_rows, st, hf_name, lo, rows, axis)
            out[part] = (shape, FLOAT_DTYPES[info.dtype], load)
    return out


def _split_kv_b(weights, st, names_map: dict[str, str], quantized: dict, cfg):
    """MLA's kv_b_proj (per head its key rows, then its value rows) as llama.cpp's deepseek2 GGUF keeps it
    (convert_hf_to_gguf.py's DeepseekV2Model): attn_k_b, each head's key rows transposed, (heads, r, nope),
    and attn_v_b, (heads, v, r): name -> (shape, source type, float32 loader). Takes attn_kv_b out of
    names_map (and quantized: an FP8 kv_b_proj is decoded first)."""
    heads, nope, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = {}
    for name in [n for n in names_map if n.endswith(".attn_kv_b.weight")]:
        hf_name = names_map.pop(name)
        if name in quantized:
            source_type = quantized.pop(name)[0]
            whole = functools.partial(_dequantized, weights, name, heads * (nope + v), r)
        else:
            source_type = FLOAT_DTYPES[st.tensors[hf_name].dtype]
            whole = functools.partial(_rows, st, hf_name, 0, heads * (nope + v))

        def k_b(whole=whole):
            return np.ascontiguousarray(whole().reshape(heads, nope + v, r)[:, :nope].transpose(0, 2, 1))

        def v_b(whole=whole):
            return np.ascontiguousarray(whole().reshape(heads, nope + v, r)[:, nope:])

        out[name.replace("attn_kv_b", "attn_k_b")] = ((heads, r, nope), source_type, k_b)
        out[name.replace("attn_kv_b", "attn_v_b")] = ((heads, v, r), source_type, v_b)
    return out


def _rows(st, hf_name: str, lo: int, n: int, axis: int = 0) -> np.ndarray:
    """Rows lo..lo+n (along `axis`: 1 for each expert's of an (experts, rows, cols) tensor) of a safetensors
    tensor as float32."""
    bf16 = st.tensors[hf_name].dtype == "BF16"
    part = st.array(hf_name)[(slice(None),) * axis + (slice(lo, lo + n),)]
    return np.ascontiguousarray(float32_of(part, bf16))


def _mamba_shape(name: str, shape: tuple[int, ...], mamba) -> tuple[int, ...]:
    """A Mamba-2 tensor's shape as llama.cpp's granitehybrid GGUF keeps it: A and D as (heads, 1), the
    gated norm as (groups, d_inner / groups)."""
    if name.endswith((".ssm_a", ".ssm_d")):
        return mamba.heads, 1
    if name.endswith("ssm_norm.weight"):
        return mamba.groups, mamba.d_inner // mamba.groups
    return shape


def _gemma3n_per_layer_table(
    st, names_map: dict[str, str], cfg
) -> dict[str, tuple[tuple[int, ...], int, Any]]:
    """Gemma 3n's per-layer embedding table grown to the vocabulary, as llama.cpp's gemma3n GGUF keeps it
    (vocab_size rows; its converter pads the audio and image ids' rows with zeros). The rows added here are
    copies of row 0, the row transformers reads for every id past the table, so the file keeps its logits."""
    name = "per_layer_token_embd.weight"
    hf_name = names_map.pop(name)
    info = st.tensors[hf_name]
    rows = cfg.vocab_size

    def load() -> np.ndarray:
        table = float32_of(st.array(hf_name), info.dtype == "BF16")
        return np.concatenate([table, np.repeat(table[:1], rows - len(table), axis=0)])

    return {name: ((rows, info.shape[1]), FLOAT_DTYPES[info.dtype], load)}


def _gemma4_rope_freqs(cfg) -> dict[str, tuple[tuple[int, ...], int, Any]]:
    """Gemma 4's global layers' proportional RoPE as llama.cpp's gemma4 GGUF keeps it: rope_freqs, a divisor
    per frequency of the whole head (the RoPE factor for those that turn, 1e30 for those that stay)."""
    half = cfg.global_head_dim // 2
    turning = int(cfg.global_rotary_factor * cfg.global_head_dim // 2)
    factors = np.full(half, 1e30, np.float32)
    factors[:turning] = cfg.global_rope_factor
    return {"rope_freqs.weight": ((half,), _F32, factors.copy)}


def _fused_experts(weights, cfg) -> dict[str, tuple[tuple[int, ...], int, Any]]:
    """gpt-oss's fused expert tensors as GGUF's: name -> (shape, source type, float32 loader) for each
    layer's ffn_{gate,up,down}_exps weights (experts, rows, cols) and biases (experts, rows)."""
    from engine.backends import cpu

    out = {}
    if not weights.fused:
        return out
    n, ff, d = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    for layer, fused in sorted(weights.fused.items()):
        for kind, (rows, cols) in {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}.items():
            name = f"blk.{layer}.ffn_{kind}_exps."

            def matrix(fused=fused, kind=kind, rows=rows, cols=cols):
                stack = fused.build(kind, n, rows, cols)  # not kept: one tensor's memory at a time
                x = np.empty((n * rows, cols), np.float32)
                cpu.get_rows(x, stack, np.arange(n * rows))
                return x.reshape(n, rows, cols)

            out[name + "weight"] = ((n, rows, cols), fused.source_type(), matrix)
            if fused.has(kind, "bias"):
                bias = name + "bias"
                out[bias] = ((n, rows), _F32, lambda b=bias, r=rows: weights.floats(b, (n, r)))
    return out


def _quantized_linears(st, folder: Path, weights) -> dict[str, tuple[int, tuple[int, int]]]:
    """gguf name -> (type id, (rows, cols)) of the linear layers a Hub checkpoint stores quantized and the
    engine computes with: FP8 (per-channel or block-wise), NVFP4 (codes (rows, cols/2)) and AutoAWQ
    (qweight (cols, rows/8)). The shape of the matrix comes from the codes; the loader checks the scales."""
    from engine.backends.cpu.fpquant import FP8_E4M3, FP8_E4M3_BLOCK, NVFP4

    out = {}
    for g_name, hf_name in weights.names.items():
        t = st.tensors[hf_name]
        if t.dtype == "F8_E4M3" and len(t.shape) == 2:
            block = hf_name.rsplit(".", 1)[0] + ".weight_scale_inv" in st.tensors
            out[g_name] = (FP8_E4M3_BLOCK if block else FP8_E4M3, tuple(t.shape))
        elif t.dtype == "U8" and len(t.shape) == 2:
            out[g_name] = (NVFP4, (t.shape[0], 2 * t.shape[1]))
    for g_name, prefix in weights.awq.items():
        shape = st.tensors[prefix + "qweight"].shape
        if len(shape) != 2:
            raise ModelFormatError(folder, f"AWQ tensor {prefix}qweight has shape {shape}; expected 2-D")
        out[g_name] = (_Q4_1, (shape[1] * 8, shape[0]))  # AWQ groups run as Q4_1 blocks
    return out


def _dequantized(weights, name: str, rows: int, cols: int) -> np.ndarray:
    # the engine's Weight for the layer (validated as a model load validates it), decoded to float32
    from engine.backends import cpu

    w = weights.matrix(name, rows, cols)
    out = np.empty((rows, cols), np.float32)
    cpu.get_rows(out, w, np.arange(rows))
    return out


def _tensor_order(name: str) -> tuple:
    # token_embd first, then layers in order, then output_norm/output: the order llama.cpp writes
    if name.startswith("blk."):
        layer, _, rest = name[4:].partition(".")
        return (1, int(layer), rest)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def open_source(path: str | Path) -> SourceModel:
    """Open a GGUF file or a Hugging Face folder (config.json + *.safetensors + tokenizer.json) to convert.

    Raises:
        ModelNotFoundError: nothing at the path.
        ModelFormatError: malformed input, or weights in a dtype that cannot be read (e.g. int8).
        UnsupportedArchitectureError: a family conversion does not know.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFormatError(
                path, "is a folder without config.json; give a GGUF file or a Hugging Face model folder"
            )
        return _hf_source(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such model file or folder")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(
            path, "is neither a GGUF file nor a Hugging Face folder; convert takes one of those"
        )
    return _gguf_source(path)


def describe_type(t: int) -> str:
    from engine.backends.cpu.fpquant import TYPE_NAMES

    return TYPE_NAMES.get(t) or type_name(t)
