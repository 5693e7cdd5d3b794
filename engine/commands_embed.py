"""`hearth embed -m MODEL "text" ...`: embeddings on the command line.

Each input (the arguments, or the lines of stdin when there are none) becomes one JSON array of floats on
its own line of stdout, in order (JSON Lines: `jq`, `numpy.loadtxt`-free parsing). Vectors are
L2-normalised unless --no-normalize; --dims keeps the first N components (Matryoshka models) and
normalises again; --truncate cuts inputs longer than the model takes instead of failing; --prompt applies
one of a sentence-transformers model's named prompts (Qwen3-Embedding's "query"). --bench times the
inputs instead (texts/s, tokens/s) and prints one summary line (JSON with --json).

Task prefixes are the caller's: nomic-embed-text wants "search_query: " before a query and
"search_document: " before a passage (EPILOG says so in --help).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

EPILOG = """\
Task prefixes: some models want the task written before each text, and Hearth adds nothing itself.
nomic-embed-text (v1, v1.5): "search_query: " before a question, "search_document: " before each passage
you search (also "clustering: ", "classification: "), e.g.
  hearth embed -m nomic-embed-text-v1.5.Q8_0.gguf "search_query: what is a hearth?"
Models whose sentence-transformers files name prompts (Qwen3-Embedding's "query") take --prompt NAME.
"""


def add_embed_parser(sub) -> None:
    p = sub.add_parser(
        "embed",
        help="print embedding vectors of texts (arguments or stdin lines) as JSON arrays, one per line",
        description="Print embedding vectors of texts (arguments or stdin lines) as JSON arrays, one a line.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-m", "--model", required=True, help="model file, Hugging Face folder or starter name")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("texts", nargs="*", help="texts to embed (default: one per line of stdin)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="L2-normalise each vector (default: on)")
    p.add_argument("--dims", type=int, default=None, help="keep the first N dimensions (then normalise)")
    p.add_argument("--truncate", action="store_true", help="cut inputs longer than the model takes")
    p.add_argument("--prompt", default=None, metavar="NAME",
                   help="a prompt the model names in config_sentence_transformers.json (e.g. query)")
    p.add_argument("--ctx", type=int, default=None, help="the most tokens per input (decoders; default: "
                   "the model's context)")
    p.add_argument("--bench", type=int, default=0, metavar="N",
                   help="embed the inputs N times and print texts/s and tokens/s instead of vectors")
    p.add_argument("--json", action="store_true", help="with --bench: one JSON object")


def cmd_embed(args) -> int:
    from engine.backends import cpu
    from engine.embed import embed_texts
    from engine.errors import EmbeddingInputError
    from engine.loader import load_model
    from models.resolve import resolve_model

    texts = list(args.texts)
    if not texts:
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise EmbeddingInputError(
            "nothing to embed: give texts as arguments or lines on stdin", "empty_input"
        )
    if args.threads:
        cpu.set_threads(args.threads)
    lm = load_model(resolve_model(args.model))
    options = dict(
        normalize=args.normalize, dims=args.dims, truncate=args.truncate, prompt_name=args.prompt,
        n_ctx=args.ctx,
    )
    if args.bench:
        embed_texts(lm, texts[:1], **options)  # compile / warm
        t0 = time.perf_counter()
        n_tokens = 0
        for _ in range(args.bench):
            _, counts = embed_texts(lm, texts, **options)
            n_tokens += sum(counts)
        seconds = time.perf_counter() - t0
        n_texts = len(texts) * args.bench
        figures = {"model": lm.name, "threads": cpu.get_threads(), "texts": n_texts, "tokens": n_tokens,
                   "seconds": round(seconds, 4), "texts_per_s": round(n_texts / seconds, 2),
                   "tokens_per_s": round(n_tokens / seconds, 1)}
        if args.json:
            print(json.dumps(figures))
        else:
            print(f"{lm.name}: {figures['texts_per_s']} texts/s, {figures['tokens_per_s']} tokens/s "
                  f"({n_texts} texts, {n_tokens} tokens, {cpu.get_threads()} threads)")
        return 0
    vectors, _ = embed_texts(lm, texts, **options)
    for v in vectors:
        print(json.dumps([float(x) for x in v]))
    return 0
