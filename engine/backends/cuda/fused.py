"""The fused decode step: a llama-family or Gemma 3 decode step as one persistent kernel (kernels/step.cu).

The graph path launches ~7 kernels per layer; each boundary drains the GPU and costs microseconds,
which on a 1B model is as long as reading the layer's weights. `decode_step` keeps one block per SM
resident for the whole step, meets at a software grid barrier between phases, prefetches the coming
phases' weights into L2 and multiplies quantized weights by int8 activations with dp4a.

It is chosen with `CudaDecoder(decode_kernel="fused")` or HEARTH_CUDA_DECODE=fused, for the llama
family (Llama, Mistral, Qwen2, SmolLM) and Gemma 3 with GGUF weight types; FP8/NVFP4 models keep the
graph path. The grid barrier needs every block resident at once: the grid is one block per SM after an
occupancy check, and a barrier that waits ~10 s gives up and reports FusedStepError instead of hanging
the GPU.
"""

from __future__ import annotations

import os

import cupy as cp
import numpy as np

from engine.backends.cuda import ops
from models.errors import HearthError

THREADS = 512
LAYER_SLOTS = 20  # as step.cu
MAX_HD = 256
STEP_WARPS = 16
SPLIT_KEYS = 256  # keys per attention split (up to max_splits splits: one per block and head)
ENV = "HEARTH_CUDA_DECODE"
KINDS = ("graphs", "fused")
# descriptor slots holding a layer's vectors (device pointers, 0 when absent); 7-13 hold the matrices,
# 14 their types, 16 the sliding window
_SLOTS = {0: "attn_norm", 1: "ffn_norm", 2: "q_norm", 3: "k_norm", 4: "bq", 5: "bk", 6: "bv", 15: "inv_freq"}
_SLOTS |= {17: "post_attn_norm", 18: "post_ffn_norm"}
_MATS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_i32, _f32 = np.int32, np.float32


class FusedStepError(HearthError):
    """The fused decode step could not finish (a grid barrier timed out)."""


def decode_kind(kind: str | None) -> str:
    """The decode path asked for: the argument, else $HEARTH_CUDA_DECODE, else "graphs".

    Raises:
        ValueError: not one of KINDS.
    """
    kind = kind or os.environ.get(ENV) or "graphs"
    if kind not in KINDS:
        raise ValueError(f"decode kernel must be one of {', '.join(KINDS)}, got {kind!r} (from {ENV}?)")
    return kind


def unsupported_reason(dec) -> str | None:
    """Why the fused step cannot run this CudaDecoder's model (None when it can)."""
    cfg = dec.cfg
    if dec.moe is not None:
        return "mixture-of-experts layers"
    if dec.parallel:
        return "Cohere's parallel blocks"
    if dec.n_conv:
        return "short-convolution layers (LFM2)"
    if dec.delta is not None or dec.gated:
        return "DeltaNet layers and gated attention (Qwen3.5)"
    if dec.mamba is not None:
        return "Mamba-2 layers (Granite 4.0-H, Nemotron-H)"
    if any(not L["mixer"] or L["ffn"] != "glu" for L in dec.layers):
        return "blocks of one branch and relu^2 MLPs (Nemotron-H)"
    if any(L["sinks"] is not None or L["bo"] is not None for L in dec.layers):
        return "attention sinks or output biases (gpt-oss)"
    if dec.softcap:
        return "attention soft-capping (Gemma 2)"
    if len({L["scale"] for L in dec.layers}) > 1:
        return "attention scales that differ between layers (OLMo 3)"
    if any(L["n_rot"] != dec.n_rot for L in dec.layers):
        return "layers without RoPE (SmolLM3, EXAONE 4)"
    if dec.rope_scales != ops.NO_ROPE_SCALES:
        return "a partly rotated head's RoPE attention factor (Phi-4-mini) or query temperature (Ministral 3)"
    if dec.residual != 1.0:
        return "a residual multiplier (Granite)"
    if any(L["attn_norm"] is None or L["ffn_norm"] is None for L in dec.layers):
        return "branches without input norms (EXAONE 4, OLMo 2)"
    if any(L["qk_rows"] is not None for L in dec.layers):
        return "q/k norms over the whole projection (OLMo 2)"
    if not dec.gemma and any(L["post_attn_norm"] is not None or L["post_ffn_norm"] is not None
                             for L in dec.layers):
        return "norms of the branch outputs (GLM-4)"
    if cfg.head_dim > MAX_HD:
        return f"head_dim {cfg.head_dim} > {MAX_HD}"
    weights = [L[m] for L in dec.layers for m in _MATS] + [dec.token_embd]
    if dec.output is not None:
        weights.append(dec.output)
    if any(w.ggml_type in ops._FP_TYPES for w in weights):
        return "FP8/NVFP4 weights"
    if any(n % 32 for n in (cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)):
        return "a width that is not a multiple of 32"
    return None


def smem_bytes(cfg) -> int:
    """Dynamic shared memory of one block (the layout at the top of decode_step)."""
    maxc = max(cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)
    floats = 64 + 2 * maxc + ops.records_width(maxc) + 3 * MAX_HD + STEP_WARPS * (MAX_HD + 2)
    return 4 * floats


def _ptr(a) -> int:
    return 0 if a is None else int(a.data.ptr)


class FusedStep:
    """Launches decode_step for one CudaDecoder (its uploaded weights), any of its caches.

    Args:
        dec: the CudaDecoder (weights uploaded).
        threads: block size, a multiple of 32 up to 512 (default 512; smaller in host-thread tests).
        blocks: grid size (default: one block per SM, when the occupancy check allows one).
        prefetch_budget: bytes of weights prefetched into L2 ahead of use (default a third of L2;
            negative: no prefetching).
    """

    def __init__(
        self, dec, threads: int | None = None, blocks: int | None = None, prefetch_budget: int | None = None
    ):
        self.dec = dec
        cfg = dec.cfg
        self.threads = threads or THREADS
        if self.threads % 32 or not 32 <= self.threads <= 32 * STEP_WARPS:
            raise ValueError(f"threads must be a multiple of 32 up to {32 * STEP_WARPS}, got {self.threads}")
        self.smem = smem_bytes(cfg)
        table = np.zeros((len(dec.layers), LAYER_SLOTS), np.uint64)
        for i, L in enumerate(dec.layers):
            for slot, k in _SLOTS.items():
                table[i, slot] = _ptr(L[k])
            table[i, 7:14] = [_ptr(L[m].raw) for m in _MATS]
            table[i, 14] = sum(L[m].ggml_type << (8 * j) for j, m in enumerate(_MATS))
            table[i, 16] = L["window"]
        self.table = cp.asarray(table)
        self.k = ops.kernel("decode_step", cp.cuda.Device().id)
        ops.allow_shared(self.k, self.smem)
        self.blocks = blocks or self._resident_blocks()
        n_heads = cfg.num_attention_heads
        self.max_splits = max(1, self.blocks // n_heads)
        # a third of L2 for the weights prefetched ahead (the rest: activations, KV, this phase's lines)
        self.prefetch_budget = max(1 << 20, _l2_bytes() // 3) if prefetch_budget is None else prefetch_budget

    def _resident_blocks(self) -> int:
        occupancy = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor
        per_sm = occupancy(self.k.kernel.ptr, self.threads, self.smem)
        if per_sm < 1:
            raise FusedStepError("its block does not fit on one SM")
        return ops._sm_count()

    def buffers(self, step) -> None:
        """Add what the fused step needs to a decoder's per-cache _Step buffers (once)."""
        if getattr(step, "sync", None) is not None:
            return
        cfg = self.dec.cfg
        step.sync = cp.zeros(4, cp.uint32)  # arrivals, generation, finished blocks
        step.best = cp.zeros(1, cp.uint64)
        step.status = cp.zeros(2, cp.int32)  # greedy token, barrier timed out
        step.fparts = cp.zeros(cfg.num_attention_heads * self.max_splits * (cfg.head_dim + 2), cp.float32)
        step.xr = cp.zeros(2 * cfg.hidden_size, cp.float32)  # Gemma's residual stream, double-buffered

    def launch(self, step, cache, token: int, greedy: bool) -> None:
        """One decode step of token at position cache.offset: logits (or x for a head decoder) in step."""
        dec, cfg = self.dec, self.dec.cfg
        self.buffers(step)
        out = dec.output
        args = (
            self.table,
            _i32(len(dec.layers)),
            dec.token_embd.raw,
            _i32(dec.token_embd.ggml_type),
            _f32(dec.embed_scale),
            ops.NULL if out is None else out.raw,
            _i32(0 if out is None else out.ggml_type),
            ops.NULL if out is None else dec.output_norm,
            cache.k,
            cache.v,
            _i32(cache.k.dtype == cp.float16),
            _i32(cache.n_ctx),
            step.x,
            step.xr,
            step.o,
            step.qkv,
            step.gu,
            step.fparts,
            ops.NULL if step.logits is None else step.logits,  # None: a head decoder's step
            step.sync,
            step.best,
            step.status,
            _i32(cfg.hidden_size),
            _i32(cfg.num_attention_heads),
            _i32(cfg.num_key_value_heads),
            _i32(cfg.head_dim),
            _i32(cfg.intermediate_size),
            _i32(cfg.vocab_size),
            _i32(dec.n_rot),
            _i32(dec.neox),
            _f32(cfg.rms_norm_eps),
            _f32(dec.scale),
            _i32(self.max_splits),
            _i32(SPLIT_KEYS),
            _i32(token),
            _i32(cache.offset),
            _i32(greedy and out is not None),
            _i32(dec.gemma),
            _f32(getattr(cfg, "final_logit_softcapping", None) or 0.0),
            np.int64(self.prefetch_budget),
        )
        self.k((self.blocks,), (self.threads,), args, shared_mem=self.smem)

    def check(self, step) -> np.ndarray:
        """step.status on the host: [greedy token, timed out]; raises FusedStepError on a timeout."""
        status = cp.asnumpy(step.status, stream=self.dec.stream)
        if status[1]:
            step.status[1] = 0
            step.sync[...] = 0
            raise FusedStepError(
                "a grid barrier of the fused decode step timed out (another program using the GPU?); "
                f"set {ENV}=graphs to use the graph path"
            )
        return status


def _l2_bytes() -> int:
    try:
        return int(cp.cuda.Device().attributes["L2CacheSize"])
    except Exception:  # noqa: BLE001 - an attribute CuPy does not report: plan for a small L2
        return 4 << 20
