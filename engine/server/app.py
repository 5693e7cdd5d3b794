"""The Starlette application of `hearth serve`: routes, guards, SSE streaming, cancellation.

Guards run before any route (one ASGI middleware): the Host header must name this server (DNS
rebinding: a web page's script cannot reach a loopback server through its own domain name), the API
key must match when one is set, and bodies are bounded. Every rejection is an OpenAI-style error body
(Ollama's `{"error": ...}` under /api/, whose routes are engine.server.ollama's) with a 4xx status.
Handlers validate (engine.server.protocol), render the chat template and tokenize on a worker thread,
and hand the request to the engine thread (engine.server.scheduler); replies come back through an
asyncio queue. A client that goes away cancels its generation at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import ipaddress
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import tools
from engine.chat_template import TemplateError
from engine.errors import ImageInputError, ImagesBusyError
from engine.reasoning import ReasoningStream, opens_reasoning, split_reasoning, strip_reasoning
from engine.server import anthropic, modelfile, ollama, protocol
from engine.server import pool as pool_mod
from engine.server.constraints import grammar_for
from engine.server.embeddings import EmbeddingRoutes, refuse_generation
from engine.server.errors import APIError, ServeError, invalid
from engine.server.manage import ManageRoutes
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.pool import ModelPool, Served
from engine.server.scheduler import Delta, Engine, SeqParams
from engine.tokenizer import TokenizerError
from engine.vision import encode_with_images, prepare_messages
from models.errors import HearthError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


REASONING_FORMATS = ("deepseek", "none")


@dataclass
class ServerConfig:
    """How the server is exposed.

    Args:
        model_name: the id clients pass as `model` (GET /v1/models lists it).
        host: the address bound; a non-loopback one needs api_key.
        port: the port bound (for the Host check).
        api_key: required as `Authorization: Bearer KEY` on /v1/* and /metrics when set.
        allowed_hosts: further names the Host header may carry (a LAN name, a reverse proxy's).
        aliases: further model ids accepted (the file name, the model's own name).
        request_timeout_s: a generation still running after this is stopped (504).
        max_body_bytes: larger request bodies get 413.
        reasoning_format: "deepseek" returns a reply's thinking block (engine.reasoning) as the
            message's `reasoning_content` (DeepSeek's API, as llama.cpp and vLLM do); "none" leaves it
            in `content`.
    """

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    allowed_hosts: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    request_timeout_s: float = 600.0
    max_body_bytes: int = protocol.MAX_BODY_BYTES
    reasoning_format: str = "deepseek"

    def __post_init__(self):
        if self.reasoning_format not in REASONING_FORMATS:
            raise ServeError(f"reasoning format must be one of {', '.join(REASONING_FORMATS)}")
        if not is_loopback(self.host) and not self.api_key:
            raise ServeError(
                f"binding to {self.host} exposes the server to the network: pass --api-key KEY "
                "(or bind to 127.0.0.1)"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The name part of a Host header ("[::1]:8080" -> "::1", "localhost:80" -> "localhost")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _Guard:
    """ASGI middleware: Host allowlist, API key, body size; counts every answer in the metrics."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics):
        self.app = app
        self.config = config
        self.metrics = metrics
        wildcard = config.host in ("0.0.0.0", "::", "")
        self.any_host = wildcard and not config.allowed_hosts
        self.hosts = {n.lower() for n in (*LOOPBACK_NAMES, config.host, *config.allowed_hosts)}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        status = {"code": 500}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._check(scope)
            if error is not None:
                await _error_response(error, path)(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            self.metrics.requests.inc(endpoint=endpoint, status=str(status["code"]))

    def _check(self, scope) -> APIError | None:
        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host")
        if not self.any_host and (host is None or _host_name(host) not in self.hosts):
            return APIError(
                403,
                f"Host {host!r} is not allowed; use http://127.0.0.1:{self.config.port} or start the "
                "server with --allow-host NAME",
                "permission_error",
                code="host_not_allowed",
            )
        if self.config.api_key and scope.get("path", "") != "/health":
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer":  # Anthropic's SDKs send the key as x-api-key
                token = headers.get("x-api-key", "")
            given = token.strip().encode("utf-8", "replace")
            if not hmac.compare_digest(given, self.config.api_key.encode()):
                return APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer KEY' with the key given to "
                    "hearth serve --api-key",
                    "authentication_error",
                    code="invalid_api_key",
                )
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return invalid("Content-Length must be a number")
            if int(length) > self.config.max_body_bytes:
                return APIError(
                    413,
                    f"the request body is over {self.config.max_body_bytes >> 20} MiB",
                    code="request_too_large",
                )
        return None


_ENDPOINTS = {
    "/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics",
    "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version", "/api/pull",
    "/api/delete", "/api/create", "/api/copy",
    "/v1/embeddings", "/api/embed", "/api/embeddings", "/v1/messages", "/v1/messages/count_tokens",
}


def _error_response(e: APIError, path: str = "") -> JSONResponse:
    """The error's body as the API at `path` writes errors: Ollama's under /api/, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic.error_body(e), status_code=e.status)
    body = ollama.error_body(e) if path.startswith("/api/") else e.body()
    return JSONResponse(body, status_code=e.status)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_BODY = "hearth.body"  # where a request's parsed body is kept: the router reads it, then its model's handler


async def read_json(request: Request, limit: int) -> object:
    """The request's JSON body (at most `limit` bytes), parsed once and kept on the request.

    Raises:
        APIError: 413 over the limit, 400 empty, not JSON, or a client gone before sending it.
    """
    if _BODY in request.scope:
        return request.scope[_BODY]
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over {limit >> 20} MiB", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect as e:
        raise APIError(400, "the client went away before sending the body") from e
    raw = b"".join(chunks)
    if not raw:
        raise invalid("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from e
    request.scope[_BODY] = body
    return body


class _Api:
    """Route handlers over one engine and model; with a preset (models.library.Preset), over the preset's
    template (a ChatTemplate; default the model's) and conversation (engine.server.modelfile)."""

    def __init__(self, engine: Engine, lm, config: ServerConfig, metrics: ServerMetrics, template=None,
                 preset=None):
        self.engine = engine
        self.lm = lm
        self.tok = lm.tokenizer
        self.config = config
        self.metrics = metrics
        self.names = [config.model_name, *[a for a in config.aliases if a and a != config.model_name]]
        self.created = protocol.now()
        self._template = template
        self.preset = preset
        source = getattr(self.template, "source", "") or ""
        self.tool_format = tools.tool_format(source)  # the call format the template teaches (None: try each)
        self.template_has_tools = "tools" in source
        self._vision_lock = threading.Lock()  # one image encoding at a time (the model's image table)

    @property
    def template(self):
        """The chat template requests are rendered with: the preset's, else the model's."""
        return self._template or self.lm.template

    def model_object(self) -> dict:
        """This model's GET /v1/models entry."""
        vision = getattr(self.lm, "vision", None) is not None
        spec = getattr(self.lm, "embedding", None)
        return protocol.model_object(
            self.names[0], self.created, vision=vision, embedding=spec is not None and spec.dedicated,
            completion=spec is None or not spec.encoder_only,
        )

    # --- helpers ---

    async def _json(self, request: Request) -> object:
        return await read_json(request, self.config.max_body_bytes)

    def check_model(self, model: str) -> None:
        """Raise the 404 for a name this model does not answer to (any case; Ollama's default tag
        ":latest" may be added, as Ollama's clients and users do)."""
        names = {n.casefold() for n in self.names}
        if model.casefold() not in names and model.casefold().removesuffix(":latest") not in names:
            raise APIError(
                404,
                f"the model {model!r} does not exist on this server; it serves {self.names[0]!r} "
                "(GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def _limits(self, n_prompt: int, max_tokens: int | None) -> int:
        n_ctx = self.engine.n_ctx
        if n_prompt >= n_ctx:
            raise invalid(
                f"the prompt is {n_prompt} tokens; this server's context is {n_ctx} (hearth serve --ctx)",
                "messages",
                "context_length_exceeded",
            )
        room = n_ctx - n_prompt
        if max_tokens is not None and max_tokens > room:
            raise invalid(
                f"max_tokens {max_tokens} + the prompt's {n_prompt} tokens exceed the context of {n_ctx}",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens or room

    def _encode_chat(self, req: protocol.ChatRequest) -> tuple[list[int], Callable[[], None] | None]:
        """The prompt ids of a chat request, and, when it holds images, what lets them go again: they are
        held in the model's image table (other requests' encodings do not drop them) until its prompt is
        prefilled or it ends (SeqParams.release)."""
        extra = {}
        if req.tools and req.tool_choice != "none":
            if not self.template_has_tools:
                raise invalid(f"{self.config.model_name}'s chat template does not support tools", "tools")
            extra["tools"] = req.tools
        messages = strip_reasoning(req.messages)  # earlier replies' thinking stays out of the context
        if self.preset is not None:
            messages = modelfile.conversation(self.preset, messages)
        messages, images = prepare_messages(self.lm, messages)
        text = self.template.render(messages, add_generation_prompt=True, **req.template_vars, **extra)
        if not images:
            return encode_with_images(self.lm, text, images), None
        table = self.lm.vision.images
        with self._vision_lock:
            ids = encode_with_images(self.lm, text, images)
            slots = table.hold(ids)
        return ids, functools.partial(table.release, slots)

    def _encode_completion(self, req: protocol.CompletionRequest) -> list[int]:
        if isinstance(req.prompt, list):
            bad = [t for t in req.prompt if not 0 <= t < self.tok.vocab_size]
            if bad:
                raise invalid(
                    f"token id {bad[0]} is outside the vocabulary of {self.tok.vocab_size}", "prompt"
                )
            return list(req.prompt)
        return self.tok.encode(req.prompt, add_special=True)

    def _seq_params(
        self,
        req: protocol.Common,
        ids: list[int],
        max_tokens: int | None,
        *,
        text_start: bool,
        grammar: str | None = None,
    ) -> SeqParams:
        """The engine's parameters for a parsed chat / completion request whose prompt encodes to `ids`."""
        refuse_generation(self.lm, req.model)
        return SeqParams(
            prompt_ids=ids,
            max_tokens=self._limits(len(ids), max_tokens),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            stop=req.stop,
            logprobs=req.logprobs,
            grammar=grammar,
            text_start=text_start,
            ignore_eos=req.ignore_eos,
            timeout_s=self.config.request_timeout_s,
        )

    async def _answer(
        self,
        request: Request,
        req: protocol.Common,
        params: SeqParams,
        meta: dict,
        stream: Callable[..., AsyncIterator[str]],
        reply: Callable[..., dict],
    ) -> Response:
        """Run `params` for an endpoint: with req.stream, the SSE events of `stream(req, job, q, meta)`;
        otherwise the JSON `reply(req, meta, deltas)` of the whole reply (a client that leaves cancels it)."""
        job, q = await self._submit(params)
        if req.stream:
            return StreamingResponse(
                stream(req, job, q, meta),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(reply(req, meta, await self._collect(request, job, q)))

    async def _submit(self, params: SeqParams):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta] = asyncio.Queue()

        def emit(delta: Delta) -> None:
            loop.call_soon_threadsafe(q.put_nowait, delta)

        job = await run_in_threadpool(self.engine.submit, params, emit)
        return job, q

    def _token_logprobs(self, d: Delta) -> dict:
        def entry(tid: int, lp: float) -> dict:
            raw = self.tok.token_bytes(tid)
            return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

        out = entry(d.token, d.logprob)
        out["top_logprobs"] = [entry(t, lp) for t, lp in d.top_logprobs]
        return out

    # --- chat ---

    async def chat(self, request: Request) -> Response:
        req = protocol.parse_chat(await self._json(request), self.engine.n_ctx)
        params, split, opened = await self.prepare_chat(req)
        meta = {"id": protocol.new_id("chatcmpl"), "created": protocol.now(), "model": req.model}
        return await self._answer(
            request, req, params, meta,
            functools.partial(self._chat_stream, split=split, opened=opened),
            functools.partial(self._chat_reply, split=split, opened=opened),
        )

    async def prepare_chat(
        self, req: protocol.ChatRequest, split: bool | None = None
    ) -> tuple[SeqParams, bool, bool]:
        """The engine's parameters for a parsed chat request, whether its reply's thinking block is split off
        (split: as asked, by default as the server's reasoning format says; never with a grammar) and whether
        the prompt opened one already (opened). Used by the Ollama routes too.

        Raises:
            APIError: an unknown model, a bad template/tokenizer input or image (400), images that do not
                fit beside other requests' (503), a prompt over the context (400).
        """
        self.check_model(req.model)
        refuse_generation(self.lm, req.model)
        grammar = grammar_for(req.response_format)
        if grammar is not None and req.tools and req.tool_choice != "none":
            raise invalid("response_format and tools cannot be combined", "response_format")
        try:
            ids, release = await run_in_threadpool(self._encode_chat, req)
        except (TemplateError, TokenizerError) as e:
            raise invalid(str(e), "messages") from e
        except ImagesBusyError as e:  # other requests' images fill the table until they are prefilled
            raise APIError(503, str(e), "server_error", code="server_busy") from e
        except ImageInputError as e:  # the model reads no images, or one is no readable image
            code = "invalid_image" if getattr(self.lm, "vision", None) is not None else "images_not_supported"
            raise invalid(str(e), "messages", code) from e
        try:
            params = self._seq_params(req, ids, req.max_tokens, text_start=True, grammar=grammar)
        except BaseException:
            if release is not None:
                release()
            raise
        params.respell = True
        params.release = release
        # with grammar-constrained output there is no thinking block to split off
        if split is None:
            split = self.config.reasoning_format == "deepseek"
        split = split and grammar is None
        tail = [t for t in ids[-8:] if t < self.tok.vocab_size]  # image ids (engine.vision) are no text
        opened = split and opens_reasoning(self.tok.decode(tail))
        return params, split, opened

    def _chat_reply(self, req, meta: dict, deltas: list[Delta], split: bool, opened: bool) -> dict:
        last = deltas[-1]
        text = "".join(d.text for d in deltas)
        message: dict = {"role": "assistant", "content": text}
        if split:  # split as the stream is, so both give the same texts
            stream = ReasoningStream(opened)
            pieces = [stream.feed(text), stream.flush()]
            thinking = "".join(t for t, _ in pieces)
            if opened or split_reasoning(text).thinking is not None:
                text = "".join(a for _, a in pieces)
                message = {"role": "assistant", "content": text, "reasoning_content": thinking}
        reason = protocol.finish(last.finish_reason)
        if req.tools:
            rest, calls = protocol.parse_tool_calls(text, self.tool_format)
            if calls:
                message = {**message, "content": rest or None, "tool_calls": calls}
                reason = "tool_calls"
        logprobs = None
        if req.logprobs is not None:
            logprobs = {
                "content": [
                    self._token_logprobs(d)
                    for d in deltas
                    if d.token is not None and d.token not in self.tok.eot_ids
                ]
            }
        return {
            **meta,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}],
            "usage": protocol.usage(last.prompt_tokens, last.generated_tokens, last.cached_tokens),
        }

    async def _collect(self, request: Request, job, q: asyncio.Queue) -> list[Delta]:
        """Wait for a whole reply; a client that disconnects meanwhile cancels it."""

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    job.cancel()
                    return

        watcher = asyncio.create_task(watch())
        deltas: list[Delta] = []
        try:
            while True:
                d = await q.get()
                if d.error is not None:
                    raise d.error
                deltas.append(d)
                if d.finish_reason is not None:
                    return deltas
        finally:
            watcher.cancel()
            job.cancel()

    async def _chat_stream(
        self, req, job, q: asyncio.Queue, meta: dict, split: bool, opened: bool
    ) -> AsyncIterator[str]:
        chunk = {**meta, "object": "chat.completion.chunk"}
        thinking = ReasoningStream(opened) if split else None

        def choice(delta: dict, reason=None, logprobs=None) -> str:
            return _sse(
                {
                    **chunk,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
                }
            )

        # with tools the content streams through a gate that holds the calls' markup back; the calls go out
        # as tool_calls deltas once the reply is complete (they parse as the non-streamed reply's do)
        gate = tools.ToolCallStream(self.tool_format) if req.tools else None
        try:
            yield choice({"role": "assistant", "content": ""})
            while True:
                d = await q.get()
                if d.error is not None:
                    yield _sse(d.error.body())
                    break
                text = d.text
                if thinking is not None:
                    reasoning, text = thinking.feed(text)
                    if d.finish_reason is not None:
                        rest = thinking.flush()
                        reasoning, text = reasoning + rest[0], text + rest[1]
                    if reasoning:
                        yield choice({"reasoning_content": reasoning})
                if gate is not None:
                    text = gate.feed(text)
                if text or (
                    req.logprobs is not None and d.token is not None and d.token not in self.tok.eot_ids
                ):
                    lp = {"content": [self._token_logprobs(d)]} if req.logprobs is not None else None
                    yield choice({"content": text}, logprobs=lp)
                if d.finish_reason is not None:
                    reason = protocol.finish(d.finish_reason)
                    if gate is not None:
                        rest, calls = gate.finish()
                        if rest:
                            yield choice({"content": rest})
                        for i, call in enumerate(calls):  # one delta per call, whole, as OpenAI's stream ends
                            yield choice({"tool_calls": [{"index": i, **call.openai()}]})
                        if calls:
                            reason = "tool_calls"
                    yield choice({}, reason)
                    if req.include_usage:
                        yield _usage_chunk(chunk, d)
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client went away (or the reply ended: then a no-op)

    # --- completions ---

    async def completions(self, request: Request) -> Response:
        req = protocol.parse_completion(await self._json(request), self.engine.n_ctx)
        self.check_model(req.model)
        refuse_generation(self.lm, req.model)
        try:
            ids = await run_in_threadpool(self._encode_completion, req)
        except TokenizerError as e:
            raise invalid(str(e), "prompt") from e
        if not ids:
            raise invalid("the prompt encodes to no tokens", "prompt")
        params = self._seq_params(req, ids, req.max_tokens or 16, text_start=self.tok.is_control(ids[-1]))
        meta = {
            "id": protocol.new_id("cmpl"),
            "created": protocol.now(),
            "model": req.model,
            "object": "text_completion",
        }
        return await self._answer(request, req, params, meta, self._completion_stream, self._completion_reply)

    def _completion_reply(self, req, meta: dict, deltas: list[Delta]) -> dict:
        last = deltas[-1]
        return {
            **meta,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(d.text for d in deltas),
                    "logprobs": self._completion_logprobs(deltas, req.logprobs),
                    "finish_reason": protocol.finish(last.finish_reason),
                }
            ],
            "usage": protocol.usage(last.prompt_tokens, last.generated_tokens, last.cached_tokens),
        }

    def _completion_logprobs(self, deltas: list[Delta], k: int | None) -> dict | None:
        if k is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for d in deltas:
            if d.token is None or d.token in self.tok.eot_ids:
                continue
            text = lambda t: self.tok.token_bytes(t).decode("utf-8", "replace")  # noqa: E731
            out["tokens"].append(text(d.token))
            out["token_logprobs"].append(d.logprob)
            out["top_logprobs"].append({text(t): lp for t, lp in d.top_logprobs})
            out["text_offset"].append(offset)
            offset += len(d.text)
        return out

    async def _completion_stream(self, req, job, q: asyncio.Queue, meta: dict) -> AsyncIterator[str]:
        try:
            while True:
                d = await q.get()
                if d.error is not None:
                    yield _sse(d.error.body())
                    break
                reason = protocol.finish(d.finish_reason)
                if d.text or reason:
                    yield _sse(
                        {
                            **meta,
                            "choices": [
                                {
                                    "index": 0,
                                    "text": d.text,
                                    "logprobs": self._completion_logprobs([d], req.logprobs),
                                    "finish_reason": reason,
                                }
                            ],
                        }
                    )
                if reason:
                    if req.include_usage:
                        yield _usage_chunk(meta, d)
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()


def _usage_chunk(base: dict, last: Delta) -> str:
    """The stream's closing usage chunk (stream_options.include_usage): no choices, the counts."""
    usage = protocol.usage(last.prompt_tokens, last.generated_tokens, last.cached_tokens)
    return _sse({**base, "choices": [], "usage": usage})


async def _api_error(request: Request, exc: APIError) -> Response:
    return _error_response(exc, request.url.path)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    message = {
        404: f"no route {request.url.path}; see /v1/models, /v1/chat/completions, /v1/completions, "
        "/v1/embeddings, and Ollama's /api/chat, /api/generate, /api/embed, /api/tags",
        405: f"{request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, exc.detail)
    return _error_response(
        APIError(exc.status_code, message, kinds.get(exc.status_code, "invalid_request_error")),
        request.url.path,
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
    return _error_response(error, request.url.path)


@dataclass
class _Handlers:
    """One loaded model's route handlers."""

    api: _Api
    ollama: ollama.OllamaRoutes
    embed: EmbeddingRoutes
    anthropic: anthropic.AnthropicRoutes


def attach(served: Served, config: ServerConfig) -> None:
    """Give a loaded model its route handlers (ModelPool.prepare)."""
    names = served.names or [served.id]
    own = dataclasses.replace(config, model_name=names[0], aliases=names[1:])
    api = _Api(served.engine, served.lm, own, served.engine.metrics)
    api.names = served.names  # one list: names the pool learns later (a library entry's) count too
    served.handlers = _Handlers(api, ollama.OllamaRoutes(api), EmbeddingRoutes(api),
                                anthropic.AnthropicRoutes(api))


def preset_handlers(served: Served, preset, config: ServerConfig) -> _Handlers:
    """The route handlers of a preset (models.library.Preset) over its base model's engine, made once per
    version of the preset and kept with the loaded model."""
    key = (preset.name.casefold(), preset.created_at, id(config))
    handlers = served.variants.get(key)
    if handlers is None:
        from engine.chat_template import ChatTemplate

        base = served.lm.template
        template = None
        if preset.template:
            template = ChatTemplate(preset.template, getattr(base, "bos_token", None),
                                    getattr(base, "eos_token", None))
        own = dataclasses.replace(config, model_name=preset.name, aliases=[])
        api = _Api(served.engine, served.lm, own, served.engine.metrics, template=template, preset=preset)
        handlers = _Handlers(api, ollama.OllamaRoutes(api), EmbeddingRoutes(api),
                             anthropic.AnthropicRoutes(api))
        served.variants = {k: v for k, v in served.variants.items() if k[0] != key[0]}
        served.variants[key] = handlers
    return handlers


class _Leased:
    """A route's response, sent; then the model's lease goes back (however the sending ended)."""

    def __init__(self, response: Response, release: Callable[[], None]):
        self.response = response
        self.release = release

    async def __call__(self, scope, receive, send):
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()


class _Router:
    """The routes that name a model: each request gets its model from the pool (loaded if need be, with a
    lease so it is not unloaded under it) and goes to that model's handlers. Also the routes about all
    models: /v1/models, /api/tags, /api/ps, /health."""

    def __init__(self, pool: ModelPool, config: ServerConfig, metrics: ServerMetrics):
        self.pool = pool
        self.config = config
        self.metrics = metrics

    async def _dispatch(self, request: Request, pick: Callable[[_Handlers], Callable], *,
                        keys: tuple[str, ...], keep_alive: str, ollama_names: bool) -> Response:
        body = await read_json(request, self.config.max_body_bytes)
        fields = body if isinstance(body, dict) else {}
        name = next((v for k in keys if isinstance(v := fields.get(k), str) and v), None)
        ka = pool_mod.parse_duration(fields.get(keep_alive), keep_alive)
        preset = await run_in_threadpool(self.pool.preset, name) if name is not None else None
        if ollama_names and ka == 0 and _no_prompt(request.url.path, fields) and name is not None:
            return await self._unload(request, name if preset is None else preset.base)
        if preset is not None:  # its parameters are the request's defaults
            modelfile.apply_parameters(request.url.path, body, preset.preset.parameters)
        served, load_s = await run_in_threadpool(self._acquire, name, ollama_names)
        request.scope[ollama.LOAD_S] = load_s
        try:
            handlers = served.handlers
            if preset is not None:
                handlers = preset_handlers(served, preset.preset, self.config)
            response = await pick(handlers)(request)
        except BaseException:
            self.pool.release(served, ka)
            raise
        return _Leased(response, functools.partial(self.pool.release, served, ka))

    def _acquire(self, name: str | None, ollama_names: bool) -> tuple[Served, float]:
        if name is None:  # the handler says what is missing; the default model's handler answers
            default = self.pool.default
            if default is None:
                raise invalid("'model' is required", "model")
            name = default.id
        try:
            try:
                return self.pool.acquire(name)
            except pool_mod.ModelNotServedError:
                if ollama_names and name.endswith(":latest"):  # Ollama clients add the default tag
                    return self.pool.acquire(name.removesuffix(":latest"))
                raise
        except APIError:
            raise
        except (HearthError, MemoryError, OSError) as e:  # the load failed: say which model and why
            raise APIError(500, f"cannot load the model {name!r}: {e}", "server_error", "model",
                           "model_load_failed") from e

    async def _unload(self, request: Request, name: str) -> Response:
        """Ollama's unload idiom: no prompt and keep_alive 0."""
        await run_in_threadpool(self.pool.unload, name.removesuffix(":latest") if not any(
            s.answers(name) for s in self.pool.loaded()) else name)
        key = "message" if request.url.path == "/api/chat" else "response"
        body = {"model": name, "created_at": ollama.created_at(), "done": True, "done_reason": "unload"}
        body[key] = {"role": "assistant", "content": ""} if key == "message" else ""
        return JSONResponse(body)

    # --- per-model routes ---

    def handler(self, pick: Callable[[_Handlers], Callable], ollama_api: bool = False,
                keys: tuple[str, ...] = ("model",)) -> Callable:
        """The route handler that sends a request to its model's `pick(handlers)`: an Ollama route takes
        `keep_alive` and ":latest" names, an OpenAI route LM Studio's `ttl`."""

        async def route(request: Request) -> Response:
            return await self._dispatch(request, pick, keys=keys, ollama_names=ollama_api,
                                        keep_alive="keep_alive" if ollama_api else "ttl")

        return route

    async def ollama_show(self, request: Request) -> Response:
        """/api/show: a loaded model's from its handlers, a library model's from its file (no load)."""
        body = await read_json(request, self.config.max_body_bytes)
        fields = body if isinstance(body, dict) else {}
        name = next((v for k in ("model", "name") if isinstance(v := fields.get(k), str) and v), None)
        if name is not None:
            preset = await run_in_threadpool(self.pool.preset, name)
            if preset is not None:
                shown = await run_in_threadpool(lambda: ollama.show_preset(preset, self.pool.base_of(preset)))
                return JSONResponse(shown)
            served, entry = await run_in_threadpool(self.pool.find, name)
            if served is None and entry is not None:
                return JSONResponse(await run_in_threadpool(ollama.show_unloaded, entry))
        return await self._dispatch(request, lambda h: h.ollama.show, keys=("model", "name"),
                                    keep_alive="keep_alive", ollama_names=True)

    # --- about all models ---

    async def health(self, request: Request) -> Response:
        loaded = self.pool.loaded()
        ok = all(s.engine.alive for s in loaded)
        default = self.pool.default
        body = {
            "status": "ok" if ok else "engine stopped",
            "model": default.id if default is not None else None,
            "loaded": [s.id for s in loaded],
            "running": sum(s.engine.running for s in loaded),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        listing = await run_in_threadpool(self.pool.listing)
        data = []
        for _, served, entry in listing:
            handlers = served.handlers if served is not None else None
            if handlers is not None:
                data.append(handlers.api.model_object())
            elif entry is not None:
                data.append(pool_mod.catalog_model_object(entry))
        return JSONResponse({"object": "list", "data": data})

    async def tags(self, request: Request) -> Response:
        def entries() -> list[dict]:
            out = []
            for _, served, entry in self.pool.listing():
                handlers = served.handlers if served is not None else None
                if handlers is not None:
                    out.append(handlers.ollama.entry())
                elif entry is not None:
                    out.append(ollama.catalog_tag(entry))
            return out

        return JSONResponse({"models": await run_in_threadpool(entries)})

    async def ps(self, request: Request) -> Response:
        def entries() -> list[dict]:
            out = []
            for s in self.pool.loaded():
                handlers = s.handlers
                if handlers is None:
                    continue
                until = (time.time() + s.expires_at - time.monotonic()) if s.expires_at is not None else None
                # the model, then the presets served on it (by their names, as Ollama lists a created model)
                presets = [self.pool.preset(name) for name, _created, _config in s.variants]
                tags = [handlers.ollama.entry()] + [ollama.catalog_tag(p) for p in presets if p is not None]
                for entry in tags:
                    entry.pop("modified_at")
                    entry.update(expires_at=ollama.timestamp(until), size_vram=0,
                                 context_length=s.engine.n_ctx)
                out += tags
            return out

        return JSONResponse({"models": await run_in_threadpool(entries)})


def _no_prompt(path: str, body: dict) -> bool:
    """An Ollama load/unload request: /api/generate without a prompt, /api/chat without messages."""
    if path == "/api/generate":
        return not body.get("prompt")
    if path == "/api/chat":
        return not body.get("messages")
    return False


def create_app(
    config: ServerConfig, engine: Engine | None = None, lm=None, pool: ModelPool | None = None
) -> Starlette:
    """The ASGI application serving the pool's models (engine.server.pool), or just `lm` through `engine`.

    Args:
        config: exposure settings (model_name and aliases name `lm`; a pool's models have their own).
        engine: the running engine (engine.server.scheduler.Engine) over lm's model and tokenizer (its
            thread the caller starts and stops), when there is no pool.
        lm: the engine.loader.LoadedModel (tokenizer, chat template), when there is no pool.
        pool: the loaded and loadable models (their engines the pool stops).
    """
    if pool is None:
        if engine is None or lm is None:
            raise ValueError("create_app needs a pool, or an engine and its model")
        pool = ModelPool(metrics=engine.metrics)
        names = [config.model_name, *[a for a in config.aliases if a and a != config.model_name]]
        pool.add(Served(config.model_name, names, lm.path, engine, lm, pinned=True))
    pool.set_prepare(functools.partial(attach, config=config))
    metrics = pool.metrics
    router = _Router(pool, config, metrics)
    oll = ollama.OllamaRoutes(None)
    routes = [
        Route("/health", router.health, methods=["GET"]),
        Route("/metrics", router.metrics_text, methods=["GET"]),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/v1/chat/completions", router.handler(lambda h: h.api.chat), methods=["POST"]),
        Route("/v1/completions", router.handler(lambda h: h.api.completions), methods=["POST"]),
        Route("/v1/embeddings", router.handler(lambda h: h.embed.openai), methods=["POST"]),
        # Anthropic's Messages API (engine.server.anthropic)
        Route("/v1/messages", router.handler(lambda h: h.anthropic.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", router.handler(lambda h: h.anthropic.count_tokens),
              methods=["POST"]),
        # Ollama's native API (engine.server.ollama)
        Route("/", oll.root, methods=["GET", "HEAD"]),
        Route("/api/version", oll.version, methods=["GET"]),
        Route("/api/tags", router.tags, methods=["GET"]),
        Route("/api/ps", router.ps, methods=["GET"]),
        Route("/api/show", router.ollama_show, methods=["POST"]),
        Route("/api/chat", router.handler(lambda h: h.ollama.chat, True), methods=["POST"]),
        Route("/api/generate", router.handler(lambda h: h.ollama.generate, True), methods=["POST"]),
        Route("/api/embed", router.handler(lambda h: h.embed.ollama_embed, True), methods=["POST"]),
        Route("/api/embeddings", router.handler(lambda h: h.embed.ollama_embeddings, True), methods=["POST"]),
        Route("/api/push", oll.unsupported, methods=["POST", "DELETE"]),
    ]
    if pool.serves_library:  # pulls, deletes and created models change the library this server serves
        manage = ManageRoutes(pool, functools.partial(read_json, limit=config.max_body_bytes))
        routes += [Route("/api/pull", manage.pull, methods=["POST"]),
                   Route("/api/delete", manage.delete, methods=["DELETE"]),
                   Route("/api/create", manage.create, methods=["POST"]),
                   Route("/api/copy", manage.copy, methods=["POST"]),
                   Route("/api/blobs/{digest}", manage.blobs, methods=["HEAD", "POST"])]
    else:
        routes += [Route(f"/api/{name}", oll.unsupported, methods=["POST", "DELETE"])
                   for name in ("pull", "delete", "create", "copy")]
    app = Starlette(
        routes=routes,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
    app.add_middleware(_Guard, config=config, metrics=metrics)
    app.state.pool = pool
    return app


def ready_line(config: ServerConfig, port: int) -> str:
    """The line `hearth serve` prints once it accepts connections (the app waits for its URL)."""
    host = config.host
    shown = (
        "127.0.0.1"
        if host in ("0.0.0.0", "")
        else "[::1]"
        if host == "::"
        else (f"[{host}]" if ":" in host else host)
    )
    return f"Hearth is serving {config.model_name} at http://{shown}:{port}/v1"
