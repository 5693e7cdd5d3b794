"""Decode and prefill speed of gpt-oss-20b-shaped layers on the CPU (random weights).

    .venv/bin/python scripts/bench_gpt_oss.py [--layers 4] [--threads 2] [--tokens 32] [--prompt 128]

Writes a GGUF in llama.cpp's gpt-oss layout with gpt-oss-20b's layer shape (hidden 2880, 64 query and 8 kv
heads of 64, attention sinks and biases, a window of 128 on the even layers, 32 experts of 2880 with 4 a
token, experts MXFP4 as the release ships them, attention Q8_0) and the tokenizer of the tiny gpt-oss test
checkpoint, `--layers` deep, then prints one JSON line: decode ms a token and a layer, prefill tokens a
second, the file size. gpt-oss-20b has 24 such layers plus a 201088 x 2880 output matrix (Q8_0 in
llama.cpp's files: about 0.6 GB read a token), which this leaves out; per-layer figures scale.
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
from scripts.bench_moe import shaped_metadata  # noqa: E402

F32, Q8_0, MXFP4 = 0, 8, 39
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FF, WINDOW = 2880, 64, 8, 64, 32, 4, 2880, 128


def _random_blocks(rng: np.random.Generator, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random blocks of a quantized type with sane scales (Q8_0: f16 0.01; MXFP4: exponents near 2^-7)."""
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, (rows, row_nbytes(ggml_type, shape[-1])), dtype=np.uint8)
    if ggml_type == Q8_0:
        raw.reshape(rows, -1, 34)[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    else:
        raw.reshape(rows, -1, 17)[:, :, 0] = rng.integers(118, 122, (rows, shape[-1] // 32))
    return raw


def write_model(path: Path, base_md: dict, layers: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    arch = "gpt-oss"
    md, vocab = shaped_metadata(base_md, arch, layers, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 150000.0, 1e-5)
    md.update({
        f"{arch}.feed_forward_length": EXPERT_FF, f"{arch}.expert_feed_forward_length": EXPERT_FF,
        f"{arch}.expert_count": EXPERTS, f"{arch}.expert_used_count": USED,
        f"{arch}.attention.sliding_window": WINDOW,
        f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": 32.0,
        f"{arch}.rope.scaling.original_context_length": 4096,
    })
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    specs = [("token_embd.weight", F32, (vocab, HIDDEN)), ("output_norm.weight", F32, (HIDDEN,)),
             ("output.weight", F32, (vocab, HIDDEN))]
    for i in range(layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", F32, (HIDDEN,)), (p + "attn_sinks.weight", F32, (HEADS,)),
                  (p + "post_attention_norm.weight", F32, (HIDDEN,)),
                  (p + "attn_q.weight", Q8_0, (q, HIDDEN)), (p + "attn_q.bias", F32, (q,)),
                  (p + "attn_k.weight", Q8_0, (kv, HIDDEN)), (p + "attn_k.bias", F32, (kv,)),
                  (p + "attn_v.weight", Q8_0, (kv, HIDDEN)), (p + "attn_v.bias", F32, (kv,)),
                  (p + "attn_output.weight", Q8_0, (HIDDEN, q)), (p + "attn_output.bias", F32, (HIDDEN,)),
                  (p + "ffn_gate_inp.weight", F32, (EXPERTS, HIDDEN)),
                  (p + "ffn_gate_inp.bias", F32, (EXPERTS,))]
        for kind, (rows, cols) in {"gate": (EXPERT_FF, HIDDEN), "up": (EXPERT_FF, HIDDEN),
                                   "down": (HIDDEN, EXPERT_FF)}.items():
            specs += [(p + f"ffn_{kind}_exps.weight", MXFP4, (EXPERTS, rows, cols)),
                      (p + f"ffn_{kind}_exps.bias", F32, (EXPERTS, rows))]
    with open(path, "wb") as fh:
        w = GGUFWriter(fh, md, specs)
        w.write_header()
        for name, t, shape in specs:
            if t == F32:
                scale = 1.0 if name.endswith("norm.weight") else 0.02
                x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
                if name.endswith("norm.weight"):
                    x = np.abs(x)
                w.write_tensor(name, x.view(np.uint8).reshape(-1))
            else:
                w.write_tensor(name, _random_blocks(rng, t, shape).reshape(-1))
        w.finish()


def measure(path: Path, tokens: int, prompt: int) -> dict:
    lm = load_model(path)
    model = lm.model
    rng = np.random.default_rng(1)
    ids = rng.integers(3, model.cfg.vocab_size, prompt + tokens).tolist()
    cache = model.new_cache(prompt + tokens + 8)
    # compile, and map every expert's pages once (a long chat touches them all; the first touch of each
    # page is a fault that a running model pays once)
    model.forward(ids[:prompt], cache)
    for t in ids[prompt : prompt + 4]:
        model.forward([t], cache)
    cache.trim(cache.offset)
    t0 = time.perf_counter()
    model.forward(ids[:prompt], cache)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in ids[prompt:]:
        model.forward([t], cache)
    ms = (time.perf_counter() - t0) * 1000 / tokens
    layers = model.cfg.num_hidden_layers
    return {"decode_ms_per_token": round(ms, 2), "decode_ms_per_layer": round(ms / layers, 2),
            "prefill_tokens_per_s": round(prompt / t_prefill, 1), "prompt": prompt, "layers": layers,
            "file_mb": round(path.stat().st_size / 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    if args.threads:
        cpu.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = convert(ROOT / "tests" / "fixtures" / "tiny" / "gpt-oss", "F32", Path(tmp) / "t.gguf").output
        base_md = dict(open_gguf(tiny).metadata)
        path = Path(tmp) / "gpt-oss-shaped.gguf"
        write_model(path, base_md, args.layers)
        print(json.dumps({"model": "gpt-oss-20b-shaped", "threads": cpu.get_threads(),
                          **measure(path, args.tokens, args.prompt)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
