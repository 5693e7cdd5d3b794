"""Browse the Hugging Face Hub: search, repo details, files, GGUF variants, safetensors sets.

Protocol work goes through `huggingface_hub.HfApi` (search, model info with LFS metadata, tree);
this module turns its answers into small dataclasses and its exceptions into our typed errors.
Everything a server sends that later becomes a path on disk (repo ids, file names) is checked
here by `check_repo_id` / `check_filename` / `library_path`, so no name can escape the library folder.

`HF_ENDPOINT` points at another Hub (a mirror, or the loopback server of the tests); it is read
on every call, not once at import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from models.errors import HearthError, ModelNotFoundError

DEFAULT_ENDPOINT = "https://huggingface.co"
TOKEN_HELP = (
    "set a token in HF_TOKEN or run `huggingface-cli login` (accept the license on the repo page first)"
)


# --------------------------------------------------------------------------------------------- errors


class HubError(HearthError):
    """Something went wrong talking to the Hub or downloading from it."""


class GatedRepoError(HubError):
    """401/403: the repo is gated or private and this machine has no (valid) token for it."""


class RemoteNotFoundError(HubError, ModelNotFoundError):
    """404: no such repo, revision or file on the Hub."""


class RateLimitedError(HubError):
    """429: the Hub asked us to slow down and kept asking after our retries."""


class HubServerError(HubError):
    """5xx or a malformed answer from the Hub."""


class OfflineError(HubError):
    """The Hub cannot be reached (no network, DNS failure, HF_HUB_OFFLINE=1)."""


class UnsafeNameError(HubError):
    """A repo id, revision or file name would write outside the library folder or is malformed."""


# ----------------------------------------------------------------------------------- name checks

_REPO_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$")
_MAX_PATH_BYTES = 1024
_MAX_COMPONENT_BYTES = 255


def check_repo_id(repo_id: str) -> str:
    """Return `repo_id` ("owner/name" or a legacy bare "name") or raise UnsafeNameError."""
    if not isinstance(repo_id, str):
        raise UnsafeNameError(f"repo id must be text, got {type(repo_id).__name__}")
    parts = repo_id.split("/")
    if not 1 <= len(parts) <= 2 or not all(_REPO_PART.match(p) for p in parts):
        raise UnsafeNameError(f"{repo_id!r} is not a valid repo id (expected owner/name)")
    if any(".." in p or "--" in p for p in parts):
        raise UnsafeNameError(f"{repo_id!r} is not a valid repo id ('..' and '--' are not allowed)")
    return repo_id


def check_revision(revision: str) -> str:
    """Return a revision (branch, tag or commit) that is safe to put in a URL, or raise UnsafeNameError."""
    if (
        not isinstance(revision, str)
        or not revision
        or len(revision) > 255
        or any(ord(c) < 32 or c in "\\\x7f" for c in revision)
        or ".." in revision
        or revision.startswith(("/", "-"))
    ):
        raise UnsafeNameError(f"{revision!r} is not a valid revision")
    return revision


def check_filename(filename: str) -> str:
    """Return a repo file path ("a/b.gguf") that is a plain relative POSIX path, or raise UnsafeNameError.

    Refused: absolute paths, "..", ".", empty components, backslashes, drive letters and other
    colons, control characters, over-long names.
    """
    bad = UnsafeNameError(f"{filename!r} is not a safe file name inside a repo")
    if not isinstance(filename, str) or not filename or len(filename.encode()) > _MAX_PATH_BYTES:
        raise bad
    if any(ord(c) < 32 or c in "\\:\x7f" for c in filename) or filename.startswith("/"):
        raise bad
    parts = filename.split("/")
    if any(p in ("", ".", "..") or len(p.encode()) > _MAX_COMPONENT_BYTES for p in parts):
        raise bad
    return filename


def library_path(root: Path, repo_id: str, filename: str) -> Path:
    """Where file `filename` of `repo_id` lives under the library folder `root`.

    Layout: root/hub/<owner>/<name>/<filename> ("_" as owner for legacy bare names).

    Raises:
        UnsafeNameError: a name is invalid, or a symlink on the way would lead outside `root`.
    """
    check_repo_id(repo_id)
    check_filename(filename)
    owner, _, name = repo_id.rpartition("/")
    rel = PurePosixPath("hub", owner or "_", name, *filename.split("/"))
    target = root.joinpath(*rel.parts)
    # a pre-existing symlink anywhere below root could redirect the write; refuse rather than follow
    probe = root
    for part in rel.parts:
        probe = probe / part
        if probe.is_symlink():
            raise UnsafeNameError(f"{probe} is a symbolic link; refusing to write through it")
    resolved_root = root.resolve()
    if not target.resolve().is_relative_to(resolved_root):
        raise UnsafeNameError(f"{filename!r} of {repo_id} would be written outside {root}")
    return target


# ----------------------------------------------------------------------------------- endpoint, token


def endpoint() -> str:
    """The Hub's base URL: HF_ENDPOINT when set, else huggingface.co."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def hf_token() -> str | None:
    """The user's Hub token from the usual places (HF_TOKEN, the `huggingface-cli login` file), or None."""
    from huggingface_hub import get_token

    return get_token() or None


def offline() -> bool:
    """True when the user asked for no network (HF_HUB_OFFLINE=1)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_url(repo_id: str, filename: str, revision: str = "main") -> str:
    """The Hub's download URL of one file (it answers with the file or a redirect to its CDN)."""
    check_repo_id(repo_id)
    check_filename(filename)
    check_revision(revision)
    return f"{endpoint()}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(filename)}"


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=hf_token() or False)


def http_error(status: int, what: str, retry_after: float | None = None) -> HubError:
    """Our typed error for an HTTP status from the Hub, with what the user can do about it."""
    if status == 401:
        return GatedRepoError(f"{what}: the Hub requires a token (HTTP 401); {TOKEN_HELP}")
    if status == 403:
        return GatedRepoError(
            f"{what}: access denied (HTTP 403). The repo is gated or private and this token has no access; "
            f"{TOKEN_HELP}"
        )
    if status == 404:
        return RemoteNotFoundError(
            f"{what}: not found on the Hub (HTTP 404); check the repo id and file name"
        )
    if status == 429:
        wait = f" (retry after {retry_after:.0f} s)" if retry_after else ""
        return RateLimitedError(f"{what}: the Hub is rate-limiting us (HTTP 429){wait}; try again later")
    return HubServerError(f"{what}: the Hub answered HTTP {status}; try again later")


def _translate(e: Exception, what: str) -> HubError:
    """Map huggingface_hub / httpx exceptions to our errors."""
    import httpx2
    from huggingface_hub import errors as hf_errors
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return OfflineError(f"{what}: offline mode is on (HF_HUB_OFFLINE); unset it to reach the Hub")
    if isinstance(e, hf_errors.GatedRepoError):
        return GatedRepoError(f"{what}: this repo is gated; {TOKEN_HELP}")
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        return RemoteNotFoundError(
            f"{what}: no such repo on the Hub (or it is private: then {TOKEN_HELP.removeprefix('set')})"
        )
    if isinstance(e, hf_errors.RevisionNotFoundError | hf_errors.EntryNotFoundError):
        return RemoteNotFoundError(f"{what}: no such revision or file on the Hub")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else 0
        return http_error(status, what)
    if isinstance(e, httpx2.TransportError | OSError):
        return OfflineError(f"{what}: cannot reach the Hub at {endpoint()} ({e}); check your connection")
    if isinstance(e, KeyError | TypeError | ValueError):
        return HubServerError(f"{what}: the Hub sent an answer we cannot read ({e!r})")
    raise e


def _call(what: str, fn, *args, **kwargs):
    if offline():
        raise OfflineError(f"{what}: offline mode is on (HF_HUB_OFFLINE); unset it to reach the Hub")
    try:
        return fn(*args, **kwargs)
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes a typed error or is re-raised
        raise _translate(e, what) from e


# ----------------------------------------------------------------------------------------- search

SORTS = {"downloads": "downloads", "likes": "likes", "recent": "last_modified"}
FORMATS = ("gguf", "safetensors")


@dataclass(frozen=True)
class RepoSummary:
    """One search hit."""

    repo_id: str
    downloads: int
    likes: int
    last_modified: str | None
    gated: bool
    tags: tuple[str, ...]


def search(
    query: str = "", fmt: str | None = None, sort: str = "downloads", limit: int = 20
) -> list[RepoSummary]:
    """Search model repos on the Hub.

    Args:
        query: text matched against repo ids.
        fmt: "gguf" or "safetensors" to keep only repos with files of that format, or None.
        sort: "downloads", "likes" or "recent" (descending).
        limit: at most this many results.

    Raises:
        ValueError: unknown fmt or sort.
        HubError: the Hub could not answer.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {tuple(SORTS)}, got {sort!r}")
    api = _api()

    def run() -> list[RepoSummary]:
        hits = []
        for m in api.list_models(search=query or None, filter=fmt, sort=SORTS[sort], limit=limit):
            hits.append(
                RepoSummary(
                    repo_id=m.id,
                    downloads=int(m.downloads or 0),
                    likes=int(m.likes or 0),
                    last_modified=m.last_modified.isoformat() if m.last_modified else None,
                    gated=bool(m.gated),
                    tags=tuple(m.tags or ()),
                )
            )
        return hits

    return _call(f"search {query!r}", run)


# ------------------------------------------------------------------------------------ repo details


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo. sha256 is the LFS object id (None for small non-LFS files, checked by blob_id)."""

    path: str
    size: int | None
    sha256: str | None = None
    blob_id: str | None = None


@dataclass(frozen=True)
class RepoDetails:
    """What the library view shows about one repo."""

    repo_id: str
    commit: str | None
    license: str | None
    gated: bool
    params: int | None
    summary: str
    tags: tuple[str, ...]
    files: tuple[RemoteFile, ...]
    safetensors_dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> parameter count


def _files_from_siblings(siblings: Iterable) -> tuple[RemoteFile, ...]:
    files = []
    for s in siblings or ():
        lfs = s.lfs
        files.append(
            RemoteFile(
                path=s.rfilename,
                size=(lfs.size if lfs else s.size),
                sha256=(lfs.sha256 if lfs else None),
                blob_id=s.blob_id,
            )
        )
    return tuple(files)


def card_summary(text: str, limit: int = 400) -> str:
    """The first prose paragraph of a model card (README.md), without YAML front matter or markup."""
    if text.startswith("---"):
        end = text.find("\n---", 3)
        text = text[end + 4 :] if end >= 0 else ""
    for block in re.split(r"\n\s*\n", text):
        block = block.strip()
        if not block or block.startswith(("#", "<", "|", "```", "!", "[!", ">")):
            continue
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", " ".join(block.split()))
        plain = re.sub(r"[*_`]", "", plain)
        return plain if len(plain) <= limit else plain[: limit - 1].rstrip() + "…"
    return ""


def repo_details(repo_id: str, revision: str | None = None, with_card: bool = True) -> RepoDetails:
    """Details of one model repo: license, gating, parameter count, card summary, files with sizes/sha256.

    Raises:
        UnsafeNameError: an invalid repo id or revision.
        GatedRepoError, RemoteNotFoundError, OfflineError, HubServerError.
    """
    check_repo_id(repo_id)
    if revision is not None:
        check_revision(revision)
    api = _api()
    info = _call(repo_id, api.model_info, repo_id, revision=revision, files_metadata=True, timeout=30)
    files = _files_from_siblings(info.siblings)
    for f in files:
        check_filename(f.path)
    card = info.card_data
    license_ = None
    if card is not None:
        license_ = getattr(card, "license", None) or (card.get("license") if hasattr(card, "get") else None)
    tags = tuple(info.tags or ())
    if license_ is None:
        license_ = next((t.split(":", 1)[1] for t in tags if t.startswith("license:")), None)
    params = None
    dtypes: dict[str, int] = {}
    if info.safetensors is not None:
        params = int(info.safetensors.total)
        dtypes = {str(k): int(v) for k, v in info.safetensors.parameters.items()}
    elif isinstance(info.gguf, dict) and info.gguf.get("total"):
        params = int(info.gguf["total"])
    summary = ""
    if with_card and any(f.path == "README.md" for f in files):
        summary = card_summary(_read_small_file(repo_id, "README.md", info.sha or revision or "main"))
    return RepoDetails(
        repo_id=repo_id,
        commit=info.sha,
        license=license_,
        gated=bool(info.gated),
        params=params,
        summary=summary,
        tags=tags,
        files=files,
        safetensors_dtypes=dtypes,
    )


def _read_small_file(repo_id: str, filename: str, revision: str, limit: int = 256 * 1024) -> str:
    """A small text file of a repo (the model card), best effort: "" when it cannot be read."""
    from huggingface_hub.utils import build_hf_headers, get_session

    try:
        r = get_session().get(
            resolve_url(repo_id, filename, revision),
            headers=build_hf_headers(token=hf_token() or False),
            timeout=30,
            follow_redirects=True,
        )
        if r.status_code != 200:
            return ""
        return r.content[:limit].decode("utf-8", errors="replace")
    except Exception:  # noqa: BLE001 - the summary is decoration; its absence is not an error
        return ""


def list_files(repo_id: str, revision: str = "main") -> tuple[RemoteFile, ...]:
    """Every file of a repo (recursive tree listing) with size and LFS sha256.

    Raises:
        UnsafeNameError: an invalid repo id/revision, or the server listed an unsafe file name.
        GatedRepoError, RemoteNotFoundError, OfflineError, HubServerError.
    """
    from huggingface_hub.hf_api import RepoFile

    check_repo_id(repo_id)
    check_revision(revision)
    api = _api()

    def run():
        return list(api.list_repo_tree(repo_id, recursive=True, revision=revision))

    files = []
    for entry in _call(repo_id, run):
        if not isinstance(entry, RepoFile):
            continue
        check_filename(entry.path)
        sha = entry.lfs.sha256 if entry.lfs is not None else None  # the tree's lfs.oid is the sha256
        files.append(RemoteFile(path=entry.path, size=entry.size, sha256=sha, blob_id=entry.blob_id))
    return tuple(files)


# --------------------------------------------------------------------------------- variant grouping

_SPLIT = re.compile(r"^(?P<base>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[A-Z0-9]{1,3}){0,3}|TQ[12]_0|BF16|F16|FP16|F32|FP32|MXFP4)(?![A-Za-z0-9])",
    re.IGNORECASE,
)


def quant_from_name(filename: str) -> str | None:
    """The quantization named in a GGUF file name ("Llama-Q4_K_M.gguf" -> "Q4_K_M"), or None."""
    stem = PurePosixPath(filename).name
    m = _SPLIT.match(stem)
    stem = m.group("base") if m else re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    found = _QUANT.findall(stem)
    if not found:
        return None
    q = found[-1].upper()
    return {"FP16": "F16", "FP32": "F32"}.get(q, q)


def is_mmproj(filename: str) -> bool:
    """True for llama.cpp's vision tower file of a model (an "mmproj" GGUF), by name, as loaders find it."""
    name = PurePosixPath(filename).name.lower()
    return name.endswith(".gguf") and "mmproj" in name


def mmprojs_in(folder: Path) -> list[Path]:
    """The complete mmproj GGUFs in a local folder (a partial download ends in another suffix)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("*.gguf") if is_mmproj(p.name) and p.is_file())


# The projector types (an mmproj's clip.projector_type) whose vision towers Hearth runs: the keys of
# engine.vision.load.GGUF_READERS, which a test keeps equal to this (models/ never imports engine/). To add
# one: write its reader in engine/vision/load.py, register it in GGUF_READERS, and name it here; until it
# is named here, a model download skips towers of that type instead of fetching what the engine cannot read.
VISION_PROJECTOR_TYPES = ("gemma3", "pixtral", "qwen3vl_merger", "qwen2.5vl_merger", "qwen2vl_merger")

_HEADER_FIRST_READ = 64 * 1024  # an mmproj's key/value section is a few KiB
_HEADER_MAX_READ = 8 << 20  # a header that needs more than this is read by downloading the file


@dataclass(frozen=True)
class TowerHeader:
    """What a vision tower's (mmproj's) GGUF header says about it."""

    projector_type: str | None  # clip.projector_type (clip.vision.projector_type in audio+vision files)
    has_vision_encoder: bool  # False: an audio-only projector

    @property
    def unsupported(self) -> str | None:
        """Why Hearth cannot read images with this tower, or None when it can."""
        if not self.has_vision_encoder:
            return f"it has no vision encoder (projector {self.projector_type or 'unknown'}, audio only)"
        if self.projector_type not in VISION_PROJECTOR_TYPES:
            return (
                f"projector {self.projector_type or '(none named)'} is not one Hearth reads "
                f"(it reads {', '.join(VISION_PROJECTOR_TYPES)})"
            )
        return None


def tower_header(metadata: dict) -> TowerHeader:
    """The projector facts of an mmproj GGUF from its metadata (as engine.vision.load reads them)."""
    kind = metadata.get("clip.vision.projector_type") or metadata.get("clip.projector_type")
    has_vision = metadata.get("clip.has_vision_encoder", True)
    return TowerHeader(kind if isinstance(kind, str) else None, bool(has_vision))


def remote_gguf_metadata(
    repo_id: str, filename: str, revision: str = "main", size: int | None = None, timeout: float = 20.0
) -> dict | None:
    """A Hub file's GGUF key/value metadata, read with HTTP Range requests for its first bytes only.

    The request goes through huggingface_hub's session with its headers (HF_ENDPOINT, the user's token; the
    token is not sent on to the CDN). A server that ignores Range answers 200: only the first bytes of that
    body are read before the connection is closed.

    Args:
        repo_id, filename, revision: the file.
        size: its size when known (bounds what the header may claim).
        timeout: per request, in seconds.

    Returns:
        The metadata, or None when it could not be had: no network, offline mode, an HTTP error, a header
        over 8 MiB, or bytes that are no GGUF header. The caller then goes on without it.
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    from models.formats.gguf import metadata_from_prefix

    if offline() or (size is not None and size < 24):  # 24 bytes: magic, version and the two counts
        return None
    check_repo_id(repo_id)
    check_filename(filename)
    check_revision(revision)
    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint())
    want = _HEADER_FIRST_READ if size is None else min(_HEADER_FIRST_READ, size)
    try:
        while True:
            headers = build_hf_headers(token=hf_token() or False)
            headers.update({"Range": f"bytes=0-{want - 1}", "Accept-Encoding": "identity"})
            data = bytearray()
            with get_session().stream(
                "GET", url, headers=headers, timeout=timeout, follow_redirects=True
            ) as r:
                if r.status_code not in (200, 206):
                    return None
                for block in r.iter_bytes():
                    data += block
                    if len(data) >= want:
                        break
            data = bytes(data[:want])
            metadata = metadata_from_prefix(data, size, filename)
            if metadata is not None:
                return metadata
            if len(data) < want or want >= _HEADER_MAX_READ or (size is not None and want >= size):
                return None
            want = min(want * 4, _HEADER_MAX_READ, size or _HEADER_MAX_READ)
    except Exception:  # noqa: BLE001 - a missing header means "download as before", never an error
        return None


_MMPROJ_PRECISIONS = ("F16", "BF16", "F32")  # preferred in this order; quantized towers come after


def pick_mmproj(files: Iterable[RemoteFile], model_file: str) -> RemoteFile | None:
    """The vision tower (mmproj GGUF) of a repo that goes with its GGUF model `model_file`, or None.

    None when `model_file` is no GGUF language model (an mmproj itself, a safetensors file) or the repo
    has no single-file mmproj. Among several: those in the model's own folder, then at the repo's top,
    then elsewhere; within those F16, then BF16, then F32, then the largest quantized one.
    """
    if not model_file.lower().endswith(".gguf") or is_mmproj(model_file):
        return None
    folder = PurePosixPath(model_file).parent

    def rank(f: RemoteFile) -> tuple:
        where = PurePosixPath(f.path).parent
        place = 0 if where == folder else 1 if where == PurePosixPath(".") else 2
        quant = quant_from_name(f.path)
        precision = _MMPROJ_PRECISIONS.index(quant) if quant in _MMPROJ_PRECISIONS else 3
        return place, precision, -(f.size or 0), f.path

    towers = [f for f in files if is_mmproj(f.path) and not _SPLIT.match(f.path)]
    return min(towers, key=rank) if towers else None


def same_model_file(a: str, b: str) -> bool:
    """Whether repo paths `a` and `b` are one model: the same file, or parts of one split set."""
    if a == b:
        return True
    ma, mb = _SPLIT.match(a), _SPLIT.match(b)
    return bool(ma and mb and (ma.group("base"), ma.group("count")) == (mb.group("base"), mb.group("count")))


@dataclass(frozen=True)
class GGUFVariant:
    """One downloadable GGUF model: a single file or a complete split set (-00001-of-0000N)."""

    quant: str  # e.g. "Q4_K_M"; the file name when none can be parsed
    files: tuple[RemoteFile, ...]  # in part order
    size: int  # bytes, summed over parts (0 when a size is unknown)
    complete: bool  # False when a split set misses parts
    mmproj: bool  # a vision projector, not a language model


def gguf_variants(files: Iterable[RemoteFile]) -> list[GGUFVariant]:
    """Group a repo's .gguf files into variants, split sets joined, sorted by size.

    Args:
        files: the repo's files (any kind; non-GGUF files are ignored).
    """
    singles: list[GGUFVariant] = []
    splits: dict[tuple[str, int], list[tuple[int, RemoteFile]]] = {}
    for f in files:
        name = PurePosixPath(f.path).name
        if not name.lower().endswith(".gguf"):
            continue
        m = _SPLIT.match(f.path)
        if m:
            splits.setdefault((m.group("base"), int(m.group("count"))), []).append((int(m.group("index")), f))
            continue
        singles.append(
            GGUFVariant(
                quant=quant_from_name(f.path) or name,
                files=(f,),
                size=f.size or 0,
                complete=True,
                mmproj=is_mmproj(name),
            )
        )
    for (base, count), parts in splits.items():
        parts.sort(key=lambda p: p[0])
        indices = [i for i, _ in parts]
        ordered = tuple(f for _, f in parts)
        singles.append(
            GGUFVariant(
                quant=quant_from_name(ordered[0].path) or PurePosixPath(base).name,
                files=ordered,
                size=sum(f.size or 0 for f in ordered),
                complete=indices == list(range(1, count + 1)),
                mmproj=is_mmproj(PurePosixPath(base).name + ".gguf"),
            )
        )
    return sorted(singles, key=lambda v: (v.mmproj, v.size, v.quant))


@dataclass(frozen=True)
class SafetensorsSet:
    """The safetensors weights of a repo plus the small files a loader needs (config, tokenizer)."""

    files: tuple[RemoteFile, ...]
    size: int  # weights bytes
    dtypes: dict[str, int]  # dtype -> parameter count, from the Hub's safetensors metadata


_SIDE_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|"
    r"chat_template\.(json|jinja)|model\.safetensors\.index\.json)$"
)


def safetensors_set(details: RepoDetails) -> SafetensorsSet | None:
    """The top-level safetensors weights of a repo with their side files, or None when it has none."""
    top = [f for f in details.files if "/" not in f.path]
    weights = [f for f in top if f.path.endswith(".safetensors")]
    if not weights:
        return None
    side = [f for f in top if _SIDE_FILES.match(f.path)]
    return SafetensorsSet(
        files=tuple(sorted(weights + side, key=lambda f: f.path)),
        size=sum(f.size or 0 for f in weights),
        dtypes=dict(details.safetensors_dtypes),
    )


def pick_files(details: RepoDetails, selector: str | None) -> tuple[RemoteFile, ...]:
    """The files `hearth pull REPO[:QUANT|:FILE]` means.

    selector None: the repo's only GGUF variant, else Q4_K_M when present, else its safetensors set.
    A selector that names a file in the repo picks that file; otherwise it is a quant name (case-insensitive).

    Raises:
        RemoteNotFoundError: nothing matches; the message lists what the repo offers.
        HubError: the choice is ambiguous.
    """
    variants = [v for v in gguf_variants(details.files) if not v.mmproj]
    offered = ", ".join(v.quant for v in variants) or "no GGUF files"
    if selector:
        by_path = [f for f in details.files if f.path == selector]
        if by_path:
            return tuple(by_path)
        chosen = [v for v in variants if v.quant.upper() == selector.upper()]
        if not chosen:
            raise RemoteNotFoundError(
                f"{details.repo_id} has no file or quant {selector!r}; it offers: {offered}"
            )
        if len(chosen) > 1:
            names = ", ".join(v.files[0].path for v in chosen)
            raise HubError(f"{details.repo_id}: several files are {selector}: {names}; name the file instead")
        return _complete(details.repo_id, chosen[0])
    if len(variants) == 1:
        return _complete(details.repo_id, variants[0])
    if variants:
        default = [v for v in variants if v.quant == "Q4_K_M"]
        if len(default) == 1:
            return _complete(details.repo_id, default[0])
        raise HubError(f"{details.repo_id} has several GGUF variants ({offered}); pick one with REPO:QUANT")
    st = safetensors_set(details)
    if st is None:
        raise RemoteNotFoundError(f"{details.repo_id} has neither GGUF nor safetensors weights")
    return st.files


def _complete(repo_id: str, variant: GGUFVariant) -> tuple[RemoteFile, ...]:
    if not variant.complete:
        raise HubServerError(
            f"{repo_id}: the split set {variant.quant} misses parts on the Hub; cannot download it"
        )
    return variant.files
