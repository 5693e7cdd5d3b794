"""AWQ (activation-aware weight quantization, Lin et al. 2023) with our own engine as the calibration model.

1. Calibration: the float model (the source's weights as F32) runs Hearth's own forward pass over a
   calibration text (resources/calibration/default.txt, or a user file) in windows of 512 tokens.
   `Decoder.capture` hands over the input X of each layer's linears; we keep, per input, the
   per-channel mean |x| and the Gram matrix G = X^T X / n, so the output error of any weight change
   dW over every calibration token is tr(dW G dW^T), computed without keeping activations.
2. Scale search, per layer and per input shared by a group of linears (q/k/v after attn_norm,
   gate/up after ffn_norm, o after v, down after up): s = mean|x|^alpha (normalised to geometric
   mean 1) for alpha on a grid over [0, 1]; each candidate quantizes W * s, and the alpha whose
   Q(W * s) / s has the smallest output error wins. alpha = 0 is plain round-to-nearest, so the
   search never does worse than RTN on the calibration data. Under grouped-query attention one
   v row feeds several heads, so o's scales are tied across the heads that share a kv head.
3. Clipping search (optional, on by default): for every linear but q and k (whose errors the
   attention softmax amplifies, as AutoAWQ skips them), every row and every group of 128 inputs,
   the weights are clamped to r * max|w| for r in 1.0, 0.95, ..., 0.55 and the r with the smallest
   error on that group's slice of G is kept.
4. Folding: q/k/v columns are multiplied by s and attn_norm divided by it (Gemma's stored 1 + w is
   the factor the norm multiplies by, so dividing it is exact there too); gate/up against
   ffn_norm; o columns against v rows (and v's bias); down columns against up rows. The result is
   an ordinary float model with the same outputs, ready for any 4-bit encoder.

Targets (registered in engine.quant.registry):
    awq        AutoAWQ-layout safetensors folder (INT4, group 128, zero point, GEMM packing)
    int4:g128  the same layout by plain round-to-nearest (the baseline AWQ is measured against)
    awq:q4_0   GGUF, Q4_0 encoders on the AWQ-scaled weights (the search uses Q4_0 itself)
    awq:q4_k   GGUF, Q4_K (with the documented fallbacks), the search uses the planned types
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.quant.awq_pack import GROUP, fake_quantize
from engine.quant.registry import ConvertResult, ProgressFn, TargetFormat, register
from engine.quant.source import SourceModel
from models.errors import HearthError

DEFAULT_CALIBRATION = Path(__file__).resolve().parents[2] / "resources" / "calibration" / "default.txt"
WINDOW = 512
N_GRID = 20
CLIP_SHRINK = 0.5  # smallest clip ratio tried: 1 - CLIP_SHRINK + 1 / N_GRID
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_NO_CLIP = ("attn_q", "attn_k")

# qdq(tensor name, float32 (rows, cols)) -> the matrix quantized and decoded again
QDQ = Callable[[str, np.ndarray], np.ndarray]


class CalibrationError(HearthError):
    """The calibration text cannot be used (missing, unreadable, too short)."""


class _Stats:
    """Running mean |x| and Gram matrix of one linear input, over every calibration token."""

    def __init__(self, d: int):
        self.abs_sum = np.zeros(d, np.float64)
        self.gram = np.zeros((d, d), np.float32)
        self.n = 0

    def add(self, x: np.ndarray) -> None:
        # x (n, d) float32
        self.abs_sum += np.abs(x).sum(axis=0, dtype=np.float64)
        self.gram += x.T @ x
        self.n += x.shape[0]

    @property
    def mean_abs(self) -> np.ndarray:
        return self.abs_sum / max(self.n, 1)

    @property
    def g(self) -> np.ndarray:
        return self.gram / np.float32(max(self.n, 1))


class _FloatWeights:
    """A source model as an architecture's weight source: matrices as F32 (embedding F16), no copies kept."""

    def __init__(self, source: SourceModel):
        self.source = source

    def has(self, name: str) -> bool:
        return name in self.source.shapes

    def matrix(self, name: str, rows: int, cols: int):
        from engine.weights import Weight

        x = self.source.tensor(name).reshape(rows, cols)
        if name in ("token_embd.weight", "output.weight"):
            return Weight(1, x.astype(np.float16).view(np.uint8), rows, cols)
        return Weight(0, np.ascontiguousarray(x, np.float32).view(np.uint8), rows, cols)

    def vector(self, name: str, n: int) -> np.ndarray:
        return np.ascontiguousarray(self.source.tensor(name).reshape(n), np.float32)

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.ascontiguousarray(self.source.tensor(name).reshape(shape), np.float32)


def float_model(source: SourceModel):
    """The source as a runnable float architecture instance (for calibration and tests)."""
    from engine.arch import model_class

    cls = model_class(source.architecture)
    cfg = cls.config_class.from_gguf(source.metadata, vocab_size=source.shapes["token_embd.weight"][0])
    return cls(cfg, _FloatWeights(source))


def calibration_text(path: str | Path | None) -> str:
    """The calibration text: a user file, or the default set shipped in resources/calibration/."""
    p = Path(path) if path else DEFAULT_CALIBRATION
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrationError(
            f"{p}: no such calibration text file; give a UTF-8 text with --calib"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{p}: cannot be read as UTF-8 text ({e})") from e
    return text


def calibrate(
    source: SourceModel, text: str, window: int = WINDOW, progress: ProgressFn | None = None
) -> tuple[dict[tuple[int, str], _Stats], int]:
    """Run the float model over `text`; returns ({(layer, input key): stats}, tokens seen).

    Raises:
        CalibrationError: fewer than 64 tokens of text.
    """
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(source.metadata)
    ids = tok.encode(text, add_special=False)
    if len(ids) < 64:
        raise CalibrationError(
            f"the calibration text has {len(ids)} tokens; give at least 64 (ideally 2000+)"
        )
    bos = tok.bos_id if tok.add_bos else None
    step = window - (bos is not None)
    windows = [ids[i : i + step] for i in range(0, len(ids), step)]
    if len(windows) > 1 and len(windows[-1]) < 32:
        windows.pop()
    model = float_model(source)
    stats: dict[tuple[int, str], _Stats] = {}

    def capture(layer: int, key: str, x: np.ndarray) -> None:
        st = stats.get((layer, key))
        if st is None:
            st = stats[(layer, key)] = _Stats(x.shape[1])
        st.add(x)

    model.capture = capture
    seen = 0
    for i, w in enumerate(windows):
        if progress:
            progress(i, len(windows), f"calibration window {i + 1}/{len(windows)}")
        tokens = np.asarray(([bos] if bos is not None else []) + list(w), np.int64)
        model.forward(tokens, model.new_cache(len(tokens)))
        seen += len(tokens)
    return stats, seen


def _error(dw: np.ndarray, g: np.ndarray) -> float:
    """tr(dw G dw^T): summed squared output error of a weight change dw (rows, d) under Gram g (d, d)."""
    return float(np.einsum("ij,ij->", dw @ g, dw, dtype=np.float64))


def _normalise(s: np.ndarray) -> np.ndarray:
    s = s / np.sqrt(s.max() * s.min())
    return np.maximum(s, 1e-4).astype(np.float32)


def search_scale(
    mats: dict[str, np.ndarray],
    stats: _Stats,
    qdq: QDQ,
    tie: Callable[[np.ndarray], np.ndarray] | None = None,
    n_grid: int = N_GRID,
    max_rows: int = 256,
) -> tuple[np.ndarray, float, float, float]:
    """Best per-input-channel scale for linears sharing one input.

    Args:
        mats: tensor name -> float32 (rows, d) weights that read the input.
        stats: the input's statistics.
        qdq: the quantizer the weights will be stored with.
        tie: maps mean |x| (d,) to the scales actually allowed (o under GQA: shared across heads);
            applied before normalising.
        n_grid: alpha runs over 0, 1/n_grid, ..., 1.
        max_rows: the search looks at every k-th row of the matrices, at most this many in all.

    Returns:
        (scales (d,), alpha, error at alpha 0 (RTN), error at the best alpha), errors over the rows seen
    """
    g = stats.g
    x = np.maximum(stats.mean_abs, 1e-8)
    # alpha is one number per group: an even spread of at most max_rows rows picks it as well as all
    step = -(-sum(w.shape[0] for w in mats.values()) // max_rows)
    mats = {name: np.ascontiguousarray(w[::step]) for name, w in mats.items()}
    if tie is not None:
        x = tie(x)
    best = (np.ones_like(x, dtype=np.float32), 0.0, np.inf)
    rtn = np.inf
    for i in range(n_grid + 1):
        alpha = i / n_grid
        s = _normalise(x**alpha)
        err = 0.0
        for name, w in mats.items():
            err += _error(w - qdq(name, w * s) / s, g)
        if i == 0:
            rtn = err
        if err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], rtn, best[2]


def search_clip(
    name: str, w: np.ndarray, g: np.ndarray, qdq: QDQ, group: int = GROUP, n_grid: int = N_GRID
) -> np.ndarray:
    """w (rows, d) with each row's group of `group` inputs clamped to its best r * max|w| (see module doc).

    g is the (d, d) Gram matrix of the inputs w reads (already divided by the scales folded into w).
    """
    rows, d = w.shape
    ng = d // group
    wg = w.reshape(rows, ng, group)
    top = np.abs(wg).max(axis=2, keepdims=True)
    blocks = np.stack([g[j * group : (j + 1) * group, j * group : (j + 1) * group] for j in range(ng)])
    best_err = np.full((rows, ng), np.inf)
    best_r = np.ones((rows, ng, 1), np.float32)
    for i in range(int(CLIP_SHRINK * n_grid)):
        r = np.float32(1 - i / n_grid)
        lim = top * r
        dw = (w - qdq(name, np.clip(wg, -lim, lim).reshape(rows, d))).reshape(rows, ng, group)
        dw = np.ascontiguousarray(dw.transpose(1, 0, 2))  # (ng, rows, group)
        err = np.einsum("grk,grk->rg", dw @ blocks, dw, dtype=np.float64)
        better = err < best_err
        best_err[better] = err[better]
        best_r[better] = r
    lim = top * best_r
    return np.clip(wg, -lim, lim).reshape(rows, d)


@dataclasses.dataclass
class AWQResult:
    """AWQ-transformed float tensors and what the search chose."""

    tensors: dict[str, np.ndarray]  # canonical name -> float32, every tensor AWQ changed
    alphas: dict[str, float]  # "blk.N.<input key>" -> alpha
    rtn_error: float  # summed calibration output error of the block linears under plain RTN
    awq_error: float  # the same after scaling (before clipping)
    tokens: int
    calib_seconds: float
    search_seconds: float

    def overlay(self, source: SourceModel) -> SourceModel:
        """`source` with AWQ's tensors in place of the originals (the source itself is not changed)."""
        base = source._loader
        new = self.tensors
        return dataclasses.replace(
            source, _loader=lambda n: new[n].copy() if n in new else base(n), _closer=None
        )


def awq_transform(
    source: SourceModel,
    qdq: QDQ,
    text: str,
    *,
    clip: bool = True,
    clip_group: int = GROUP,
    scale_o: bool = True,
    n_grid: int = N_GRID,
    progress: ProgressFn | None = None,
) -> AWQResult:
    """Calibrate on `text`, search scales (and clipping) against quantizer `qdq`, fold the scales.

    Returns the changed tensors (q/k/v/o/gate/up/down of every layer, attn_norm, ffn_norm, v bias).
    """
    report = progress or (lambda done, total, msg: None)
    t0 = time.perf_counter()
    stats, tokens = calibrate(source, text, progress=report)
    t1 = time.perf_counter()
    md, arch = source.metadata, source.architecture
    heads = int(md[f"{arch}.attention.head_count"])
    kv_heads = int(md.get(f"{arch}.attention.head_count_kv", heads))
    n_rep = heads // kv_heads
    out: dict[str, np.ndarray] = {}
    alphas: dict[str, float] = {}
    rtn_total = awq_total = 0.0
    n_layers = source.n_layers
    for i in range(n_layers):
        report(i, n_layers, f"AWQ search, layer {i + 1}/{n_layers}")
        p = f"blk.{i}."
        w = {k: source.tensor(p + k + ".weight") for k in LINEARS}
        attn_norm = source.tensor(p + "attn_norm.weight")
        ffn_norm = source.tensor(p + "ffn_norm.weight")
        v_bias = source.tensor(p + "attn_v.bias") if p + "attn_v.bias" in source.shapes else None

        def fit(key, names, tie=None, i=i, p=p, w=w):
            mats = {p + k + ".weight": w[k] for k in names}
            s, alpha, e_rtn, e_awq = search_scale(mats, stats[(i, key)], qdq, tie, n_grid)
            alphas[p + key] = alpha
            return s, e_rtn, e_awq

        # q/k/v against attn_norm
        s, e0, e1 = fit("attn_q", ("attn_q", "attn_k", "attn_v"))
        for k in ("attn_q", "attn_k", "attn_v"):
            w[k] = w[k] * s
        attn_norm = attn_norm / s
        s_qkv = s
        rtn_total, awq_total = rtn_total + e0, awq_total + e1
        # o against v's rows: one v row (kv head g, dim d) feeds channel (h, d) of every head h of group g
        s_o = np.ones(w["attn_output"].shape[1], np.float32)
        if scale_o:
            hd = w["attn_v"].shape[0] // kv_heads

            def tie(x, hd=hd):
                per_kv = x.reshape(kv_heads, n_rep, hd).mean(axis=1, keepdims=True)
                return np.repeat(per_kv, n_rep, axis=1).reshape(-1)

            s_o, e0, e1 = fit("attn_output", ("attn_output",), tie)
            rtn_total, awq_total = rtn_total + e0, awq_total + e1
            w["attn_output"] = w["attn_output"] * s_o
            s_kv = s_o.reshape(kv_heads, n_rep, hd)[:, 0, :].reshape(-1)
            w["attn_v"] = w["attn_v"] / s_kv[:, None]
            if v_bias is not None:
                v_bias = v_bias / s_kv
        # gate/up against ffn_norm
        s, e0, e1 = fit("ffn_up", ("ffn_gate", "ffn_up"))
        w["ffn_gate"], w["ffn_up"] = w["ffn_gate"] * s, w["ffn_up"] * s
        ffn_norm = ffn_norm / s
        s_ffn = s
        rtn_total, awq_total = rtn_total + e0, awq_total + e1
        # down against up's rows
        s_down, e0, e1 = fit("ffn_down", ("ffn_down",))
        w["ffn_down"] = w["ffn_down"] * s_down
        w["ffn_up"] = w["ffn_up"] / s_down[:, None]
        rtn_total, awq_total = rtn_total + e0, awq_total + e1
        if clip:
            inputs = {
                "attn_v": ("attn_q", s_qkv),
                "attn_output": ("attn_output", s_o),
                "ffn_gate": ("ffn_up", s_ffn),
                "ffn_up": ("ffn_up", s_ffn),
                "ffn_down": ("ffn_down", s_down),
            }
            for k, (key, s) in inputs.items():
                g = stats[(i, key)].g / np.outer(s, s)
                w[k] = search_clip(p + k + ".weight", w[k], g, qdq, clip_group, n_grid)
        for k in LINEARS:
            out[p + k + ".weight"] = np.ascontiguousarray(w[k], np.float32)
        out[p + "attn_norm.weight"] = attn_norm.astype(np.float32)
        out[p + "ffn_norm.weight"] = ffn_norm.astype(np.float32)
        if v_bias is not None:
            out[p + "attn_v.bias"] = v_bias.astype(np.float32)
        for key in ("attn_q", "attn_output", "ffn_up", "ffn_down"):
            stats.pop((i, key), None)  # free the layer's Gram matrices
    report(n_layers, n_layers, "AWQ search done")
    return AWQResult(out, alphas, rtn_total, awq_total, tokens, t1 - t0, time.perf_counter() - t1)


def pick_group(source: SourceModel, group: int | None = None) -> int:
    """The INT4 group size: `group` if given, else 128, or 64 / 32 when some row length is not a multiple
    of 128 (SmolLM2's 576-wide rows take 64), the same for every linear as AutoAWQ's config has one.

    Raises:
        UnsupportedArchitectureError: a block linear is missing (fused q/k/v), or rows don't split.
    """
    from engine.errors import UnsupportedArchitectureError

    if any("shortconv" in name or ".ssm_" in name for name in source.shapes):
        raise UnsupportedArchitectureError(
            f"{source.path}: AWQ does not cover LFM2's convolution, Qwen3.5's DeltaNet or Mamba-2 layers "
            "yet; pick a GGUF format instead"
        )
    if source.architecture == "gemma4":
        raise UnsupportedArchitectureError(
            f"{source.path}: AWQ does not cover Gemma 4 (its shared-KV layers, per-layer embeddings and "
            "experts beside the MLP) yet; pick a GGUF format instead"
        )
    if source.architecture == "deepseek2":
        raise UnsupportedArchitectureError(
            f"{source.path}: AWQ does not cover multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) "
            "yet; pick a GGUF format instead"
        )
    if source.architecture == "gemma3n":
        raise UnsupportedArchitectureError(
            f"{source.path}: AWQ does not cover Gemma 3n (its AltUp streams, LAuReL blocks, shared-KV layers "
            "and per-layer embeddings) yet; pick a GGUF format instead"
        )
    if "blk.0.attn_norm.weight" not in source.shapes:
        raise UnsupportedArchitectureError(
            f"{source.path}: AWQ folds its scales into the norms before q/k/v and gate/up, which this model "
            "(OLMo 2) does not have; pick a GGUF format instead"
        )
    cols = set()
    for i in range(source.n_layers):
        for k in LINEARS:
            name = f"blk.{i}.{k}.weight"
            if name not in source.shapes:
                raise UnsupportedArchitectureError(
                    f"{source.path}: {name} is missing; AWQ needs separate q/k/v/o/gate/up/down matrices"
                )
            cols.add(source.shapes[name][-1])
    for g in (group,) if group else (GROUP, 64, 32):
        if g % 32 == 0 and all(c % g == 0 for c in cols):
            return g
    raise UnsupportedArchitectureError(
        f"{source.path}: row lengths {sorted(cols)} do not split into INT4 groups of "
        f"{group or '128, 64 or 32'}; pick a GGUF format instead"
    )


def _result_lines(res: AWQResult) -> list[str]:
    gain = 100.0 * (1 - res.awq_error / res.rtn_error) if res.rtn_error else 0.0
    mean_alpha = float(np.mean(list(res.alphas.values()))) if res.alphas else 0.0
    return [
        f"AWQ: calibrated on {res.tokens} tokens in {res.calib_seconds:.1f} s, "
        f"scale search {res.search_seconds:.1f} s",
        f"AWQ: block output error {gain:.1f}% below round-to-nearest on the calibration text "
        f"(mean alpha {mean_alpha:.2f})",
    ]


def _extra(res: AWQResult) -> dict:
    return {
        "calibration_tokens": res.tokens,
        "calibration_seconds": res.calib_seconds,
        "search_seconds": res.search_seconds,
        "rtn_error": res.rtn_error,
        "awq_error": res.awq_error,
        "alphas": res.alphas,
    }


def _options(options: dict) -> tuple[str, bool]:
    text = calibration_text(options.get("calibration"))
    clip = str(options.get("clip", True)).lower() not in ("0", "false", "no", "off")
    return text, clip


# ---- GGUF targets ----------------------------------------------------------------------------------


def _gguf_writer(preset: str):
    def write(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
        from engine.quant.encode import dequantize, quantize
        from engine.quant.gguf_formats import output_metadata, preset_plan, write_gguf
        from engine.quant.presets import F32, PRESETS
        from models.formats.ggml_types import type_name

        pick_group(source, 32)
        text, clip = _options(options)
        types = preset_plan(preset, source)

        def qdq(name: str, w: np.ndarray) -> np.ndarray:
            t = types[name]
            return w if t == F32 else dequantize(t, quantize(t, w), w.shape[1])

        # ggml's 4-bit types scale blocks of 32 (Q4_K: 32-wide sub-blocks), so clipping is per 32 too
        res = awq_transform(source, qdq, text, clip=clip, clip_group=32, progress=progress)
        write_gguf(
            res.overlay(source), out_path, types, progress, output_metadata(source, PRESETS[preset][1])
        )
        return ConvertResult(
            tensor_types={n: type_name(t) for n, t in types.items()},
            report=_result_lines(res),
            extra=_extra(res),
        )

    return write


# ---- AutoAWQ safetensors targets ---------------------------------------------------------------------


def _is_block_linear(name: str) -> bool:
    return name.startswith("blk.") and name.rsplit(".", 2)[-2] in LINEARS and name.endswith(".weight")


def write_awq_folder(
    source: SourceModel, out_path: Path, progress: ProgressFn, group: int = GROUP
) -> dict[str, str]:
    """An AutoAWQ-layout Hugging Face folder of `source`, its block linears quantized by plain RTN.

    Returns HF tensor name -> type written.
    """
    import json

    from engine.export import _to_hf, hf_name
    from engine.quant.awq_pack import quantize_groups, to_awq_tensors
    from engine.quant.hf_meta import config_json, tokenizer_files

    md = source.metadata
    arch = source.architecture
    config = config_json(md, source.shapes["token_embd.weight"][0], tied="output.weight" not in source.shapes)
    config["torch_dtype"] = "float16"
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    # header first: every size is known from the shapes
    entries = []  # (hf name, dtype, shape, canonical name, part)
    for name in source.names:
        shape = source.shapes[name]
        hf = hf_name(name, arch)
        if _is_block_linear(name):
            rows, cols = shape
            prefix = hf[: -len("weight")]
            entries.append((prefix + "qweight", "I32", [cols, rows // 8], name, "qweight"))
            entries.append((prefix + "qzeros", "I32", [cols // group, rows // 8], name, "qzeros"))
            entries.append((prefix + "scales", "F16", [cols // group, rows], name, "scales"))
        else:
            entries.append((hf, "F16" if len(shape) >= 2 else "F32", list(shape), name, None))
    width = {"I32": 4, "F16": 2, "F32": 4}
    header: dict = {"__metadata__": {"format": "pt", "quant_method": "awq"}}
    off = 0
    for hf, dt, shape, _, _ in entries:
        n = int(np.prod(shape)) * width[dt]
        header[hf] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    out_path.mkdir()
    types: dict[str, str] = {}
    with open(out_path / "model.safetensors", "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        packed: dict[str, np.ndarray] = {}
        for j, (hf, dt, shape, name, part) in enumerate(entries):
            progress(j, len(entries), f"[{j + 1}/{len(entries)}] {hf}")
            if part is None:
                x = _to_hf(source, name)
                data = x.astype(np.float16) if dt == "F16" else x
                types[hf] = dt
            else:
                if part == "qweight":
                    packed = to_awq_tensors(*quantize_groups(_to_hf(source, name), group))
                    types[hf[: -len("qweight")] + "weight"] = f"int4-g{group}"
                data = packed[part]
            assert list(data.shape) == shape, (hf, data.shape, shape)
            fh.write(np.ascontiguousarray(data).tobytes())
        progress(len(entries), len(entries), "done")
    tok_json, tok_config = tokenizer_files(md)
    (out_path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out_path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    (out_path / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (out_path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return types


def _write_awq(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
    group = pick_group(source, options.get("group"))
    text, clip = _options(options)
    res = awq_transform(
        source, lambda name, w: fake_quantize(w, group), text, clip=clip, clip_group=group, progress=progress
    )
    types = write_awq_folder(res.overlay(source), out_path, progress, group)
    lines = [*_result_lines(res), f"wrote an AutoAWQ folder (INT4, group {group}, GEMM packing)"]
    return ConvertResult(tensor_types=types, report=lines, extra={**_extra(res), "group_size": group})


def _rtn_writer(group: int):
    def write(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
        pick_group(source, group)
        types = write_awq_folder(source, out_path, progress, group)
        return ConvertResult(
            tensor_types=types,
            report=[f"wrote INT4 group-{group} round-to-nearest weights in AutoAWQ's layout (no AWQ)"],
            extra={"group_size": group},
        )

    return write


register(
    TargetFormat(
        "awq",
        "safetensors",
        _write_awq,
        "AWQ INT4 (group 128, or 64/32 when rows need it), AutoAWQ-layout safetensors (--calib FILE)",
    )
)
for _g in (128, 64, 32):
    register(
        TargetFormat(
            f"int4:g{_g}",
            "safetensors",
            _rtn_writer(_g),
            f"INT4 group {_g} round-to-nearest in AutoAWQ's layout (the baseline for awq)",
        )
    )
register(TargetFormat("awq:q4_0", "gguf", _gguf_writer("Q4_0"), "AWQ-scaled weights as a Q4_0 GGUF"))
register(TargetFormat("awq:q4_k", "gguf", _gguf_writer("Q4_K"), "AWQ-scaled weights as a Q4_K GGUF"))
