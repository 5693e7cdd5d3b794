"""Which ggml type each tensor gets, per target format: llama.cpp's preset rules, our code.

A format name is one of llama.cpp's file types. The rules (as llama.cpp's quantizer applies them when
it has no importance matrix and no overrides):

* 1-D tensors (norms, biases) stay F32; F32/F16/BF16 formats store every matrix in that type.
* The output matrix (or the token embedding when it doubles as the output, i.e. there is no
  output.weight) gets Q8_0 if its rows are not a multiple of 256, else Q6_K (Q8_0 stays Q8_0).
* Q4_K_M / Q5_K_M: attn_v and ffn_down of the layers `use_more_bits` picks (the first and last
  eighth, and every third layer between) get Q6_K; attn_qkv gets Q5_K / Q6_K.
* Q3_K_M: attn_v Q5_K in the first two layers, Q4_K after; ffn_down Q5_K in the first 1/16 of the
  layers, Q4_K after; attn_output and attn_qkv Q4_K.
* Q2_K: attn_v Q4_K when n_head/n_head_kv >= 4, else Q3_K; ffn_down and attn_output Q3_K.
* Q3_K, Q4_K, Q5_K (no llama.cpp file type of that name): every matrix in that type ("pure"), with the
  output rule above.
* Models with 8 experts a layer (Mixtral): attn_v and attn_k get Q8_0 (llama.cpp: "bumping this to Q8_0
  trades just ~128MB"), and attn_output Q5_K in Q2_K, Q3_K_M and Q4_K_M.
* MXFP4_MOE: the experts' (experts, rows, cols) tensors MXFP4 (gpt-oss's own format), every other
  matrix Q8_0, the output included. A dense model gets Q8_0 throughout, as in llama.cpp.
* Fallback for rows that are not a multiple of a type's block (K-quants need 256): Q2_K, Q3_K ->
  Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0; and F16 if even 32 does not divide the row.
  Both starter models hit this: SmolLM2's 576-wide and Gemma-3-270M's 640-wide matrices.
"""

from __future__ import annotations

import re

from gguf import GGMLQuantizationType as T

from models.formats.ggml_types import BLOCK_SIZES

F32, F16, BF16 = int(T.F32), int(T.F16), int(T.BF16)
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 = int(T.Q8_0), int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(T.Q2_K), int(T.Q3_K), int(T.Q4_K), int(T.Q5_K), int(T.Q6_K)
MXFP4 = 39

# format name -> (base type, llama.cpp file type id written as general.file_type)
PRESETS: dict[str, tuple[int, int]] = {
    "F32": (F32, 0),
    "F16": (F16, 1),
    "BF16": (BF16, 32),
    "Q8_0": (Q8_0, 7),
    "Q4_0": (Q4_0, 2),
    "Q4_1": (Q4_1, 3),
    "Q5_0": (Q5_0, 8),
    "Q5_1": (Q5_1, 9),
    "Q2_K": (Q2_K, 10),
    "Q3_K_M": (Q3_K, 12),
    "Q4_K_M": (Q4_K, 15),
    "Q5_K_M": (Q5_K, 17),
    "Q6_K": (Q6_K, 18),
    "Q3_K": (Q3_K, 12),
    "Q4_K": (Q4_K, 15),
    "Q5_K": (Q5_K, 17),
    "MXFP4_MOE": (MXFP4, 38),
}
_PURE = ("Q3_K", "Q4_K", "Q5_K")  # every matrix in the one type: no per-tensor rules
FALLBACK = {Q2_K: Q4_0, Q3_K: Q4_0, Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}
_LAYER = re.compile(r"blk\.(\d+)\.")
_FFN_DOWN = re.compile(r"ffn_down(_exps|_shexp)?\.weight$")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's layer pick for extra bits: first and last eighth, and every third in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# Gemma 3n's AltUp routers and coefficients: (4, hidden), (16, 4), (4, 4), read as floats
_ALTUP_FLOAT = ("altup_router.weight", "altup_predict_coef.weight", "altup_correct_coef.weight")


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Matrices ending in "weight" except norms, mixture-of-experts routers (ffn_gate_inp, kept F32
    as llama.cpp keeps them: small, and a rounded router logit can change which experts run), shared
    expert gates (ffn_gate_inp_shexp: one row, which llama.cpp's quantizer counts as 1-D) and LFM2's and
    Qwen3.5's convolution kernels (a few taps a row, F32 in llama.cpp's files too) and Gemma 3n's AltUp
    routers and coefficients (A = 4 columns or rows, read as floats); everything else is stored as F32."""
    return (
        len(shape) >= 2
        and shape[-2] > 1
        and name.endswith("weight")
        and "_norm.weight" not in name
        and not name.endswith(("ffn_gate_inp.weight", "shortconv.conv.weight", "ssm_conv1d.weight"))
        and not name.endswith(_ALTUP_FLOAT)
    )


def fits(ggml_type: int, cols: int) -> bool:
    return cols % BLOCK_SIZES[ggml_type][0] == 0


def fallback(ggml_type: int, cols: int) -> int:
    """`ggml_type`, or its documented fallback when rows of `cols` elements do not split into its blocks."""
    if fits(ggml_type, cols):
        return ggml_type
    t = FALLBACK.get(ggml_type, F16)
    return t if fits(t, cols) else F16


def _mix_type(
    fmt: str, base: int, name: str, shape: tuple[int, ...], n_layers: int, n_gqa: int, tied: bool,
    n_experts: int,
) -> int:
    cols = shape[-1]
    is_output = name == "output.weight" or (tied and name == "token_embd.weight")
    if fmt == "MXFP4_MOE":
        return MXFP4 if len(shape) == 3 and not is_output else Q8_0
    if is_output:
        if not fits(base, cols) or cols % 256:
            return Q8_0
        return Q8_0 if base == Q8_0 else Q6_K
    if name == "token_embd.weight":
        return base
    m = _LAYER.match(name)
    layer = int(m.group(1)) if m else 0
    t = base
    if n_experts == 8 and fmt not in _PURE and name.endswith(("attn_v.weight", "attn_k.weight")):
        t = Q8_0
    elif name.endswith("attn_v.weight"):
        if fmt == "Q2_K":
            t = Q4_K if n_gqa >= 4 else Q3_K
        elif fmt == "Q3_K_M":
            t = Q5_K if layer < 2 else Q4_K
        elif fmt in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n_layers):
            t = Q6_K
    elif _FFN_DOWN.search(name):  # dense, routed experts' or shared expert's (llama.cpp: "ffn_down" in name)
        if fmt == "Q2_K":
            t = Q3_K
        elif fmt == "Q3_K_M":
            t = Q5_K if layer < n_layers // 16 else Q4_K
        elif fmt in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n_layers):
            t = Q6_K
    elif name.endswith("attn_output.weight"):
        if n_experts == 8:
            t = Q5_K if fmt in ("Q2_K", "Q3_K_M", "Q4_K_M") else base
        elif fmt == "Q2_K":
            t = Q3_K
        elif fmt == "Q3_K_M":
            t = Q4_K
    elif name.endswith("attn_qkv.weight"):
        t = {"Q3_K_M": Q4_K, "Q4_K_M": Q5_K, "Q5_K_M": Q6_K}.get(fmt, base)
    return t


def plan(
    fmt: str, shapes: dict[str, tuple[int, ...]], n_layers: int, n_gqa: int, n_experts: int = 0
) -> dict[str, int]:
    """Tensor name -> ggml type for preset `fmt` (a PRESETS key), fallbacks applied.

    Args:
        shapes: tensor name -> numpy shape (last dim = row length), in file order.
        n_layers: number of blocks; n_gqa: attention heads per kv head; n_experts: experts a layer (0: dense).
    """
    base, _ = PRESETS[fmt]
    tied = "output.weight" not in shapes
    out: dict[str, int] = {}
    for name, shape in shapes.items():
        if not is_quantizable(name, shape):
            out[name] = F32
            continue
        cols = shape[-1]
        if base in (F32, F16, BF16):
            out[name] = base
            continue
        out[name] = fallback(_mix_type(fmt, base, name, shape, n_layers, n_gqa, tied, n_experts), cols)
    return out
