"""Benchmark the CPU backend's linear kernels at SmolLM2-135M or Gemma-3-270M shapes.

Prints, per ggml type, decode matvec throughput (G weights/s) for each matrix shape, and prefill
(n_tok=512) GFLOP/s, plus the per-token decode time those figures imply for the whole model.
The per-shape figures run one matrix over and over, so a layer matrix sits in the caches; the
"model pass" line runs every matrix of the model once (each layer's own copy plus the output
matrix), so the weights stream from DRAM as in a real decode step. Shapes whose column count is
not a multiple of the type's block (K-quants need 256) are skipped.
--gguf FILE instead runs decode matvecs over every 2-D tensor of a real model file in its own
types (the tied embedding once more as the output matrix): the matvec time of one decode step.
Times are the best of several repeats (the machine may be shared); compare runs back to back.

    .venv/bin/python scripts/bench_kernels.py [--threads 2] [--model smollm2|gemma3] [--types Q4_K,Q5_0]
        [--prefill-tokens 512] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402

import engine  # noqa: E402, F401  (sets NUMBA_CACHE_DIR before the kernels compile)
from engine.backends import cpu  # noqa: E402
from engine.weights import Weight  # noqa: E402
from models.formats.gguf import open_gguf  # noqa: E402

# model -> (layer shapes as (rows, cols, matrices per token), output matrix (rows, cols, 1))
MODELS = {
    # SmolLM2-135M: q/o, k/v, gate/up, down per layer x 30 layers
    "smollm2": ([(576, 576, 60), (192, 576, 60), (1536, 576, 60), (576, 1536, 30)], (49152, 576, 1)),
    # Gemma-3-270M: q, k/v, o, gate/up, down per layer x 18 layers; a 262144-token tied output
    "gemma3": ([(1024, 640, 18), (256, 640, 36), (640, 1024, 18), (2048, 640, 36), (640, 2048, 18)],
               (262144, 640, 1)),
}
TYPES = {t.name: int(t) for t in gguf.GGMLQuantizationType if int(t) in cpu.SUPPORTED_TYPES}
# byte offsets of the f16 scale fields in a block of the types gguf cannot quantize to
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}


def make_weight(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> Weight:
    """Random weight: gguf's quantizer where it has one, else random bytes with sane f16 scales."""
    qtype = gguf.GGMLQuantizationType(ggml_type)
    try:
        dense = rng.standard_normal((rows, cols), dtype=np.float32)
        raw = np.ascontiguousarray(gguf.quants.quantize(dense, qtype)).view(np.uint8).reshape(rows, -1)
    except NotImplementedError:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
        for off in F16_FIELDS[qtype.name]:  # sane scales: no inf/nan/subnormal arithmetic in the timing
            scales = rng.uniform(1e-3, 5e-2, (raw.shape[0], 1)).astype(np.float16)
            raw[:, off : off + 2] = scales.view(np.uint8)
        raw = raw.reshape(rows, -1)
    return Weight(ggml_type, raw, rows, cols)


def fits(ggml_type: int, cols: int) -> bool:
    return cols % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)][0] == 0


def best_time(out: np.ndarray, w: Weight, x: np.ndarray, min_repeats: int, min_seconds: float) -> float:
    """Best wall time of cpu.linear(out, w, x) over at least min_repeats calls and min_seconds."""
    cpu.linear(out, w, x)
    best, spent, n = float("inf"), 0.0, 0
    while n < min_repeats or spent < min_seconds:
        t = time.perf_counter()
        cpu.linear(out, w, x)
        dt = time.perf_counter() - t
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def model_pass(ggml_type: int, shapes: list, rng: np.random.Generator) -> str:
    """Decode matvecs over a whole model's worth of distinct matrices; returns the figures as text."""
    weights = []
    for rows, cols, per_token in shapes:
        w = make_weight(ggml_type, rows, cols, rng)
        # per-layer copies of one random matrix: the bytes differ in address, which is what matters here
        weights += [Weight(ggml_type, w.raw.copy(), rows, cols) for _ in range(per_token)]
    return timed_pass(weights, rng)


def timed_pass(weights: list[Weight], rng: np.random.Generator) -> str:
    """Best time of one decode matvec on each weight in turn; the figures as text."""
    xs = {w.cols: rng.standard_normal((1, w.cols), dtype=np.float32) for w in weights}
    outs = [np.empty((1, w.rows), np.float32) for w in weights]
    for w, out in zip(weights, outs):  # compile / fault in outside the timing
        cpu.linear(out, w, xs[w.cols])
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        for w, out in zip(weights, outs):
            cpu.linear(out, w, xs[w.cols])
        best = min(best, time.perf_counter() - t)
    n = sum(w.rows * w.cols for w in weights)
    mb = sum(w.nbytes for w in weights) / 2**20
    return (f"{len(weights)} matrices, {mb:.0f} MB: {best * 1e3:.2f} ms, {n / best / 1e9:.1f} G weights/s"
            f" (= {1 / best:.1f} tok/s of matvecs)")


def gguf_pass(path: str, rng: np.random.Generator) -> str:
    """Decode matvecs over every 2-D tensor of a real file, plus the tied output matrix if there is one."""
    f = open_gguf(path)
    weights = []
    for name, t in f.tensors.items():
        if len(t.shape) == 2 and int(t.ggml_type) in cpu.SUPPORTED_TYPES:
            rows, cols = t.shape
            w = Weight(int(t.ggml_type), t.raw(), rows, cols)
            if name != "token_embd.weight" or "output.weight" not in f.tensors:
                weights.append(w)  # the embedding itself is a row lookup, not a matvec
    kinds = sorted({gguf.GGMLQuantizationType(w.ggml_type).name for w in weights})
    return f"{Path(path).name} ({', '.join(kinds)}): " + timed_pass(weights, rng)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--types", default="F32,F16,BF16,Q8_0,Q4_0,Q4_1")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--gguf", help="time decode matvecs over this model file's own tensors and exit")
    args = ap.parse_args()
    threads = cpu.set_threads(args.threads)
    rng = np.random.default_rng(0)
    if args.gguf:
        print(f"threads={threads}; " + gguf_pass(args.gguf, rng))
        return
    layer_shapes, output_shape = MODELS[args.model]
    print(f"threads={threads}; {args.model} shapes; decode: best-of-N G weights/s; prefill: GFLOP/s")
    for name in args.types.split(","):
        t = TYPES[name]
        shapes = [s for s in layer_shapes + [output_shape] if fits(t, s[1])]
        decode_s = 0.0
        cells = []
        for rows, cols, per_token in shapes:
            w = make_weight(t, rows, cols, rng)
            x = rng.standard_normal((1, cols), dtype=np.float32)
            out = np.empty((1, rows), np.float32)
            dt = best_time(out, w, x, 30, 0.3)
            decode_s += dt * per_token
            cells.append(f"{rows}x{cols} {rows * cols / dt / 1e9:5.1f}")
        if len(shapes) == len(layer_shapes) + 1:
            cells.append(f"| {1 / decode_s:6.1f} tok/s if all weights were {name}")
        print(f"{name:5} decode  " + "  ".join(cells))
        print(f"{name:5} decode  model pass " + model_pass(t, shapes, rng))
        cells = []
        n = args.prefill_tokens
        big = sorted(layer_shapes, key=lambda s: -s[0] * s[1])[:2] + [output_shape]
        for rows, cols, _ in [s for s in big if fits(t, s[1])]:
            w = make_weight(t, rows, cols, rng)
            x = rng.standard_normal((n, cols), dtype=np.float32)
            out = np.empty((n, rows), np.float32)
            dt = best_time(out, w, x, 3, 0.5)
            cells.append(f"{rows}x{cols} {2 * n * rows * cols / dt / 1e9:6.1f}")
        print(f"{name:5} prefill n_tok={n}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
