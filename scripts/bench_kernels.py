"""Benchmark the CPU backend's linear kernels at SmolLM2-135M shapes.

Prints, per ggml type, decode matvec throughput (G weights/s) for each matrix shape, and prefill
(n_tok=512) GFLOP/s, plus the per-token decode time those figures imply for the whole model.
The per-shape figures run one matrix over and over, so a layer matrix sits in the caches; the
"model pass" line runs every matrix of the model once (30 layers' own copies plus the output
matrix, ~100 MB for Q4_1), so the weights stream from DRAM as in a real decode step.
Times are the best of several repeats (the machine may be shared); compare runs back to back.

    .venv/bin/python scripts/bench_kernels.py [--threads 2] [--types Q4_1,Q8_0] [--prefill-tokens 512]
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

# SmolLM2-135M: (rows, cols, matrices per token) — q/o, k/v, gate/up, down per layer x 30 layers
LAYER_SHAPES = [(576, 576, 60), (192, 576, 60), (1536, 576, 60), (576, 1536, 30)]
OUTPUT_SHAPE = (49152, 576, 1)
TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q8_0": 8, "Q4_0": 2, "Q4_1": 3}


def make_weight(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> Weight:
    dense = rng.standard_normal((rows, cols), dtype=np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(dense, gguf.GGMLQuantizationType(ggml_type)))
    return Weight(ggml_type, raw.view(np.uint8).reshape(rows, -1), rows, cols)


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


def model_pass(ggml_type: int, rng: np.random.Generator) -> str:
    """Decode matvecs over a whole model's worth of distinct matrices; returns the figures as text."""
    weights = []
    for rows, cols, per_token in LAYER_SHAPES + [OUTPUT_SHAPE]:
        w = make_weight(ggml_type, rows, cols, rng)
        # per-layer copies of one random matrix: the bytes differ in address, which is what matters here
        weights += [Weight(ggml_type, w.raw.copy(), rows, cols) for _ in range(per_token)]
    xs = {cols: rng.standard_normal((1, cols), dtype=np.float32) for _, cols, _ in LAYER_SHAPES}
    outs = [np.empty((1, w.rows), np.float32) for w in weights]
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        for w, out in zip(weights, outs):
            cpu.linear(out, w, xs[w.cols])
        best = min(best, time.perf_counter() - t)
    n = sum(w.rows * w.cols for w in weights)
    mb = sum(w.nbytes for w in weights) / 2**20
    return f"{len(weights)} matrices, {mb:.0f} MB: {best * 1e3:.2f} ms, {n / best / 1e9:.1f} G weights/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--prefill-tokens", type=int, default=512)
    args = ap.parse_args()
    threads = cpu.set_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"threads={threads}; decode figures are best-of-N G weights/s, prefill GFLOP/s")
    for name in args.types.split(","):
        t = TYPES[name]
        decode_s = 0.0
        cells = []
        for rows, cols, per_token in LAYER_SHAPES + [OUTPUT_SHAPE]:
            w = make_weight(t, rows, cols, rng)
            x = rng.standard_normal((1, cols), dtype=np.float32)
            out = np.empty((1, rows), np.float32)
            dt = best_time(out, w, x, 30, 0.3)
            decode_s += dt * per_token
            cells.append(f"{rows}x{cols} {rows * cols / dt / 1e9:5.1f}")
        cells.append(f"| {1 / decode_s:6.1f} tok/s if all weights were {name}")
        print(f"{name:5} decode  " + "  ".join(cells))
        print(f"{name:5} decode  model pass " + model_pass(t, rng))
        cells = []
        n = args.prefill_tokens
        for rows, cols in [(1536, 576), (576, 1536), (49152, 576)]:
            w = make_weight(t, rows, cols, rng)
            x = rng.standard_normal((n, cols), dtype=np.float32)
            out = np.empty((n, rows), np.float32)
            dt = best_time(out, w, x, 3, 0.5)
            cells.append(f"{rows}x{cols} {2 * n * rows * cols / dt / 1e9:6.1f}")
        print(f"{name:5} prefill n_tok={n}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
