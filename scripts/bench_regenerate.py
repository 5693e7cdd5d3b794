"""Time a regenerate: a prompt prefilled cold, then the same prompt again from the cache it left.

    .venv/bin/python scripts/bench_regenerate.py MODEL [--prompt 1536] [--chunk 512] [--threads 2]

MODEL is any model path `load_model` takes (e.g. the GGUF scripts/bench_qwen3next.py writes). The prompt is
random token ids of the tokenizer's vocabulary; each line gives the tokens the cache kept, the tokens computed
again, the time to the first token and the greedy reply (the same for every run). A recurrent model's cache
(RecurrentKVCache) restarts a regenerate from its snapshot one token before the prompt's end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends import cpu  # noqa: E402
from engine.generate import GenerationParams, generate  # noqa: E402
from engine.loader import load_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        cpu.set_threads(args.threads)
    lm = load_model(args.model)
    model, tokenizer = lm.model, lm.tokenizer
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, tokenizer.vocab_size, args.prompt)]
    params = GenerationParams(max_tokens=args.tokens, temperature=0.0, prefill_chunk=args.chunk)
    list(generate(model, tokenizer, prompt[:32], model.new_cache(64), params))  # compile the kernels
    cache = model.new_cache(args.prompt + args.tokens + 1)
    for run in ("cold", "regenerate", "regenerate"):
        events = list(generate(model, tokenizer, prompt, cache, params))
        kept = events[-1].cached_tokens
        print(f"{run:10s} prompt {args.prompt}: kept {kept}, computed {args.prompt - kept}, "
              f"first token {events[-1].ttft_s:.3f} s, reply {[e.token for e in events]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
