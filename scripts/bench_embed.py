"""Embedding throughput: texts/s and tokens/s of `engine.embed.embed_texts`, reported, not asserted.

    .venv/bin/python scripts/bench_embed.py [--threads 2] [--repeat 3]

Models: a randomly initialised BERT of bge-small-en-v1.5's shape (12 layers, hidden 384, 12 heads, FFN 1536,
30522-token vocabulary, 512 positions; written here with numpy as a Hugging Face folder, F32, and converted
to a Q8_0 GGUF by `hearth convert`), and the tiny test fixtures bert-embed, nomic-embed, xlmr-embed,
modernbert-embed and qwen3-embed. The texts are short sentences and paragraphs of a RAG corpus's kind;
tokens are counted as each model's tokenizer gives them (the bge-shaped model borrows the tiny fixture's
WordPiece vocabulary, so its words split into more pieces than bge's would: the token figures are what matter
there). An encoder embeds all 16 texts in one pass (engine.embed.batches), so a run's figures are a batched
pass's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny"
TEXTS = [
    "What is the capital of France?",
    "Embeddings map text to vectors so that similar meanings land close together.",
    "The cat sat on the mat. " * 4,
    "Retrieval-augmented generation looks up passages relevant to a question and hands them to the model "
    "along with the question, so its answer can quote them instead of guessing.",
] * 4


def bge_small_folder(out: Path) -> Path:
    """A random BertModel of bge-small-en-v1.5's shape, in safetensors, with the tiny fixture's tokenizer."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    d, ff, layers, vocab, pos = 384, 1536, 12, 30522, 512

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    t = {
        "embeddings.word_embeddings.weight": w(vocab, d),
        "embeddings.position_embeddings.weight": w(pos, d),
        "embeddings.token_type_embeddings.weight": w(2, d),
        "embeddings.LayerNorm.weight": np.ones(d, np.float32),
        "embeddings.LayerNorm.bias": np.zeros(d, np.float32),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name, rows, cols in (("attention.self.query", d, d), ("attention.self.key", d, d),
                                 ("attention.self.value", d, d), ("attention.output.dense", d, d),
                                 ("intermediate.dense", ff, d), ("output.dense", d, ff)):
            t[p + name + ".weight"], t[p + name + ".bias"] = w(rows, cols), w(rows)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + norm + ".weight"], t[p + norm + ".bias"] = np.ones(d, np.float32), np.zeros(d, np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    config = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": d, "intermediate_size": ff,
              "num_hidden_layers": layers, "num_attention_heads": 12, "vocab_size": vocab,
              "max_position_embeddings": pos, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
              "hidden_act": "gelu"}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "modules.json"):
        shutil.copy(TINY / "bert-embed" / name, out / name)
    shutil.copytree(TINY / "bert-embed" / "1_Pooling", out / "1_Pooling")
    return out


def bench(path: Path, repeat: int) -> dict:
    from engine.embed import embed_texts
    from engine.loader import load_model

    lm = load_model(path)
    embed_texts(lm, TEXTS[:4], truncate=True)  # warm: kernels loaded or compiled
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        _, counts = embed_texts(lm, TEXTS, truncate=True)
        seconds = time.perf_counter() - t0
        best = seconds if best is None else min(best, seconds)
    tokens = sum(counts)
    return {"model": path.name, "texts": len(TEXTS), "tokens": tokens, "seconds": round(best, 4),
            "texts_per_s": round(len(TEXTS) / best, 1), "tokens_per_s": round(tokens / best, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="runs per model; the best is reported")
    args = parser.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    sys.path.insert(0, str(ROOT))
    from engine.convert import convert

    with tempfile.TemporaryDirectory() as tmp:
        folder = bge_small_folder(Path(tmp) / "bge-small-random")
        gguf = Path(tmp) / "bge-small-random-Q8_0.gguf"
        convert(folder, "Q8_0", gguf)
        fixtures = ("bert-embed", "nomic-embed", "xlmr-embed", "modernbert-embed", "qwen3-embed")
        for path in (folder, gguf, *(TINY / name for name in fixtures)):
            print(json.dumps({**bench(path, args.repeat), "threads": args.threads}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
