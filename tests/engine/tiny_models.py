"""Tiny random Llama-family GGUF files and a plain-numpy reference forward pass for them.

The reference is written from the published model definitions (HF modeling_llama / qwen2), in
float64, with none of the engine's code: it checks the architecture wiring (GQA, RoPE layouts,
biases, tied output, norms), while the golden files made by transformers check real models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from engine.tokenizer import bytes_to_unicode

T = gguf.GGMLQuantizationType


def _byte_vocab() -> list[str]:
    """The 256 byte-level BPE symbols, one merge result and end-of-text."""
    table = bytes_to_unicode()
    return [table[b] for b in range(256)] + ["Ġt", "<|endoftext|>"]


@dataclass
class TinySpec:
    arch: str = "llama"
    hidden: int = 64
    ffn: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    theta: float = 10000.0
    eps: float = 1e-5
    qkv_bias: bool = False
    tied: bool = True
    matrix_type: int = T.F32
    ctx: int = 128
    seed: int = 0
    omit: tuple[str, ...] = ()  # tensor names to leave out (bad-input tests)
    types: tuple[tuple[str, int], ...] = ()  # (tensor name, GGML type) pairs overriding matrix_type


def make_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Random float32 weights in numpy (rows, cols) order, canonical GGUF names."""
    rng = np.random.default_rng(spec.seed)
    vocab = len(_byte_vocab())
    hd = spec.hidden // spec.heads
    w = {"token_embd.weight": rng.normal(0, 0.5, (vocab, spec.hidden))}
    w["output_norm.weight"] = 1 + rng.normal(0, 0.1, spec.hidden)
    if not spec.tied:
        w["output.weight"] = rng.normal(0, 0.2, (vocab, spec.hidden))
    for i in range(spec.layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = 1 + rng.normal(0, 0.1, spec.hidden)
        w[p + "ffn_norm.weight"] = 1 + rng.normal(0, 0.1, spec.hidden)
        w[p + "attn_q.weight"] = rng.normal(0, 0.15, (spec.heads * hd, spec.hidden))
        w[p + "attn_k.weight"] = rng.normal(0, 0.15, (spec.kv_heads * hd, spec.hidden))
        w[p + "attn_v.weight"] = rng.normal(0, 0.15, (spec.kv_heads * hd, spec.hidden))
        w[p + "attn_output.weight"] = rng.normal(0, 0.15, (spec.hidden, spec.heads * hd))
        w[p + "ffn_gate.weight"] = rng.normal(0, 0.15, (spec.ffn, spec.hidden))
        w[p + "ffn_up.weight"] = rng.normal(0, 0.15, (spec.ffn, spec.hidden))
        w[p + "ffn_down.weight"] = rng.normal(0, 0.15, (spec.hidden, spec.ffn))
        if spec.qkv_bias:
            w[p + "attn_q.bias"] = rng.normal(0, 0.1, spec.heads * hd)
            w[p + "attn_k.bias"] = rng.normal(0, 0.1, spec.kv_heads * hd)
            w[p + "attn_v.bias"] = rng.normal(0, 0.1, spec.kv_heads * hd)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_byte_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The tiny models' byte-level BPE vocabulary (_byte_vocab) as GGUF tokenizer keys."""
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", _byte_vocab())
    writer.add_array("tokenizer.ggml.token_type", [1] * 257 + [3])
    writer.add_array("tokenizer.ggml.merges", ["Ġ t"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 257)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 257)


def write_tiny_gguf(path: Path, spec: TinySpec) -> dict[str, np.ndarray]:
    """Write the tiny model; returns the weights as stored (dequantized), for the reference."""
    weights = make_weights(spec)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    writer.add_uint32(f"{a}.block_count", spec.layers)
    writer.add_uint32(f"{a}.context_length", spec.ctx)
    writer.add_uint32(f"{a}.embedding_length", spec.hidden)
    writer.add_uint32(f"{a}.feed_forward_length", spec.ffn)
    writer.add_uint32(f"{a}.attention.head_count", spec.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", spec.kv_heads)
    writer.add_float32(f"{a}.rope.freq_base", spec.theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.eps)
    write_byte_tokenizer(writer)
    stored = {}
    for name, value in weights.items():
        if name in spec.omit:
            continue
        qtype = dict(spec.types).get(name, spec.matrix_type) if value.ndim == 2 else T.F32
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


def _rope(x: np.ndarray, positions: np.ndarray, theta: float, neox: bool) -> np.ndarray:
    """x (n, heads, hd). GGML normal = adjacent pairs; NeoX = halves (HF's rotate_half)."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    ang = positions[:, None] * inv[None, :]  # (n, hd/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        out[..., : hd // 2] = a * cos - b * sin
        out[..., hd // 2 :] = b * cos + a * sin
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
    return out


def reference_logits(spec: TinySpec, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """All-position logits (n, vocab) in float64, causal attention over the whole sequence."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    hd = spec.hidden // spec.heads
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.eps) * g

    x = w["token_embd.weight"][tokens]
    for i in range(spec.layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + f"attn_{t}.weight"].T for t in "qkv")
        if spec.qkv_bias:
            q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        neox = spec.arch == "qwen2"
        q = _rope(q.reshape(n, spec.heads, hd), pos, spec.theta, neox)
        k = _rope(k.reshape(n, spec.kv_heads, hd), pos, spec.theta, neox)
        v = v.reshape(n, spec.kv_heads, hd)
        rep = spec.heads // spec.kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        x = x + att @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    out = w.get("output.weight", w["token_embd.weight"])
    return norm(x, w["output_norm.weight"]) @ out.T
