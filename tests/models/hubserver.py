"""A Hugging Face Hub on 127.0.0.1 for tests: the endpoints huggingface_hub and our downloader use.

Served: GET /api/models (search), /api/models/{repo}[/revision/{rev}] (info; siblings with size,
blobId and LFS sha256 when ?blobs=true), /api/models/{repo}/tree/{rev} (recursive listing),
HEAD/GET /{repo}/resolve/{rev}/{file} (X-Repo-Commit, ETag/X-Linked-Etag, X-Linked-Size; LFS files
redirect to /cdn/{sha256} on another host name, like the real CDN), and /cdn/{sha256} with Range
(bytes=START- and bytes=START-END) and If-Range.

Fault injection: `faults` is a queue of one-shot faults. Status faults ("401", "403", "404", "429",
"500") are consumed by the next resolve request; body faults ("cut", "stall", "ignore_range",
"corrupt") by the next body served. `sticky` holds faults applied to every request.
`throttle` slows bodies (bytes per second) so a test can kill a client mid-transfer.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

STATUS_FAULTS = ("401", "403", "404", "429", "500")
BODY_FAULTS = ("cut", "stall", "ignore_range", "corrupt")
TOKEN = "hf_test_token_for_the_loopback_hub"


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    tags: tuple[str, ...] = ()
    downloads: int = 0
    likes: int = 0
    last_modified: str = "2024-01-01T00:00:00.000Z"
    card_data: dict | None = None
    safetensors: dict | None = None
    gguf: dict | None = None
    lfs_paths: set[str] = field(default_factory=set)

    @property
    def commit(self) -> str:
        return hashlib.sha1(self.repo_id.encode()).hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path in self.lfs_paths or path.endswith((".gguf", ".safetensors", ".bin"))


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class HubServer:
    """Start it, add repos with `add_repo`, point HF_ENDPOINT at `.url`, `close()` at the end."""

    def __init__(self, seed: int = 0):
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes (the CDN's store)
        self.faults: list[str] = []
        self.sticky: set[str] = set()
        self.throttle: int | None = None  # body bytes per second
        self.stall_seconds = 5.0
        self.rng = random.Random(seed)
        self.log: list[dict] = []  # one entry per request: method, path, range, status, sent, auth
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn_url = f"http://localhost:{self.port}"  # another host name: a token must not follow
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def add_repo(self, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        repo = Repo(repo_id, dict(files), **kw)
        self.repos[repo_id] = repo
        for path, data in files.items():
            if repo.is_lfs(path):
                self.blobs[hashlib.sha256(data).hexdigest()] = data
        return repo

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    def sent_bytes(self, path_part: str) -> int:
        """Body bytes written for requests whose path contains `path_part`."""
        with self._lock:
            return sum(e["sent"] for e in self.log if path_part in e["path"])

    def _take(self, kinds: tuple[str, ...]) -> str | None:
        with self._lock:
            sticky = next((f for f in kinds if f in self.sticky), None)
            if sticky:
                return sticky
            if self.faults and self.faults[0] in kinds:
                return self.faults.pop(0)
        return None

    # ------------------------------------------------------------------------------------ JSON views
    def _sibling(self, repo: Repo, path: str, blobs: bool) -> dict:
        entry: dict = {"rfilename": path}
        if blobs:
            data = repo.files[path]
            entry["size"] = len(data)
            entry["blobId"] = git_blob_id(data)
            if repo.is_lfs(path):
                entry["lfs"] = {
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "pointerSize": 134,
                }
        return entry

    def _info(self, repo: Repo, blobs: bool) -> dict:
        info = {
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": repo.commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "downloads": repo.downloads,
            "likes": repo.likes,
            "lastModified": repo.last_modified,
            "tags": list(repo.tags),
            "siblings": [self._sibling(repo, p, blobs) for p in sorted(repo.files)],
        }
        if repo.card_data is not None:
            info["cardData"] = repo.card_data
        if repo.safetensors is not None:
            info["safetensors"] = repo.safetensors
        if repo.gguf is not None:
            info["gguf"] = repo.gguf
        return info

    def _tree(self, repo: Repo) -> list[dict]:
        out, folders = [], set()
        for path in sorted(repo.files):
            parts = path.split("/")
            for i in range(1, len(parts)):
                folders.add("/".join(parts[:i]))
            data = repo.files[path]
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if repo.is_lfs(path):
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            out.append(entry)
        out += [{"type": "directory", "path": f, "oid": "0" * 40} for f in sorted(folders)]
        return out

    def _search(self, query: dict) -> list[dict]:
        text = (query.get("search") or [""])[0].lower()
        filters = query.get("filter", [])
        hits = [
            r for r in self.repos.values() if text in r.repo_id.lower() and all(f in r.tags for f in filters)
        ]
        key = (query.get("sort") or ["downloads"])[0]
        attr = {"downloads": "downloads", "likes": "likes", "lastModified": "last_modified"}.get(
            key, "downloads"
        )
        hits.sort(key=lambda r: getattr(r, attr), reverse=True)
        limit = int((query.get("limit") or ["1000"])[0])
        return [{k: v for k, v in self._info(r, False).items() if k != "siblings"} for r in hits[:limit]]

    # -------------------------------------------------------------------------------------- handler
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._dispatch(head=True)

            def do_GET(self):
                self._dispatch(head=False)

            def _entry(self, status, sent=0) -> dict:
                entry = {
                    "method": self.command,
                    "path": unquote(urlsplit(self.path).path),
                    "range": self.headers.get("Range"),
                    "status": status,
                    "sent": sent,
                    "auth": self.headers.get("Authorization"),
                }
                with hub._lock:
                    hub.log.append(entry)  # logged when the response starts; "sent" grows as it goes
                return entry

            def _json(self, obj, status=200, headers=None):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                self._entry(status)

            def _error(self, status, code=None, extra=None):
                headers = {"X-Error-Code": code} if code else {}
                headers.update(extra or {})
                self._json({"error": code or f"HTTP {status}"}, status, headers)

            def _auth(self, repo: Repo) -> bool:
                if not repo.gated:
                    return True
                auth = self.headers.get("Authorization")
                if auth == f"Bearer {TOKEN}":
                    return True
                self._error(401 if auth is None else 403, "GatedRepo")
                return False

            def _repo(self, repo_id: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(401, "RepoNotFound")  # the Hub answers 401 to hide private repos
                return repo

            def _revision_ok(self, repo: Repo, rev: str) -> bool:
                if rev in ("main", repo.commit):
                    return True
                self._error(404, "RevisionNotFound")
                return False

            def _dispatch(self, head):
                url = urlsplit(self.path)
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                query = parse_qs(url.query)
                if parts[:2] == ["api", "models"]:
                    if len(parts) == 2:
                        return self._json(hub._search(query))
                    repo = self._repo("/".join(parts[2:4]))
                    if repo is None or not self._auth(repo):
                        return
                    rest = parts[4:]
                    blobs = query.get("blobs", ["false"])[0].lower() == "true"
                    if not rest:
                        return self._json(hub._info(repo, blobs))
                    if rest[0] == "revision" and len(rest) == 2:
                        if self._revision_ok(repo, rest[1]):
                            self._json(hub._info(repo, blobs))
                        return
                    if rest[0] == "tree" and len(rest) >= 2:
                        if self._revision_ok(repo, rest[1]):
                            self._json(hub._tree(repo))
                        return
                    return self._error(404)
                if parts[0] == "cdn" and len(parts) == 2:
                    data = hub.blobs.get(parts[1])
                    if data is None:
                        return self._error(404)
                    return self._body(data, head, etag=f'"{parts[1]}"')
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._resolve(parts, head)
                self._error(404)

            def _resolve(self, parts, head):
                fault = hub._take(STATUS_FAULTS)
                if fault:
                    extra = {"Retry-After": "0"} if fault == "429" else None
                    code = {"401": "GatedRepo", "403": "GatedRepo", "404": "EntryNotFound"}.get(fault)
                    return self._error(int(fault), code, extra)
                repo = self._repo("/".join(parts[:2]))
                if repo is None or not self._auth(repo) or not self._revision_ok(repo, parts[3]):
                    return
                path = "/".join(parts[4:])
                data = repo.files.get(path)
                if data is None:
                    return self._error(404, "EntryNotFound")
                common = {"X-Repo-Commit": repo.commit}
                if repo.is_lfs(path):
                    sha = hashlib.sha256(data).hexdigest()
                    self.send_response(302)
                    self.send_header("Location", f"{hub.cdn_url}/cdn/{sha}")
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                    self.send_header("ETag", f'"{git_blob_id(data)}"')
                    for k, v in common.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    self._entry(302)
                    return
                self._body(data, head, etag=f'"{git_blob_id(data)}"', extra=common)

            def _body(self, data: bytes, head: bool, etag: str, extra=None):
                fault = None if head else hub._take(BODY_FAULTS)
                start, stop, status = 0, len(data), 200
                rng = self.headers.get("Range")
                if_range = self.headers.get("If-Range")
                if rng and fault != "ignore_range" and (if_range is None or if_range == etag):
                    try:
                        first, _, last = rng.removeprefix("bytes=").partition("-")
                        start = int(first)
                        stop = min(len(data), int(last) + 1) if last else len(data)
                    except ValueError:
                        return self._error(400)
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return self._entry(416)
                    status = 206
                body = data[start:stop]
                if fault == "corrupt" and body:
                    i = hub.rng.randrange(len(body))
                    body = body[:i] + bytes([body[i] ^ 0x5A]) + body[i + 1 :]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", etag)
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                entry = self._entry(status)
                if head:
                    return
                limit = len(body)
                if fault in ("cut", "stall"):
                    limit = hub.rng.randrange(0, max(1, len(body)))
                sent = 0
                try:
                    while sent < limit:
                        piece = body[sent : min(limit, sent + 4096)]
                        # counted before the write: the client may have read it all (and the test
                        # looked at the log) before this thread runs again
                        entry["sent"] = sent + len(piece)
                        self.wfile.write(piece)
                        sent += len(piece)
                        if hub.throttle:
                            self.wfile.flush()
                            time.sleep(len(piece) / hub.throttle)
                    self.wfile.flush()
                    if fault == "stall":
                        hub._stop.wait(hub.stall_seconds)
                except OSError:
                    entry["sent"] = sent  # the client went away (it was killed, or gave up on a stall)
                self.close_connection = True

        return Handler


def isolate_hf(monkeypatch, tmp_path, server: HubServer | None = None) -> None:
    """Point huggingface_hub at `server` (if given) and away from any real token or cache of this user."""
    import huggingface_hub.constants as hf_constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    if server is not None:
        monkeypatch.setenv("HF_ENDPOINT", server.url)


def payload(n: int, seed: int) -> bytes:
    """Deterministic incompressible-looking bytes of length n."""
    return random.Random(seed).randbytes(n)


def mmproj_bytes(
    path, projector: str | None, nbytes: int = 200_000, has_vision: bool = True, kv_padding: int = 0
) -> bytes:
    """A llama.cpp vision tower (mmproj GGUF, architecture "clip") of about `nbytes`, written by the `gguf`
    package to `path` and returned as bytes.

    Args:
        projector: its clip.projector_type (None: no such key).
        has_vision: its clip.has_vision_encoder.
        kv_padding: bytes of an extra metadata array placed before the projector keys (a large header).
    """
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "clip")
    if kv_padding:
        w.add_array("clip.test.padding", [0.5] * (kv_padding // 4))
    w.add_bool("clip.has_vision_encoder", has_vision)
    if projector is not None:
        w.add_string("clip.projector_type", projector)
    rows = max(1, nbytes // (64 * 4))
    w.add_tensor("v.patch_embd.weight", np.random.default_rng(0).normal(size=(rows, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "rb") as f:
        return f.read()
