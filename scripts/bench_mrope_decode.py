"""Per-token decode time of a Qwen3.5 / Qwen3-VL model with an image in its history, at several context
lengths: M-RoPE positions of a decode step should not cost more at a longer context.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/bench_mrope_decode.py [FOLDER] \\
        --context 256,4096,16384 --steps 64 --threads 1

FOLDER (default: the tiny tests/fixtures/tiny/qwen3_5-vision, whose layers cost little, so that what grows
with the context shows) is a folder with a golden_vision.json whose prompt holds images; the prompt is
prefilled, text tokens fill the cache up to each context length, then `steps` greedy decode steps are timed
(median ms a token) along with the M-RoPE position lookup alone for one more token (median of `steps`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from engine.backends import cpu as ops
from engine.generate import prefill
from engine.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.engine.test_vision_mrope import golden_prompt  # noqa: E402

TINY = ROOT / "tests" / "fixtures" / "tiny" / "qwen3_5-vision"


def _lookup(model, cache) -> None:
    """The M-RoPE positions of one more text token, as the decode step computes them."""
    table = model.images
    if hasattr(table, "cache_positions"):
        table.cache_positions(cache, [5])
    else:  # before the positions were kept with the cache
        table.positions(cache.tokens, [5])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=str(TINY))
    parser.add_argument("--context", default="256,4096,16384")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ops.set_threads(args.threads)
    folder = Path(args.folder)
    lm = load_model(folder)
    model = lm.model
    ids = golden_prompt(lm, folder)
    rng = np.random.default_rng(0)
    for n_ctx in (int(v) for v in args.context.split(",")):
        fill = rng.integers(10, 200, max(0, n_ctx - len(ids))).tolist()
        cache = model.new_cache(n_ctx + args.steps + 2)
        prefill(model, cache, ids + fill, 512)
        token, steps = 5, []
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            token = int(np.argmax(model.forward([token], cache)[-1]))
            steps.append(time.perf_counter() - t0)
        lookups = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            _lookup(model, cache)
            lookups.append(time.perf_counter() - t0)
        context = cache.offset - args.steps - 1
        print(f"context {context:6d}: decode {np.median(steps[1:]) * 1e3:7.3f} ms a token, M-RoPE positions "
              f"{np.median(lookups) * 1e3:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
