"""Downloads from the Hub that end with a verified file or no file.

One file's transfer (`download_file`):
- the bytes go to `<target>.hearth-partial` beside the target (same file system, so the final
  `os.replace` is atomic); a partial file never ends in a model suffix, so it is never listed;
- a partial left by an earlier run (pause, crash, kill -9) is resumed with `Range` (+ `If-Range`
  with the ETag we saw), its bytes are hashed locally instead of fetched again;
- a server that ignores Range (200 instead of 206) or answers another range restarts from zero;
- cuts, stalls (read timeout), 5xx and 429 are retried with exponential backoff whose counter
  resets whenever bytes arrive; 429's Retry-After is honoured (capped);
- 401/403 (gated/private), 404 and a full disk stop at once with a typed error;
- the size, then the sha256 from the Hub's LFS metadata (or the git blob id of small files) are
  checked; a mismatch deletes the partial and retries from zero once, then fails;
- redirects are followed by hand so the token is never sent to another host (the CDN).

A GGUF model's vision tower (llama.cpp's mmproj file) is one more such transfer, into the model's folder:
`vision_tower` says which, if any: it reads the tower's GGUF header remotely first (a Range request for its
first bytes) and skips a tower whose projector Hearth does not run (hub.VISION_PROJECTOR_TYPES).
`check_free_space` checks a model's files and its tower together before either starts.

`DownloadManager` runs a persisted queue of such transfers with a parallelism limit, progress
callbacks (bytes, speed, ETA), pause / resume / cancel, and resumes unfinished jobs after a restart.
A tower follows its model there: cancelling, pausing or resuming a model's file does the same to the tower
queued beside it (the tower's own buttons leave the model alone), and a tower that ends up in a folder with
no model, nor a model download, is deleted (`drop_orphan_towers`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from email.utils import parsedate_to_datetime
from http.client import HTTPException
from pathlib import Path, PurePosixPath
from urllib.parse import urljoin, urlsplit

from models.hub import (
    HubError,
    HubServerError,
    OfflineError,
    RateLimitedError,
    RemoteFile,
    check_filename,
    check_repo_id,
    check_revision,
    hf_token,
    http_error,
    is_mmproj,
    library_path,
    mmprojs_in,
    offline,
    pick_mmproj,
    remote_gguf_metadata,
    resolve_url,
    same_model_file,
    tower_header,
)
from models.paths import data_dir, models_dir

PARTIAL_SUFFIX = ".hearth-partial"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_MAX_REDIRECTS = 10


class DownloadInterruptedError(HubError):
    """The connection kept failing (cuts, stalls, 5xx) after every retry; the partial is kept to resume."""


class IntegrityError(HubError):
    """The downloaded bytes do not match the Hub's size or checksum, even after a fresh download."""


class DiskSpaceError(HubError):
    """Not enough free space for the download."""


class DownloadCancelled(HubError):
    """The download was cancelled; its partial file is gone."""


class DownloadPaused(HubError):
    """The download was paused; its partial file is kept for a resume."""


@dataclass
class DownloadSettings:
    """Tunables of one transfer; tests shrink them (small chunks, short timeouts, no backoff)."""

    chunk_size: int = 1 << 20
    timeout: float = 30.0  # socket timeout: a connect or a body that sends nothing for this long has stalled
    max_retries: int = 8  # consecutive failed attempts without a byte arriving
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    disk_margin: int = 32 << 20  # keep this much free beyond the file itself


@dataclass
class DownloadJob:
    """One file to fetch. Persisted (as JSON) while unfinished, so a restart resumes it."""

    repo_id: str
    filename: str
    revision: str = "main"
    size: int | None = None
    sha256: str | None = None
    blob_id: str | None = None  # git sha1 of small non-LFS files
    state: str = "queued"  # queued, running, paused, done, failed, cancelled
    error: str | None = None
    etag: str | None = None
    commit: str | None = None
    path: str | None = None  # the verified file, once done
    beside: str | None = None  # a model file of the repo: this file (its vision tower) goes into its folder
    note: str | None = None  # shown with the job's row, e.g. why the model's vision tower is not fetched

    @property
    def local_name(self) -> str:
        """Where the file goes inside the repo's library folder: its repo path, or beside its model."""
        if self.beside is None:
            return self.filename
        return str(PurePosixPath(self.beside).parent / PurePosixPath(self.filename).name)

    @property
    def id(self) -> str:
        """Stable key: repo@revision:local name (the repo path unless the file goes beside a model)."""
        return f"{self.repo_id}@{self.revision}:{self.local_name}"

    def validate(self) -> DownloadJob:
        """Check every name that becomes part of a URL or a path; returns self."""
        check_repo_id(self.repo_id)
        check_filename(self.filename)
        check_revision(self.revision)
        if self.beside is not None:
            check_filename(self.beside)
        if self.sha256 is not None and not _HEX64.match(self.sha256):
            raise HubServerError(f"{self.filename}: {self.sha256!r} is not a sha256 digest")
        return self


@dataclass(frozen=True)
class ProgressInfo:
    """A progress report: bytes so far, total (None when unknown), speed in bytes/s, ETA in seconds."""

    job_id: str
    filename: str
    done: int
    total: int | None
    speed: float
    eta: float | None


@dataclass
class TransferStats:
    """What one `download_file` call did, for tests and for the curious."""

    resumed_from: int = 0  # bytes of an earlier partial that were kept
    requests: int = 0
    restarts_from_zero: int = 0
    retries: int = 0
    bytes_received: int = 0


class _Transient(Exception):
    """One attempt failed in a way a retry may fix."""

    def __init__(self, final: HubError, retry_after: float | None = None):
        super().__init__(str(final))
        self.final = final
        self.retry_after = retry_after


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # we follow redirects ourselves, deciding per hop whether the token may go along


_OPENER = urllib.request.build_opener(_NoRedirect)


def partial_path(target: Path) -> Path:
    """The temporary file a download of `target` writes to."""
    return target.with_name(target.name + PARTIAL_SUFFIX)


def target_path(job: DownloadJob, root: Path | None = None) -> Path:
    """Where `job`'s verified file goes (checked to stay inside the library folder)."""
    return library_path(root or models_dir(), job.repo_id, job.local_name)


@dataclass(frozen=True)
class TowerChoice:
    """The vision tower to fetch beside a GGUF model: `job` (None: nothing to fetch) and, when a tower the
    repo offers is not fetched because Hearth could not read images with it, `note` saying so."""

    job: DownloadJob | None
    note: str | None = None


def vision_tower(
    repo_id: str,
    repo_files: Iterable[RemoteFile],
    model_file: str,
    revision: str = "main",
    root: Path | None = None,
    read_header: bool = True,
) -> TowerChoice:
    """The download of the vision tower that goes beside a GGUF model being downloaded, if any.

    llama.cpp keeps a vision model's image encoder in a second GGUF, its "mmproj" file, and Hearth's loader
    takes it from the model file's folder; so when a repo publishes one (F16 preferred, see `pick_mmproj`),
    it is fetched with the model, by the same machinery, into the model's folder. Before that, its GGUF
    header is read remotely (`hub.remote_gguf_metadata`: a Range request for the first bytes): a tower whose
    projector Hearth does not run (hub.VISION_PROJECTOR_TYPES), or one without a vision encoder, is not
    fetched. When the header cannot be read (no network, a server without Range, no GGUF header), the tower
    is fetched as it is and the engine judges it when the model loads. This makes a network request: call
    it off the GUI thread.

    Args:
        repo_id: the repo.
        repo_files: every file of the repo (RepoDetails.files).
        model_file: the model's file in the repo (the first part of a split set).
        revision: the commit the model is downloaded from.
        root: the library folder (default models_dir()).
        read_header: False skips the header check (no network).

    Returns:
        A TowerChoice whose job is None when `model_file` is no GGUF language model (an mmproj itself
        included), the repo has no mmproj, the model's folder holds an mmproj already, or the tower is one
        Hearth cannot read (then its note says why: "vision tower not fetched: ...").
    """
    tower = pick_mmproj(repo_files, model_file)
    if tower is None:
        return TowerChoice(None)
    job = DownloadJob(
        repo_id,
        tower.path,
        revision=revision,
        size=tower.size,
        sha256=tower.sha256,
        blob_id=tower.blob_id,
        beside=model_file,
    ).validate()
    if mmprojs_in(target_path(job, root).parent):
        return TowerChoice(None)
    if read_header:
        metadata = remote_gguf_metadata(repo_id, tower.path, revision, tower.size)
        why = tower_header(metadata).unsupported if metadata is not None else None
        if why is not None:
            model = PurePosixPath(model_file).name
            return TowerChoice(None, f"vision tower not fetched: {why}; {model} works for text without it")
    return TowerChoice(job)


def vision_tower_job(
    repo_id: str,
    repo_files: Iterable[RemoteFile],
    model_file: str,
    revision: str = "main",
    root: Path | None = None,
) -> DownloadJob | None:
    """`vision_tower(...).job`: the tower's download, or None (see `vision_tower`)."""
    return vision_tower(repo_id, repo_files, model_file, revision, root).job


def _existing_folder(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_free_space(
    jobs: Iterable[DownloadJob], root: Path | None = None, margin: int | None = None
) -> None:
    """Check, before any of them starts, that the disk holds all of `jobs` at once (a model's files and its
    vision tower): what is left of each (a partial from an earlier run counts as fetched) plus a margin.

    Args:
        jobs: the downloads about to be queued (a size None counts as 0).
        root: the library folder (default models_dir()).
        margin: bytes to keep free beyond the files (default DownloadSettings().disk_margin).

    Raises:
        DiskSpaceError: naming the model's size, the tower's, and the free space.
    """
    root = root or models_dir()
    margin = DownloadSettings().disk_margin if margin is None else margin
    model, tower, folder = 0, 0, None
    for job in jobs:
        target = target_path(job, root)
        folder = folder or target.parent
        left = job.size or 0
        with contextlib.suppress(OSError):
            left -= partial_path(target).stat().st_size
        if job.beside is not None:
            tower += max(left, 0)
        else:
            model += max(left, 0)
    if folder is None:
        return
    where = _existing_folder(folder)
    free = shutil.disk_usage(where).free
    if free >= model + tower + margin:
        return
    mib = 2**20
    what = f"the model needs {model / mib:,.1f} MiB"
    if tower:
        what += f" and its vision tower {tower / mib:,.1f} MiB ({(model + tower) / mib:,.1f} MiB together)"
    raise DiskSpaceError(
        f"{what}, but {where} has {free / mib:,.1f} MiB free (keeping {margin / mib:.0f} MiB spare); "
        "free space or pick a smaller variant"
    )


def model_in_folder(folder: Path) -> bool:
    """Whether a library folder holds a GGUF model other than a vision tower, complete or partial."""
    with contextlib.suppress(OSError):
        for p in folder.iterdir():
            name = p.name.removesuffix(PARTIAL_SUFFIX)
            if name.lower().endswith(".gguf") and not is_mmproj(name):
                return True
    return False


def drop_orphan_towers(folder: Path) -> list[Path]:
    """Delete the complete vision towers of a library folder no model, nor a model's partial download, is
    left in: they were fetched for a model and are never listed on their own, so nothing else would ever
    delete them. (A tower's own partial belongs to its running or queued download, whose cancel deletes it.)

    Returns:
        The files deleted.
    """
    if model_in_folder(folder):
        return []
    towers = mmprojs_in(folder)
    for tower in towers:
        tower.unlink(missing_ok=True)
    return towers


def _sha256_file(path: Path, h=None):
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h


def _git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    return _sha256_file(path, h).hexdigest()


def _retry_after(headers) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        with contextlib.suppress(TypeError, ValueError):
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    return None


class _Transfer:
    def __init__(
        self,
        job: DownloadJob,
        root: Path,
        settings: DownloadSettings,
        on_bytes: Callable[[int, int | None], None] | None,
        should_stop: Callable[[], str | None] | None,
    ):
        self.job = job.validate()
        self.root = root
        self.s = settings
        self.on_bytes = on_bytes
        self.should_stop = should_stop or (lambda: None)
        self.target = target_path(job, root)
        self.partial = partial_path(self.target)
        self.stats = TransferStats()
        self.hasher = hashlib.sha256()
        self.total: int | None = job.size
        self.fd: int | None = None
        self._got_bytes = False  # set by an attempt that received at least one byte

    # ---- file handling
    def _open_partial(self) -> None:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        # re-check after mkdir: a symlink could have appeared on the way
        target_path(self.job, self.root)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        self.fd = os.open(self.partial, flags, 0o644)
        size = os.fstat(self.fd).st_size
        if self.total is not None and size > self.total:
            size = self._truncate()
        elif size:
            # bytes from an earlier run are hashed here instead of fetched again
            with open(self.partial, "rb") as f:
                left = size
                while left and (block := f.read(min(1 << 20, left))):
                    self.hasher.update(block)
                    left -= len(block)
        self.stats.resumed_from = size
        os.lseek(self.fd, size, os.SEEK_SET)

    def _truncate(self) -> int:
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.hasher = hashlib.sha256()
        return 0

    def _offset(self) -> int:
        assert self.fd is not None
        return os.lseek(self.fd, 0, os.SEEK_CUR)

    def _write(self, block: bytes) -> None:
        view = memoryview(block)
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError as e:
                if e.errno == 28:  # ENOSPC
                    raise DiskSpaceError(
                        f"{self.job.filename}: the disk is full; free space and resume"
                    ) from e
                raise
            view = view[n:]
        self.hasher.update(block)

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _check_disk(self) -> None:
        if self.total is None:
            return
        need = self.total - self._offset()
        free = shutil.disk_usage(self.target.parent).free
        if free < need + self.s.disk_margin:
            raise DiskSpaceError(
                f"{self.job.filename} needs {need / 2**20:.1f} MiB but {self.target.parent} has "
                f"{free / 2**20:.1f} MiB free (keeping {self.s.disk_margin / 2**20:.0f} MiB spare); "
                "free space first"
            )

    # ---- HTTP
    def _request(self, offset: int):
        url = resolve_url(self.job.repo_id, self.job.filename, self.job.revision)
        home = urlsplit(url).netloc
        token = hf_token()
        for _ in range(_MAX_REDIRECTS):
            headers = {"User-Agent": "hearth", "Accept-Encoding": "identity"}
            if token and urlsplit(url).netloc == home:
                headers["Authorization"] = f"Bearer {token}"
            if offset:
                headers["Range"] = f"bytes={offset}-"
                if self.job.etag:
                    headers["If-Range"] = self.job.etag
            self.stats.requests += 1
            try:
                response = _OPENER.open(urllib.request.Request(url, headers=headers), timeout=self.s.timeout)
            except urllib.error.HTTPError as e:
                response = e  # an HTTPError is the response (status, headers, body)
            except (urllib.error.URLError, OSError, HTTPException) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, socket.timeout | TimeoutError):
                    raise _Transient(
                        DownloadInterruptedError(f"{self.job.filename}: connecting timed out")
                    ) from e
                raise _Transient(
                    OfflineError(
                        f"{self.job.filename}: cannot reach the Hub at {home} ({reason}); "
                        "check your connection"
                    )
                ) from e
            self._remember(response.headers)
            status = response.status
            if status in (301, 302, 303, 307, 308):
                location = response.headers.get("Location")
                response.close()
                if not location:
                    raise HubServerError(f"{self.job.filename}: redirect without a Location")
                url = urljoin(url, location)
                if urlsplit(url).scheme not in ("http", "https"):
                    raise HubServerError(f"{self.job.filename}: redirect to a non-HTTP URL {url!r}")
                continue
            return response
        raise HubServerError(f"{self.job.filename}: more than {_MAX_REDIRECTS} redirects")

    def _remember(self, headers) -> None:
        # the first hop (the Hub) carries X-Linked-Etag / X-Repo-Commit; the CDN hop only ETag
        etag = headers.get("X-Linked-Etag") or headers.get("ETag")
        if etag and not self.job.etag:
            self.job.etag = etag
        commit = headers.get("X-Repo-Commit")
        if commit and _HEX40.match(commit):
            self.job.commit = commit
        if self.job.sha256 is None and etag:
            bare = etag.strip('"').removeprefix("W/").strip('"')
            if _HEX64.match(bare):
                self.job.sha256 = bare  # an LFS file's ETag is its sha256

    def _attempt(self) -> None:
        """One request; appends to the partial. Returns when the body ended as announced."""
        offset = self._offset()
        if self.total is not None and offset == self.total:
            return
        response = self._request(offset)
        with response:
            status = response.status
            if status in (401, 403, 404):
                raise http_error(status, f"{self.job.repo_id}/{self.job.filename}")
            if status == 429:
                retry_after = _retry_after(response.headers)
                raise _Transient(http_error(429, self.job.filename, retry_after), retry_after)
            if status == 416:
                self._truncate()  # our partial is not a prefix of what the server has
                self.stats.restarts_from_zero += 1
                raise _Transient(DownloadInterruptedError(f"{self.job.filename}: server refused our range"))
            if status >= 500:
                raise _Transient(http_error(status, self.job.filename))
            if status == 200:
                if offset:
                    offset = self._truncate()  # Range ignored (or If-Range saw a new file): start over
                    self.stats.restarts_from_zero += 1
                length = response.headers.get("Content-Length")
                announced = int(length) if length and length.isdigit() else None
            elif status == 206:
                m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", response.headers.get("Content-Range", ""))
                if not m or int(m.group(1)) != offset:
                    self._truncate()
                    self.stats.restarts_from_zero += 1
                    raise _Transient(
                        DownloadInterruptedError(f"{self.job.filename}: server sent another range")
                    )
                announced = int(m.group(3)) if m.group(3) != "*" else None
            else:
                raise HubServerError(f"{self.job.filename}: unexpected HTTP {status} from the Hub")
            if announced is not None:
                if self.total is not None and announced != self.total:
                    raise IntegrityError(
                        f"{self.job.filename}: the server offers {announced} bytes but the Hub's metadata "
                        f"says {self.total}; the file changed on the Hub, look it up again"
                    )
                self.total = announced
            self._check_disk()
            self._read_body(response)

    def _read_body(self, response) -> None:
        got = 0
        while True:
            want = self.s.chunk_size
            if self.total is not None:
                want = min(want, self.total - self._offset())
                if want <= 0:
                    break
            try:
                block = response.read(want)
            except TimeoutError as e:
                raise _Transient(
                    DownloadInterruptedError(f"{self.job.filename}: the download stalled")
                ) from e
            except (OSError, HTTPException) as e:
                raise _Transient(
                    DownloadInterruptedError(f"{self.job.filename}: the connection dropped ({e})")
                ) from e
            if not block:
                break
            self._write(block)
            got += len(block)
            self.stats.bytes_received += len(block)
            self._got_bytes = True
            if self.on_bytes:
                self.on_bytes(self._offset(), self.total)
            self._check_stop()
        if self.total is None:
            self.total = self._offset()  # no length announced: trust the close, the checksum decides
        if self._offset() < self.total:
            raise _Transient(
                DownloadInterruptedError(
                    f"{self.job.filename}: connection closed at {self._offset()} of {self.total} bytes"
                )
            )

    def _check_stop(self) -> None:
        what = self.should_stop()
        if what == "pause":
            raise DownloadPaused(f"{self.job.filename}: paused")
        if what == "cancel":
            raise DownloadCancelled(f"{self.job.filename}: cancelled")

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._check_stop()
            time.sleep(min(left, 0.05))

    def _verify(self) -> str | None:
        """None when the partial is the right file, else what is wrong."""
        size = self._offset()
        if self.total is not None and size != self.total:
            return f"size {size}, expected {self.total}"
        if self.job.sha256:
            got = self.hasher.hexdigest()
            return None if got == self.job.sha256 else f"sha256 {got}, expected {self.job.sha256}"
        if self.job.blob_id and _HEX40.match(self.job.blob_id):
            os.fsync(self.fd)
            got = _git_blob_sha1(self.partial)
            return None if got == self.job.blob_id else f"git blob id {got}, expected {self.job.blob_id}"
        return None  # nothing to check against but the size

    # ---- the whole transfer
    def run(self) -> Path:
        if offline():
            raise OfflineError(
                f"{self.job.filename}: offline mode is on (HF_HUB_OFFLINE); unset it to download"
            )
        keep_partial = True
        self._open_partial()
        try:
            self._check_disk()  # before the first request when the size is known already
            fresh_restarts = 0
            failures = 0
            while True:
                self._check_stop()
                self._got_bytes = False
                try:
                    self._attempt()
                except _Transient as t:
                    if self._got_bytes:
                        failures = 0  # bytes arrived: the connection works, start counting afresh
                    failures += 1
                    self.stats.retries += 1
                    if failures > self.s.max_retries:
                        if isinstance(t.final, RateLimitedError | OfflineError):
                            raise t.final from None
                        raise DownloadInterruptedError(
                            f"{t.final} (gave up after {self.s.max_retries} retries; resume later, "
                            "the partial file is kept)"
                        ) from None
                    delay = min(self.s.backoff_max, self.s.backoff_base * 2 ** (failures - 1))
                    delay *= random.uniform(0.5, 1.0)
                    if t.retry_after is not None:
                        delay = max(delay, min(t.retry_after, self.s.backoff_max))
                    self._sleep(delay)
                    continue
                problem = self._verify()
                if problem is None:
                    break
                fresh_restarts += 1
                if fresh_restarts > 1:
                    keep_partial = False
                    raise IntegrityError(
                        f"{self.job.filename}: downloaded twice and still wrong ({problem}); "
                        "the file on the Hub may be corrupt"
                    )
                self._truncate()  # bytes were wrong somewhere: start over once
                self.stats.restarts_from_zero += 1
            os.fsync(self.fd)
            self._close()
            os.replace(self.partial, self.target)
            with contextlib.suppress(OSError):
                dfd = os.open(self.target.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            self.job.path = str(self.target)
            return self.target
        except _RESUMABLE:
            raise  # the partial stays for a resume
        except HubError:
            keep_partial = False  # cancelled, wrong bytes, 401/403/404: end with no file at all
            raise
        finally:
            self._close()
            with contextlib.suppress(OSError):
                if not keep_partial or self.partial.stat().st_size == 0:
                    self.partial.unlink()  # an empty partial resumes nothing: leave no trace


# failures after which the partial file is kept: trying again later may well succeed
_RESUMABLE = (DownloadPaused, DownloadInterruptedError, RateLimitedError, OfflineError, DiskSpaceError)


def download_file(
    job: DownloadJob,
    root: Path | None = None,
    settings: DownloadSettings | None = None,
    on_bytes: Callable[[int, int | None], None] | None = None,
    should_stop: Callable[[], str | None] | None = None,
) -> tuple[Path, TransferStats]:
    """Fetch one file of a Hub repo into the library folder, verified.

    Args:
        job: what to fetch (repo, file, revision, expected size and sha256 when known).
        root: the library folder (default: models_dir()).
        settings: chunk size, timeouts, retries.
        on_bytes: callback(done_bytes, total_bytes_or_None) after each chunk.
        should_stop: polled between chunks; "pause" keeps the partial, "cancel" deletes it.

    Returns:
        (path of the verified file, what the transfer did).

    Raises:
        UnsafeNameError: a name would leave the library folder.
        GatedRepoError, RemoteNotFoundError, RateLimitedError, OfflineError, HubServerError,
        DownloadInterruptedError, IntegrityError, DiskSpaceError, DownloadPaused, DownloadCancelled.
    """
    t = _Transfer(job, root or models_dir(), settings or DownloadSettings(), on_bytes, should_stop)
    path = t.run()
    return path, t.stats


# -------------------------------------------------------------------------------------- the manager

ACTIVE = ("queued", "running")
PERSISTED = ("queued", "running", "paused", "failed")


def state_path() -> Path:
    """The file that remembers unfinished downloads between runs."""
    return data_dir() / "downloads.json"


@dataclass
class _Live:
    started: float = field(default_factory=time.monotonic)
    first_offset: int | None = None
    stop: str | None = None


class DownloadManager:
    """A queue of downloads with a parallelism limit, persisted so a restart resumes them.

    Args:
        root: library folder (default models_dir()).
        parallel: how many files download at once.
        settings: per-transfer tunables.
        on_progress: callback(ProgressInfo) from worker threads, after each chunk.
        on_state: callback(DownloadJob) whenever a job changes state (from worker threads).
        state_file: where the queue is persisted (default data_dir()/downloads.json).
        autostart: start worker threads now (else call start()).

    Jobs left queued or running by an earlier run (even one killed with -9) are queued again;
    paused and failed ones wait for resume().
    """

    def __init__(
        self,
        root: Path | None = None,
        parallel: int = 2,
        settings: DownloadSettings | None = None,
        on_progress: Callable[[ProgressInfo], None] | None = None,
        on_state: Callable[[DownloadJob], None] | None = None,
        state_file: Path | None = None,
        autostart: bool = True,
    ):
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        self.root = root or models_dir()
        self.parallel = parallel
        self.settings = settings or DownloadSettings()
        self.on_progress = on_progress
        self.on_state = on_state
        self.state_file = state_file or state_path()
        self._cond = threading.Condition()
        self._jobs: dict[str, DownloadJob] = {}
        self._live: dict[str, _Live] = {}
        self.stats: dict[str, TransferStats] = {}
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._load()
        if autostart:
            self.start()

    # ---- persistence
    def _load(self) -> None:
        try:
            saved = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            return  # an unreadable state file loses the queue, never the partial files' safety
        names = {f.name for f in fields(DownloadJob)}
        for entry in saved.get("jobs", []) if isinstance(saved, dict) else []:
            try:
                job = DownloadJob(**{k: v for k, v in entry.items() if k in names}).validate()
            except (TypeError, HubError):
                continue  # a tampered entry must not become a path
            if job.state == "running":
                job.state = "queued"  # interrupted by a crash or a kill
            if job.state in PERSISTED:
                self._jobs[job.id] = job

    def _save(self) -> None:
        # called with the lock held
        jobs = [asdict(j) for j in self._jobs.values() if j.state in PERSISTED]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps({"version": 1, "jobs": jobs}, indent=1))
        os.replace(tmp, self.state_file)

    def _set_state(self, job: DownloadJob, state: str, error: str | None = None) -> None:
        job.state = state
        job.error = error
        self._save()
        self._cond.notify_all()
        if self.on_state:
            self.on_state(job)

    # ---- public API
    def add(self, job: DownloadJob) -> DownloadJob:
        """Queue `job` (validated). Re-adding a job that is already known returns the known one, queued again
        unless it is running or done."""
        job.validate()
        target_path(job, self.root)
        with self._cond:
            known = self._jobs.get(job.id)
            if known is not None:
                if known.state in ("paused", "failed", "cancelled"):
                    self._set_state(known, "queued")
                return known
            self._jobs[job.id] = job
            self._set_state(job, "queued")
            return job

    def jobs(self) -> list[DownloadJob]:
        """Every job this manager knows, in the order added."""
        with self._cond:
            return list(self._jobs.values())

    def get(self, job_id: str) -> DownloadJob:
        """The job with this id (KeyError if unknown)."""
        with self._cond:
            return self._jobs[job_id]

    def towers_of(self, job_id: str) -> list[DownloadJob]:
        """The vision tower jobs queued beside the model that job `job_id` downloads (any of its split
        parts); [] for a tower's own job."""
        with self._cond:
            job = self._jobs[job_id]
            if job.beside is not None:
                return []
            return [
                t
                for t in self._jobs.values()
                if t.beside is not None
                and (t.repo_id, t.revision) == (job.repo_id, job.revision)
                and same_model_file(t.beside, job.filename)
            ]

    def pause(self, job_id: str) -> None:
        """Stop a job after its current chunk, keeping the partial file; a model's vision tower pauses with
        it (pausing the tower alone leaves the model running)."""
        with self._cond:
            job = self._jobs[job_id]
            if job.state not in ACTIVE:
                return
            for j in [job, *self.towers_of(job_id)]:
                if j.state == "running":
                    self._live[j.id].stop = "pause"
                elif j.state == "queued":
                    self._set_state(j, "paused")

    def resume(self, job_id: str) -> None:
        """Queue a paused or failed job again; it continues from its partial file. A model's paused or failed
        vision tower is resumed with it."""
        with self._cond:
            job = self._jobs[job_id]
            if job.state not in ("paused", "failed"):
                return
            for j in [job, *self.towers_of(job_id)]:
                if j.state in ("paused", "failed"):
                    self._set_state(j, "queued")

    def cancel(self, job_id: str) -> None:
        """Stop a job and delete its partial file. Cancelling a model's file cancels the vision tower queued
        beside it too, and a tower already fetched is deleted once no model (nor model download) is left in
        its folder; cancelling the tower alone leaves the model alone."""
        with self._cond:
            job = self._jobs[job_id]
            if job.state not in PERSISTED:
                return  # done or cancelled already: its tower, if still coming, is left alone
            for j in [job, *self.towers_of(job_id)]:
                if j.state == "running":
                    self._live[j.id].stop = "cancel"
                elif j.state in ("queued", "paused", "failed"):
                    partial_path(target_path(j, self.root)).unlink(missing_ok=True)
                    self._set_state(j, "cancelled")
            if job.state == "cancelled" and job.beside is None:
                self._drop_orphans(job)

    def _model_coming(self, folder: Path) -> bool:
        """Whether a model download into `folder` is queued, running, paused or failed (lock held)."""
        coming = (o for o in self._jobs.values() if o.beside is None and o.state in PERSISTED)
        return any(target_path(o, self.root).parent == folder for o in coming)

    def _drop_orphans(self, job: DownloadJob) -> list[Path]:
        """Delete the vision towers in `job`'s folder unless a model is there or still to come (lock held)."""
        folder = target_path(job, self.root).parent
        return [] if self._model_coming(folder) else drop_orphan_towers(folder)

    def cancel_lone_towers(self, folder: Path) -> list[DownloadJob]:
        """Cancel the vision tower downloads into `folder` when no model is left there nor on its way (the
        model was deleted while its tower was still coming). Returns the jobs cancelled."""
        folder = folder.absolute()
        with self._cond:
            if model_in_folder(folder) or self._model_coming(folder):
                return []
            towers = [
                j
                for j in self._jobs.values()
                if j.beside is not None
                and j.state in PERSISTED
                and target_path(j, self.root).parent.absolute() == folder
            ]
            for tower in towers:
                self.cancel(tower.id)
            return towers

    def wait(self, job_ids: list[str] | None = None, timeout: float | None = None) -> bool:
        """Block until the given jobs (default: all) are neither queued nor running. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                ids = job_ids if job_ids is not None else list(self._jobs)
                if all(self._jobs[i].state not in ACTIVE for i in ids):
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        with self._cond:
            self._closing = False
            while len(self._threads) < self.parallel:
                t = threading.Thread(target=self._worker, name="hearth-download", daemon=True)
                self._threads.append(t)
                t.start()

    def close(self, timeout: float = 10.0) -> None:
        """Pause running jobs (they resume on the next start) and stop the workers."""
        with self._cond:
            self._closing = True
            for live in self._live.values():
                live.stop = live.stop or "pause"
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        with self._cond:
            self._save()

    # ---- workers
    def _next(self) -> DownloadJob | None:
        with self._cond:
            while not self._closing:
                for job in self._jobs.values():
                    if job.state == "queued":
                        self._live[job.id] = _Live()
                        self._set_state(job, "running")
                        return job
                self._cond.wait()
            return None

    def _worker(self) -> None:
        while (job := self._next()) is not None:
            live = self._live[job.id]

            def on_bytes(done: int, total: int | None, job=job, live=live) -> None:
                if live.first_offset is None:
                    live.first_offset = done
                elapsed = max(time.monotonic() - live.started, 1e-6)
                speed = (done - (live.first_offset or 0)) / elapsed
                eta = (total - done) / speed if total is not None and speed > 0 else None
                if self.on_progress:
                    self.on_progress(ProgressInfo(job.id, job.filename, done, total, speed, eta))

            state, error = "done", None
            try:
                _, stats = download_file(job, self.root, self.settings, on_bytes, lambda live=live: live.stop)
                self.stats[job.id] = stats
            except DownloadPaused:
                state = "queued" if self._closing else "paused"
            except DownloadCancelled:
                state = "cancelled"
            except HubError as e:
                state, error = "failed", str(e)
            except Exception as e:  # noqa: BLE001 - a worker must survive to report the failure
                state, error = "failed", f"{job.filename}: unexpected error {e!r}"
            with self._cond:
                self._live.pop(job.id, None)
                if state == "cancelled" and job.beside is None:
                    self._set_state(job, state, error)
                    self._drop_orphans(job)
                    continue
                if state == "done" and job.beside is not None and self._drop_orphans(job):
                    # its model was cancelled or deleted while the tower was on its way
                    state = "cancelled"
                    job.note = "no model is left in its folder: the vision tower was not kept"
                self._set_state(job, state, error)
