"""`hearth` command line: run, chat, tokenize, bench, embed (and the library, quantization and server
commands).

Heavy imports (numpy, numba, the engine) happen after argument parsing, so that `--threads`
can size OpenBLAS's pool (it reads its environment once, when numpy loads).
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_CTX = 4096

# subcommand -> "module:function(args) -> exit code"; imported only when that command runs
HANDLERS = {
    "run": "engine.commands:cmd_run",
    "chat": "engine.commands:cmd_chat",
    "tokenize": "engine.commands:cmd_tokenize",
    "bench": "engine.commands:cmd_bench",
    "search": "engine.commands_library:cmd_search",
    "pull": "engine.commands_library:cmd_pull",
    "ls": "engine.commands_library:cmd_ls",
    "rm": "engine.commands_library:cmd_rm",
    "import": "engine.commands_library:cmd_import",
    "convert": "engine.commands_quant:cmd_convert",
    "eval": "engine.commands_quant:cmd_eval",
    "quant-report": "engine.commands_quant:cmd_quant_report",
    "serve": "engine.commands_server:cmd_serve",
    "embed": "engine.commands_embed:cmd_embed",
}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help="model file path or starter model name")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument(
        "--ctx", type=int, default=DEFAULT_CTX, help=f"context length in tokens (default {DEFAULT_CTX})"
    )


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N (GPU N); without CuPy or a GPU it runs on the CPU and says so",
    )
    p.add_argument(
        "-ngl",
        "--gpu-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --device cuda: put only the first N layers on the GPU, the rest run on the CPU "
        "(default: all layers)",
    )


# sampling options not given on the command line: a preset's value (-m PRESET), else these
SAMPLING_DEFAULTS = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    # None: not given (a preset's parameter, else the default, applies: engine.commands._params)
    d = SAMPLING_DEFAULTS
    p.add_argument("-n", "--max-tokens", type=int, default=None, help=f"default {max_tokens}")
    p.set_defaults(max_tokens_default=max_tokens)
    p.add_argument("--temperature", "--temp", type=float, default=None,
                   help=f"0 = greedy (default {d['temperature']})")
    p.add_argument("--top-k", type=int, default=None, help=f"default {d['top_k']}")
    p.add_argument("--top-p", type=float, default=None, help=f"default {d['top_p']}")
    p.add_argument("--min-p", type=float, default=None, help=f"default {d['min_p']}")
    p.add_argument("--repeat-penalty", type=float, default=None, help=f"default {d['repeat_penalty']}")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hearth", description="Chat with language models on your own machine."
    )
    from models.version import VERSION

    parser.add_argument("--version", action="version", version=f"hearth {VERSION}")
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="check this installation: load the starter model, generate a few tokens, check the data "
        "folders are writable; prints one PASS/FAIL line (exit status 0/1)",
    )
    sub = parser.add_subparsers(dest="command")  # required unless --self-test (checked in main)

    run = sub.add_parser("run", help="generate a reply to one prompt (streams to stdout)")
    _add_model_args(run)
    _add_sampling_args(run, 256)
    run.add_argument("prompt")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument(
        "--image", action="append", default=[], metavar="FILE",
        help="an image for a vision model (Gemma 3 and 4, Mistral 3, Qwen3.5, Qwen3-VL, Qwen2-VL and "
        "Qwen2.5-VL; a GGUF needs its mmproj beside it), before the prompt; repeatable; implies --chat",
    )
    run.add_argument("--system", default=None, help="system prompt (with --chat)")
    run.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    add_device_args(run)

    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_model_args(chat)
    _add_sampling_args(chat, 1024)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--doc", action="append", default=[], metavar="FILE",
        help="a document (PDF, .docx, HTML, text, source code) the chat is about; repeatable. Whole when it "
        "fits the context, else the parts that best match each question",
    )
    chat.add_argument(
        "--embed-model", default=None, metavar="MODEL",
        help="an embedding model (file or folder) that finds the parts of long documents by "
        "meaning as well as keywords (default: the library's first embedding model; 'none': keywords only)",
    )
    chat.add_argument(
        "--mcp",
        action="store_true",
        help="use the tools of the MCP servers in mcp.json (Hearth's config dir); asks before each call",
    )
    chat.add_argument(
        "--mcp-config", default=None, metavar="FILE", help="an mcp.json elsewhere; implies --mcp"
    )
    add_device_args(chat)

    tok = sub.add_parser("tokenize", help="print the token ids of a text")
    tok.add_argument("-m", "--model", default=DEFAULT_MODEL)
    tok.add_argument("text")
    tok.add_argument("--special", action="store_true", help="add BOS/EOS as the model's metadata asks")
    tok.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="measure load time, prefill and decode speed, TTFT and peak memory")
    _add_model_args(bench)
    bench.add_argument("-p", "--prompt-tokens", type=int, default=512)
    bench.add_argument("-g", "--gen-tokens", type=int, default=128)
    bench.add_argument(
        "-r", "--repetitions", type=int, default=1, help="repeat prefill/decode, report the best"
    )
    bench.add_argument("--json", action="store_true")
    bench.add_argument(
        "--image", default=None, metavar="FILE",
        help="also time a chat prompt with this image (vision models): reading the image, its prefill, TTFT",
    )
    add_device_args(bench)
    bench.add_argument(
        "--chat",
        action="store_true",
        help="scripted 8-turn chat: prefilled tokens, TTFT and tok/s per turn, with and without KV reuse "
        "(-g: reply tokens per turn)",
    )
    from engine.commands_spec import add_spec_bench_args

    add_spec_bench_args(bench)
    _add_library_parsers(sub)
    from engine.commands_quant import _add_quant_parsers

    _add_quant_parsers(sub)
    from engine.commands_server import add_serve_parser

    add_serve_parser(sub)
    from engine.commands_embed import add_embed_parser

    add_embed_parser(sub)
    return parser


def _add_library_parsers(sub) -> None:
    search = sub.add_parser("search", help="search models on the Hugging Face Hub")
    search.add_argument("query", nargs="?", default="")
    search.add_argument("--format", choices=("gguf", "safetensors"), default=None)
    search.add_argument("--sort", choices=("downloads", "likes", "recent"), default="downloads")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--json", action="store_true")

    pull = sub.add_parser("pull", help="download a model: REPO, REPO:QUANT, REPO:FILE or a starter name")
    pull.add_argument("spec")
    pull.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    pull.add_argument("--parallel", type=int, default=2, help="files downloaded at once")
    pull.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="context length for the fit estimate")

    ls = sub.add_parser("ls", help="list the models in the library")
    ls.add_argument("--no-scan", action="store_true", help="skip looking into the Hugging Face cache")
    ls.add_argument("--json", action="store_true")
    ls.add_argument(
        "--drafts-for",
        metavar="MODEL",
        default=None,
        help="list the local models that can draft for MODEL (same tokenizer, smaller), smallest first",
    )

    rm = sub.add_parser("rm", help="remove a model (and files Hearth downloaded) or a preset")
    rm.add_argument("model", help="id, path or REPO:FILE as `hearth ls` shows, or a preset's name")
    rm.add_argument("--delete-files", action="store_true", help="also delete files imported in place")

    imp = sub.add_parser("import", help="add a model file or folder to the library (indexed in place)")
    imp.add_argument("path")
    imp.add_argument("--copy", action="store_true", help="copy it into the library folder")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.self_test:
        from engine.selftest import main as self_test

        return self_test()
    if args.command is None:
        parser.error("a command is required (or --self-test)")
    if getattr(args, "threads", None):
        if args.threads < 1:
            print("hearth: --threads must be at least 1", file=sys.stderr)
            return 2
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            os.environ[var] = str(args.threads)

    from models.errors import HearthError

    try:
        import importlib

        module, function = HANDLERS[args.command].split(":")
        return getattr(importlib.import_module(module), function)(args)
    except HearthError as e:
        print(f"hearth: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
