"""A llama-family / Gemma 3 decoder on the GPU, built from the CPU model of the same file.

The CPU model (engine.arch.llama / gemma3) has parsed the config and mapped every weight; this
class uploads those weights unchanged (GGUF blocks) and runs the same maths with the CUDA kernels:

- decode (one token): per layer a fused norm + q|k|v matvec, one attention kernel (RoPE with Gemma's
  q/k norms, the KV-cache write, split-K attention and its reduction), the output matvec added into
  the residual, a fused norm + gate|up matvec and the down matvec with the activation fused into its
  input. The whole step is captured once per cache as a CUDA graph (position and token live in device
  memory), so a step costs one graph launch from Python.
- prefill (several tokens): each layer matrix multiplied with cuBLAS, as a float16 (or float32) copy
  dequantized at load where the GPU's memory allows (prefill_weights), else as tiles dequantized into
  a scratch buffer at each prefill (float16 weights are read in place); attention is two strided-batched
  cuBLAS GEMMs per batch of KV heads straight on the cache (scores, then the weighted sum of V) around
  a masked-softmax kernel, or one flash kernel (HEARTH_CUDA_FLASH=1).

The fused path (decode_kernel="fused" or HEARTH_CUDA_DECODE=fused; GGUF weights): the whole decode step
is one persistent kernel instead (engine.backends.cuda.fused); `decode_path` says which path runs.

Batched decode (the server): forward_batch runs the same step over B sequences at once, captured as a
CUDA graph per batch of caches. Integer-dot weights are read once for up to ops.MAX_BATCH of them; RoPE,
attention and float-kernel matvecs run per sequence inside the step.

Mixture-of-experts layers (llama family, experts of GGUF block types): the router's matvec, moe_route
(the chosen experts and weights stay on the GPU, so the graph picks them as it runs), matvec_qb_experts
for the chosen experts' gate|up and down, moe_combine for their weighted sum and the shared expert; their
prefill groups the tokens by expert on the host (_moe_prefill).

Partial offload: with n_layers below the model's layer count the decoder runs the embedding and the
first n_layers layers only and hands the residual stream to the CPU model (engine.backends.cuda.hybrid).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import weakref

import cupy as cp
import numpy as np

from engine.arch.base import check_batch, rewound_on_failure
from engine.arch.deltanet import split_ba, split_qkvz
from engine.arch.gemma3 import Gemma3Model
from engine.arch.llama import LlamaModel
from engine.arch.mamba2 import MambaShape
from engine.arch.nemotron_h import NemotronHModel
from engine.backends.cuda import fused, ops
from engine.backends.cuda.device import CudaMemoryExhaustedError, CudaOutOfMemoryError
from engine.backends.cuda.nemotron import NemotronHBlocks
from engine.kv_cache import KVCache, RecurrentKVCache, ShortConvKVCache
from engine.sampling import draw
from models.errors import HearthError

PREFILL_TILE_ELEMS = 32 << 20  # dequantized weight elements per prefill tile (64 MiB in float16)
MARGIN_BYTES = 512 << 20  # CUDA context, cuBLAS workspace, allocator slack
BATCH_GRAPHS = 4  # batches whose captured steps are kept (a server's batch changes as requests come and go)
SERVE_ROWS = 16  # sequences per batched step the VRAM estimate plans for (hearth serve --max-seqs default)
PREFILL_WEIGHT_MODES = ("auto", "resident", "tiles")
# prefill_weights "auto": the copies take at most this share of the memory left after the estimate
RESIDENT_SHARE = 0.25


class UnsupportedCudaModelError(HearthError):
    """The model uses a weight type or a feature the CUDA backend does not implement."""


class CudaKVCache(KVCache):
    """KVCache's interface (offset, tokens, trim, common_prefix, advance) over GPU arrays
    k, v (n_layers, n_kv_heads, n_ctx, head_dim), float16 or float32."""

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, dtype=np.float16, stream=None
    ):
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
            raise ValueError(f"KV cache dtype must be float32 or float16, got {dtype}")
        self.n_ctx = n_ctx
        self.dtype = dtype
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        self.k = cp.zeros((n_layers, n_kv_heads, n_ctx, head_dim), dtype)
        self.v = cp.zeros((n_layers, n_kv_heads, n_ctx, head_dim), dtype)
        self._tokens: list[int] = []

    def update_and_fetch(self, layer, k, v):  # the GPU decoder writes the cache in its RoPE kernel
        raise NotImplementedError("CudaKVCache is written by the CUDA decoder's kernels")

    # on the decoder's stream, finished before returning: its kernels are ordered with these copies
    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        with self.stream:
            k = cp.asnumpy(self.k[:, :, lo:hi, :], stream=self.stream)
            v = cp.asnumpy(self.v[:, :, lo:hi, :], stream=self.stream)
            self.stream.synchronize()
        return k, v

    def write(self, lo: int, k: np.ndarray, v: np.ndarray) -> None:
        n = k.shape[2]
        with self.stream:
            self.k[:, :, lo : lo + n, :] = cp.asarray(k, self.dtype)
            self.v[:, :, lo : lo + n, :] = cp.asarray(v, self.dtype)
            self.stream.synchronize()

    @property
    def state(self):
        return cp.asnumpy(self.k), cp.asnumpy(self.v), self.tokens


class CudaRecurrentKVCache(RecurrentKVCache, CudaKVCache):
    """A CudaKVCache of the attention layers beside the recurrent layers' states on the GPU (Qwen3.5's
    DeltaNet): RecurrentKVCache's snapshots and trims, its copies on the decoder's stream."""

    xp = cp

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, dtype, stream, n_rec: int,
                 state_shape: tuple[int, ...], conv_shape: tuple[int, ...]):
        CudaKVCache.__init__(self, n_layers, n_kv_heads, head_dim, n_ctx, dtype, stream)
        with self.stream:
            self._init_states(n_rec, state_shape, conv_shape)

    def _back_to(self, limit: int) -> int:
        with self.stream:
            return super()._back_to(limit)


class CudaShortConvKVCache(ShortConvKVCache, CudaKVCache):
    """A CudaKVCache of the attention layers beside the convolution layers' inputs at every position on the
    GPU (LFM2): ShortConvKVCache's layout, written by the decoder's short_conv kernel, its copies on the
    decoder's stream."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, dtype, stream, n_conv: int,
                 width: int):
        CudaKVCache.__init__(self, n_layers, n_kv_heads, head_dim, n_ctx, dtype, stream)
        with self.stream:
            self.conv = cp.zeros((n_conv, 1, n_ctx, width), self.dtype)

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        k, v = CudaKVCache.read(self, lo, hi)
        with self.stream:
            conv = cp.asnumpy(self.conv[:, :, lo:hi, :], stream=self.stream)
            self.stream.synchronize()
        return k, v, conv

    def write(self, lo: int, k: np.ndarray, v: np.ndarray, conv: np.ndarray) -> None:
        CudaKVCache.write(self, lo, k, v)
        with self.stream:
            self.conv[:, :, lo : lo + conv.shape[2], :] = cp.asarray(conv, self.dtype)
            self.stream.synchronize()


LAYER_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
PREFILL_STACKS = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))  # a GEMM each in prefill


def _moe_weights(moe) -> list:
    """A MoE block's weights as they go to the GPU: the router, each expert matrix (uploaded into one
    merged tensor per kind: CudaDecoder._upload_moe) and the shared expert's three."""
    return [moe.router, *moe.gate, *moe.up, *moe.down, *(moe.shared or ())]


def _weights_of(model, n_layers: int | None = None) -> list:
    """The distinct weights on the GPU: embedding, the first n_layers layers' matrices (all: None), their
    experts, and the output projection when every layer is there."""
    seen, out = set(), []
    n = len(model.layers) if n_layers is None else n_layers
    heads = [model.token_embd] + ([model.output] if n >= len(model.layers) else [])
    layers = [getattr(layer, a) for layer in model.layers[:n] for a in LAYER_WEIGHTS]
    moes = [getattr(layer, "moe", None) for layer in model.layers[:n]]
    experts = [w for moe in moes if moe is not None for w in _moe_weights(moe)]
    kinds = ("delta", "conv", "mamba")
    mixers = [getattr(layer, kind, None) for layer in model.layers[:n] for kind in kinds]
    mixed = [w for mixer in mixers if mixer is not None for w in mixer.weights()]  # their mixers'
    for w in heads + layers + experts + mixed:
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def ffn_width(model) -> int:
    """The widest dense FFN of the model's layers (a MoE model's dense layers may be wider than its
    experts, cfg.intermediate_size), at least cfg.intermediate_size: the width of the decode step's and
    prefill's FFN buffers."""
    widths = [layer.w_gate.rows for layer in model.layers if getattr(layer, "w_gate", None) is not None]
    return max([model.cfg.intermediate_size, *widths])


def moe_dims(model) -> tuple:
    """(experts, chosen a token, expert ff, shared expert ff (0: none)) when some layer has experts, else
    None."""
    moes = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
    if not moes:
        return None
    cfg, m = model.cfg, moes[0]
    shared_ff = 0 if m.shared is None else m.shared[0].rows
    return (cfg.num_experts, cfg.num_experts_per_tok, m.gate[0].rows, shared_ff)


def _moe_refusal(model) -> str | None:
    """Why the CUDA kernels cannot run this model's mixture-of-experts layers (None: they can, or there
    are none): the experts run on matvec_qb's integer dot products (every GGUF block type) or the float
    kernels' (F32/F16/BF16: Hugging Face folders), routed by
    softmax or sigmoid scores with an optional router bias and choice bias, with SwiGLU or gpt-oss's
    clamped SwiGLU experts (biases allowed) and an optional shared expert."""
    cfg = model.cfg
    if cfg.expert_act not in ("silu", "swiglu_oai"):
        return f"mixture-of-experts layers with {cfg.expert_act} experts have no CUDA kernels yet"
    groups, used = getattr(cfg, "expert_groups", 1), getattr(cfg, "expert_groups_used", 0)
    if groups > 1 and 0 < used < groups:
        return "mixture-of-experts layers with group-limited routing (DeepSeek) have no CUDA kernels yet"
    if cfg.num_experts > ops.MOE_MAX_EXPERTS or not 1 <= cfg.num_experts_per_tok <= 32:
        return (f"mixture-of-experts layers of {cfg.num_experts} experts, {cfg.num_experts_per_tok} a "
                f"token, have no CUDA kernels (up to {ops.MOE_MAX_EXPERTS} experts and 32 a token)")
    for layer in model.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        types = {w.ggml_type for w in [*moe.gate, *moe.up, *moe.down]}
        other = sorted(types - ops.INT_DOT_TYPES - set(ops._FLOAT_TYPES))
        if other:
            from models.formats.ggml_types import type_name

            return (f"mixture-of-experts layers with {type_name(other[0])} experts have no CUDA kernels yet "
                    "(the experts take GGUF block types such as Q4_K or Q8_0, or F32/F16/BF16)")
        if any(len({w.ggml_type for w in ws}) > 1 for ws in (moe.gate, moe.up, moe.down)):
            return "mixture-of-experts layers whose experts differ in weight type have no CUDA kernels"
        float_gu = {moe.gate[0].ggml_type, moe.up[0].ggml_type} & set(ops._FLOAT_TYPES)
        if float_gu and moe.gate[0].ggml_type != moe.up[0].ggml_type:
            return "MoE layers whose float gate and up experts differ in type have no CUDA kernels"
        if moe.expert_scale is not None:
            return "mixture-of-experts layers with per-expert scales (Gemma 4) have no CUDA kernels yet"
        if (moe.gate_bias is None) != (moe.up_bias is None):
            return "mixture-of-experts layers with only one of gate and up biases have no CUDA kernels"
    return None


def _recurrent_refusal(model) -> str | None:
    """Why the CUDA kernels cannot run this model's DeltaNet or Mamba-2 layers (None: they can, or there are
    none)."""
    deltas = [layer.delta for layer in model.layers if getattr(layer, "delta", None) is not None]
    mambas = any(getattr(layer, "mamba", None) is not None for layer in model.layers)
    if mambas:
        m = model.cfg.mamba
        if m.taps > ops.DELTA_MAX_TAPS or m.state_size > ops.SSM_MAX_STATE or m.heads % m.groups:
            return (f"Mamba-2 layers of {m.taps} taps, states of {m.state_size} and {m.heads} heads in "
                    f"{m.groups} groups have no CUDA kernels")
    if not deltas:
        return None
    shape = model.cfg.delta
    fused = [w for d in deltas for w in (d.in_qkvz, d.in_ba) if w is not None]
    if any(w.ggml_type in ops._FP_TYPES for w in fused):
        return "DeltaNet layers with Qwen3-Next's fused projections in FP8/NVFP4 have no CUDA kernels"
    if shape.taps > ops.DELTA_MAX_TAPS or max(shape.head_k, shape.head_v) > ops.DELTA_MAX_HEAD:
        heads = f"{shape.head_k}/{shape.head_v}"
        return f"DeltaNet layers of {shape.taps} taps and heads {heads} have no CUDA kernels"
    if any(getattr(layer, b, None) is not None for layer in model.layers for b in ("bq", "bk", "bv")) and (
        model.cfg.attn_output_gate
    ):
        return "gated attention with q/k/v biases has no CUDA kernels"
    return None


def estimate_vram(
    model, n_ctx: int, kv_dtype=np.float16, prefill_tokens: int = 512, n_layers: int | None = None
) -> int:
    """Bytes of GPU memory the model needs: weights, KV cache for n_ctx, prefill buffers, a margin.

    n_layers: how many layers go to the GPU (None: all of them and the output projection).
    """
    model = cuda_view(model)
    cfg = model.cfg
    n = cfg.num_hidden_layers if n_layers is None else min(n_layers, cfg.num_hidden_layers)
    weights = sum(w.nbytes for w in _weights_of(model, n))
    norms = 4 * cfg.hidden_size * (4 * n + 1)
    n_rec = sum(_recurrent(layer) for layer in model.layers[:n])
    shape = (getattr(cfg, "delta", None) or getattr(cfg, "mamba", None)) if n_rec else None
    states = 4 * (1 + RecurrentKVCache.MAX_SNAPSHOTS) * n_rec * shape.state_floats if shape else 0
    n_conv = sum(getattr(layer, "conv", None) is not None for layer in model.layers[:n])
    size = np.dtype(kv_dtype).itemsize
    kv = 2 * _attention_layers(model, n) * cfg.num_key_value_heads * n_ctx * cfg.head_dim * size
    kv += n_conv * n_ctx * cfg.hidden_size * size  # LFM2: every position's convolution input
    ff = ffn_width(model)
    q_rows = 2 * cfg.q_dim if getattr(cfg, "attn_output_gate", False) else cfg.q_dim  # Qwen3.5: + its gates
    extra = q_rows - cfg.q_dim + _recurrent_row_floats(shape) + (4 * cfg.hidden_size if n_conv else 0)
    acts = 4 * prefill_tokens * (3 * cfg.hidden_size + 2 * cfg.q_dim + 2 * cfg.kv_dim + 3 * ff + extra)
    moe = moe_dims(model)
    if moe is not None:  # router logits, routing, the experts' outputs by slot, the shared expert's rows
        E, k, eff, sff = moe
        acts += 4 * prefill_tokens * (E + 2 * k + k * cfg.hidden_size + 3 * eff + 3 * sff + 1)
    # prefill attention: scores (and probabilities), q and the output regrouped by KV head
    attn_parts = ops.ATTN_GEMM_BYTES + 8 * prefill_tokens * cfg.q_dim
    tile = 2 * PREFILL_TILE_ELEMS + (4 * cfg.vocab_size * 2 if n == cfg.num_hidden_layers else 0)
    # decode steps: a sequence's rows (activations, logits) and attention partials, for one sequence
    # and the kept batched steps of up to SERVE_ROWS sequences each
    vocab = cfg.vocab_size if n == cfg.num_hidden_layers else 0
    row = 4 * (3 * cfg.hidden_size + 2 * cfg.q_dim + 2 * cfg.kv_dim + 2 * ff + vocab + extra)
    row += _Step.moe_row_bytes(cfg.hidden_size, moe)
    row += 4 * cfg.num_attention_heads * ops.attention_splits(n_ctx)[1] * (cfg.head_dim + 2)
    steps = row * (1 + BATCH_GRAPHS * SERVE_ROWS)
    # captured prefills keep their buffers (one prefill's, up to PREFILL_GRAPH_MAX tokens) for each kept one
    graphs = PREFILL_GRAPHS * (acts + attn_parts) * min(PREFILL_GRAPH_MAX, n_ctx) // max(1, prefill_tokens)
    graphs = graphs if prefill_graphs_enabled() else 0
    return int(weights + norms + kv + states + acts + attn_parts + tile + steps + graphs + MARGIN_BYTES)


def cuda_view(model):
    """The model as the CUDA decoder reads it: a LlamaModel or Gemma3Model as it is, a NemotronHModel's
    blocks as layers of one branch each (engine.backends.cuda.nemotron)."""
    return NemotronHBlocks(model) if isinstance(model, NemotronHModel) else model


def _attention_layers(model, n: int) -> int:
    """How many of the first n layers keep keys and values (those with attention)."""
    return sum(getattr(layer, "wq", None) is not None for layer in model.layers[:n])


def _recurrent(layer) -> bool:
    """Whether a layer keeps a recurrent state (Qwen3.5's DeltaNet, Granite 4.0-H's Mamba-2)."""
    return getattr(layer, "delta", None) is not None or getattr(layer, "mamba", None) is not None


def _recurrent_row_floats(shape) -> int:
    """float32 values a token's recurrent rows take (None: 0). A deltanet.DeltaShape: its q|k|v|z
    projection, b and a, the convolution's output and the rule's; a mamba2.MambaShape: in_proj's
    z|x|B|C|dt, the convolution's output and the scan's."""
    if shape is None:
        return 0
    if isinstance(shape, MambaShape):
        return shape.in_rows + shape.conv_dim + shape.d_inner
    return 2 * shape.conv_dim + 2 * shape.value_dim + 2 * shape.v_heads


def _check_shared(model, n_layers: int, int_dot: bool) -> None:
    """UnsupportedCudaModelError unless one vector's matvec over each weight on the GPU fits a block's
    shared memory on the current device (ops.matvec_shared: the widest matrices on GPUs with less of it)."""
    cap = ops.max_shared()
    for w in _weights_of(model, n_layers):
        need = ops.matvec_shared(w, int_dot)
        if need > cap:
            raise UnsupportedCudaModelError(
                f"a matrix of {w.cols} columns needs {need / 1024:.1f} KiB of shared memory a block for its "
                f"matrix-vector kernel and this GPU allows {cap / 1024:.1f} KiB; use --device cpu"
            )


def layers_that_fit(model, n_ctx: int, free: int, kv_dtype=np.float16) -> int:
    """The most layers whose estimate fits in `free` bytes (the whole model counts as all layers)."""
    model = cuda_view(model)
    n_all = model.cfg.num_hidden_layers
    if estimate_vram(model, n_ctx, kv_dtype) <= free:
        return n_all
    lo, hi = 0, n_all - 1  # estimates grow with n: the largest n in 1..hi that fits, else 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_vram(model, n_ctx, kv_dtype, n_layers=mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Step:
    """The buffers of a decode step over B sequences (B rows each, allocated once) and its captured
    graphs (by greedy flag), for one list of caches; held by weak references, checked by `holds`."""

    def __init__(self, cfg, caches: list, head_only: bool, ff: int | None = None, moe: tuple | None = None,
                 delta=None, q_rows: int | None = None, conv: bool = False, mamba=None):
        """ff: the widest dense FFN (ffn_width; None: cfg.intermediate_size); moe: moe_dims (None: no
        experts), for the MoE rows below; delta: the DeltaNet layers' deltanet.DeltaShape (None: none);
        q_rows: the q projection's rows (Qwen3.5's gated attention: 2 q_dim; None: q_dim); conv: LFM2's
        convolution layers' rows too; mamba: the Mamba-2 layers' mamba2.MambaShape (None: none)."""
        f32 = cp.float32
        B = len(caches)
        d, q, kv = cfg.hidden_size, cfg.q_dim, cfg.kv_dim
        ff = cfg.intermediate_size if ff is None else ff
        self.refs = [weakref.ref(c) for c in caches]
        self.x = cp.empty((B, d), f32)
        self.o = cp.empty((B, d), f32)
        self.h = cp.empty((B, d), f32)  # a LayerNorm'd x (Cohere)
        self.qkv = cp.empty((B, (q_rows or q) + 2 * kv), f32)
        if delta is not None:  # DeltaNet rows: q|k|v|z projection, b|a, the convolution's, the rule's output
            self.dproj = cp.empty((B, delta.conv_dim + delta.value_dim), f32)
            self.dba = cp.empty((B, 2 * delta.v_heads), f32)
            self.dconv = cp.empty((B, delta.conv_dim), f32)
            self.dout = cp.empty((B, delta.value_dim), f32)
        if conv:  # LFM2's rows: in_proj's [B | C | x], the gated convolution's output
            self.bcx = cp.empty((B, 3 * d), f32)
            self.cout = cp.empty((B, d), f32)
        if mamba is not None:  # Mamba-2's rows: in_proj's z|x|B|C|dt, the convolution's, the scan's output
            self.mproj = cp.empty((B, mamba.in_rows), f32)
            self.mconv = cp.empty((B, mamba.conv_dim), f32)
            self.mout = cp.empty((B, mamba.d_inner), f32)
        self.attn = cp.empty((B, q), f32)
        self.gu = cp.empty((B, 2 * ff), f32)
        self.logits = None if head_only else cp.empty((B, cfg.vocab_size), f32)
        self.ids = cp.zeros(B, cp.int32)
        # the hand-off's activation records (ops.Emit): of the residual stream (normed) and of the GLU
        self.x_rec = cp.empty((B, ops.records_width(d)), cp.uint32)
        self.act_rec = cp.empty((B, ops.records_width(ff)), cp.uint32)
        self.attn_rec = cp.empty((B, ops.records_width(q)), cp.uint32) if cfg.head_dim % 32 == 0 else None
        self.counts = cp.zeros(max(d, ff) // 32, cp.int32)
        self.argmax_parts = ops.argmax_parts()
        self.pos = cp.zeros(B, cp.int32)
        # each sequence's split-K attention scratch (its cache's size sets the splits)
        h, hd = cfg.num_attention_heads, cfg.head_dim
        self.parts = [ops.attention_parts(h, hd, c.n_ctx) for c in caches]
        # B > 1 with caches of one dtype: each layer's attention in one launch (ops.attention_batch), over
        # a table per layer of the caches' (k, v, n_ctx) and scratch for the batch
        self.kv_tables = self.batch_parts = None
        if B > 1 and len({c.k.dtype for c in caches}) == 1:
            self.n_keys = max(c.n_ctx for c in caches)
            self.batch_parts = ops.attention_parts(h, hd, self.n_keys, B)
            self.kv_tables = [
                cp.asarray(np.array([[c.k[i].data.ptr, c.v[i].data.ptr, c.n_ctx] for c in caches], np.uint64))
                for i in range(caches[0].k.shape[0])
            ]
        # the MoE layers' rows: router logits, the chosen experts (B x k slots) and their weights, each
        # slot's gate|up and output, the shared expert's gate|up, output and gate logit
        if moe is not None:
            E, k, eff, sff = moe
            self.router = cp.empty((B, E), f32)
            self.expert_ids = cp.zeros((B, k), cp.int32)
            self.expert_w = cp.empty((B, k), f32)
            self.expert_gu = cp.empty((B * k, 2 * eff), f32)
            self.expert_act = cp.empty((B * k, eff), f32)  # the activation, where the prologue cannot take it
            self.expert_y = cp.empty((B, k, d), f32)
            self.shared_gu = cp.empty((B, 2 * sff), f32) if sff else None
            self.shared_y = cp.empty((B, d), f32) if sff else None
            self.shared_gate = cp.empty((B, 1), f32) if sff else None
        self.graphs: dict[bool, object] = {}

    @staticmethod
    def row_bytes(cfg, head_only: bool, ff: int | None = None, moe: tuple | None = None, delta=None,
                  q_rows: int | None = None, conv: bool = False, mamba=None) -> int:
        """Bytes of one sequence's rows of the buffers above (the attention partials aside)."""
        d, q, kv = cfg.hidden_size, cfg.q_dim, cfg.kv_dim
        ff = cfg.intermediate_size if ff is None else ff
        floats = 3 * d + q + (q_rows or q) + 2 * kv + 2 * ff + (0 if head_only else cfg.vocab_size)
        floats += _recurrent_row_floats(delta) + _recurrent_row_floats(mamba) + (4 * d if conv else 0)
        words = ops.records_width(d) + ops.records_width(ff) + ops.records_width(q) + 2  # + ids, pos
        return 4 * (floats + words) + _Step.moe_row_bytes(d, moe)

    @staticmethod
    def moe_row_bytes(d: int, moe: tuple | None) -> int:
        """Bytes of one sequence's MoE rows (none without experts)."""
        if moe is None:
            return 0
        E, k, eff, sff = moe
        return 4 * (E + 2 * k + k * 3 * eff + k * d + 2 * sff + d + 1)

    def holds(self, caches: list) -> bool:
        return len(caches) == len(self.refs) and all(r() is c for r, c in zip(self.refs, caches))

    def alive(self) -> bool:
        return all(r() is not None for r in self.refs)




PREFILL_GRAPH_STEP = 64  # a captured prefill runs its prompt padded to a multiple of this many tokens
# longer prompts (and prompts after cached tokens) go launch by launch: past ~512 tokens the GPU's work
# outlasts the host's issuing (H200, 1B shape), and each kept graph holds a prefill's buffers
PREFILL_GRAPH_MAX = 512
PREFILL_GRAPHS = 2  # captured prefill lengths kept per cache


def prefill_weights_mode(mode: str | None = None) -> str:
    """A CudaDecoder's prefill_weights: mode, else $HEARTH_CUDA_PREFILL_WEIGHTS, else "auto".

    Raises:
        ValueError: not one of PREFILL_WEIGHT_MODES.
    """
    if mode is None:
        mode = os.environ.get("HEARTH_CUDA_PREFILL_WEIGHTS", "").strip().lower() or "auto"
    if mode not in PREFILL_WEIGHT_MODES:
        raise ValueError(
            f"prefill weights must be one of {', '.join(PREFILL_WEIGHT_MODES)}, not {mode!r} "
            "(HEARTH_CUDA_PREFILL_WEIGHTS)"
        )
    return mode


def handoff_enabled() -> bool:
    """The decode step's matvecs hand their outputs on as the next one's quantized records (ops.Emit),
    unless HEARTH_CUDA_HANDOFF=0 (every matvec then quantizes its float input in every block, the H200's
    per-op profile's largest slice)."""
    return os.environ.get("HEARTH_CUDA_HANDOFF", "").strip() != "0"


def prefill_graphs_enabled() -> bool:
    """Captured prefills, unless HEARTH_CUDA_PREFILL_GRAPHS=0 (CuPy refuses cuBLAS in a capture, so
    they call libcublas through capture_blas; on the H200 that captures and replays, and the replay
    takes 5.4 ms where issuing the same 512-token prefill takes the host 6.8 ms)."""
    return os.environ.get("HEARTH_CUDA_PREFILL_GRAPHS", "").strip() != "0"


class _PrefillGraph:
    """A prefill of `size` tokens at position 0 of one cache, captured once and replayed for every
    prompt of up to `size` tokens there: its inputs (the prompt padded with token 0, the index of its
    last token), its logits, and the memory pool its capture allocated from. The capture's temporaries
    go back to that pool and the capture's later allocations reuse them (the graph runs its nodes in the
    stream's order, as the launches ran), so the graph holds one prefill's working set, and no other
    work allocates from the pool while the graph lives."""

    def __init__(self, size: int):
        self.size = size
        self.ids = cp.zeros(size, cp.int32)
        self.pos = cp.zeros(1, cp.int32)
        self.last = cp.zeros(1, cp.int32)
        self.pool = cp.cuda.MemoryPool()
        self.graph = self.logits = None


class CudaDecoder:
    """The GPU twin of a LlamaModel or Gemma3Model (same forward/new_cache interface, numpy logits;
    greedy_step and sample_step decode a token and pick the next on the GPU).

    Args:
        model: the CPU model built from the file (weights still mapped, nothing dequantized).
        device: CUDA device ordinal.
        n_ctx: the context the VRAM estimate plans for.
        prefill_dtype: "float16" (cuBLAS on half tiles, the fast path) or "float32" (exact checks).
        prefill_weights: how prefill's GEMMs get the layer matrices (prefill_weights_mode): "resident"
            copies in prefill_dtype, dequantized once at load, for as many matrices as the memory left
            after the estimate holds; "auto" (the default) the same within RESIDENT_SHARE of it; "tiles"
            none: every prefill dequantizes tiles. None: $HEARTH_CUDA_PREFILL_WEIGHTS, else "auto".
        progress: progress(done_bytes, total_bytes) while weights upload.
        use_graphs: capture the decode step as a CUDA graph (False: launch kernel by kernel).
        n_layers: layers on the GPU (None: all, with the output projection). Fewer make a head
            decoder: `hidden` returns the residual stream after them instead of logits.
        decode_kernel: "graphs" (a captured CUDA graph of per-op kernels) or "fused" (one persistent
            kernel per step; FP8/NVFP4 models keep the graphs); None: $HEARTH_CUDA_DECODE, else "graphs".
        int_dot: the graph path's matvecs over weights of ops.INT_DOT_TYPES (every GGUF block type) take
            integer dot products against the activation quantized per 32 (ops.matvec); False: float dot
            products; None: False when $HEARTH_CUDA_MATVEC is "float", else True.

    Raises:
        UnsupportedCudaModelError: a weight type or layer kind without CUDA kernels.
        CudaOutOfMemoryError: the estimate exceeds the GPU's free memory.
        ValueError: an unknown decode_kernel or prefill_weights.
    """

    sample_max_k = ops.SAMPLE_MAX_K  # the widest top-k sample_step takes (engine.generate.device_steps)

    def __init__(
        self,
        model,
        device: int = 0,
        n_ctx: int = 4096,
        prefill_dtype: str = "float16",
        progress=None,
        use_graphs: bool = True,
        n_layers: int | None = None,
        decode_kernel: str | None = None,
        int_dot: bool | None = None,
        prefill_weights: str | None = None,
    ):
        kind = fused.decode_kind(decode_kernel)
        weights_mode = prefill_weights_mode(prefill_weights)
        if int_dot is None:
            int_dot = os.environ.get("HEARTH_CUDA_MATVEC", "").strip().lower() != "float"
        self.int_dot = bool(int_dot)
        model = cuda_view(model)
        if getattr(model, "mla", False):
            raise UnsupportedCudaModelError(
                "multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) has no CUDA kernels yet; "
                "use --device cpu"
            )
        if not isinstance(model, (LlamaModel, Gemma3Model, NemotronHBlocks)):
            raise UnsupportedCudaModelError(
                f"the CUDA backend runs llama, gemma3 and nemotron_h models, not {type(model).__name__}"
            )
        self.gemma = isinstance(model, Gemma3Model)
        cfg = self.cfg = model.cfg
        # LongRoPE's factors are chosen for the context planned here (llama.cpp's choice)
        self.rope_n_ctx = int(n_ctx)
        refusal = _moe_refusal(model) if getattr(cfg, "num_experts", 0) else None
        if refusal is not None:
            raise UnsupportedCudaModelError(f"{refusal}; use --device cpu")
        self.moe = moe_dims(model)  # (experts, k, expert ff, shared ff), or None: no experts
        self.ff = ffn_width(model)
        layers = [] if self.gemma else model.layers
        refusal = _recurrent_refusal(model)
        if refusal is not None:
            raise UnsupportedCudaModelError(f"{refusal}; use --device cpu")
        # the recurrent layers among those on the GPU: DeltaNet's (Qwen3.5, Qwen3-Next), Mamba-2's (Granite
        # 4.0-H), and their shapes (None: none there)
        deltas = [lay.delta for lay in layers[:n_layers] if lay.delta is not None]
        self.delta = cfg.delta if deltas else None
        mambas = [lay.mamba for lay in layers[:n_layers] if lay.mamba is not None]
        self.mamba = cfg.mamba if mambas else None
        self.n_rec = len(deltas) + len(mambas)
        # caches keep recurrent states (CudaRecurrentKVCache) where the model has such layers, also on a
        # partial offload's GPU side without one (HybridKVCache trims both sides to the same snapshots)
        self.rec_cache = not self.gemma and cfg.n_recurrent_layers > 0
        # LFM2's convolution layers among those on the GPU (each keeps its inputs in the cache)
        self.n_conv = sum(lay.conv is not None for lay in layers[:n_layers])
        # caches keep convolution inputs (CudaShortConvKVCache) where the model has such layers, also on
        # a partial offload's GPU side without one (HybridKVCache pairs them with the CPU side's)
        self.conv_cache = not self.gemma and cfg.n_conv_layers > 0
        n_gpu = len(model.layers) if n_layers is None else int(n_layers)
        # the layers keeping keys and values (Nemotron-H's MLP blocks keep none)
        self.n_attn = _attention_layers(model, n_gpu)
        self.gated = not self.gemma and bool(cfg.attn_output_gate)  # Qwen3.5's gated attention
        self.q_rows = 2 * cfg.q_dim if self.gated else cfg.q_dim
        if not self.gemma and cfg.parallel_block and any(lay.moe is not None for lay in layers):
            raise UnsupportedCudaModelError(
                "parallel blocks with mixture-of-experts layers have no CUDA kernels yet; use --device cpu"
            )
        post_normed = any(lay.post_attn_norm is not None or lay.post_ffn_norm is not None for lay in layers)
        if post_normed and cfg.residual_multiplier != 1.0:
            raise UnsupportedCudaModelError(
                "a residual multiplier with norms of the branch outputs has no CUDA kernels; use --device cpu"
            )
        if any(layer.moe is not None and (layer.ffn_norm is None or layer.post_ffn_norm is not None)
               for layer in layers):
            raise UnsupportedCudaModelError(
                "mixture-of-experts layers without an FFN norm or with an output norm have no CUDA kernels "
                "yet; use --device cpu"
            )
        if cfg.head_dim % 8 or cfg.head_dim > 512:  # attn_decode reads cache rows in 16-byte pieces
            raise UnsupportedCudaModelError(
                f"the CUDA kernels take head sizes that are multiples of 8 up to 512, not {cfg.head_dim}; "
                "use --device cpu"
            )
        n_all = len(model.layers)
        self.n_layers = n_all if n_layers is None else int(n_layers)
        if not 1 <= self.n_layers <= n_all:
            raise ValueError(f"n_layers must be 1..{n_all}, got {n_layers}")
        self.head_only = self.n_layers < n_all
        for w in _weights_of(model, self.n_layers):
            try:
                ops.check_type(w.ggml_type, w.cols)
            except ops.UnsupportedCudaWeightType as e:
                raise UnsupportedCudaModelError(f"{e}; use --device cpu") from None
        self.device = int(device)
        self.prefill_dtype = cp.float16 if prefill_dtype == "float16" else cp.float32
        self.use_graphs = use_graphs
        with cp.cuda.Device(self.device):
            _check_shared(model, self.n_layers, self.int_dot)
            free, _ = cp.cuda.runtime.memGetInfo()
            needed = estimate_vram(model, n_ctx, n_layers=self.n_layers)
            if needed > free:
                fit = layers_that_fit(model, n_ctx, free)
                raise CudaOutOfMemoryError(needed, free, self.device, fit, n_all)
            try:
                self._upload(model, progress)
            except cp.cuda.memory.OutOfMemoryError:
                cp.get_default_memory_pool().free_all_blocks()
                raise CudaOutOfMemoryError(needed, free, self.device) from None
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._keep_prefill_weights(weights_mode, reserve=needed - self.weight_bytes)
            self.fused = None
            # decode_path: what runs ("fused", or "graphs" with the reason the fused step was not used)
            self.decode_path = "graphs"
            if kind == "fused":
                reason = fused.unsupported_reason(self)
                if reason is None:
                    try:
                        self.fused = fused.FusedStep(self)
                        self.decode_path = "fused"
                    except fused.FusedStepError as e:  # e.g. its block does not fit on an SM
                        reason = str(e)
                if reason is not None:
                    self.decode_path = f"graphs (fused step: {reason})"
        # per cache: its one-sequence step (the graphs hold the cache's and the buffers' pointers, so
        # they live and die with the cache)
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # batched decode: the latest batches' steps, by their caches' ids (checked by weak references:
        # an id can come back for a new cache)
        self._batches: collections.OrderedDict = collections.OrderedDict()
        # prefills at position 0, captured per cache and padded prompt length (_prefill_replay); a cache's
        # first prefill runs launch by launch (and loads the kernels and sets cuBLAS up, outside a capture)
        # (not for MoE models: their prefill reads the routing on the host; nor recurrent ones (DeltaNet,
        # Mamba-2): theirs keeps snapshots of the states, which the host arranges)
        self.prefill_graphs = prefill_graphs_enabled() and self.moe is None and not self.n_rec
        self._prefill_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.prefill_graph_error: str | None = None  # why captured prefills were given up, if they were
        # a decode step's matvecs and attention as programmatic dependent launches (ops.dependent_launches)
        self.pdl = os.environ.get("HEARTH_CUDA_PDL", "").strip() == "1"
        self.pdl_error: str | None = None  # why they were given up, if they were
        # each matvec's outputs quantized once for the next one (ops.Emit) where both run matvec_qb
        # (_handoff_plan), unless HEARTH_CUDA_HANDOFF=0
        self.handoff = handoff_enabled()
        # prefill attention in one flash kernel (HEARTH_CUDA_FLASH=1), once it has matched the cuBLAS path
        self.flash, self.flash_error = False, None
        if ops.flash_enabled():
            heads = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            with cp.cuda.Device(self.device), self.stream:
                if ops.flash_applies(np.float16, cfg.head_dim):
                    self.flash_error = ops.flash_check(*heads)
                else:
                    self.flash_error = f"flash prefill takes head sizes {ops.FLASH_HEAD_DIMS} on sm_80+"
            self.flash = self.flash_error is None
        self._sample_parts = None  # _sample_rows' scratch (ops.sample_parts), made on first use
        self.host_draws = 0  # rows the GPU sampler left to the host (top-k off, a cut past its candidates)
        self.max_position_embeddings = cfg.max_position_embeddings

    # ---- loading -------------------------------------------------------------------------
    def _upload(self, model, progress) -> None:
        total = sum(w.nbytes for w in _weights_of(model, self.n_layers))
        done = [0]

        def tick(n):
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        uploaded: dict[int, ops.GpuWeight] = {}

        def up(w):
            if w is None:  # a MoE layer's dense FFN
                return None
            if id(w) not in uploaded:
                uploaded[id(w)] = ops.upload(w, tick)
            return uploaded[id(w)]

        def vec(a):
            return None if a is None else cp.asarray(np.ascontiguousarray(a, np.float32))

        self.token_embd = up(model.token_embd)
        self.output = None if self.head_only else up(model.output)
        # Granite divides its logits and Cohere multiplies them: folded into the final norm's weight (the
        # output matvec is linear in it)
        logit_mul = 1.0 if self.gemma else float(model.cfg.logit_scale) / float(model.cfg.logits_scaling)
        self.output_norm = None if self.head_only else vec(model.output_norm * np.float32(logit_mul))
        self.layers = []
        cfg = model.cfg
        for i, layer in enumerate(model.layers[: self.n_layers]):
            g = {
                "attn_norm": vec(layer.attn_norm),
                "ffn_norm": vec(layer.ffn_norm),
                "wq": up(layer.wq),
                "wk": up(layer.wk),
                "wv": up(layer.wv),
                "wo": up(layer.wo),
                "w_gate": up(layer.w_gate),
                "w_up": up(layer.w_up),
                "w_down": up(layer.w_down),
                # per-head q/k norms (Qwen3, Gemma: in the RoPE kernels), or over the whole projection
                # (OLMo 2: qk_rows, their own launches)
                **self._qk_norms(layer, vec),
                "bq": vec(getattr(layer, "bq", None)),
                "bk": vec(getattr(layer, "bk", None)),
                "bv": vec(getattr(layer, "bv", None)),
                "post_attn_norm": vec(getattr(layer, "post_attn_norm", None)),
                "post_ffn_norm": vec(getattr(layer, "post_ffn_norm", None)),
                "inv_freq": vec(self._layer_freqs(model, i)),
                # keys a query sees: the last `window` positions (0: all); Gemma's sliding layers, llama's
                # windowed ones (Mistral v0.1: all; gpt-oss, OLMo 3: some)
                "window": (cfg.sliding_window * layer.sliding) if self.gemma else (cfg.window(i) or 0),
                "scale": float(model.scale if self.gemma else model._scale_of(i)),
                "sinks": None if self.gemma else vec(layer.sinks),  # gpt-oss's sink logits (H,)
                "bo": None if self.gemma else vec(layer.bo),  # the output projection's bias (gpt-oss)
                "moe": self._upload_moe(layer.moe, up, tick, vec) if getattr(layer, "moe", None) else None,
                # the layer's index among the cache's layers of its kind (attention, or DeltaNet states)
                "slot": i if self.gemma else cfg.cache_slot(i),
                "delta": self._upload_delta(layer.delta, up, vec) if getattr(layer, "delta", None) else None,
                "conv": self._upload_conv(layer.conv, up, vec) if getattr(layer, "conv", None) else None,
                "mamba": self._upload_mamba(layer.mamba, up, vec) if getattr(layer, "mamba", None) else None,
                # Nemotron-H's blocks have one branch: no mixer (an MLP block) or no FFN (ffn None), and
                # their MLP is down(relu(up x)^2) ("relu2"; "glu": gate and up)
                "mixer": getattr(layer, "mixer", True),
                "ffn": getattr(layer, "ffn", "glu"),
            }
            # the q|k|v biases as one vector over the stacked projection (zeros where one is missing)
            biases = [getattr(layer, b, None) for b in ("bq", "bk", "bv")]
            sizes = (self.cfg.q_dim, self.cfg.kv_dim, self.cfg.kv_dim)
            if all(b is None for b in biases):
                g["bqkv"] = None
            else:
                parts = [np.zeros(m) if b is None else b for b, m in zip(biases, sizes)]
                g["bqkv"] = vec(np.concatenate(parts))
            self.layers.append(g)
        self.scale = float(model.scale)
        # Gemma 2's attention soft-capping (0: none)
        self.softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0) if self.gemma else 0.0
        self.embed_scale = float(model.embed_scale if self.gemma else cfg.embedding_multiplier)
        # Granite's residual multiplier: each branch's output scaled before it joins x
        self.residual = 1.0 if self.gemma else float(cfg.residual_multiplier)
        # Cohere: attention and the FFN side by side from one LayerNorm (no bias), the final norm one too
        self.parallel = not self.gemma and bool(cfg.parallel_block)
        self.n_rot = self.cfg.head_dim if self.gemma else self.cfg.rotary_dim
        # ops.rope_store's mscale (Phi-4-mini's attention factor on its rotated dims) and temperature
        # (Ministral 3's queries, sharpened with the distance from the start)
        self.rope_scales = ops.NO_ROPE_SCALES
        if not self.gemma:
            beta = float(cfg.attn_temperature_beta)
            temperature = (beta, int(cfg.attn_temperature_length)) if beta else ops.NO_ROPE_SCALES[1]
            self.rope_scales = (float(model.rope_mscale), temperature)
        for i, g in enumerate(self.layers):  # SmolLM3's and EXAONE 4's layers without RoPE: none rotated
            g["n_rot"] = self.n_rot if self.gemma or cfg.uses_rope(i) else 0
        self.neox = True if self.gemma else bool(self.cfg.rope_neox)
        biggest = max(w.cols for w in uploaded.values())
        self._tile = cp.empty(max(PREFILL_TILE_ELEMS, biggest * 8), self.prefill_dtype)
        self.weight_bytes = total
        # what one decode step reads: every layer matrix and the output projection in full, one
        # embedding row (the whole embedding only when it is the tied output matrix)
        layer_bytes = sum(g[k].nbytes for g in self.layers for k in LAYER_WEIGHTS if g[k] is not None)
        deltas = [g["delta"] for g in self.layers if g["delta"] is not None]
        layer_bytes += sum(w.nbytes for D in deltas for w in [*D["proj"], *D["ba"], D["out"]])
        mixers = [g[kind] for g in self.layers for kind in ("conv", "mamba") if g[kind] is not None]
        layer_bytes += sum(X[k].nbytes for X in mixers for k in ("in", "out"))  # LFM2's, Mamba-2's
        # a MoE layer reads its router, the k chosen experts and the shared expert
        for g in self.layers:
            m = g["moe"]
            if m is not None:
                chosen = self.cfg.num_experts_per_tok * m["experts"].nbytes // m["experts"].n_experts
                layer_bytes += m["router"].nbytes + chosen + sum(w.nbytes for w in m["shared"] or ())
        embd_row = 0 if self.token_embd is self.output else self.token_embd.nbytes // self.token_embd.rows
        output = 0 if self.output is None else self.output.nbytes
        self.decode_weight_bytes = layer_bytes + output + embd_row

    def _qk_norms(self, layer, vec) -> dict:
        """A layer's q_norm and k_norm (RMSNorms per head, or None), qk_rows: (q, k) RMSNorm weights over
        the whole q and k projections (OLMo 2), and qk_heads: (q, k) weights (heads x head_dim each) of
        LayerNorms per head (Command R+), each None where the layer has no such norms."""
        q, k = getattr(layer, "q_norm", None), getattr(layer, "k_norm", None)
        out = {"q_norm": None, "k_norm": None, "qk_rows": None, "qk_heads": None}
        if q is None or len(q) == self.cfg.head_dim:
            out.update(q_norm=vec(q), k_norm=vec(k))
        else:
            out["qk_heads" if getattr(self.cfg, "parallel_block", False) else "qk_rows"] = (vec(q), vec(k))
        return out

    def _layer_freqs(self, model, i: int) -> np.ndarray:
        """Layer i's RoPE frequencies: Gemma's per layer; llama's for the planned context, or plain RoPE's
        on OLMo 3's windowed layers (LlamaModel._plain)."""
        if self.gemma:
            return model.layers[i].inv_freq
        return model._plain_rope[0] if model._plain(i) else model.rope_freqs(self.rope_n_ctx)

    def _upload_delta(self, net, up, vec) -> dict:
        """A DeltaNet layer on the GPU: the q|k|v and z projections, b and a (Qwen3-Next's fused in_proj_qkvz
        and in_proj_ba with their rows regrouped so: deltanet.split_qkvz / split_ba on the rows), the
        convolution's weights (channels, taps), dt_bias, -exp(A_log), the gated norm's weight and out_proj."""
        shape = self.cfg.delta

        def split(w, splitter) -> list[ops.GpuWeight]:  # a fused weight's rows, regrouped
            parts = splitter(np.ascontiguousarray(w.raw), shape, 0)
            return [ops.GpuWeight(w.ggml_type, cp.asarray(p), p.shape[0], w.cols) for p in parts]

        proj = split(net.in_qkvz, split_qkvz) if net.in_qkvz is not None else [up(net.in_qkv), up(net.in_z)]
        ba = split(net.in_ba, split_ba) if net.in_ba is not None else [up(net.in_b), up(net.in_a)]
        return {
            "proj": proj,
            "ba": ba,
            "conv": vec(net.conv),
            "dt_bias": vec(net.dt_bias),
            "neg_a": vec(net.neg_a),
            "norm": vec(net.norm),
            "out": up(net.out_proj),
        }

    @staticmethod
    def _upload_mamba(net, up, vec) -> dict:
        """A Mamba-2 layer on the GPU: in_proj (z | x|B|C | dt rows), the convolution's weights (channels,
        taps) and bias, dt_bias, -exp(A_log), the skip D, the grouped norm's weight and out_proj."""
        return {
            "in": up(net.in_proj),
            "conv": vec(net.conv),
            "conv_bias": vec(net.conv_bias),
            "dt_bias": vec(net.dt_bias),
            "neg_a": vec(net.neg_a),
            "d": vec(net.d),
            "norm": vec(net.norm),
            "out": up(net.out_proj),
        }

    @staticmethod
    def _upload_conv(conv, up, vec) -> dict:
        """LFM2's convolution layer on the GPU: in_proj ([B | C | x] rows), kernel (d, taps), out_proj."""
        return {"in": up(conv.in_proj), "kernel": vec(conv.kernel), "out": up(conv.out_proj)}

    def _upload_moe(self, moe, up, tick, vec) -> dict:
        """A MoE block on the GPU: its router (GpuWeight), its experts merged per kind (ops.GpuExperts: each
        kind's experts one after another in one allocation, as a GGUF's merged tensors are), the shared
        expert's three matrices and its gate as a one-row float32 weight (None: none or ungated), and the
        choice bias; gpt-oss's router bias (experts,), its experts' [gate | up] biases (experts, 2 ff) and
        down biases (experts, hidden), None where the model has none."""
        n = len(moe.gate)

        def merged(ws) -> ops.GpuWeight:
            w0 = ws[0]
            raw = cp.empty((n * w0.rows, w0.raw.shape[1]), cp.uint8)
            for e, w in enumerate(ws):
                raw[e * w0.rows : (e + 1) * w0.rows].set(np.ascontiguousarray(w.raw))
                tick(w.nbytes)
            return ops.GpuWeight(w0.ggml_type, raw, n * w0.rows, w0.cols)

        gate, up_w = merged(moe.gate), merged(moe.up)
        experts = ops.GpuExperts(gate, up_w, merged(moe.down), n, moe.gate[0].rows)
        shared_gate = None
        if moe.shared_gate is not None:
            g = cp.asarray(np.ascontiguousarray(moe.shared_gate, np.float32).reshape(1, -1))
            shared_gate = ops.GpuWeight(ops.F32, g.view(cp.uint8), 1, g.shape[1])
        return {
            "router": up(moe.router),
            "experts": experts,
            "shared": None if moe.shared is None else [up(w) for w in moe.shared],
            "shared_gate": shared_gate,
            "score_bias": None if moe.score_bias is None else vec(moe.score_bias),
            "router_bias": vec(moe.router_bias),
            "gu_bias": None if moe.gate_bias is None else vec(np.hstack([moe.gate_bias, moe.up_bias])),
            "down_bias": vec(moe.down_bias),
        }

    @property
    def placement(self) -> str:
        """Where the model runs, for status lines: "cuda:N"."""
        return f"cuda:{self.device}"

    # ---- the Decoder interface --------------------------------------------------------------
    def new_cache(self, n_ctx: int, dtype=np.float16) -> CudaKVCache:
        cfg = self.cfg
        # zeroed on the decoder's stream (a non-blocking stream does not wait for the default one)
        with self._on_gpu(f"allocating a KV cache of {n_ctx} positions"):
            kv_heads, hd = cfg.num_key_value_heads, cfg.head_dim
            if self.conv_cache:
                return CudaShortConvKVCache(self.n_attn, kv_heads, hd, n_ctx, dtype, self.stream, self.n_conv,
                                            cfg.hidden_size)
            if not self.rec_cache:
                return CudaKVCache(self.n_attn, kv_heads, hd, n_ctx, dtype, self.stream)
            return CudaRecurrentKVCache(self.n_attn, kv_heads, hd, n_ctx, dtype, self.stream, self.n_rec,
                                        *cfg.recurrent_shapes)

    def cache_bytes(self, n_ctx: int, dtype=np.float16) -> int:
        """GPU bytes one more sequence of n_ctx positions takes: its KV cache (this decoder's layers), and
        its rows of a decode step of its own and of a batch's (_Step: activations, logits, the hand-off's
        records, attention partials, its entry in the batch's tables)."""
        cfg = self.cfg
        kv = 2 * self.n_attn * cfg.num_key_value_heads * n_ctx * cfg.head_dim * np.dtype(dtype).itemsize
        if self.n_rec:  # the recurrent states and their snapshots
            floats = (self.delta or self.mamba).state_floats
            kv += 4 * (1 + RecurrentKVCache.MAX_SNAPSHOTS) * self.n_rec * floats
        kv += self.n_conv * n_ctx * cfg.hidden_size * np.dtype(dtype).itemsize  # LFM2's convolution inputs
        splits = ops.attention_splits(n_ctx)[1]
        partials = 4 * cfg.num_attention_heads * splits * (cfg.head_dim + 2)
        rows = _Step.row_bytes(cfg, self.head_only, *self._step_shape)
        return int(kv + 2 * (partials + rows) + 24 * self.n_layers)

    def caches_that_fit(self, n_ctx: int, dtype=np.float16) -> int:
        """How many more sequences of n_ctx positions (cache_bytes each) the GPU's memory holds now: its
        free memory and the blocks CuPy's pool keeps for reuse, less MARGIN_BYTES (hearth serve's
        concurrent requests each take one)."""
        with cp.cuda.Device(self.device):
            free, _ = cp.cuda.runtime.memGetInfo()
            pooled = cp.get_default_memory_pool().free_bytes()
        return max(0, int(free + pooled - MARGIN_BYTES) // self.cache_bytes(n_ctx, dtype))

    def forward(self, tokens, cache: CudaKVCache, all_logits: bool = False) -> np.ndarray:
        """As Decoder.forward: float32 numpy logits (n, vocab) when all_logits, else (1, vocab)."""
        if self.head_only:
            raise ValueError("this decoder holds only the first layers: use hidden()")
        return self._run(tokens, cache, all_logits)

    def hidden(self, tokens, cache: CudaKVCache) -> np.ndarray:
        """Head decoder: run tokens through the GPU layers; the residual stream after them, (n, hidden)."""
        if not self.head_only:
            raise ValueError("this decoder holds every layer: use forward()")
        return self._run(tokens, cache, True)

    def _run(self, tokens, cache: CudaKVCache, all_logits: bool) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        cache.check_room(len(tokens))
        what = "decoding" if len(tokens) == 1 else f"prefilling {len(tokens)} tokens"
        # a recurrent cache keeps the states of a pass's start and end - 1 (RecurrentKVCache.start_pass)
        with self._on_gpu(what), cache.forward_pass(tokens):
            if len(tokens) == 1 and (self.head_only or not all_logits):
                out = self._decode(int(tokens[0]), cache, greedy=False)
                out = cp.asnumpy(out, stream=self.stream).reshape(1, -1)
            else:
                out = cp.asnumpy(self._prefill(tokens, cache, all_logits), stream=self.stream)
            self.stream.synchronize()
        return out

    def forward_batch(self, tokens, caches: list[CudaKVCache]) -> np.ndarray:
        """As Decoder.forward_batch: one decode step for B sequences, float32 logits (B, vocab).

        The B sequences share one step, captured per batch of caches: with `batchable` weights its
        matrix-vector kernels read each weight once for up to ops.MAX_BATCH of them (attention stays
        per sequence); other weights get a matvec per sequence inside the step.
        """
        self._need_output()
        return self._run_batch(tokens, caches)

    def hidden_batch(self, tokens, caches: list[CudaKVCache]) -> np.ndarray:
        """Head decoder: forward_batch's residual streams after the GPU layers, (B, hidden)."""
        if not self.head_only:
            raise ValueError("this decoder holds every layer: use forward_batch()")
        return self._run_batch(tokens, caches)

    def _run_batch(self, tokens, caches) -> np.ndarray:
        tokens = check_batch(tokens, caches)
        # a step that fails part way rewinds the caches (recurrent states it moved on: their snapshots)
        with self._on_gpu(f"decoding a batch of {len(caches)}"), rewound_on_failure(caches):
            out = cp.asnumpy(self._decode_rows(tokens, caches), stream=self.stream)
            self.stream.synchronize()
        for t, cache in zip(tokens, caches):
            cache.advance([int(t)])
        return out

    def _decode_rows(self, tokens, caches):
        """One step of B >= 1 sequences: logits (B, vocab), or a head decoder's residual streams."""
        if len(caches) > 1:
            return self._decode_batch(tokens, caches)
        return self._decode(int(tokens[0]), caches[0], greedy=False)

    def pick_batch(
        self, tokens, caches: list[CudaKVCache], picks: list, vocab: int | None = None
    ) -> tuple[list[int | None], dict[int, np.ndarray]]:
        """forward_batch's step with each row's next token picked on the GPU, so only the tokens come
        back (the server's decode step).

        Args:
            picks: per row, (temp, top_k, top_p, min_p, u, banned) -- temp 0 is argmax; top_k 0 is off;
                u the row's uniform draw; banned: token ids never picked (end-of-turn tokens when a
                request ignores them) -- or None: that row's logits come back instead (a grammar or
                logprobs needs them).
            vocab: only the first vocab logits count (as greedy_step's).

        Returns:
            (tokens: the pick per row, None for the rows without one; {row: its float32 logits} for
            those rows).
        """
        self._need_output()
        tokens = check_batch(tokens, caches)
        if len(picks) != len(caches):
            raise ValueError(f"{len(picks)} picks for {len(caches)} sequences")
        with self._on_gpu(f"decoding a batch of {len(caches)}"), rewound_on_failure(caches):
            full = self._decode_rows(tokens, caches)  # (B, embedding rows) contiguous
            n = full.shape[1] if vocab is None else min(vocab, full.shape[1])
            logits = full[:, :n]
            chosen = [b for b, p in enumerate(picks) if p is not None]
            banned = [b * full.shape[1] + t for b in chosen for t in picks[b][5] if 0 <= t < n]
            if banned:  # every row's at once, through the flat view
                full.ravel()[cp.asarray(np.asarray(banned, np.int64))] = -np.inf
            got = self._sample_rows(full, chosen, [picks[b][:5] for b in chosen], n)
            rest = [b for b, p in enumerate(picks) if p is None]
            host = cp.asnumpy(logits[rest], stream=self.stream) if rest else None
        for t, cache in zip(tokens, caches):
            cache.advance([int(t)])
        out: list[int | None] = [None] * len(picks)
        for b, t in zip(chosen, got):
            out[b] = t
        return out, {b: host[i] for i, b in enumerate(rest)}

    def greedy_step(
        self, token: int, cache: CudaKVCache, vocab: int | None = None, penalty: tuple | None = None
    ) -> int:
        """Decode one token and return the argmax of its logits; only the token crosses to the host.
        vocab: only the first vocab logits count (a tokenizer with fewer tokens than embedding rows).
        penalty: (repetition penalty, the recent token ids it applies to) -- ops.penalize first."""
        self._need_output()
        cache.check_room(1)
        whole = (vocab is None or vocab >= self.cfg.vocab_size) and penalty is None
        with self._on_gpu("decoding"), cache.forward_pass([token]):  # (advanced at its end)
            step = self._decode(int(token), cache, greedy=whole)
            if not whole:  # the step's own argmax scratch (its counter is left zeroed for the graph)
                st = self._steps[cache]
                ids = st.ids
                self._penalize(step[0], penalty)
                ops.argmax(ids, step[0] if vocab is None else step[0, :vocab], st.argmax_parts)
                nxt = int(cp.asnumpy(ids, stream=self.stream)[0])
            elif self.fused is not None:
                nxt = int(self.fused.check(step)[0])
            else:
                nxt = int(cp.asnumpy(step.ids, stream=self.stream)[0])
        return nxt

    def sample_step(
        self,
        token: int,
        cache: CudaKVCache,
        temp: float,
        top_k: int,
        top_p: float,
        u: float,
        min_p: float = 0.0,
        vocab: int | None = None,
        penalty: tuple | None = None,
    ) -> int:
        """Decode one token and draw the next on the GPU (ops.sample_topk: temperature, top-k (0: off),
        top-p, min-p, the uniform u); only the token crosses to the host, unless with top-k off the pick
        needs more than the GPU's candidates: then the logits row does, and engine.sampling.draw picks
        with the same u. vocab, penalty: as greedy_step's."""
        self._need_output()
        cache.check_room(1)
        with self._on_gpu("decoding"), cache.forward_pass([token]):  # (advanced at its end)
            logits = self._decode(int(token), cache, greedy=False)
            self._penalize(logits[0], penalty)
            n = logits.shape[1] if vocab is None else min(vocab, logits.shape[1])
            nxt = self._sample_rows(logits, [0], [(temp, top_k, top_p, min_p, u)], n)[0]
        return nxt

    def _penalize(self, row, penalty: tuple | None) -> None:
        """The repetition penalty (factor, token ids) on a logits row on the GPU, in place."""
        if penalty is not None and penalty[0] != 1.0:
            ids = np.unique(np.asarray(penalty[1], np.int64))
            ids = ids[(ids >= 0) & (ids < row.size)].astype(np.int32)
            ops.penalize(row, cp.asarray(ids), float(penalty[0]))

    def _sample_rows(self, logits, rows: list[int], picks: list[tuple], n: int) -> list[int]:
        """A token from the first n logits of each of the rows of logits (device, float32, C-contiguous)
        with its (temp, top_k, top_p, min_p, u): one launch for them all (ops.sample_rows; temp 0 is
        argmax), one copy of the picks to the host, and the rows the GPU's candidates could not settle
        (top-k off) drawn on the host by engine.sampling.draw."""
        if not rows:
            return []
        if self._sample_parts is None or self._sample_parts[3].size < len(rows):
            self._sample_parts = ops.sample_parts(max(len(rows), ops.MAX_BATCH))
        ids = cp.empty(len(rows), cp.int32)
        ops.sample_rows(ids, logits, rows, picks, self._sample_parts, n)
        got = [int(t) for t in cp.asnumpy(ids, stream=self.stream)]
        for i, t in enumerate(got):
            if t < 0:
                self.host_draws += 1
                temp, top_k, top_p, min_p, u = picks[i]
                row = cp.asnumpy(logits[rows[i], :n], stream=self.stream)
                got[i] = draw(row, temp, top_k, top_p, min_p, u)
        return got

    @contextlib.contextmanager
    def _on_gpu(self, what: str):
        """The decoder's device and stream; CuPy's out-of-memory error (CuPy has already given its pool's
        cached blocks back and retried) as a CudaMemoryExhaustedError saying what ran out. The kept
        captures (prefill graphs, batched steps) are dropped, so that their memory is there for a
        retry; the caches were not advanced."""
        try:
            with cp.cuda.Device(self.device), self.stream:
                yield
        except cp.cuda.memory.OutOfMemoryError:
            self._prefill_graphs = weakref.WeakKeyDictionary()
            self._batches.clear()
            with cp.cuda.Device(self.device):
                cp.get_default_memory_pool().free_all_blocks()
            raise CudaMemoryExhaustedError(what, self.device) from None

    def _need_output(self) -> None:
        if self.head_only:
            raise ValueError("this decoder holds only the first layers: the CPU computes the logits")

    # ---- decode -----------------------------------------------------------------------------
    def _decode(self, token: int, cache: CudaKVCache, greedy: bool):
        """One step of one sequence: its logits (1, vocab), the residual stream (1, hidden) of a head
        decoder, or with greedy the step (its ids hold the argmax)."""
        step = self._steps.get(cache)
        if step is None:
            step = self._steps[cache] = self._new_step([cache])
        result = step if greedy else step.x if self.head_only else step.logits
        if self.fused is not None:  # token and position travel as launch arguments
            self.fused.launch(step, cache, token, greedy)
            if not greedy:
                self.fused.check(step)
            return result
        self._replay(step, [cache], [token], greedy)
        return result

    def _decode_batch(self, tokens: list[int], caches: list) -> cp.ndarray:
        """One step of B sequences: logits (B, vocab), or the residual streams (B, hidden) of a head
        decoder."""
        step = self._batch_step(caches)
        self._replay(step, caches, tokens, greedy=False)
        return step.x if self.head_only else step.logits

    def _batch_step(self, caches: list) -> _Step:
        for key in [k for k, st in self._batches.items() if not st.alive()]:  # their caches are gone
            del self._batches[key]
        key = tuple(map(id, caches))
        step = self._batches.get(key)
        if step is None or not step.holds(caches):
            step = self._batches[key] = self._new_step(caches)
        self._batches.move_to_end(key)
        while len(self._batches) > BATCH_GRAPHS:
            self._batches.popitem(last=False)
        return step

    @property
    def _step_shape(self) -> tuple:
        """_Step's ff, moe, delta, q_rows, conv and mamba for this model."""
        return self.ff, self.moe, self.delta, self.q_rows, self.n_conv > 0, self.mamba

    def _new_step(self, caches: list) -> _Step:
        return _Step(self.cfg, caches, self.head_only, *self._step_shape)

    def _replay(self, step: _Step, caches: list, tokens: list[int], greedy: bool) -> None:
        """Token ids and positions to device memory, then the step: its graph (captured on first use,
        after a warm-up run that loads every kernel), or kernel by kernel without graphs."""
        ids = np.asarray(tokens, np.int32)
        pos = np.array([c.offset for c in caches], np.int32)
        # on the decoder's stream, after the previous step (CuPy 13 copies on the legacy stream otherwise)
        step.ids.set(ids, stream=self.stream)
        step.pos.set(pos, stream=self.stream)
        if not self.use_graphs:
            self._step_kernels(step, caches, greedy)
            return
        graph = step.graphs.get(greedy)
        if graph is None and self.pdl:
            try:
                graph = self._capture_step(step, caches, ids, pos, greedy)
            except Exception as e:  # noqa: BLE001 - a driver without programmatic launches: plain ones
                self.pdl, self.pdl_error = False, f"{type(e).__name__}: {e}"
                step.ids.set(ids, stream=self.stream)
                step.pos.set(pos, stream=self.stream)
        if graph is None:
            graph = self._capture_step(step, caches, ids, pos, greedy)
        graph.launch(self.stream)

    def _capture_step(self, step: _Step, caches: list, ids, pos, greedy: bool):
        """A warm-up run of the step (it loads every kernel), then its capture (kept in step.graphs). The
        warm-up advances recurrent states (DeltaNet layers), unlike keys and values written again at the
        same place: they are put back before the capture, so the graph's launch takes the step once."""
        kept = [(c.recurrent.copy(), c.conv_state.copy()) if isinstance(c, RecurrentKVCache) else None
                for c in caches]
        self._step_kernels(step, caches, greedy)
        for c, states in zip(caches, kept):
            if states is not None:
                c.recurrent[...], c.conv_state[...] = states
        step.ids.set(ids, stream=self.stream)
        step.pos.set(pos, stream=self.stream)
        self.stream.begin_capture()
        try:
            self._step_kernels(step, caches, greedy)
        finally:
            graph = self.stream.end_capture()
        step.graphs[greedy] = graph
        return graph

    def _step_kernels(self, s: _Step, caches: list, greedy: bool) -> None:
        """The decode step's launches over the B = len(caches) rows of s (its matvecs and attention as
        programmatic dependent launches with self.pdl)."""
        with ops.dependent_launches(self.pdl):
            self._step_launches(s, caches, greedy)

    def _step_launches(self, s: _Step, caches: list, greedy: bool) -> None:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        mv = functools.partial(_matvecs, int_dot=self.int_dot, eps=eps)  # eps: the RMSNorm prologues
        ops.dequant(s.x, self.token_embd, ids=s.ids, scale=self.embed_scale)
        # with the hand-off, a matvec whose input another kernel wrote reads that one's records (ops.Emit):
        # attention's output for wo, gate|up's GLU for the down projection, and the residual stream for
        # the next norm's matvec from whatever adds into it last (llama: wo and down; Gemma: its post-norms).
        # Each pair decides for itself (_handoff_plan): where both ends run matvec_qb
        plan, head_handed = self._handoff_plan()
        glu = ops.EMIT_GELU if self.gemma else ops.EMIT_SILU

        def x_emit(norm, handed: bool):  # the residual stream's records for the matvec of the next norm
            return ops.Emit(ops.EMIT_NORM, norm, s.x_rec, s.counts) if handed else None

        def normed(norm, handed: bool):  # a matvec's RMSNorm'd input: records handed to it, or x (normed)
            if handed:
                return dict(x=s.x_rec, prologue=5)
            return dict(x=s.x) if norm is None else dict(x=s.x, norm=norm, prologue=1)

        def branch(w, inp: dict, post, bias, norm, handed: bool):
            """x += the branch's output W act(inp) (+ bias; RMSNorm'd by `post` where given: Gemma's and
            GLM-4's output norms; times Granite's residual multiplier), and x's records for `norm`."""
            if post is None and self.residual == 1.0:  # the residual add in the matvec
                mv(s.x, [w], **inp, accumulate=True, emit=x_emit(norm, handed))
                if bias is not None:  # (the plan hands the next matvec no records then)
                    ops.add_inplace(s.x, bias)
                return
            mv(s.o, [w], **inp)
            if bias is not None:
                ops.add_inplace(s.o, bias)
            if post is None:  # (the plan hands no records past a scaled branch)
                ops.add_inplace(s.x, s.o, self.residual)
            else:
                ops.rmsnorm(s.x, s.o, post, eps, accumulate=True, emit=x_emit(norm, handed))

        def layernorm(norm) -> dict:  # Cohere: s.h = LayerNorm(x) * norm, the matvecs' input
            ops.rmsnorm(s.h, s.x, norm, eps, center=True)
            return dict(x=s.h)

        glu_emit = functools.partial(ops.Emit, glu, None, s.act_rec, s.counts)
        # the first matvec reading x in each layer (its mixer's, or its FFN's in a layer without a mixer:
        # Nemotron-H's MLP blocks) and in the LM head: its norm, and whether it reads x's records
        firsts = [(L["attn_norm"], plan[i]["qkv"]) if L["mixer"] else (L["ffn_norm"], plan[i]["gu"])
                  for i, L in enumerate(self.layers)] + [(self.output_norm, head_handed)]
        for i, L in enumerate(self.layers):
            p, D, C, M, j = plan[i], L["delta"], L["conv"], L["mamba"], L["slot"]
            ffn = L["moe"] is not None or L["ffn"] is not None
            after_mixer = (L["ffn_norm"], p["gu"]) if ffn else firsts[i + 1]  # who reads x next
            if L["mixer"]:
                qkv_in = layernorm(L["attn_norm"]) if self.parallel else normed(L["attn_norm"], p["qkv"])
                if D is not None:  # DeltaNet: each sequence through its own states (CudaRecurrentKVCache.mix)
                    mv(s.dproj, D["proj"], **qkv_in)
                    mv(s.dba, D["ba"], **qkv_in)
                    for b, c in enumerate(caches):
                        rows = [s.dproj[b : b + 1], s.dba[b : b + 1]]
                        bufs = dict(out=s.dout[b : b + 1], conv=s.dconv[b : b + 1])
                        c.mix(j, functools.partial(self._delta_mix, D, **bufs), rows)
                    branch(D["out"], dict(x=s.dout), L["post_attn_norm"], None, *after_mixer)
                elif C is not None:  # LFM2: each sequence's convolution over its own cache's inputs
                    mv(s.bcx, [C["in"]], **qkv_in)
                    for b, c in enumerate(caches):
                        rows = slice(b, b + 1)
                        ops.short_conv(s.cout[rows], s.bcx[rows], c.conv[j, 0], C["kernel"], s.pos[rows])
                    branch(C["out"], dict(x=s.cout), L["post_attn_norm"], None, *after_mixer)
                elif M is not None:  # Mamba-2: each sequence through its own states (as DeltaNet)
                    mv(s.mproj, [M["in"]], **qkv_in)
                    for b, c in enumerate(caches):
                        bufs = dict(out=s.mout[b : b + 1], conv=s.mconv[b : b + 1])
                        c.mix(j, functools.partial(self._mamba_mix, M, **bufs), [s.mproj[b : b + 1]])
                    branch(M["out"], dict(x=s.mout), L["post_attn_norm"], None, *after_mixer)
                else:
                    mv(s.qkv, [L["wq"], L["wk"], L["wv"]], **qkv_in)
                if self.parallel:  # the FFN's gate|up from the same input, before attention's output joins x
                    mv(s.gu, [L["w_gate"], L["w_up"]], **qkv_in, emit=glu_emit() if p["down"] else None)
                if D is None and C is None and M is None:
                    self._attention_step(s, L, caches, p, branch, after_mixer)
            if L["moe"] is not None:  # the experts instead of the FFN (llama family), their sum added into x
                self._moe_step(s, L, mv)
                continue
            if L["ffn"] == "relu2":  # Nemotron-H: down(relu(up x)^2), up's outputs in s.gu's first columns
                up_emit = ops.Emit(ops.EMIT_RELU2, None, s.act_rec, s.counts) if p["down"] else None
                mv(s.gu, [L["w_up"]], **normed(L["ffn_norm"], p["gu"]), emit=up_emit)
                down_in = dict(x=s.act_rec, prologue=4) if p["down"] else dict(x=s.gu, prologue=6)
            elif L["ffn"] is not None:
                if not self.parallel:
                    gu_emit = glu_emit() if p["down"] else None
                    mv(s.gu, [L["w_gate"], L["w_up"]], **normed(L["ffn_norm"], p["gu"]), emit=gu_emit)
                act = 3 if self.gemma else 2
                glu_in = dict(x=s.gu, cols_x2=True, prologue=act)
                down_in = dict(x=s.act_rec, prologue=4) if p["down"] else glu_in
            else:  # (Nemotron-H's mixer blocks have no FFN)
                continue
            branch(L["w_down"], down_in, L["post_ffn_norm"], None, *firsts[i + 1])
        if self.head_only:
            return
        head_in = layernorm(self.output_norm) if self.parallel else normed(self.output_norm, head_handed)
        mv(s.logits, [self.output], **head_in)
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap is not None:
            ops.softcap(s.logits, cap)
        if greedy:
            ops.argmax(s.ids, s.logits, s.argmax_parts)

    def _attention_step(self, s: _Step, L: dict, caches: list, p: dict, branch, to: tuple) -> None:
        """An attention layer's branch in the decode step over the B rows of s, from its q|k|v rows: biases,
        q/k norms, RoPE, the cache writes and attention (the batch's in one launch where the caches allow),
        then wo's output added into x (branch: _step_launches'; to: the norm and hand-off flag of the matvec
        reading x next)."""
        cfg, j = self.cfg, L["slot"]
        if L["bqkv"] is not None:
            ops.add_inplace(s.qkv, L["bqkv"])  # one bias over the B rows
        self._qk_rows(s.qkv, L)
        rope = (L["inv_freq"], L["n_rot"], self.neox, cfg.rms_norm_eps, L["q_norm"], L["k_norm"])
        rope += self.rope_scales
        attn_rec = s.attn_rec if p["wo"] else None  # attention's output as records for wo
        extra = dict(softcap=self.softcap, sinks=L["sinks"], gated=self.gated)
        H = cfg.num_attention_heads
        if s.kv_tables is not None:  # RoPE, cache writes, attention: the batch's in one launch
            kv, keys = [(c.k[j], c.v[j]) for c in caches], (s.n_keys, L["window"], s.batch_parts)
            where = (s.kv_tables[j], s.pos, rope, L["scale"])
            ops.attention_batch(s.attn, s.qkv, H, kv, *where, *keys, attn_rec, **extra)
        for b, c in enumerate(caches if s.kv_tables is None else []):  # each sequence its own
            kv, pos, keys = (c.k[j], c.v[j]), s.pos[b : b + 1], (c.n_ctx, L["window"], s.parts[b])
            rec = None if attn_rec is None else attn_rec[b]
            ops.attention(s.attn[b], s.qkv[b], H, *kv, pos, rope, L["scale"], *keys, records=rec, **extra)
        wo_in = dict(x=s.attn) if attn_rec is None else dict(x=attn_rec, prologue=4)
        branch(L["wo"], wo_in, L["post_attn_norm"], L["bo"], *to)

    def _delta_mix(self, D: dict, rows, conv_state, state, out=None, conv=None):
        """A DeltaNet layer over one sequence's rows [q|k|v|z projections (n, C + value_dim),
        b|a (n, 2 v_heads)] from and into its conv_state and state (CudaRecurrentKVCache.mix's run): the
        convolution, then the gated delta rule and its gated norm into out (n, value_dim) (and conv, the
        convolution's rows: a decode step's buffers; None: new arrays)."""
        shape, eps = self.delta, self.cfg.rms_norm_eps
        proj, ba = rows
        n, C = proj.shape[0], shape.conv_dim
        conv = cp.empty((n, C), cp.float32) if conv is None else conv
        out = cp.empty((n, shape.value_dim), cp.float32) if out is None else out
        ops.delta_conv(conv, proj, conv_state, D["conv"])
        weights = (D["dt_bias"], D["neg_a"], D["norm"])
        ops.delta_rule(out, conv, proj, C, ba, state, *weights, shape, eps)
        return out

    def _mamba_mix(self, M: dict, rows, conv_state, state, out=None, conv=None):
        """A Mamba-2 layer over one sequence's in_proj rows [z | x|B|C | dt (n, in_rows)] from and into its
        conv_state and state (CudaRecurrentKVCache.mix's run): the convolution with its bias, the selective
        scan gated by SiLU(z), then the RMSNorm of each group, into out (n, d_inner) (and conv, the
        convolution's rows: a decode step's buffers; None: new arrays)."""
        shape, eps = self.mamba, self.cfg.rms_norm_eps
        (proj,) = rows
        n, di = proj.shape[0], shape.d_inner
        conv = cp.empty((n, shape.conv_dim), cp.float32) if conv is None else conv
        out = cp.empty((n, di), cp.float32) if out is None else out
        ops.delta_conv(conv, proj[:, di:], conv_state, M["conv"], M["conv_bias"])
        weights = (M["dt_bias"], M["neg_a"], M["d"])
        ops.ssm_scan(out, conv, proj, di + shape.conv_dim, state, *weights, shape)
        ops.rmsnorm(out, out, M["norm"], eps, heads=shape.groups)
        return out

    def _qk_rows(self, qkv, L: dict) -> None:
        """OLMo 2's q and k RMSNorms over the whole projections, or Command R+'s LayerNorms of each head, in
        place on the q|k|v rows (n, q + 2 kv)."""
        norms = L["qk_rows"] or L["qk_heads"]
        if norms is None:
            return
        cfg = self.cfg
        q, kv, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps
        per_head = L["qk_heads"] is not None
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads) if per_head else (1, 1)
        for part, w, h in zip((qkv[:, :q], qkv[:, q : q + kv]), norms, heads):
            ops.rmsnorm(part, part, w, eps, center=per_head, heads=h)

    def _moe_step(self, s: _Step, L: dict, mv) -> None:
        """A MoE layer's FFN in the decode step over the B rows of s, added into s.x: the router's logits,
        the routing (moe_route: ids and weights stay on the GPU, so the captured step picks its experts as it
        runs), the chosen experts' gate|up and down (one matvec_qb_experts launch each for the B x k slots),
        the shared expert, and their weighted sum (moe_combine)."""
        cfg, m = self.cfg, L["moe"]
        B, d = s.x.shape
        k = self.moe[1]
        normed = dict(x=s.x, norm=L["ffn_norm"], prologue=1)
        mv(s.router, [m["router"]], **normed)
        if m["router_bias"] is not None:
            ops.add_inplace(s.router, m["router_bias"])
        self._route(s.expert_ids, s.expert_w, s.router, m)
        ids, eps = s.expert_ids.reshape(-1), cfg.rms_norm_eps
        experts = m["experts"]
        ops.matvec_experts(s.expert_gu, experts, "gate_up", s.x, ids, k, L["ffn_norm"], eps, prologue=1)
        y = s.expert_y.reshape(B * k, d)
        if self._plain_experts(m):  # silu(gate) * up in the down matvecs' prologue
            ops.matvec_experts(y, experts, "down", s.expert_gu, ids, 1, prologue=2)
        else:  # biases first, or gpt-oss's activation: the activation into rows of its own
            ops.glu(s.expert_act, s.expert_gu, ids=ids, **self._expert_glu(m))
            ops.matvec_experts(y, experts, "down", s.expert_act, ids, 1, prologue=0)
        ys = sg = None
        if m["shared"] is not None:
            gate, up, down = m["shared"]
            mv(s.shared_gu, [gate, up], **normed)
            mv(s.shared_y, [down], x=s.shared_gu, cols_x2=True, prologue=2)
            ys = s.shared_y
            if m["shared_gate"] is not None:
                mv(s.shared_gate, [m["shared_gate"]], **normed)
                sg = s.shared_gate
        ops.moe_combine(s.x, s.expert_y, s.expert_w, ys, sg, *self._down_bias(m, s.expert_ids),
                        scale=self.residual)

    def _plain_experts(self, m: dict) -> bool:
        """Whether a MoE block's experts are plain SwiGLU ones (no gate/up biases)."""
        return m["gu_bias"] is None and self.cfg.expert_act == "silu"

    def _expert_glu(self, m: dict) -> dict:
        """ops.glu's mode, bias (rows by expert) and oai arguments for the experts of MoE block m."""
        cfg = self.cfg
        if cfg.expert_act == "swiglu_oai":
            return dict(mode=ops.GLU_OAI, bias=m["gu_bias"], oai=(cfg.swiglu_alpha, cfg.swiglu_limit))
        return dict(mode=ops.GLU_SILU, bias=m["gu_bias"])

    def _down_bias(self, m: dict, ids) -> tuple:
        """moe_combine's (down_bias, ids): the experts' down biases and the chosen ids, or (None, None)."""
        return (None, None) if m["down_bias"] is None else (m["down_bias"], ids)

    @property
    def batchable(self) -> bool:
        """Whether forward_batch reads every weight row once for the batch (ops.matvec_batch, as often
        as shared memory needs): each stacked projection's matrices take one kernel (_matvecs)."""

        stacks = self._stacks() + ([] if self.head_only else [[self.output]])
        return all(len({_kernel_of(w, self.int_dot) for w in ws}) == 1 for ws in stacks)

    def _stacks(self) -> list[list[ops.GpuWeight]]:
        """The layers' stacked projections (PREFILL_STACKS: q|k|v, wo, gate|up, down; a DeltaNet layer's
        q|k|v|z, b|a and out_proj, an LFM2 convolution layer's or a Mamba-2 layer's in_proj and out_proj
        instead of attention's), layer by layer."""
        stacks = []
        for L in self.layers:
            D, C, M = L["delta"], L["conv"], L["mamba"]
            stacks += [[L[k] for k in names if L[k] is not None] for names in PREFILL_STACKS]
            stacks += [] if D is None else [D["proj"], D["ba"], [D["out"]]]
            stacks += [[X["in"]], [X["out"]]] if (X := C or M) is not None else []
        return [ws for ws in stacks if ws]  # a MoE layer's FFN is its experts; Nemotron-H's MLP has no gate

    def _int_dot_all(self, ws) -> bool:
        """Whether every weight of ws takes integer dot products here (matvec_qb)."""
        return self.int_dot and all(w.ggml_type in ops.INT_DOT_TYPES for w in ws)

    def _handoff_plan(self) -> tuple[list[dict], bool]:
        """Which of the decode step's matvecs read records another kernel handed them (ops.Emit): a dict a
        layer, matvec (qkv, wo, gu, down) -> bool, and whether the LM head does. A matvec reads records
        where it runs matvec_qb (every matrix of its stack takes integer dot products) and its producer
        can write them: attention (head sizes that are multiples of 32) and Gemma's post-norms always
        can; llama's wo and down, and gate|up for the down projection, where they run matvec_qb
        themselves (Nemotron-H's up projection hands relu(up x)^2 on). Layer 0's q|k|v reads the embedding;
        a layer without a mixer (Nemotron-H's MLP blocks) reads x at its FFN. Nothing with
        HEARTH_CUDA_HANDOFF=0."""

        def qb(*ws) -> bool:
            return self.handoff and self._int_dot_all(ws)

        def writes(L, post: str, w, bias=None) -> bool:  # whether a branch's last kernel writes x's records
            if L[post] is not None:  # its output norm (Gemma, GLM-4)
                return True
            return self.residual == 1.0 and bias is None and qb(w)  # the matvec adding into x

        def takes_rms(norm) -> bool:  # whether a matvec's input is x RMSNorm'd (x's records can stand for it)
            return norm is not None and not self.parallel

        plan, writer = [], False  # writer: the kernel adding into x last can write its records
        for L in self.layers:
            p = dict.fromkeys(("qkv", "wo", "gu", "down"), False)
            if L["mixer"]:  # (Nemotron-H's MLP blocks have none)
                # a DeltaNet, convolution or Mamba-2 layer: its projections read what q|k|v would, out_proj
                # writes as wo
                D, X = L["delta"], L["conv"] or L["mamba"]
                inputs, out = [L["wq"], L["wk"], L["wv"]], L["wo"]
                if D is not None:
                    inputs, out = [*D["proj"], *D["ba"]], D["out"]
                elif X is not None:
                    inputs, out = [X["in"]], X["out"]
                p["qkv"] = writer and takes_rms(L["attn_norm"]) and qb(*inputs)
                p["wo"] = D is None and X is None and qb(out) and self.cfg.head_dim % 32 == 0
                writer = writes(L, "post_attn_norm", out, L["bo"])
            if L["moe"] is not None:  # a MoE layer's FFN (moe_combine adds into x last) takes and writes none
                writer = False
            elif L["ffn"] is not None:  # (Nemotron-H's mixer blocks have none)
                gu = qb(*([L["w_up"]] if L["ffn"] == "relu2" else [L["w_gate"], L["w_up"]]))
                p["gu"] = gu and takes_rms(L["ffn_norm"]) and writer
                p["down"] = gu and qb(L["w_down"])
                writer = writes(L, "post_ffn_norm", L["w_down"])
            plan.append(p)
        return plan, not self.head_only and not self.parallel and writer and qb(self.output)

    # ---- prefill ----------------------------------------------------------------------------
    def _keep_prefill_weights(self, mode: str, reserve: int) -> None:
        """The matrices prefill's GEMMs read in place (self._resident, by their weights' ids: each stack's
        parts as (first row, matrix)): float16 weights as they are (float32 ones for float32 prefill),
        and, unless mode is "tiles", copies of the others dequantized now in prefill_dtype, layer by
        layer while they fit in the memory left after `reserve` bytes (the estimate's KV cache,
        buffers and margin), or in RESIDENT_SHARE of it for "auto". What a prefill finds here it does
        not dequantize: on the 1B shape the tiles write and read back 1.9 GB a prompt.
        prefill_weights says what was kept (bench and status lines)."""
        self._resident: dict[tuple, list] = {}
        dt, size = self.prefill_dtype, np.dtype(self.prefill_dtype).itemsize
        free, _ = cp.cuda.runtime.memGetInfo()
        room = max(0, free + cp.get_default_memory_pool().free_bytes() - reserve)
        budget = 0 if mode == "tiles" else int(room * (RESIDENT_SHARE if mode == "auto" else 1.0))
        stacks = self._stacks()
        # the output matrix multiplies every prompt row only for all_logits: read in place, never copied
        direct_output = None if self.output is None else ops.direct_matrix(self.output, dt)
        if direct_output is not None:
            self._resident[(id(self.output),)] = [(0, direct_output)]
        in_place = copied = copied_bytes = 0
        with self.stream:
            for ws in stacks:
                direct = [ops.direct_matrix(w, dt) for w in ws]
                if all(m is not None for m in direct):
                    starts = np.cumsum([0] + [w.rows for w in ws])
                    self._resident[tuple(map(id, ws))] = list(zip(starts.tolist(), direct))
                    in_place += 1
                    continue
                rows = sum(w.rows for w in ws)
                nbytes = rows * ws[0].cols * size
                if nbytes > budget - copied_bytes:
                    continue
                try:
                    m = cp.empty((rows, ws[0].cols), dt)
                except cp.cuda.memory.OutOfMemoryError:  # less usable than memGetInfo said: tiles
                    budget = copied_bytes  # for the rest
                    continue
                ops.dequant_stack(m, ws)
                self._resident[tuple(map(id, ws))] = [(0, m)]
                copied, copied_bytes = copied + 1, copied_bytes + nbytes
        self.stream.synchronize()
        self.prefill_resident_bytes = copied_bytes
        kept = f"{copied} of {len(stacks) - in_place} dequantized ({copied_bytes / 2**30:.2f} GiB)"
        self.prefill_weights = f"{mode}: {kept}, {in_place} read in place"

    def _linear(self, out, ws: list[ops.GpuWeight], x16, accumulate: bool = False) -> None:
        parts = self._resident.get(tuple(map(id, ws)))
        if parts is None:  # tiles dequantized now
            ops.linear_prefill(out, ws, x16, self._tile, accumulate)
            return
        for r0, m in parts:
            ops.gemm_nt(out[:, r0 : r0 + m.shape[0]], x16, m, accumulate)

    def _prefill(self, tokens: np.ndarray, cache: CudaKVCache, all_logits: bool):
        size = -(-len(tokens) // PREFILL_GRAPH_STEP) * PREFILL_GRAPH_STEP
        graphable = self.prefill_graphs and self.use_graphs and self.prefill_graph_error is None
        if graphable and cache.offset == 0 and not (all_logits or self.head_only):
            graphs = self._prefill_graphs.get(cache)
            if graphs is None:  # the cache's first prompt goes launch by launch: one used once keeps none
                self._prefill_graphs[cache] = collections.OrderedDict()
            elif size <= min(PREFILL_GRAPH_MAX, cache.n_ctx):
                try:
                    return self._prefill_replay(tokens, cache, size, graphs)
                except cp.cuda.memory.OutOfMemoryError:  # no room for the capture's buffers: not a refusal
                    raise
                except Exception as e:  # noqa: BLE001 - a capture the driver refuses: launch by launch
                    self.prefill_graph_error = f"{type(e).__name__}: {e}"
                    self._prefill_graphs = weakref.WeakKeyDictionary()
        ids = cp.asarray(tokens.astype(np.int32))
        pos = cp.asarray(np.array([cache.offset], np.int32))
        return self._prefill_kernels(ids, pos, cache, all_logits)

    def _moe_prefill(self, x, h_in, L: dict) -> None:
        """A MoE layer's FFN over the n prompt rows of x (n, hidden), added into x; h_in (n, hidden) is
        scratch in the GEMMs' dtype. The router's GEMM and the routing run on the GPU; the chosen experts
        then come to the host (one synchronisation a layer, so a MoE model's prefill is not captured), the
        tokens are grouped by expert as the CPU groups them, and each chosen expert multiplies its tokens'
        rows: gate|up, the activation and down, through tiles dequantized from its rows of the merged
        tensors. Each output row lands in its (token, slot) place and moe_combine adds the weighted sum and
        the shared expert into x."""
        cfg, m, f32 = self.cfg, L["moe"], cp.float32
        n, d = x.shape
        E, k = self.moe[:2]
        ops.rmsnorm(h_in, x, L["ffn_norm"], cfg.rms_norm_eps)
        logits = cp.empty((n, E), f32)
        self._linear(logits, [m["router"]], h_in)
        if m["router_bias"] is not None:
            ops.add_inplace(logits, m["router_bias"])
        ids, wts = cp.empty((n, k), cp.int32), cp.empty((n, k), f32)
        self._route(ids, wts, logits, m)
        chosen = cp.asnumpy(ids, stream=self.stream).reshape(-1)  # slot t * k + j: token t's j-th expert
        y = cp.zeros((n * k, d), f32)
        experts = m["experts"]
        glu = self._expert_glu(m)
        for e in np.unique(chosen).tolist():
            slots = np.flatnonzero(chosen == e)
            rows = h_in[cp.asarray((slots // k).astype(np.int32))]  # (m, hidden) the tokens routed to e
            ffn = [experts.expert(which, e) for which in ("gate", "up", "down")]
            act = glu if glu["bias"] is None else {**glu, "bias": glu["bias"][e]}  # expert e's bias row
            y[cp.asarray(slots.astype(np.int32))] = self._swiglu_prefill(rows, *ffn, act)
        ys = sg = None
        if m["shared"] is not None:
            ys = self._swiglu_prefill(h_in, *m["shared"])
            if m["shared_gate"] is not None:
                sg = cp.empty((n, 1), f32)
                self._linear(sg, [m["shared_gate"]], h_in)
        ops.moe_combine(x, y.reshape(n, k, d), wts, ys, sg, *self._down_bias(m, ids), scale=self.residual)

    def _swiglu_prefill(self, h, gate, up, down, glu: dict | None = None):
        """down(silu(gate h) * up h), float32 (m, hidden), for the rows h (m, hidden) in the GEMMs' dtype;
        glu: ops.glu's mode, bias and oai arguments instead of plain SwiGLU's (gpt-oss's experts)."""
        m, ff = h.shape[0], gate.rows
        gu = cp.empty((m, 2 * ff), cp.float32)
        self._linear(gu, [gate, up], h)
        act = cp.empty((m, ff), self.prefill_dtype)
        ops.glu(act, gu, **(glu or dict(mode=ops.GLU_SILU)))
        out = cp.empty((m, down.rows), cp.float32)
        self._linear(out, [down], act)
        return out

    def _route(self, ids, wts, logits, m: dict) -> None:
        """ids (n, k), wts (n, k) = moe_route of router logits (n, experts) by the model's routing rules."""
        cfg = self.cfg
        sigmoid = cfg.expert_gating == "sigmoid"
        ops.moe_route(ids, wts, logits, self.moe[1], sigmoid, cfg.norm_topk_prob, cfg.expert_weights_scale,
                      m["score_bias"])

    def _prefill_replay(self, tokens: np.ndarray, cache: CudaKVCache, size: int, graphs) -> cp.ndarray:
        """The prefill of a prompt at position 0 as one CUDA graph launch: a prefill launches about 17
        kernels and cuBLAS calls a layer, and on the H200 issuing them took the host longer than the GPU
        took to run them. A cache that starts over (a new chat on the chat runner's cache) replays the
        capture of its earlier prompt of the same padded size; graphs: the cache's captures by size (LRU).

        The prompt is padded to `size` tokens (token 0): the padding's keys and values land past the
        cache's offset, where decode overwrites them, and causal attention keeps them from the prompt's
        tokens. Logits of the last real token."""
        g = graphs.get(size)
        if g is None:
            g = graphs[size] = self._capture_prefill(cache, size)
            while len(graphs) > PREFILL_GRAPHS:
                graphs.popitem(last=False)
        graphs.move_to_end(size)
        ids = np.zeros(size, np.int32)
        ids[: len(tokens)] = tokens
        g.ids.set(ids, stream=self.stream)
        g.last.set(np.array([len(tokens) - 1], np.int32), stream=self.stream)
        g.graph.launch(self.stream)
        return g.logits

    def _capture_prefill(self, cache: CudaKVCache, size: int) -> _PrefillGraph:
        g = _PrefillGraph(size)
        self.stream.begin_capture()
        try:
            with cp.cuda.using_allocator(g.pool.malloc):
                g.logits = self._prefill_kernels(g.ids, g.pos, cache, False, last=g.last)
        finally:
            g.graph = self.stream.end_capture()
        return g

    def _prefill_kernels(self, ids, pos, cache: CudaKVCache, all_logits: bool, last=None):
        """The prefill of the tokens ids (n,) int32 at positions cache.offset.. (pos (1,) int32 on the GPU
        holds it too): launches only, no host-device copy or synchronisation. Without all_logits the
        logits are those of token n - 1, or of token last[0] (int32 (1,) on the GPU) when given."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        n = int(ids.shape[0])
        f32, dt = cp.float32, self.prefill_dtype
        H, hd = cfg.num_attention_heads, cfg.head_dim
        d, ff = cfg.hidden_size, self.ff
        pos0 = cache.offset
        x = cp.empty((n, d), f32)
        ops.dequant(x, self.token_embd, ids=ids, scale=self.embed_scale)
        o = cp.empty((n, d), f32)
        qkv = cp.empty((n, self.q_rows + 2 * cfg.kv_dim), f32)  # one GEMM for q|k|v
        KV = cfg.num_key_value_heads
        # rotated queries grouped by KV head, in the cache's dtype (attention's GEMMs take both)
        qg = cp.empty((KV, n * (H // KV), hd), cache.k.dtype)
        attn = cp.empty((n, cfg.q_dim), dt)  # the wo GEMM's input: attention writes it in the tiles' dtype
        gu = cp.empty((n, 2 * ff), f32)  # one GEMM for gate|up
        # the GEMM inputs in the tiles' dtype: the norms and the activation write them directly
        h_in = cp.empty((n, d), dt)
        act_in = cp.empty((n, ff), dt)

        def normed(norm) -> None:  # h_in = rmsnorm(x) * norm (Cohere: LayerNorm), or x itself (EXAONE 4)
            if norm is None:
                ops.convert(h_in, x)
            else:
                ops.rmsnorm(h_in, x, norm, eps, center=self.parallel)

        def branch(w, inp, post, bias) -> None:  # x += W inp (+ bias), normed or scaled (as _step_launches)
            if post is None and self.residual == 1.0:
                self._linear(x, [w], inp, accumulate=True)  # the residual add in the GEMM
                if bias is not None:
                    ops.add_inplace(x, bias)
                return
            self._linear(o, [w], inp)
            if bias is not None:
                ops.add_inplace(o, bias)
            if post is None:
                ops.add_inplace(x, o, self.residual)
            else:
                ops.rmsnorm(x, o, post, eps, accumulate=True)

        def gemm_in(y):  # float32 rows y as a GEMM's input (the tiles' dtype)
            if dt == f32:
                return y
            y16 = cp.empty(y.shape, dt)
            ops.convert(y16, y)
            return y16

        for L in self.layers:
            D, C, M, j = L["delta"], L["conv"], L["mamba"], L["slot"]
            if L["mixer"]:  # (Nemotron-H's MLP blocks have none)
                normed(L["attn_norm"])
                if D is not None:  # DeltaNet: the projections, then the cache's states (two runs: see mix)
                    shape = self.delta
                    proj = cp.empty((n, shape.conv_dim + shape.value_dim), f32)
                    self._linear(proj, D["proj"], h_in)
                    ba = cp.empty((n, 2 * shape.v_heads), f32)
                    self._linear(ba, D["ba"], h_in)
                    y = cache.mix(j, functools.partial(self._delta_mix, D), [proj, ba])
                    branch(D["out"], gemm_in(y), L["post_attn_norm"], None)
                elif C is not None:  # LFM2: in_proj, the gated convolution over the cache's inputs, out_proj
                    bcx = cp.empty((n, 3 * d), f32)
                    self._linear(bcx, [C["in"]], h_in)
                    y = cp.empty((n, d), f32)
                    ops.short_conv(y, bcx, cache.conv[j, 0], C["kernel"], pos)
                    branch(C["out"], gemm_in(y), L["post_attn_norm"], None)
                elif M is not None:  # Mamba-2: in_proj, then the cache's states (two runs: see mix), out_proj
                    proj = cp.empty((n, self.mamba.in_rows), f32)
                    self._linear(proj, [M["in"]], h_in)
                    y = cache.mix(j, functools.partial(self._mamba_mix, M), [proj])
                    branch(M["out"], gemm_in(y), L["post_attn_norm"], None)
                else:
                    self._linear(qkv, [L["wq"], L["wk"], L["wv"]], h_in)
                if self.parallel:  # Cohere: the FFN's input too, taken before attention's output joins x
                    self._linear(gu, [L["w_gate"], L["w_up"]], h_in)
                if D is None and C is None and M is None:
                    if L["bqkv"] is not None:
                        ops.add_inplace(qkv, L["bqkv"])
                    self._qk_rows(qkv, L)
                    rope = (L["inv_freq"], L["n_rot"], self.neox, eps, L["q_norm"], L["k_norm"])
                    rope += self.rope_scales
                    ops.rope_store(qg, qkv, H, cache.k[j], cache.v[j], pos, *rope, gated=self.gated)
                    attn3 = attn.reshape(n, H, hd)
                    where = (pos0, L["scale"], L["window"], self.flash)
                    ops.attention_prefill(attn3, qg, cache.k[j], cache.v[j], *where, self.softcap, L["sinks"])
                    if self.gated:
                        ops.gate_heads(attn, qkv, H, hd)
                    branch(L["wo"], attn, L["post_attn_norm"], L["bo"])
            if L["moe"] is not None:
                self._moe_prefill(x, h_in, L)
                continue
            if L["ffn"] is None:  # (Nemotron-H's mixer blocks have none)
                continue
            act = act_in
            if L["ffn"] == "relu2":  # Nemotron-H: down(relu(up x)^2)
                f = L["w_up"].rows
                up, act = gu.reshape(-1)[: n * f].reshape(n, f), act_in.reshape(-1)[: n * f].reshape(n, f)
                normed(L["ffn_norm"])
                self._linear(up, [L["w_up"]], h_in)
                ops.glu(act, up, ops.RELU2)
            else:
                if not self.parallel:
                    normed(L["ffn_norm"])
                    self._linear(gu, [L["w_gate"], L["w_up"]], h_in)
                ops.glu(act_in, gu, ops.GLU_GELU if self.gemma else ops.GLU_SILU)
            branch(L["w_down"], act, L["post_ffn_norm"], None)
        if self.head_only:
            return x
        cap = getattr(cfg, "final_logit_softcapping", None)
        if all_logits:
            normed(self.output_norm)
            logits = cp.empty((n, cfg.vocab_size), f32)
            self._linear(logits, [self.output], h_in)
        else:
            logits = cp.empty((1, cfg.vocab_size), f32)
            norm, dot = self.output_norm, self.int_dot
            row = x[n - 1]
            if last is not None:  # row last[0] of x, gathered as rows of a float32 weight are
                row = cp.empty((1, d), f32)
                ops.dequant(row, ops.GpuWeight(ops.F32, x.view(cp.uint8), n, d), ids=last)
                row = row[0]
            if self.parallel:  # LayerNorm'd first
                ops.rmsnorm(o[:1], row.reshape(1, d), norm, eps, center=True)
                ops.matvec(logits[0], [self.output], o[0], int_dot=dot)
            else:
                ops.matvec(logits[0], [self.output], row, norm=norm, eps=eps, prologue=1, int_dot=dot)
        if cap is not None:
            ops.softcap(logits, cap)
        return logits


def _kernel_of(w, int_dot: bool):
    """Which matvec kernel takes weight w (ops.matvec's rule): "int" (matvec_qb), or its float kernel's
    type."""
    return "int" if int_dot and w.ggml_type in ops.INT_DOT_TYPES else w.ggml_type


def _matvecs(out, ws: list, x, int_dot: bool, cols_x2: bool = False, **kw) -> None:
    """out (B, >= rows) (= or +=) [ws stacked] @ act(x[b]) for each row b of x (B, cols), or of
    x (B, 2 cols) = [x | x2] with cols_x2 (prologues 2/3). One launch for each run of weights one
    kernel takes (ops.matvec's rule): over all B rows (ops.matvec_batch: each weight row read once
    for as many of them as shared memory holds) for the run at the start of a row, else a launch
    per row (a stack whose weights take different kernels, integer and float)."""
    r = i = 0
    while i < len(ws):
        j = i + 1
        while j < len(ws) and _kernel_of(ws[j], int_dot) == _kernel_of(ws[i], int_dot):
            j += 1
        run, rows = ws[i:j], sum(w.rows for w in ws[i:j])
        if r == 0:
            ops.matvec_batch(out, run, x, cols_x2=cols_x2, int_dot=int_dot, **kw)
        else:
            cols = run[0].cols
            for b in range(out.shape[0]):
                xb, x2 = (x[b, :cols], x[b, cols:]) if cols_x2 else (x[b], None)
                ops.matvec(out[b, r : r + rows], run, xb, x2=x2, int_dot=int_dot, **kw)
        r += rows
        i = j
