"""`hearth quant-report SRC`: what each quantization costs and loses, measured, for the GUI's picker.

For the source and each format: file size, bits per weight (tensor bytes * 8 / parameters), sliding-
window perplexity on the evaluation text, its change against the source, and decode tokens/s (greedy,
after a short prompt). Converted files go to a temporary folder (or `keep_dir`); the report is saved
as JSON next to the model: `MODEL.gguf.quant-report.json`, or `quant-report.json` inside a folder.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.convert import convert
from engine.perplexity import DEFAULT_CTX, DEFAULT_STRIDE, bos_for, load_text, perplexity_detail
from engine.quant.registry import lookup

DEFAULT_FORMATS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
REPORT_VERSION = 1


@dataclass
class ReportRow:
    format: str
    file_bytes: int
    bits_per_weight: float
    ppl: float
    delta_ppl_pct: float | None
    decode_tps: float
    convert_s: float | None = None


def report_path(src: Path) -> Path:
    return src / "quant-report.json" if src.is_dir() else src.with_name(src.name + ".quant-report.json")


def decode_tps(loaded, n_prompt: int = 16, n_gen: int = 32) -> float:
    """Greedy decode speed: tokens/s of n_gen single-token steps after an n_prompt-token prefill."""
    model = loaded.model
    ids = loaded.tokenizer.encode("The lighthouse stood on a low island of black rock about two miles") * 4
    cache = model.new_cache(n_prompt + n_gen + 1)
    logits = model.forward(ids[:n_prompt], cache)
    tok = int(np.argmax(logits[-1]))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        logits = model.forward([tok], cache)
        tok = int(np.argmax(logits[-1]))
    return n_gen / (time.perf_counter() - t0)


def tensor_bytes(path: Path) -> int:
    """Bytes of tensor data (no header, tokenizer or padding) in a GGUF file or a safetensors folder."""
    if path.is_dir():
        from models.formats.safetensors import open_safetensors_repo

        with open_safetensors_repo(path) as st:
            return sum(t.nbytes for t in st.tensors.values())
    from models.formats.gguf import open_gguf

    with open_gguf(path) as g:
        return sum(t.nbytes for t in g.tensors.values())


def _n_params(loaded_path: Path) -> int:
    from engine.quant.source import open_source

    with open_source(loaded_path) as s:
        return int(sum(np.prod(shape) for shape in s.shapes.values()))


def measure(
    path: Path,
    tokens_text: str,
    ctx: int,
    stride: int,
    n_params: int,
    label: str,
    baseline: float | None,
    convert_s: float | None = None,
) -> ReportRow:
    from engine.loader import load_model

    loaded = load_model(path)
    tokens = loaded.tokenizer.encode(tokens_text, add_special=True)
    res = perplexity_detail(loaded.model, tokens, ctx, stride, bos_id=bos_for(loaded))
    size = loaded.file_size
    delta = None if baseline is None else (res.ppl / baseline - 1.0) * 100.0
    bpw = tensor_bytes(path) * 8 / n_params
    return ReportRow(label, size, bpw, res.ppl, delta, decode_tps(loaded), convert_s)


def quant_report(
    src: str | Path,
    formats=DEFAULT_FORMATS,
    text_file: str | Path | None = None,
    ctx: int = DEFAULT_CTX,
    stride: int = DEFAULT_STRIDE,
    keep_dir: str | Path | None = None,
    progress=None,
) -> dict:
    """Measure `formats` of `src`; save and return the report (a JSON-ready dict)."""
    src = Path(src)
    text = load_text(text_file)
    say = progress or (lambda msg: None)
    n_params = _n_params(src)
    say(f"source {src.name}")
    base = measure(src, text, ctx, stride, n_params, "source", None)
    rows = [base]
    with tempfile.TemporaryDirectory(prefix="hearth-qreport-") as tmp:
        out_dir = Path(keep_dir) if keep_dir else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = src.name[:-5] if src.name.endswith(".gguf") else src.name
        for fmt in formats:
            say(f"converting to {fmt}")
            suffix = ".gguf" if lookup(fmt)[0].container == "gguf" else ""  # fp8, nvfp4, awq: folders
            outcome = convert(src, fmt, out_dir / f"{stem}.{fmt.replace(':', '-')}{suffix}", overwrite=True)
            say(f"measuring {fmt}")
            rows.append(measure(outcome.output, text, ctx, stride, n_params, fmt, base.ppl, outcome.seconds))
    report = {
        "version": REPORT_VERSION,
        "source": str(src),
        "n_params": n_params,
        "ctx": ctx,
        "stride": stride,
        "text": str(text_file) if text_file else "resources/eval/default.txt",
        "rows": [asdict(r) for r in rows],
    }
    path = report_path(src)
    tmp_path = path.with_name("." + path.name + ".part")
    tmp_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    tmp_path.replace(path)
    report["path"] = str(path)
    return report


def format_table(report: dict) -> str:
    lines = [f"{'format':<10} {'size MB':>9} {'bits/w':>7} {'ppl':>9} {'Δppl %':>8} {'decode t/s':>11}"]
    for r in report["rows"]:
        delta = "" if r["delta_ppl_pct"] is None else f"{r['delta_ppl_pct']:+.2f}"
        lines.append(
            f"{r['format']:<10} {r['file_bytes'] / 1e6:>9.1f} {r['bits_per_weight']:>7.2f} "
            f"{r['ppl']:>9.3f} {delta:>8} {r['decode_tps']:>11.1f}"
        )
    return "\n".join(lines)
