"""Pulling a model into the library: what `hearth pull` and the server's Ollama `/api/pull` do.

A spec is a starter model's name, or REPO, REPO:QUANT or REPO:FILE on the Hugging Face Hub
(hub.pick_files chooses the files). Files the library or the Hugging Face cache already hold are not
fetched again; a GGUF's vision tower comes along (downloads.vision_tower); the model and its tower must
fit on the disk together before either starts; the downloads run in a DownloadManager (resumable: an
interrupted pull resumes where it stopped); each GGUF (first split part), or the folder of a
safetensors set, is indexed in the library.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from models.errors import HearthError


class PullInterrupted(HearthError):
    """The pull was stopped (Ctrl+C, a client that went away): its partial files stay, to resume."""


@dataclass
class Pulled:
    """What a pull left in the library."""

    entries: list = field(default_factory=list)  # models.library.ModelEntry, one per model indexed
    towers: list[str] = field(default_factory=list)  # vision towers pulled by name (no model of their own)
    tower: object | None = None  # the model's vision tower download (a DownloadJob), when one was queued
    model_file: str = ""  # the first file pulled (its path in the repo)


def pull(
    spec: str,
    *,
    revision: str | None = None,
    parallel: int = 2,
    ctx: int | None = None,
    note: Callable[[str], None] = lambda line: None,
    on_progress: Callable[[object], None] | None = None,
    cancel: threading.Event | None = None,
) -> Pulled:
    """Pull `spec` into the library.

    Args:
        spec: a starter name, or REPO[:QUANT|:FILE].
        revision: branch, tag or commit (default: main).
        parallel: files downloaded at once.
        ctx: a context length: the memory fit of a GGUF is noted for it (None: no fit note).
        note: receives lines for the user (fit, files reused, the tower).
        on_progress: receives downloads.ProgressInfo from download threads.
        cancel: set it to stop; the downloads pause (resumable) and PullInterrupted is raised.

    Raises:
        PullInterrupted (also on KeyboardInterrupt), models.hub errors (no such repo, gated, offline),
        downloads.DiskSpaceError, HearthError naming failed files.
    """
    from models import downloads, fit, hub, library
    from models.starter import STARTERS, ensure_starter

    lib = library.Library()
    if spec in STARTERS:
        path = ensure_starter(spec)
        lib.register_starters()
        return Pulled(entries=[lib.get(str(path))], model_file=spec)
    repo_id, _, selector = spec.partition(":")
    hub.check_repo_id(repo_id)
    details = hub.repo_details(repo_id, revision=revision, with_card=False)
    files = hub.pick_files(details, selector or None)
    revision = details.commit or revision or "main"
    total = sum(f.size or 0 for f in files)
    if ctx is not None and files[0].path.endswith(".gguf") and not hub.is_mmproj(files[0].path):
        note(fit.fit_for_remote(total, ctx, hub.quant_from_name(files[0].path)).summary())

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
            note(f"{f.path}: already in the Hugging Face cache, not downloading it again")
            done_paths.append((f, str(cached), "hf-cache"))
        elif here is not None and here.is_file() and here.stat().st_size == f.size:
            done_paths.append((f, str(here), "download"))
        else:
            wanted.append(f)
    tower = _vision_tower(repo_id, details, files[0], revision, done_paths, note)
    jobs = [
        downloads.DownloadJob(
            repo_id, f.path, revision=revision, size=f.size, sha256=f.sha256, blob_id=f.blob_id
        )
        for f in wanted
    ]
    # the model and its tower must fit together, before either starts (raises DiskSpaceError)
    downloads.check_free_space(jobs + ([tower] if tower else []))

    manager = downloads.DownloadManager(parallel=parallel, on_progress=on_progress)
    jobs = [manager.add(job) for job in jobs]
    if tower is not None:
        tower = manager.add(tower)
    ids = [j.id for j in jobs] + ([tower.id] if tower else [])
    try:
        while not manager.wait(ids, timeout=0.25):
            if cancel is not None and cancel.is_set():
                raise PullInterrupted(f"the pull of {spec} was stopped; pull it again to resume")
    except KeyboardInterrupt as e:
        raise PullInterrupted(f"the pull of {spec} was paused; run the same pull again to resume") from e
    finally:
        manager.close()
    failed = [j for j in jobs + ([tower] if tower else []) if j.state != "done"]
    if any(j is not tower for j in failed):
        raise HearthError("; ".join(j.error or f"{j.filename}: {j.state}" for j in failed))
    by_path = {f.path: f for f in files}
    done_paths += [(by_path[j.filename], j.path, "download") for j in jobs]

    # index what a loader opens: each GGUF (first split part), or the folder of a safetensors set; a vision
    # tower is no model of its own
    out = Pulled(tower=tower, model_file=files[0].path)
    for f, path, source in done_paths:
        if hub.is_mmproj(f.path):
            out.towers.append(path)
        elif f.path.endswith(".gguf") and not library.is_later_split_part(Path(f.path)):
            out.entries.append(
                lib.add(path, repo=repo_id, revision=revision, file=f.path, sha256=f.sha256, source=source)
            )
    if not out.entries and not out.towers and done_paths:
        _, path, source = done_paths[0]
        out.entries.append(lib.add(Path(path).parent, repo=repo_id, revision=revision, source=source))
    return out


def _vision_tower(repo_id: str, details, model, revision: str, done_paths: list, note: Callable[[str], None]):
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
            note(
                f"note: {model.path} is used from {at.parent}; to read images, put its vision tower "
                f"{job.filename} from {repo_id} in that folder"
            )
        return None
    choice = downloads.vision_tower(repo_id, details.files, model.path, revision)  # reads its header
    if choice.job is None:
        note(choice.note or f"{job.filename}: not fetched")
        return None
    note(f"{job.filename}: the model's vision tower (for images), {_mib(job.size)}, goes beside it")
    return choice.job


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.1f} MiB"
