"""Tiny random Gemma 3 GGUF files and a plain-numpy float64 reference forward pass for them.

The reference follows Hugging Face's modeling_gemma3 (Gemma3RMSNorm's (1 + w), scaled embeddings,
q/k norms, post-attention and post-MLP norms, GeGLU with tanh GELU, rotate_half RoPE with local and
global bases, the sliding-window mask `kv > q - window`, query_pre_attn_scalar, soft-caps) and
shares no code with the engine. The GGUF is written as llama.cpp's converter writes Gemma: norm
weights stored as (1 + w).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from engine.tokenizer import bytes_to_unicode

T = gguf.GGMLQuantizationType

# Specials after the 256 byte symbols and one merge; <end_of_turn> is a control token, as in Gemma.
SPECIALS = ["<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
EOS_ID, BOS_ID = 257, 258


def _vocab() -> list[str]:
    table = bytes_to_unicode()
    return [table[b] for b in range(256)] + ["Ġt"] + SPECIALS


@dataclass
class TinyGemmaSpec:
    hidden: int = 64
    ffn: int = 96
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32  # deliberately not hidden // heads, as on the real 270M (640 / 4 != 256)
    window: int = 4
    pattern: int | None = None  # None: no metadata key, the model's default period of 6 applies
    theta: float = 1_000_000.0  # global layers
    local_theta: float = 10_000.0
    rope_linear: float = 1.0  # linear RoPE scaling factor for the global layers
    eps: float = 1e-6
    final_softcap: float | None = None
    attn_softcap: float | None = None
    matrix_type: int = T.F32
    ctx: int = 128
    seed: int = 0

    def sliding(self, layer: int) -> bool:
        return bool((layer + 1) % (self.pattern or 6))


def make_weights(spec: TinyGemmaSpec) -> dict[str, np.ndarray]:
    """Random float32 weights in HF's convention (norm weights w, used as 1 + w), GGUF names."""
    rng = np.random.default_rng(spec.seed)
    vocab = len(_vocab())
    q_dim, kv_dim = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    w = {"token_embd.weight": rng.normal(0, 0.1, (vocab, spec.hidden))}
    w["output_norm.weight"] = rng.normal(0, 0.2, spec.hidden)
    for i in range(spec.layers):
        p = f"blk.{i}."
        for name, n in (
            ("attn_norm", spec.hidden),
            ("post_attention_norm", spec.hidden),
            ("ffn_norm", spec.hidden),
            ("post_ffw_norm", spec.hidden),
            ("attn_q_norm", spec.head_dim),
            ("attn_k_norm", spec.head_dim),
        ):
            w[p + name + ".weight"] = rng.normal(0, 0.2, n)
        w[p + "attn_q.weight"] = rng.normal(0, 0.15, (q_dim, spec.hidden))
        w[p + "attn_k.weight"] = rng.normal(0, 0.15, (kv_dim, spec.hidden))
        w[p + "attn_v.weight"] = rng.normal(0, 0.15, (kv_dim, spec.hidden))
        w[p + "attn_output.weight"] = rng.normal(0, 0.15, (spec.hidden, q_dim))
        w[p + "ffn_gate.weight"] = rng.normal(0, 0.15, (spec.ffn, spec.hidden))
        w[p + "ffn_up.weight"] = rng.normal(0, 0.15, (spec.ffn, spec.hidden))
        w[p + "ffn_down.weight"] = rng.normal(0, 0.15, (spec.hidden, spec.ffn))
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_tiny_gemma3(path: Path, spec: TinyGemmaSpec, omit: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Write the tiny model; returns HF-convention weights as stored (dequantized), for the reference."""
    weights = make_weights(spec)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    a = "gemma3"
    writer.add_uint32(f"{a}.block_count", spec.layers)
    writer.add_uint32(f"{a}.context_length", spec.ctx)
    writer.add_uint32(f"{a}.embedding_length", spec.hidden)
    writer.add_uint32(f"{a}.feed_forward_length", spec.ffn)
    writer.add_uint32(f"{a}.attention.head_count", spec.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", spec.kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", spec.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", spec.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.eps)
    writer.add_float32(f"{a}.rope.freq_base", spec.theta)
    if spec.local_theta != 10_000.0:
        writer.add_float32(f"{a}.rope.freq_base_swa", spec.local_theta)
    if spec.rope_linear != 1.0:
        writer.add_string(f"{a}.rope.scaling.type", "linear")
        writer.add_float32(f"{a}.rope.scaling.factor", spec.rope_linear)
    writer.add_uint32(f"{a}.attention.sliding_window", spec.window)
    if spec.pattern is not None:
        writer.add_uint32(f"{a}.attention.sliding_window_pattern", spec.pattern)
    if spec.final_softcap is not None:
        writer.add_float32(f"{a}.final_logit_softcapping", spec.final_softcap)
    if spec.attn_softcap is not None:
        writer.add_float32(f"{a}.attn_logit_softcapping", spec.attn_softcap)
    tokens = _vocab()
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [1] * 257 + [3] * len(SPECIALS))
    writer.add_array("tokenizer.ggml.merges", ["Ġ t"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", BOS_ID)
    writer.add_uint32("tokenizer.ggml.eos_token_id", EOS_ID)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    stored = {}
    for name, value in weights.items():
        if name in omit:
            continue
        if name.endswith("norm.weight"):
            # llama.cpp's converter bakes Gemma's "1 +" into the stored norm weights
            data = (value.astype(np.float64) + 1).astype(np.float32)
            writer.add_tensor(name, data, raw_dtype=T.F32)
            stored[name] = data.astype(np.float64) - 1
            continue
        qtype = spec.matrix_type
        if qtype == T.F32:
            data, stored[name] = value, value
        else:
            data = gguf.quants.quantize(value, qtype)
            stored[name] = gguf.quants.dequantize(data, qtype).reshape(value.shape).astype(np.float32)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, x (n, heads, hd)."""
    ang = positions[:, None] * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)[:, None, :]  # (n, 1, hd)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def reference_logits(spec: TinyGemmaSpec, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """All-position logits (n, vocab) in float64 for one uncached pass over `tokens`."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    hd = spec.head_dim
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)

    def norm(x, weight):  # Gemma3RMSNorm
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.eps) * (1.0 + weight)

    def gelu_tanh(g):
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))

    base_freq = np.arange(0, hd, 2, dtype=np.float64) / hd
    local_inv = spec.local_theta**-base_freq
    global_inv = spec.theta**-base_freq / spec.rope_linear
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    causal = ki <= qi
    window_mask = causal & (ki > qi - spec.window)

    x = w["token_embd.weight"][tokens] * np.sqrt(spec.hidden)
    for i in range(spec.layers):
        p = f"blk.{i}."
        sliding = spec.sliding(i)
        h = norm(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(n, spec.heads, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(n, spec.kv_heads, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, spec.kv_heads, hd)
        q = norm(q, w[p + "attn_q_norm.weight"])
        k = norm(k, w[p + "attn_k_norm.weight"])
        inv = local_inv if sliding else global_inv
        q, k = _rotate(q, pos, inv), _rotate(k, pos, inv)
        rep = spec.heads // spec.kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) * hd**-0.5  # query_pre_attn_scalar = head_dim
        if spec.attn_softcap is not None:
            scores = np.tanh(scores / spec.attn_softcap) * spec.attn_softcap
        scores = np.where((window_mask if sliding else causal)[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        x = x + norm(att @ w[p + "attn_output.weight"].T, w[p + "post_attention_norm.weight"])
        h = norm(x, w[p + "ffn_norm.weight"])
        mlp = (gelu_tanh(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) @ w[
            p + "ffn_down.weight"
        ].T
        x = x + norm(mlp, w[p + "post_ffw_norm.weight"])
    logits = norm(x, w["output_norm.weight"]) @ w["token_embd.weight"].T
    if spec.final_softcap is not None:
        logits = np.tanh(logits / spec.final_softcap) * spec.final_softcap
    return logits
