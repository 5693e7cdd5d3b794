"""CLI for quantization: `hearth convert`, `hearth eval ppl`, `hearth quant-report`."""

from __future__ import annotations

import json
import sys
import time


def _add_quant_parsers(sub) -> None:
    conv = sub.add_parser("convert", help="convert a GGUF or Hugging Face folder to another format")
    conv.add_argument("src", nargs="?", help="GGUF file or Hugging Face folder")
    conv.add_argument("--to", dest="to", help="target format: Q4_K_M, Q8_0, F16, mixed:4.5, safetensors, ...")
    conv.add_argument("-o", "--output", default=None, help="output file/folder (default: next to SRC)")
    conv.add_argument("--force", action="store_true", help="replace an existing output")
    conv.add_argument("--dtype", default=None, help="safetensors export: f16 (default), bf16 or f32")
    conv.add_argument("--calib", default=None, help="AWQ calibration text file (default: the built-in set)")
    conv.add_argument("--list", action="store_true", help="list the target formats")
    conv.add_argument("--json", action="store_true", help="print the result as JSON")
    conv.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")

    ev = sub.add_parser("eval", help="evaluate a model")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser("ppl", help="sliding-window perplexity on a text")
    ppl.add_argument("-m", "--model", required=True, help="model file, folder or starter name")
    ppl.add_argument("--text", default=None, help="UTF-8 text file (default: resources/eval/default.txt)")
    ppl.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    ppl.add_argument("--stride", type=int, default=256, help="window step in tokens (default 256)")
    ppl.add_argument(
        "--llamacpp",
        action="store_true",
        help="score like llama-perplexity: disjoint ctx chunks, second half of each",
    )
    ppl.add_argument("--json", action="store_true")
    ppl.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")

    qr = sub.add_parser("quant-report", help="size, bits/weight, perplexity and speed of each quantization")
    qr.add_argument("src", help="GGUF file or Hugging Face folder")
    qr.add_argument("--formats", default=None, help="comma-separated formats (default: Q8_0..Q2_K)")
    qr.add_argument("--text", default=None, help="evaluation text file")
    qr.add_argument("--ctx", type=int, default=512)
    qr.add_argument("--stride", type=int, default=256)
    qr.add_argument("--keep", default=None, help="keep the converted files in this folder")
    qr.add_argument("--json", action="store_true")
    qr.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")


class _Progress:
    """One updating stderr line per conversion."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, done: int, total: int, message: str) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        pct = 100.0 * done / total if total else 100.0
        sys.stderr.write(f"\r{pct:5.1f}% {message[:90]:<90}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def cmd_convert(args) -> int:
    from engine.convert import convert
    from engine.quant import registry

    if args.list:
        for fmt in registry.formats():
            name = fmt.name + (":BPW" if fmt.takes_param else "")
            print(f"{name:<12} {fmt.container:<12} {fmt.description}")
        return 0
    if not args.src or not args.to:
        print("hearth convert: SRC and --to FORMAT are required (see --list)", file=sys.stderr)
        return 2
    options = {"dtype": args.dtype} if args.dtype else {}
    if args.calib:
        options["calibration"] = args.calib
    outcome = convert(
        args.src, args.to, args.output, options=options, progress=_Progress(), overwrite=args.force
    )
    if args.json:
        print(
            json.dumps(
                {
                    "output": str(outcome.output),
                    "format": outcome.format,
                    "seconds": outcome.seconds,
                    "bytes": outcome.nbytes,
                    "tensor_types": outcome.result.tensor_types,
                    "mmproj": str(outcome.mmproj) if outcome.mmproj else None,
                    **outcome.result.extra,
                },
                indent=2,
            )
        )
    else:
        for line in outcome.result.report:
            print(line)
        print(
            f"wrote {outcome.output} ({outcome.nbytes / 1e6:.1f} MB, {outcome.format}) "
            f"in {outcome.seconds:.1f} s"
        )
        if outcome.mmproj:
            print(f"wrote {outcome.mmproj} (the vision tower, for images)")
    return 0


def cmd_eval(args) -> int:
    from engine.loader import load_model
    from engine.perplexity import bos_for, llamacpp_perplexity, load_text, perplexity_detail
    from models.resolve import resolve_model

    text = load_text(args.text)
    loaded = load_model(resolve_model(args.model))
    tokens = loaded.tokenizer.encode(text, add_special=True)
    if args.llamacpp:
        res = llamacpp_perplexity(loaded.model, tokens, args.ctx, bos_for(loaded))
    else:
        res = perplexity_detail(loaded.model, tokens, args.ctx, args.stride, bos_id=bos_for(loaded))
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(loaded.path),
                    "ppl": res.ppl,
                    "nll": res.nll,
                    "n_scored": res.n_scored,
                    "n_tokens": res.n_tokens,
                    "ctx": res.ctx,
                    "stride": res.stride,
                    "mode": "llamacpp" if args.llamacpp else "sliding",
                    "seconds": res.seconds,
                }
            )
        )
    else:
        print(
            f"perplexity {res.ppl:.4f} over {res.n_scored} tokens (ctx {res.ctx}, stride {res.stride}, "
            f"{'llama.cpp chunks' if args.llamacpp else 'sliding window'}, {res.seconds:.1f} s)"
        )
    return 0


def cmd_quant_report(args) -> int:
    from engine.quant_report import DEFAULT_FORMATS, format_table, quant_report

    formats = tuple(f.strip() for f in args.formats.split(",")) if args.formats else DEFAULT_FORMATS
    report = quant_report(
        args.src,
        formats,
        args.text,
        args.ctx,
        args.stride,
        args.keep,
        progress=lambda m: print(m, file=sys.stderr),
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
        print(f"saved {report['path']}")
    return 0
