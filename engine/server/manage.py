"""Ollama's model management on `hearth serve`: POST /api/pull and DELETE /api/delete.

Hearth's registry is the Hugging Face Hub, as in Ollama's own Hub integration: `/api/pull` takes
`hf.co/ORG/REPO[:QUANT]` (or `huggingface.co/...`, or `ORG/REPO[:QUANT|:FILE]` as `hearth pull` takes it,
or a starter model's name) and pulls it into Hearth's library through models.pull (resumable downloads,
the vision tower beside a GGUF, the disk checked first). The reply streams Ollama's status lines
(`pulling manifest`, `pulling FILE` with total/completed bytes, `verifying sha256 digest`, `writing
manifest`, `success`) or, with `"stream": false`, one `{"status": "success"}`. A client that goes away
pauses the downloads (the next pull resumes them). Pulls run one at a time. Ollama registry names
(`llama3.2`, `qwen3:8b`) are no Hub names: a 400 says how to name the model.

`/api/delete` removes a model from the library (its files too when they are in Hearth's library folder,
as the library window's Delete does), unloading it first; a model running requests answers 409.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server.errors import APIError, invalid
from engine.server.pool import ModelPool
from models.errors import HearthError

NDJSON = "application/x-ndjson"
_HUB_HOSTS = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")


def hub_spec(name: str) -> str:
    """The models.pull spec of an Ollama model name.

    Raises:
        APIError (400): a name that is no Hub repo nor starter.
    """
    from models.starter import STARTERS

    name = name.strip()
    if name.removesuffix(":latest") in STARTERS:
        return name.removesuffix(":latest")
    for host in _HUB_HOSTS:
        if name.lower().startswith(host):
            name = name[len(host):]
            break
    repo, _, tag = name.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise invalid(
            f"{name!r} is no Hugging Face repo: Hearth pulls from the Hub, so name the model as "
            "hf.co/ORG/REPO[:QUANT] (for example hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M) or a "
            "starter model; names from Ollama's own registry (llama3.2, qwen3:8b) are not on the Hub",
            "model", "invalid_model_name",
        )
    return repo if tag in ("", "latest") else f"{repo}:{tag}"


def _status(e: Exception) -> int:
    from models import downloads, hub

    if isinstance(e, hub.RemoteNotFoundError):
        return 404
    if isinstance(e, hub.GatedRepoError):
        return 403
    if isinstance(e, (hub.UnsafeNameError,)):
        return 400
    if isinstance(e, downloads.DiskSpaceError):
        return 507
    if isinstance(e, (hub.OfflineError, hub.HubServerError, hub.RateLimitedError)):
        return 502
    return 500


def _name(body: Any) -> str:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name.strip():
        raise invalid("'model' is required", "model")
    return name


class ManageRoutes:
    """/api/pull and /api/delete over the server's model pool (engine.server.pool)."""

    PROGRESS_EVERY_S = 0.1

    def __init__(self, pool: ModelPool, read_json):
        self.pool = pool
        self.read_json = read_json
        self._pulling = threading.Lock()  # one pull at a time (one download queue and state file)

    async def pull(self, request: Request) -> Response:
        body = await self.read_json(request)
        name = _name(body)
        spec = hub_spec(name)
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise invalid("'stream' must be true or false", "stream")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[dict | None] = asyncio.Queue()
        cancel = threading.Event()
        last: dict[str, float] = {}

        def put(obj: dict | None) -> None:
            loop.call_soon_threadsafe(q.put_nowait, obj)

        def progress(p) -> None:
            now = time.monotonic()
            done = p.total is not None and p.done >= p.total
            if not done and now - last.get(p.filename, 0.0) < self.PROGRESS_EVERY_S:
                return
            last[p.filename] = now
            line = {"status": f"pulling {p.filename}", "digest": p.filename, "completed": p.done}
            if p.total is not None:
                line["total"] = p.total
            put(line)

        def run() -> None:
            from models.pull import pull

            try:
                with self._pulling:
                    put({"status": "pulling manifest"})
                    pulled = pull(spec, note=lambda line: put({"status": line}), on_progress=progress,
                                  cancel=cancel)
                put({"status": "verifying sha256 digest"})
                tower = pulled.tower
                if tower is not None and tower.state != "done":
                    put({"status": f"the vision tower failed ({tower.error or tower.state}); the model works "
                                   "for text, pull again to fetch the tower"})
                put({"status": "writing manifest"})
                self.pool.catalog(refresh=True)
                put({"status": "success"})
            except (HearthError, OSError) as e:
                put({"error": str(e), "_status": _status(e)})
            except Exception as e:  # noqa: BLE001 - the client gets the error, the server goes on
                put({"error": f"internal error: {type(e).__name__}: {e}", "_status": 500})
            finally:
                put(None)

        threading.Thread(target=run, name="hearth-pull", daemon=True).start()
        if stream:
            return StreamingResponse(self._lines(q, cancel), media_type=NDJSON)
        try:
            while (line := await q.get()) is not None:
                if "error" in line:
                    raise APIError(line["_status"], line["error"], "server_error" if line["_status"] >= 500
                                   else "invalid_request_error", "model")
        except asyncio.CancelledError:
            cancel.set()
            raise
        return JSONResponse({"status": "success"})

    async def _lines(self, q: asyncio.Queue, cancel: threading.Event):
        try:
            while (line := await q.get()) is not None:
                line.pop("_status", None)
                yield json.dumps(line) + "\n"
        finally:
            cancel.set()  # the client went away (or the pull ended: then nothing is left to stop)

    async def delete(self, request: Request) -> Response:
        name = _name(await self.read_json(request))
        await run_in_threadpool(self._delete, name)
        return Response(status_code=200)

    def _delete(self, name: str):
        from models.library import Library

        entry = next((e for e in self.pool.catalog(refresh=True) if e.answers(name)
                      or e.answers(name.removesuffix(":latest"))), None)
        if entry is None or entry.entry is None:
            raise APIError(404, f"model {name!r} not found in Hearth's library (GET /api/tags lists it)",
                           "invalid_request_error", "model", "model_not_found")
        if not self.pool.unload_now(entry.path):
            raise APIError(409, f"{entry.id} is running requests; delete it once they end",
                           "invalid_request_error", "model", "model_busy")
        removed = Library().remove(entry.entry.id)
        self.pool.catalog(refresh=True)
        return removed
