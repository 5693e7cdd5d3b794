"""Ollama's model management on `hearth serve`: POST /api/pull, /api/create, /api/copy, DELETE /api/delete.

Hearth's registry is the Hugging Face Hub, as in Ollama's own Hub integration: `/api/pull` takes
`hf.co/ORG/REPO[:QUANT]` (or `huggingface.co/...`, or `ORG/REPO[:QUANT|:FILE]` as `hearth pull` takes it,
or a starter model's name) and pulls it into Hearth's library through models.pull (resumable downloads,
the vision tower beside a GGUF, the disk checked first). The reply streams Ollama's status lines
(`pulling manifest`, `pulling FILE` with total/completed bytes, `verifying sha256 digest`, `writing
manifest`, `success`) or, with `"stream": false`, one `{"status": "success"}`. A client that goes away
pauses the downloads (the next pull resumes them). Pulls run one at a time. Ollama registry names
(`llama3.2`, `qwen3:8b`) are no Hub names: a 400 says how to name the model.

`/api/delete` removes a model from the library (its files too when they are in Hearth's library folder,
as the library window's Delete does), unloading it first; a model running requests answers 409. A preset
is deleted alone: its base model stays, loaded or not.

`/api/create` makes a preset (engine.server.modelfile) from the body Ollama's clients send (`from`,
`system`, `template`, `parameters`, `messages`, `license`) or from the older `modelfile` text: FROM names a
model this server has (a library id or alias, another preset, `name:latest`) or a GGUF file on this machine
(indexed in place). Creating over a preset replaces it; a model file's name is refused. Uploaded files
(`files`, /api/blobs), `adapters` and `quantize` are refused with a 400 that says what to do. The reply
streams Ollama's lines (`using existing layer`, `creating new layer`, `writing manifest`, `success`), or
one `{"status": "success"}` with `"stream": false`. `/api/copy` gives a model (or a preset) a second name,
a preset of nothing more: no file is copied.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server import modelfile
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

        preset = self.pool.preset(name)
        if preset is not None:
            Library().remove_preset(preset.id)
            self.pool.catalog(refresh=True)
            return preset
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

    # --- presets ---

    async def create(self, request: Request) -> Response:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise invalid("'stream' must be true or false", "stream")
        lines = await run_in_threadpool(self._create, body)
        if not stream:
            return JSONResponse(lines[-1])
        return StreamingResponse(iter([json.dumps(line) + "\n" for line in lines]), media_type=NDJSON)

    def _create(self, body: dict) -> list[dict]:
        from models.library import Library, Preset

        name = modelfile.model_name(_name(body))
        fields = {}
        if body.get("modelfile") is not None:
            if not isinstance(body["modelfile"], str):
                raise invalid("'modelfile' must be the Modelfile's text", "modelfile")
            fields = modelfile.parse_modelfile(body["modelfile"])
        for key in ("from", "system", "template", "parameters", "messages", "license", "adapters", "files",
                    "quantize"):
            if body.get(key) not in (None, "", [], {}):
                fields[key] = body[key]
        if fields.get("files"):
            raise invalid(modelfile.NO_BLOBS, "files")
        if fields.get("adapters"):
            raise invalid("ADAPTER (LoRA adapters) is not supported by Hearth: merge the adapter into the "
                          "model and convert the result (`hearth convert`), then FROM that model", "adapters")
        if fields.get("quantize"):
            raise invalid("'quantize' is not supported by /api/create: quantize with `hearth convert MODEL "
                          "--to TYPE` (or the app's library), then create FROM the converted model",
                          "quantize")
        source = fields.get("from")
        if not isinstance(source, str) or not source.strip():
            raise invalid("'from' is required: name a model this server has (GET /api/tags) or the path of a "
                          "GGUF file on the server's machine", "from")
        self._claim(name, replace=True)
        params = modelfile.parameters(fields.get("parameters"))
        system = fields.get("system")
        if system is not None and not isinstance(system, str):
            raise invalid("'system' must be a string", "system")
        template = modelfile.template(fields.get("template"))
        chat = modelfile.messages(fields.get("messages"))
        license = modelfile.license_text(fields.get("license"))
        base_path, base_id, inherited = self._base(source.strip())  # last: it may index a file
        preset = Preset(
            name=name,
            base=str(base_path),
            system=system if system is not None else inherited.system,
            template=template or inherited.template,
            parameters={**inherited.parameters, **params},
            messages=chat or list(inherited.messages),
            license=license or inherited.license,
        )
        lines = [{"status": f"using existing layer sha256:{_layer(base_id, str(base_path))}"}]
        for part in ("template", "system", "parameters", "messages", "license"):
            value = getattr(preset, part)
            if value:
                lines.append({"status": f"creating new layer sha256:{_layer(part, json.dumps(value))}"})
        Library().save_preset(preset)
        self.pool.catalog(refresh=True)
        return [*lines, {"status": "writing manifest"}, {"status": "success"}]

    def _base(self, source: str):
        """The base model's path and id for a FROM, and what a preset named there sets (inherited).

        Raises:
            APIError (400): nothing this server has, nor a model file.
        """
        from models.library import Library, Preset

        preset = self.pool.preset(source)
        if preset is not None:
            return preset.path, preset.base, preset.preset
        served, entry = self.pool.find(source)
        path = served.path if served is not None else entry.path if entry is not None else None
        if path is None:
            candidate = Path(source).expanduser()
            if not candidate.exists():
                raise invalid(
                    f"FROM {source!r} is no model this server has nor a file: name one that GET /api/tags "
                    "lists (pull others with /api/pull or `hearth pull`) or the path of a GGUF file", "from")
            path = candidate.absolute()
        lib = Library()
        try:  # the base must be in the library for the preset to be served (a path given: indexed in place)
            lib.get(str(path))
        except HearthError:
            try:
                lib.add(path, source="import")
            except (HearthError, OSError) as e:
                raise invalid(f"FROM {source!r}: {e}", "from") from e
            self.pool.catalog(refresh=True)
        base = next((e for e in self.pool.catalog() if e.preset is None and e.answers(str(path))), None)
        base_id = base.id if base is not None else Path(path).stem
        return Path(path), base_id, Preset(source, str(path))

    def _claim(self, name: str, replace: bool) -> None:
        """Check that `name` may be given to a preset: no model file answers it, nor (replace False) a preset.

        Raises:
            APIError (400): the name is taken.
        """
        if self.pool.preset(name) is not None:
            if replace:
                return
        elif self.pool.find(name) == (None, None):
            return
        raise invalid(f"a model with that name already exists: {name!r} names a model of this server; choose "
                      "another name (or delete that model first)", "model", "model_exists")

    async def copy(self, request: Request) -> Response:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        await run_in_threadpool(self._copy, body.get("source"), body.get("destination"))
        return Response(status_code=200)

    def _copy(self, source, destination) -> None:
        from models.library import Library, Preset

        if not isinstance(source, str) or not source.strip():
            raise invalid("'source' is required: the model to copy", "source")
        dest = modelfile.model_name(destination, "destination")
        preset = self.pool.preset(source)
        if preset is None and self.pool.find(source) == (None, None):
            raise APIError(404, f"model {source!r} not found (GET /api/tags lists this server's models)",
                           "invalid_request_error", "source", "model_not_found")
        self._claim(dest, replace=False)
        if preset is not None:
            p = preset.preset
            copied = Preset(dest, p.base, p.system, p.template, dict(p.parameters), list(p.messages),
                            p.license)
        else:
            path, _, _ = self._base(source)
            copied = Preset(dest, str(path))
        Library().save_preset(copied)
        self.pool.catalog(refresh=True)

    async def blobs(self, request: Request) -> Response:
        raise APIError(501 if request.method == "POST" else 404, modelfile.NO_BLOBS, "not_implemented")


def _layer(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()

