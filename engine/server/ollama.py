"""Ollama's native API over the same engine as the OpenAI routes.

Many tools speak only Ollama's protocol (Open WebUI, editor plugins, the `ollama` Python and JavaScript
libraries, scripts that post to /api/chat), so `hearth serve` answers it too:

- POST /api/chat and /api/generate: newline-delimited JSON streams (the default) or one JSON object with
  `"stream": false`; `options` (temperature, top_k, top_p, min_p, seed, stop, num_predict), `format`
  ("json" or a JSON schema), `tools`, `think`, base64 `images`, /api/generate's `system`, `raw` and
  `context`. The closing object carries Ollama's counts and durations (nanoseconds).
- GET /api/tags, /api/ps, /api/version, POST /api/show: the one model this server runs.
- POST /api/embed and the legacy /api/embeddings: engine.server.embeddings.
- The model-management routes are engine.server.manage's: pull and delete, create and copy (presets:
  engine.server.modelfile); push answers 501, as all of them do on a server started with --no-library.

Requests become engine.server.protocol's ChatRequest (so one validation, one template path and one
scheduler serve both APIs); errors are Ollama's `{"error": "..."}` bodies with the same statuses.
Where Ollama's request sets no sampling options its defaults apply (temperature 0.8, top_k 40, top_p 0.9),
not OpenAI's. Options Hearth does not apply (repeat_penalty, mirostat, num_ctx above the server's context,
...) are accepted and ignored, as the OpenAI routes ignore presence_penalty: `hearth serve --ctx` sets the
context.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from engine.reasoning import ReasoningStream
from engine.server import protocol
from engine.server.errors import APIError, invalid
from engine.server.scheduler import Delta, SeqParams
from engine.tools import ToolCallStream
from models.errors import HearthError

# the Ollama release whose API these routes follow (clients read /api/version to pick features)
API_VERSION = "0.12.0"
# Ollama's sampling defaults, for requests that leave an option out
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0}
_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "seed": "seed", "stop": "stop"}
NDJSON = "application/x-ndjson"


@dataclass
class OllamaRequest:
    """A parsed /api/chat or /api/generate body.

    `chat` is what the OpenAI chat route would run; `think` is Ollama's (None: unset, True/False, or an
    effort "low"/"medium"/"high"); /api/generate's raw prompt and context are set only there."""

    chat: protocol.ChatRequest
    stream: bool
    think: bool | str | None
    raw_prompt: str | None = None  # /api/generate with raw: the prompt, no template
    context: list[int] | None = None  # /api/generate: an earlier reply's context to continue


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _common(body: dict) -> tuple[dict, bool, bool | str | None]:
    """The OpenAI-style fields of an Ollama request (model, sampling, format, think); its stream flag."""
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise invalid("'options' must be an object such as {'temperature': 0.7}", "options")
    openai: dict[str, Any] = {"model": body.get("model")}
    for name, field in _OPTIONS.items():
        if options.get(name) is not None:
            openai[field] = options[name]
        elif name in DEFAULTS:
            openai[field] = DEFAULTS[name]
    predict = options.get("num_predict")
    if predict is not None:
        if not protocol.is_int(predict) or predict == 0 or predict < -2:
            raise invalid(
                "'options.num_predict' must be a positive number of tokens, -1 (no limit) or -2 (fill the "
                f"context), got {predict!r}",
                "options.num_predict",
            )
        if predict > 0:
            openai["max_tokens"] = predict
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    fmt = body.get("format")
    if fmt == "json":
        openai["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        openai["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise invalid("'format' must be \"json\" or a JSON schema object", "format")
    think = body.get("think")
    if think not in (None, True, False, "low", "medium", "high"):
        raise invalid("'think' must be true, false, or an effort: \"low\", \"medium\" or \"high\"", "think")
    if think is False:
        openai["chat_template_kwargs"] = {"enable_thinking": False}
    elif think is True:
        openai["chat_template_kwargs"] = {"enable_thinking": True}
    elif isinstance(think, str):  # gpt-oss's template reads an effort
        openai["reasoning_effort"] = think
    return openai, stream, think


def _images(spec: Any, where: str) -> list[bytes]:
    """A message's (or /api/generate's) `images`: base64 strings (data URLs too), as files."""
    if spec is None:
        return []
    if not isinstance(spec, list) or not all(isinstance(i, str) for i in spec):
        raise invalid(f"'{where}' must be a list of base64-encoded images", where, "invalid_image")
    return [
        protocol.image_bytes(i if i.startswith("data:") else f"data:image/*;base64,{i}", f"{where}[{k}]")
        for k, i in enumerate(spec)
    ]


def _with_images(req: protocol.ChatRequest, images: dict[int, list[bytes]]) -> protocol.ChatRequest:
    """req with each message's images as the engine's image parts (before its text, as the app sends them)."""
    total = sum(len(v) for v in images.values())
    if total > protocol.MAX_IMAGES:
        raise invalid(f"at most {protocol.MAX_IMAGES} images per request", "messages", "too_many_images")
    for n, files in images.items():
        message = req.messages[n]
        if message["role"] != "user":
            raise invalid(f"messages[{n}].images: images go in user messages only", "messages")
        message["content"] = [
            *({"type": "image", "image": f} for f in files),
            {"type": "text", "text": message["content"] or ""},
        ]
    return req


def parse_chat(body: Any, n_ctx: int) -> OllamaRequest:
    """Validate an /api/chat body (an empty `messages` only loads the model: chat.messages is empty).

    Raises:
        APIError (400): a missing, mistyped or out-of-range field.
    """
    body = _object(body)
    openai, stream, think = _common(body)
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise invalid("'messages' must be a list of {role, content} objects", "messages")
    if not messages:
        return OllamaRequest(_load_only(openai, n_ctx), stream, think)
    translated, images = [], {}
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{n}] must be an object with 'role' and 'content'", "messages")
        out = {k: m[k] for k in ("role", "content", "tool_call_id") if k in m}
        out.setdefault("content", "")
        if m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise invalid(f"messages[{n}].tool_calls must be a list of objects", "messages")
            out["tool_calls"] = [{"type": "function", **c} for c in calls]
        if isinstance(m.get("tool_name"), str):  # Ollama names the tool a result came from
            out["name"] = m["tool_name"]
        if m.get("images"):
            images[n] = _images(m["images"], f"messages[{n}].images")
        translated.append(out)
    openai.update(messages=translated, tools=body.get("tools"))
    return OllamaRequest(_with_images(protocol.parse_chat(openai, n_ctx), images), stream, think)


def _load_only(openai: dict, n_ctx: int) -> protocol.ChatRequest:
    """A request with no prompt (Ollama's way to load a model): validated, with no messages."""
    req = protocol.parse_chat({**openai, "messages": [{"role": "user", "content": ""}]}, n_ctx)
    req.messages = []
    return req


def parse_generate(body: Any, n_ctx: int) -> OllamaRequest:
    """Validate an /api/generate body: its prompt (with `system` and `images`) becomes a one-turn chat
    through the model's template, or with `raw` the prompt as it is. An empty prompt only loads the model.

    Raises:
        APIError (400): a missing, mistyped or unsupported field.
    """
    body = _object(body)
    openai, stream, think = _common(body)
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string", "prompt")
    for name in ("suffix", "template"):
        if body.get(name):
            raise invalid(
                f"'{name}' is not supported by this server: it uses the model's own chat template", name
            )
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise invalid("'system' must be a string", "system")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise invalid("'raw' must be true or false", "raw")
    context = body.get("context")
    if context is not None and not (isinstance(context, list) and all(protocol.is_int(t) for t in context)):
        raise invalid("'context' must be the list of token ids an earlier reply returned", "context")
    images = _images(body.get("images"), "images")
    if not prompt and not images:
        return OllamaRequest(_load_only(openai, n_ctx), stream, think)
    if raw:
        if images or system:
            raise invalid("'raw' prompts take no 'images' or 'system': they skip the chat template", "raw")
        req = _load_only(openai, n_ctx)
        return OllamaRequest(req, stream, think, raw_prompt=prompt, context=context or None)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    openai["messages"] = messages
    req = _with_images(protocol.parse_chat(openai, n_ctx), {len(messages) - 1: images} if images else {})
    return OllamaRequest(req, stream, think, context=context or None)


# --- replies ----------------------------------------------------------------------------------


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return timestamp(time.time())


def timestamp(when: float | None) -> str:
    """A Unix time as Ollama writes times (RFC 3339, UTC); None: never (a model kept loaded for good)."""
    if when is None:
        return "2999-12-31T23:59:59Z"
    text = datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="microseconds")
    return text.replace("+00:00", "Z")


def catalog_tag(entry) -> dict:
    """The /api/tags entry of a library model not loaded (engine.server.pool.CatalogEntry), from what the
    library knows of it: no load needed."""
    e = entry.entry
    if e is None:  # a model given by path, not from the library: its header says the same
        from models.library import inspect_model

        try:
            e = inspect_model(entry.path)
        except (HearthError, OSError):
            e = None
    stat = entry.path.stat()
    preset = getattr(entry, "preset", None)
    arch = (getattr(e, "architecture", None) or "") if e is not None else ""
    params = getattr(e, "params", None) or 0
    fmt = getattr(e, "format", None) or ("gguf" if entry.path.suffix == ".gguf" else "safetensors")
    digest = _digest(entry.path, stat)
    modified = timestamp(stat.st_mtime)
    if preset is not None:  # its own digest and time; its base's file
        text = json.dumps([digest, preset.system, preset.template, preset.parameters, preset.messages])
        digest = hashlib.sha256(text.encode()).hexdigest()
        modified = preset.created_at.replace("+00:00", "Z")
    return {
        "name": entry.id,
        "model": entry.id,
        "modified_at": modified,
        "size": getattr(e, "size", None) or stat.st_size,
        "digest": digest,
        "details": {
            "parent_model": getattr(entry, "base", "") if preset is not None else "",
            "format": fmt,
            "family": arch,
            "families": [arch] if arch else None,
            "parameter_size": _size_label(params) if params else "",
            "quantization_level": getattr(e, "quant", None) or "",
        },
    }


def done_reason(delta: Delta) -> str:
    """The engine's finish reason as Ollama names it (as OpenAI does: protocol.finish)."""
    return protocol.finish(delta.finish_reason) or "stop"


LOAD_S = "hearth.load_s"  # request scope key: seconds this request waited for its model's load


def counts(last: Delta, started: float, load_s: float = 0.0) -> dict:
    """Ollama's closing figures: token counts and durations in nanoseconds (load_s: the model's load,
    when this request started it)."""
    decode_ns = int((last.generated_tokens - 1) / last.decode_tps * 1e9) if last.decode_tps else 0
    return {
        "total_duration": int((time.monotonic() - started) * 1e9),
        "load_duration": int(load_s * 1e9),
        "prompt_eval_count": last.prompt_tokens,
        "prompt_eval_duration": int(last.ttft_s * 1e9),
        "eval_count": last.generated_tokens,
        "eval_duration": decode_ns,
    }


def tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI tool calls (arguments as JSON text) as Ollama writes them (arguments as an object)."""
    out = []
    for c in calls:
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = {}
        out.append({"function": {"name": fn["name"], "arguments": args}})
    return out


def error_body(e: APIError) -> dict:
    return {"error": e.message}


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


class OllamaRoutes:
    """The /api/* handlers over the OpenAI routes' handler object (engine.server.app._Api)."""

    def __init__(self, api):
        self.api = api
        self._facts = None

    # --- model information ---

    def _model_facts(self):
        if self._facts is None:
            from models.library import inspect_model

            try:
                self._facts = inspect_model(self.api.lm.path)
            except Exception:  # noqa: BLE001 - a file Hearth loaded but cannot describe: fewer details
                self._facts = False
        return self._facts or None

    def _details(self) -> dict:
        facts = self._model_facts()
        lm = self.api.lm
        family = str(lm.metadata.get("general.architecture") or (facts.arch if facts else "") or "")
        params = facts.params if facts and facts.params else 0
        size = lm.metadata.get("general.size_label") or (_size_label(params) if params else "")
        return {
            "parent_model": "",
            "format": facts.format if facts else ("gguf" if lm.path.suffix == ".gguf" else "safetensors"),
            "family": family,
            "families": [family] if family else None,
            "parameter_size": size,
            "quantization_level": (facts.quant or "") if facts else "",
        }

    def entry(self) -> dict:
        """This model's /api/tags entry."""
        facts = self._model_facts()
        lm = self.api.lm
        stat = lm.path.stat()
        name = self.api.names[0]
        return {
            "name": name,
            "model": name,
            "modified_at": timestamp(stat.st_mtime),
            "size": facts.size if facts else lm.file_size,
            "digest": _digest(lm.path, stat),
            "details": self._details(),
        }

    def capabilities(self) -> list[str]:
        spec = getattr(self.api.lm, "embedding", None)
        return capabilities(
            getattr(self.api.lm.template, "source", "") or "",
            vision=getattr(self.api.lm, "vision", None) is not None,
            encoder=spec is not None and spec.encoder_only,
            embeds=spec is not None and spec.dedicated,
        )

    async def root(self, request: Request) -> Response:
        return PlainTextResponse("Hearth is running (Ollama's API at /api, OpenAI's at /v1)")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": API_VERSION})

    async def show(self, request: Request) -> Response:
        body = _object(await self.api._json(request))
        name = body.get("model", body.get("name"))
        if not isinstance(name, str) or not name:
            raise invalid("'model' is required", "model")
        self.check_model(name)
        lm = self.api.lm
        cfg = lm.model.cfg
        entry = await run_in_threadpool(self.entry)
        return JSONResponse(_show(
            lm.path, entry, lm.name, str(lm.metadata.get("general.license") or ""),
            getattr(lm.template, "source", "") or "", lm.context_length, getattr(cfg, "hidden_size", None),
            getattr(cfg, "num_layers", getattr(cfg, "num_hidden_layers", None)), self.capabilities(),
        ))

    async def unsupported(self, request: Request) -> Response:
        what = request.url.path.removeprefix("/api/")
        hint = ("it serves the models in Hearth's library (GET /api/tags), loading each on its first "
                "request; add models with `hearth pull` or the app's library")
        raise APIError(501, f"/api/{what} is not supported by hearth serve: {hint}", "not_implemented")

    def check_model(self, name: str) -> None:
        self.api.check_model(name)

    # --- generation ---

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        parsed = parse_chat(await self.api._json(request), self.api.engine.n_ctx)
        return await self._run(request, parsed, started, key="message")

    async def generate(self, request: Request) -> Response:
        started = time.monotonic()
        parsed = parse_generate(await self.api._json(request), self.api.engine.n_ctx)
        return await self._run(request, parsed, started, key="response")

    async def _run(self, request: Request, parsed: OllamaRequest, started: float, key: str) -> Response:
        req = parsed.chat
        self.check_model(req.model)
        head = {"model": req.model}  # as the client named it, as Ollama answers
        if not req.messages and parsed.raw_prompt is None:  # no prompt: the model is loaded already
            body = {**head, "created_at": created_at(), "done": True, "done_reason": "load"}
            body[key] = {"role": "assistant", "content": ""} if key == "message" else ""
            if parsed.stream:
                return StreamingResponse(iter([_line(body)]), media_type=NDJSON)
            return JSONResponse(body)
        params, split, opened = await self._params(parsed)
        images = any(isinstance(m.get("content"), list) for m in req.messages)
        reply = _Reply(self.api, parsed, params, split, opened, key, head, started,
                       context=key == "response" and not images)
        reply.load_s = request.scope.get(LOAD_S, 0.0)
        job, q = await self.api._submit(params)
        if parsed.stream:
            return StreamingResponse(reply.stream(job, q), media_type=NDJSON)
        return JSONResponse(reply.whole(await self.api._collect(request, job, q)))

    async def _params(self, parsed: OllamaRequest) -> tuple[SeqParams, bool, bool]:
        api, req = self.api, parsed.chat
        split = parsed.think is not False
        if parsed.raw_prompt is None:
            params, split, opened = await api.prepare_chat(req, split=split)
        else:
            tok = api.tok
            ids = await run_in_threadpool(tok.encode, parsed.raw_prompt, add_special=not parsed.context)
            text_start = bool(ids) and tok.is_control(ids[-1])
            params = api._seq_params(req, ids, req.max_tokens, text_start=text_start)
            split = opened = False
        if parsed.context:
            bad = [t for t in parsed.context if not 0 <= t < api.tok.vocab_size]
            if bad:
                raise invalid(f"context token {bad[0]} is outside the vocabulary", "context")
            ids = list(params.prompt_ids)
            if parsed.raw_prompt is None and ids and ids[0] == api.tok.bos_id:
                ids = ids[1:]  # the context starts the sequence already
            params.prompt_ids = parsed.context + ids
            try:
                params.max_tokens = api._limits(len(params.prompt_ids), req.max_tokens)
            except APIError:
                if params.release is not None:
                    params.release()
                raise
            params.respell = False
        return params, split, opened


class _Reply:
    """One Ollama reply: its lines while it streams, or the whole object."""

    def __init__(self, api, parsed: OllamaRequest, params: SeqParams, split: bool, opened: bool,
                 key: str, head: dict, started: float, context: bool):
        self.api, self.parsed, self.key, self.head, self.started = api, parsed, key, head, started
        self.prompt_ids = list(params.prompt_ids) if context else None
        self.thinking = ReasoningStream(opened) if split else None
        self.tools = bool(parsed.chat.tools)
        self.tokens: list[int] = []
        self.load_s = 0.0

    def _body(self, text: str, thinking: str = "", calls: list[dict] | None = None) -> dict:
        if self.key == "message":
            part: Any = {"role": "assistant", "content": text}
            if thinking:
                part["thinking"] = thinking
            if calls:
                part["tool_calls"] = calls
            return {**self.head, "created_at": created_at(), "message": part}
        body = {**self.head, "created_at": created_at(), "response": text}
        if thinking:
            body["thinking"] = thinking
        return body

    def _split(self, d: Delta, text: str) -> tuple[str, str]:
        if d.token is not None and d.token not in self.api.tok.eot_ids:
            self.tokens.append(d.token)
        if self.thinking is None:
            return "", text
        thinking, text = self.thinking.feed(text)
        if d.finish_reason is not None:
            rest = self.thinking.flush()
            thinking, text = thinking + rest[0], text + rest[1]
        return thinking, text

    def _closing(self, last: Delta) -> dict:
        out = {"done": True, "done_reason": done_reason(last), **counts(last, self.started, self.load_s)}
        if self.prompt_ids is not None:
            out["context"] = self.prompt_ids + self.tokens
        return out

    def whole(self, deltas: list[Delta]) -> dict:
        thinking, text = "", ""
        for d in deltas:
            t, a = self._split(d, d.text)
            thinking, text = thinking + t, text + a
        calls = None
        if self.tools:
            text, found = protocol.parse_tool_calls(text, self.api.tool_format)
            calls = tool_calls(found) or None
        return {**self._body(text, thinking, calls), **self._closing(deltas[-1])}

    async def stream(self, job, q: asyncio.Queue) -> AsyncIterator[str]:
        # with tools the content streams through a gate that holds the calls' markup back; the calls come,
        # as Ollama sends them, in a message's tool_calls (arguments as objects) once the reply is complete
        gate = ToolCallStream(self.api.tool_format) if self.tools else None
        try:
            while True:
                d = await q.get()
                if d.error is not None:
                    yield _line(error_body(d.error))
                    break
                thinking, text = self._split(d, d.text)
                if gate is not None:
                    text = gate.feed(text)
                if thinking or text:
                    yield _line({**self._body(text, thinking), "done": False})
                if d.finish_reason is not None:
                    if gate is not None:
                        text, found = gate.finish()
                        calls = tool_calls([c.openai() for c in found]) or None
                        if text or calls:
                            yield _line({**self._body(text, calls=calls), "done": False})
                    yield _line({**self._body(""), **self._closing(d)})
                    break
        finally:
            job.cancel()  # the client went away (or the reply ended: then a no-op)


def capabilities(template: str, vision: bool, encoder: bool, embeds: bool) -> list[str]:
    """Ollama's capability names of a model: an encoder only embeds; a chat model completes, and may also
    embed (a dedicated embedding model), read images, call tools (its template takes them) and think."""
    if encoder:
        return ["embedding"]
    out = ["completion", "embedding"] if embeds else ["completion"]
    if vision:
        out.append("vision")
    if "tools" in template:
        out.append("tools")
    if "enable_thinking" in template or "<think>" in template or "reasoning_effort" in template:
        out.append("thinking")
    return out


def _show(path, tag: dict, name: str, license: str, template: str, context: int | None,
          width: int | None, layers: int | None, caps: list[str]) -> dict:
    """An /api/show body."""
    arch = tag["details"]["family"] or "llama"
    info = {
        "general.architecture": arch,
        "general.name": name,
        f"{arch}.context_length": context,
        f"{arch}.embedding_length": width,
        f"{arch}.block_count": layers,
    }
    return {
        "license": license,
        "modelfile": f"# served by Hearth\nFROM {path}\n",
        "parameters": "\n".join(f"{k} {v}" for k, v in DEFAULTS.items()),
        "template": template,
        "details": tag["details"],
        "model_info": {k: v for k, v in info.items() if v is not None},
        "capabilities": caps,
        "modified_at": tag["modified_at"],
    }


def show_unloaded(entry) -> dict:
    """/api/show of a library model that is not loaded (engine.server.pool.CatalogEntry), from its GGUF
    header or its folder's config and template: no load, as Ollama reads the file.

    Raises:
        APIError (500): the file cannot be read.
    """
    from engine.server.pool import ENCODER_ARCHITECTURES

    tag = catalog_tag(entry)
    path = entry.path
    try:
        if path.is_dir():
            from engine.hf_repo import chat_template_source, read_json

            config = read_json(path / "config.json")
            tok_path = path / "tokenizer_config.json"
            template = chat_template_source(path, read_json(tok_path) if tok_path.is_file() else {}) or ""
            arch = str(config.get("model_type") or "")
            text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
            name, license = path.name, ""
            context = text.get("max_position_embeddings")
            width, layers = text.get("hidden_size"), text.get("num_hidden_layers")
        else:
            from models.formats.gguf import open_gguf

            with open_gguf(path) as g:
                md = dict(g.metadata)
            arch = str(md.get("general.architecture") or "")
            template = str(md.get("tokenizer.chat_template") or "")
            name, license = str(md.get("general.name") or path.stem), str(md.get("general.license") or "")
            context, width, layers = (md.get(f"{arch}.{k}") for k in
                                      ("context_length", "embedding_length", "block_count"))
    except (HearthError, OSError, ValueError) as e:
        raise APIError(500, f"cannot read {entry.id}: {e}", "server_error", "model") from e
    encoder = arch.lower() in ENCODER_ARCHITECTURES
    reads_images = bool(entry.entry is not None and entry.entry.reads_images)
    caps = capabilities(template, vision=reads_images, encoder=encoder, embeds=False)
    return _show(path, tag, name, license, template, context, width, layers, caps)


def show_preset(entry, base) -> dict:
    """/api/show of a preset (engine.server.pool.CatalogEntry with .preset) from its base model's file (base:
    the base's entry), with what the preset sets: its parameters, template, system prompt, messages,
    license and Modelfile, as Ollama shows a created model.

    Raises:
        APIError (500): the base's file cannot be read.
    """
    from engine.server import modelfile

    p = entry.preset
    body = show_unloaded(base or entry)
    body.update(
        parameters=modelfile.parameters_text(p.parameters),
        system=p.system or "",
        modelfile=modelfile.modelfile_text(p, entry.base, entry.path),
        details=catalog_tag(entry)["details"],
        modified_at=catalog_tag(entry)["modified_at"],
    )
    if p.template:
        caps = body["capabilities"]
        body["template"] = p.template
        body["capabilities"] = capabilities(p.template, vision="vision" in caps,
                                            encoder=caps == ["embedding"], embeds=False)
    if p.license:
        body["license"] = p.license
    if p.messages:
        body["messages"] = p.messages
    return body


def _size_label(params: int) -> str:
    """A parameter count as Ollama labels it: 494M, 1.2B, 8.0B."""
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{round(params / 1e6)}M"


def _digest(path, stat) -> str:
    """A stable id of the served file (path, size, time), hex like Ollama's digests, without reading
    gigabytes to hash them."""
    return hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
