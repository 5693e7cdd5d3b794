"""Decode speed of a mixture-of-experts layer against a dense layer with the same active weights.

    .venv/bin/python scripts/bench_moe.py [--layers 4] [--threads 2] [--tokens 32]

Writes two GGUF files with random Q4_0 weights in Qwen3-30B-A3B's layer shape (hidden 2048, 32 query
and 4 kv heads of 128, 128 experts of 768, 8 a token) and a dense twin whose FFN has 8 x 768 = 6144 rows
(the same weights a token reads), both `--layers` deep with the tokenizer of the tiny Qwen3-MoE test
checkpoint, then prints one JSON line each: decode ms a token, ms a layer, file size; the MoE model twice,
with its merged expert tensors (cpu.linear_experts: each of gate, up, down one pass for the k experts)
and expert by expert. The ratio to the dense twin is what routing and small expert matrices cost over one
dense FFN of the same active size; the MoE file holds 16x the FFN weights, so it also shows that
untouched experts cost nothing but disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.backends import cpu  # noqa: E402
from engine.convert import convert  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.quant.gguf_writer import GGUFWriter  # noqa: E402
from models.formats.ggml_types import row_nbytes  # noqa: E402
from models.formats.gguf import open_gguf  # noqa: E402

Q4_0, F32 = 2, 0
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FF = 2048, 32, 4, 128, 128, 8, 768


def _q4_0(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random Q4_0 blocks (scale 0.01, random nibbles) for a float tensor of numpy shape `shape`."""
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, (rows, row_nbytes(Q4_0, shape[-1])), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, 18)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def shaped_metadata(base_md: dict, arch: str, layers: int, hidden: int, heads: int, kv_heads: int,
                    head_dim: int, theta: float, eps: float) -> tuple[dict, int]:
    """(GGUF metadata of `arch` with these hyper-parameters and base_md's tokenizer, its vocabulary size)."""
    md = {k: v for k, v in base_md.items() if not k.startswith(arch + ".")}
    md.update({
        f"{arch}.block_count": layers, f"{arch}.context_length": 4096, f"{arch}.embedding_length": hidden,
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": theta, f"{arch}.attention.layer_norm_rms_epsilon": eps,
    })
    return md, len(base_md["tokenizer.ggml.tokens"])


def write_model(path: Path, base_md: dict, layers: int, moe: bool, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    arch = "qwen3moe"
    md, vocab = shaped_metadata(base_md, arch, layers, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 1e6, 1e-6)
    md[f"{arch}.feed_forward_length"] = USED * EXPERT_FF
    if moe:
        md.update({f"{arch}.expert_count": EXPERTS, f"{arch}.expert_used_count": USED,
                   f"{arch}.expert_feed_forward_length": EXPERT_FF})
    specs = [("token_embd.weight", F32, (vocab, HIDDEN)), ("output_norm.weight", F32, (HIDDEN,)),
             ("output.weight", F32, (vocab, HIDDEN))]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", F32, (HIDDEN,)), (p + "ffn_norm.weight", F32, (HIDDEN,)),
                  (p + "attn_q_norm.weight", F32, (HEAD_DIM,)), (p + "attn_k_norm.weight", F32, (HEAD_DIM,)),
                  (p + "attn_q.weight", Q4_0, (q, HIDDEN)), (p + "attn_k.weight", Q4_0, (kv, HIDDEN)),
                  (p + "attn_v.weight", Q4_0, (kv, HIDDEN)), (p + "attn_output.weight", Q4_0, (HIDDEN, q))]
        if moe:
            specs += [(p + "ffn_gate_inp.weight", F32, (EXPERTS, HIDDEN)),
                      (p + "ffn_gate_exps.weight", Q4_0, (EXPERTS, EXPERT_FF, HIDDEN)),
                      (p + "ffn_up_exps.weight", Q4_0, (EXPERTS, EXPERT_FF, HIDDEN)),
                      (p + "ffn_down_exps.weight", Q4_0, (EXPERTS, HIDDEN, EXPERT_FF))]
        else:
            ff = USED * EXPERT_FF
            specs += [(p + "ffn_gate.weight", Q4_0, (ff, HIDDEN)), (p + "ffn_up.weight", Q4_0, (ff, HIDDEN)),
                      (p + "ffn_down.weight", Q4_0, (HIDDEN, ff))]
    with open(path, "wb") as fh:
        w = GGUFWriter(fh, md, specs)
        w.write_header()
        for name, t, shape in specs:
            if t == Q4_0:
                raw = _q4_0(rng, shape)
            elif name.endswith("norm.weight"):
                raw = np.ones(shape, np.float32).view(np.uint8)
            else:
                raw = (rng.standard_normal(shape) * 0.05).astype(np.float32).view(np.uint8)
            w.write_tensor(name, raw.reshape(-1))
        w.finish()


def decode_ms(path: Path, tokens: int, merged: bool = True) -> float:
    m = load_model(path).model
    if not merged:  # the expert-by-expert path (what Hugging Face folders and float experts run)
        for layer in m.layers:
            layer.moe.stacks = None
    cache = m.new_cache(tokens + 16)
    m.forward(list(range(3, 11)), cache)
    for t in range(3):  # warm up: compile and page in
        m.forward([20 + t], cache)
    start = time.perf_counter()
    for t in range(tokens):
        m.forward([30 + t % 200], cache)
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if args.threads:
        cpu.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = convert(ROOT / "tests" / "fixtures" / "tiny" / "qwen3moe", "F16", tmp / "tiny.gguf").output
        g = open_gguf(tiny)
        base = dict(g.metadata)
        g.close()
        for moe, merged in ((True, True), (True, False), (False, True)):
            path = tmp / ("moe.gguf" if moe else "dense.gguf")
            if not path.exists():
                write_model(path, base, args.layers, moe)
            ms = decode_ms(path, args.tokens, merged)
            name = "moe 128x768, 8 a token" if moe else "dense ff 6144"
            name += "" if merged else ", expert by expert"
            print(json.dumps({"model": name, "layers": args.layers, "decode_ms_per_token": round(ms, 2),
                              "ms_per_layer": round(ms / args.layers, 3),
                              "file_mb": round(path.stat().st_size / 1e6, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
