"""`hearth search | pull | ls | rm | import`: the model library from the command line.

Thin: every operation is a call into models/ (hub, downloads, library, fit); this module only
parses what the user typed and prints.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.1f} MiB"


def cmd_search(args) -> int:
    from models.hub import search

    hits = search(args.query or "", fmt=args.format, sort=args.sort, limit=args.limit)
    if args.json:
        print(json.dumps([h.__dict__ for h in hits], indent=1))
        return 0
    if not hits:
        print("no models found", file=sys.stderr)
        return 0
    width = max(len(h.repo_id) for h in hits)
    for h in hits:
        gated = "  gated" if h.gated else ""
        print(f"{h.repo_id:<{width}}  {h.downloads:>10,} downloads  {h.likes:>6,} likes{gated}")
    return 0


class _ProgressLine:
    """One redrawn stderr line for all running files, at most 10 times a second."""

    def __init__(self):
        self.lock = threading.Lock()
        self.last = 0.0
        self.state: dict[str, tuple[int, int | None, float, float | None]] = {}

    def __call__(self, p) -> None:
        with self.lock:
            self.state[p.filename] = (p.done, p.total, p.speed, p.eta)
            now = time.monotonic()
            if now - self.last < 0.1 and not (p.total and p.done >= p.total):
                return
            self.last = now
            parts = []
            for name, (done, total, speed, eta) in self.state.items():
                pct = f"{done * 100 // total:3d}%" if total else "  ?%"
                eta_s = f" ETA {eta:4.0f}s" if eta is not None else ""
                parts.append(f"{name} {pct} {_mib(done)}/{_mib(total)} {speed / 2**20:5.1f} MiB/s{eta_s}")
            print("\r" + " | ".join(parts) + "\x1b[K", end="", file=sys.stderr, flush=True)


def cmd_pull(args) -> int:
    from models.pull import PullInterrupted, pull

    progress = _ProgressLine()
    note = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        pulled = pull(args.spec, revision=args.revision, parallel=args.parallel, ctx=args.ctx, note=note,
                      on_progress=progress)
    except PullInterrupted:
        if progress.state:
            print(file=sys.stderr)
        print("paused; run the same command again to resume", file=sys.stderr)
        return 130
    if progress.state:
        print(file=sys.stderr)
    for e in pulled.entries:
        print(e.path)
    for path in pulled.towers:
        print(path)
        print(
            f"{Path(path).name} is a vision tower: a GGUF model in its folder reads images with it",
            file=sys.stderr,
        )
    tower = pulled.tower
    if tower is not None and tower.state == "done":
        print(f"vision tower: {tower.path}", file=sys.stderr)
    elif tower is not None:
        print(
            f"hearth: the vision tower failed: {tower.error or tower.state}. {pulled.model_file} is "
            "downloaded and works for text; run the same command again to fetch its vision tower",
            file=sys.stderr,
        )
        return 1
    return 0


def _print_drafts(target: str, as_json: bool) -> int:
    """`hearth ls --drafts-for MODEL`: speculative-decoding drafts for MODEL among the local GGUFs."""
    from engine.draft_pairing import draft_candidates
    from models.resolve import resolve_model

    path = resolve_model(target)
    found = draft_candidates(path)
    if as_json:
        rows = [dict(c.__dict__, path=str(c.path)) for c in found]
        print(json.dumps({"target": str(path), "drafts": rows}, indent=1))
        return 0
    if not found:
        print(f"no local model can draft for {path.name}: a draft needs its tokenizer and a smaller file")
        return 0
    print(f"drafts for {path.name} (same tokenizer, smallest first):")
    for c in found:
        same = "  (same model, lower precision)" if c.same_model else ""
        print(f"  {_mib(c.size_bytes)}  {c.quantization:8s} {c.name}  {c.path}{same}")
    return 0


def cmd_ls(args) -> int:
    from models import downloads, library
    from models.starter import STARTERS, starter_path

    lib = library.Library()
    lib.register_starters()
    if not args.no_scan:
        lib.discover_hf_cache()
    if args.drafts_for:
        return _print_drafts(args.drafts_for, args.json)
    entries = lib.entries()
    presets = lib.presets()
    pending = []
    with contextlib.suppress(OSError, ValueError):
        pending = json.loads(downloads.state_path().read_text()).get("jobs", [])
    if args.json:
        out = {
            "models": [
                dict(e.__dict__, exists=e.exists, vision_towers=[str(p) for p in e.vision_towers])
                for e in entries
            ],
            "presets": [dict(p.__dict__) for p in presets],
            "downloads": pending,
            "starters": {n: str(starter_path(n)) if starter_path(n).is_file() else None for n in STARTERS},
        }
        print(json.dumps(out, indent=1))
        return 0
    for e in entries:
        missing = "  (missing)" if not e.exists else ""
        ctx = f"ctx {e.context_length}" if e.context_length else ""
        vision = "  + vision tower" if e.vision_towers else ""
        print(
            f"{e.id:>4}  {e.name}  {e.format} {e.quant or ''}  {_mib(e.size)}  {e.architecture or ''} "
            f"{ctx}  [{e.source}]{vision}{missing}"
        )
    for p in presets:  # Ollama's created models (`hearth serve`'s /api/create and /api/copy)
        what = ", ".join(x for x in ("system prompt" if p.system else "", "template" if p.template else "",
                                     f"{len(p.parameters)} parameter(s)" if p.parameters else "",
                                     f"{len(p.messages)} message(s)" if p.messages else "") if x)
        missing = "" if Path(p.base).exists() else "  (its model is missing)"
        print(f"   -  {p.name}  preset of {Path(p.base).name}{': ' + what if what else ''}{missing}")
    for n, m in STARTERS.items():
        if not starter_path(n).is_file():
            print(f"   -  {n}  (starter, not downloaded: `hearth pull {n}`) {m.description}")
    for j in pending:
        error = f": {j['error']}" if j.get("error") else ""
        error += f" ({j['note']})" if j.get("note") else ""
        print(f"   -  {j['repo_id']}:{j['filename']}  download {j['state']} (a partial, not a model){error}")
    if not entries and not pending:
        print("the library is empty; try `hearth search` and `hearth pull`", file=sys.stderr)
    return 0


def cmd_rm(args) -> int:
    from models.errors import ModelNotFoundError
    from models.library import Library

    lib = Library()
    try:
        entry = lib.remove(args.model, delete_files=True if args.delete_files else None)
    except ModelNotFoundError:
        if not lib.remove_preset(str(args.model).removesuffix(":latest")):
            raise
        print(f"removed the preset {args.model} (its model stays)")
        return 0
    print(f"removed {entry.name}")
    return 0


def cmd_import(args) -> int:
    from models.library import Library

    for e in Library().import_path(args.path, copy=args.copy):
        print(f"{e.id:>4}  {e.path}  {e.format} {e.quant or ''}  {e.architecture or ''}")
    return 0
