"""Time one latent-attention layer's branch, absorbed against decompressed (engine/arch/deepseek2.py), for a
pass of n tokens after P cached ones: the measurement behind DeepSeek2Model.decompress_min_tokens.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_mla_attention.py model.gguf \\
        --cached 0,512,2048,4096 --tokens 64,128,256,512 --runs 5

model.gguf: a deepseek2 model (scripts/make_random_deepseek2.py, converted). The cache's earlier rows are
random; each run alternates the two forms and the median of the runs is printed, with the largest
difference of the branch's outputs relative to their largest value.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.arch.base import Scratch
from engine.backends import cpu as ops
from engine.loader import load_model


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--cached", type=_ints, default=[0, 512, 2048, 4096])
    parser.add_argument("--tokens", type=_ints, default=[64, 128, 256, 512])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--f16", action="store_true", help="a float16 cache")
    args = parser.parse_args()
    ops.set_threads(args.threads)
    model = load_model(args.model).model
    cfg, layer = model.cfg, model.layers[args.layer]
    dtype = np.float16 if args.f16 else np.float32
    rng = np.random.default_rng(0)
    for p in args.cached:
        for n in args.tokens:
            cache = model.new_cache(p + n, dtype)
            rows = rng.standard_normal((cfg.num_hidden_layers, p, cache.k.shape[-1])) * 0.5
            cache.k[:, 0, :p] = rows.astype(dtype)
            cache.advance(np.ones(p, np.int64))
            s = Scratch(cfg, n)
            s.h[:] = rng.standard_normal(s.h.shape)
            s.positions[:] = np.arange(p, p + n)

            def attend(i, attn3, q3, k3, v3, cache=cache, p=p):
                keys, values = cache.update_and_fetch(i, k3, v3)
                ops.attention(attn3, q3, keys, values, p, model.scale)

            times, outs = {"absorbed": [], "decompressed": []}, {}
            with ops.batch_phase(n, model.small_batch_max):
                for run in range(args.runs + 1):  # the first, a warm-up, is not counted
                    for form in ("absorbed", "decompressed")[:: 1 if run % 2 else -1]:
                        model._pass = (cache, 0) if form == "decompressed" else None
                        t0 = time.perf_counter()
                        model._attention(s, args.layer, layer, attend, model.inv_freq)
                        if run:
                            times[form].append(time.perf_counter() - t0)
                        model._pass = None
                        outs[form] = s.o.copy()
            a, d = (float(np.median(times[f])) * 1e3 for f in ("absorbed", "decompressed"))
            diff = np.abs(outs["absorbed"] - outs["decompressed"]).max() / np.abs(outs["absorbed"]).max()
            print(f"P={p:5d} n={n:4d}  absorbed {a:8.2f} ms  decompressed {d:8.2f} ms  ratio {a / d:5.2f}  "
                  f"diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
