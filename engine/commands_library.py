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

from models.errors import HearthError


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
    from models import downloads, fit, hub, library
    from models.starter import STARTERS, ensure_starter

    lib = library.Library()
    if args.spec in STARTERS:
        path = ensure_starter(args.spec)
        lib.register_starters()
        print(path)
        return 0
    repo_id, _, selector = args.spec.partition(":")
    hub.check_repo_id(repo_id)
    details = hub.repo_details(repo_id, revision=args.revision, with_card=False)
    files = hub.pick_files(details, selector or None)
    revision = details.commit or args.revision or "main"
    total = sum(f.size or 0 for f in files)
    quant = hub.quant_from_name(files[0].path)
    if files[0].path.endswith(".gguf") and not hub.is_mmproj(files[0].path):
        print(fit.fit_for_remote(total, args.ctx, quant).summary(), file=sys.stderr)

    wanted, done_paths = [], []
    for f in files:
        known = lib.find(repo_id, f.path, f.sha256)
        cached = None if known else library.hf_cached_file(repo_id, f.path, f.sha256)
        here = None
        if hub.is_mmproj(f.path):  # a tower is never indexed: its file is the record that it is here
            here = downloads.target_path(downloads.DownloadJob(repo_id, f.path))
        if known:
            done_paths.append((f, known.path, known.source))
        elif cached:
            print(f"{f.path}: already in the Hugging Face cache, not downloading it again", file=sys.stderr)
            done_paths.append((f, str(cached), "hf-cache"))
        elif here is not None and here.is_file() and here.stat().st_size == f.size:
            done_paths.append((f, str(here), "download"))
        else:
            wanted.append(f)
    tower = _vision_tower(repo_id, details, files[0], revision, done_paths)
    jobs = [
        downloads.DownloadJob(
            repo_id, f.path, revision=revision, size=f.size, sha256=f.sha256, blob_id=f.blob_id
        )
        for f in wanted
    ]
    # the model and its tower must fit together, before either starts (raises DiskSpaceError)
    downloads.check_free_space(jobs + ([tower] if tower else []))

    progress = _ProgressLine()
    manager = downloads.DownloadManager(parallel=args.parallel, on_progress=progress)
    jobs = [manager.add(job) for job in jobs]
    if tower is not None:
        tower = manager.add(tower)
    try:
        manager.wait([j.id for j in jobs] + ([tower.id] if tower else []))
    except KeyboardInterrupt:
        manager.close()
        print("\npaused; run the same command again to resume", file=sys.stderr)
        return 130
    manager.close()
    if jobs or tower:
        print(file=sys.stderr)
    failed = [j for j in jobs + ([tower] if tower else []) if j.state != "done"]
    if any(j is not tower for j in failed):
        raise HearthError("; ".join(j.error or f"{j.filename}: {j.state}" for j in failed))
    by_path = {f.path: f for f in files}
    done_paths += [(by_path[j.filename], j.path, "download") for j in jobs]

    # index what a loader opens: each GGUF (first split part), or the folder of a safetensors set; a vision
    # tower is no model of its own
    entries, towers = [], []
    for f, path, source in done_paths:
        if hub.is_mmproj(f.path):
            towers.append(path)
        elif f.path.endswith(".gguf") and not library.is_later_split_part(Path(f.path)):
            entries.append(
                lib.add(path, repo=repo_id, revision=revision, file=f.path, sha256=f.sha256, source=source)
            )
    if not entries and not towers and done_paths:
        _, path, source = done_paths[0]
        entries.append(lib.add(Path(path).parent, repo=repo_id, revision=revision, source=source))
    for e in entries:
        print(e.path)
    for path in towers:
        print(path)
        print(
            f"{Path(path).name} is a vision tower: a GGUF model in its folder reads images with it",
            file=sys.stderr,
        )
    if tower is not None and tower.state == "done":
        print(f"vision tower: {tower.path}", file=sys.stderr)
    elif tower is not None:
        print(
            f"hearth: the vision tower failed: {tower.error or tower.state}. {files[0].path} is downloaded "
            "and works for text; run the same command again to fetch its vision tower",
            file=sys.stderr,
        )
        return 1
    return 0


def _vision_tower(repo_id: str, details, model, revision: str, done_paths: list):
    """The download of the vision tower (mmproj) that goes beside the pulled GGUF model, or None (see
    models.downloads.vision_tower: a tower whose projector Hearth does not run is skipped, with a note); a
    model already used from elsewhere (the Hugging Face cache) only gets a note, as Hearth downloads into its
    library folder alone."""
    from models import downloads, hub

    job = downloads.vision_tower(repo_id, details.files, model.path, revision, read_header=False).job
    if job is None:
        return None
    at = next((Path(p) for f, p, _ in done_paths if f is model), None)
    if at is not None and at.parent != downloads.target_path(job).parent:
        if not hub.mmprojs_in(at.parent):
            print(
                f"note: {model.path} is used from {at.parent}; to read images, put its vision tower "
                f"{job.filename} from {repo_id} in that folder",
                file=sys.stderr,
            )
        return None
    choice = downloads.vision_tower(repo_id, details.files, model.path, revision)  # reads its header
    if choice.job is None:
        print(choice.note or f"{job.filename}: not fetched", file=sys.stderr)
        return None
    print(
        f"{job.filename}: the model's vision tower (for images), {_mib(job.size)}, goes beside it",
        file=sys.stderr,
    )
    return choice.job


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
    pending = []
    with contextlib.suppress(OSError, ValueError):
        pending = json.loads(downloads.state_path().read_text()).get("jobs", [])
    if args.json:
        out = {
            "models": [
                dict(e.__dict__, exists=e.exists, vision_towers=[str(p) for p in e.vision_towers])
                for e in entries
            ],
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
    from models.library import Library

    entry = Library().remove(args.model, delete_files=True if args.delete_files else None)
    print(f"removed {entry.name}")
    return 0


def cmd_import(args) -> int:
    from models.library import Library

    for e in Library().import_path(args.path, copy=args.copy):
        print(f"{e.id:>4}  {e.path}  {e.format} {e.quant or ''}  {e.architecture or ''}")
    return 0
