"""Anthropic's Messages API over the same engine: POST /v1/messages and /v1/messages/count_tokens.

Coding agents and tools written for Claude's API (Claude Code with ANTHROPIC_BASE_URL, the `anthropic`
Python and TypeScript SDKs) talk to a local model through it, as they do to Ollama's and LM Studio's:

- Requests become engine.server.protocol's ChatRequest (one validation, template and scheduler path):
  `system` (text or text blocks), `messages` whose content is text or blocks (`text`, base64 `image`,
  an assistant's `tool_use`, a user's `tool_result`; earlier `thinking` blocks are dropped), `max_tokens`
  (required), `temperature`, `top_p`, `top_k`, `stop_sequences`, `stream`, `tools` (name, description,
  input_schema), `tool_choice` (`none` sends no tools), `thinking` (`enabled`/`disabled`: the template's
  enable_thinking), `output_config.format` (a JSON schema the reply follows, constrained as OpenAI's
  response_format is). `metadata`, `output_config.effort` and cache_control marks are accepted and
  ignored. (Anthropic's current SDKs no longer send temperature/top_p/top_k; sent anyway, they apply.)
- Replies are a message of content blocks: the model's thinking block (engine.reasoning) as a `thinking`
  block, its text as `text`, its tool calls (engine.tools) as `tool_use` blocks with `input` objects;
  `stop_reason` end_turn / max_tokens / tool_use / stop_sequence (with `stop_sequence`, the string that
  matched); `usage` with input, output and cache-read tokens.
- Streams are Anthropic's server-sent events: message_start, content_block_start / _delta (text_delta,
  thinking_delta, input_json_delta) / _stop per block, message_delta (stop_reason, output tokens),
  message_stop; a tool call's markup never streams (engine.tools.ToolCallStream).
- Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` bodies with the same statuses.
The API key may come as `x-api-key` (the SDKs' header) as well as `Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import tools
from engine.reasoning import ReasoningStream
from engine.server import protocol
from engine.server.errors import APIError, invalid
from engine.server.scheduler import Delta

# OpenAI-style error types -> Anthropic's
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}
_STOP = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}


def _stop_reason(last: Delta, calls: list) -> tuple[str, str | None]:
    """The message's stop_reason and stop_sequence: tool_use, stop_sequence (with the string that
    matched), max_tokens or end_turn."""
    if calls:
        return "tool_use", None
    if last.finish_reason == "stop" and last.stop_sequence is not None:
        return "stop_sequence", last.stop_sequence
    return _STOP.get(last.finish_reason or "stop", "end_turn"), None


def error_body(e: APIError) -> dict:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _text_of(content: Any, where: str) -> str:
    """A `system` or `tool_result` content: a string or a list of text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise invalid(f"{where}[{i}] must be a text block {{'type': 'text', 'text': ...}}", where)
            parts.append(b["text"])
        return "\n".join(parts)
    raise invalid(f"'{where}' must be a string or a list of text blocks", where)


def _image_part(block: dict, where: str) -> dict:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise invalid(f"{where}: images must be base64 sources ({{'type': 'base64', 'media_type', 'data'}}); "
                      "the server fetches no URLs", where, "invalid_image")
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise invalid(f"{where}: a base64 image needs 'media_type' and 'data' strings", where,
                      "invalid_image")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _messages(messages: Any) -> list[dict]:
    """Anthropic messages as OpenAI chat messages (tool_use -> tool_calls, tool_result -> tool messages)."""
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of {role, content} objects", "messages")
    out: list[dict] = []
    for n, m in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{where} must be an object with role 'user' or 'assistant'", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content must be a string or a list of content blocks", "messages")
        parts: list[dict] = []
        calls: list[dict] = []
        results: list[dict] = []
        for i, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{i}]"
            if kind == "text" and isinstance(b.get("text"), str):
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and m["role"] == "user":
                parts.append(_image_part(b, at))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise invalid(f"{at}: a tool_use block needs a 'name' and an 'input' object", "messages")
                call_id = str(b.get("id") or tools.new_call_id())
                calls.append(tools.ToolCall(b["name"], b.get("input") or {}, call_id).openai())
            elif kind == "tool_result" and m["role"] == "user":
                text = _text_of(b.get("content"), f"{at}.content")
                if b.get("is_error"):
                    text = f"Error: {text}"
                call_id = str(b.get("tool_use_id") or "")
                results.append({"role": "tool", "tool_call_id": call_id, "content": text})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # earlier thinking stays out of the context, as on the other routes
            else:
                raise invalid(f"{at}: a {kind!r} block is not supported in a {m['role']} message", "messages")
        out += results  # a user turn's tool results answer the calls before its text
        if parts or calls:
            only_text = all(p["type"] == "text" for p in parts)
            message: dict = {
                "role": m["role"],
                "content": "\n".join(p["text"] for p in parts) if only_text else parts,
            }
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tools(spec: Any, choice: Any) -> tuple[list[dict] | None, str | None]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "any", "tool", "none"):
        raise invalid("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
    if spec is None:
        return None, None
    if not isinstance(spec, list):
        raise invalid("'tools' must be a list of {name, description, input_schema}", "tools")
    out = []
    for i, t in enumerate(spec):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid(f"tools[{i}] needs a 'name'", "tools")
        if t.get("type") not in (None, "custom"):  # Anthropic's server tools (web search, ...) run there
            raise invalid(f"tools[{i}]: the {t['type']!r} tool is one of Anthropic's own; only custom tools "
                          "(name, description, input_schema) run here", "tools")
        schema = t.get("input_schema") or {"type": "object", "properties": {}}
        function = {"name": t["name"], "description": t.get("description", ""), "parameters": schema}
        out.append({"type": "function", "function": function})
    return out, "none" if kind == "none" else None


def parse_messages(body: Any, n_ctx: int) -> protocol.ChatRequest:
    """Validate a /v1/messages body: the chat request it means.

    Raises:
        APIError (400): a missing, mistyped or unsupported field.
    """
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if not protocol.is_int(max_tokens) or max_tokens < 1:
        raise invalid("'max_tokens' is required: a positive number of tokens", "max_tokens")
    messages = _messages(body.get("messages"))
    system = _text_of(body.get("system"), "system")
    if system:
        messages.insert(0, {"role": "system", "content": system})
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise invalid("'stop_sequences' must be a list of strings", "stop_sequences")
    tool_list, choice = _tools(body.get("tools"), body.get("tool_choice"))
    openai: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens,
                              "stream": body.get("stream", False)}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            openai[name] = body[name]
    if stop:
        openai["stop"] = stop
    if tool_list:
        openai["tools"] = tool_list
        if choice:
            openai["tool_choice"] = choice
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is not None:  # structured output: a JSON schema the reply follows (constrained decoding)
        schema = fmt.get("schema") if isinstance(fmt, dict) else None
        if not isinstance(schema, dict) or fmt.get("type") != "json_schema":
            raise invalid("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}",
                          "output_config.format")
        spec = {"name": "output", "schema": schema}
        openai["response_format"] = {"type": "json_schema", "json_schema": spec}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise invalid("'thinking' must be {'type': 'enabled' | 'disabled'}", "thinking")
        openai["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    if openai["stream"] is None:
        openai["stream"] = False
    if not isinstance(openai["stream"], bool):
        raise invalid("'stream' must be true or false", "stream")
    return protocol.parse_chat(openai, n_ctx)


def _sse(event: str, obj: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(d: Delta, output: bool = True) -> dict:
    usage = {"input_tokens": d.prompt_tokens - d.cached_tokens, "cache_read_input_tokens": d.cached_tokens,
             "cache_creation_input_tokens": 0}
    if output:
        usage["output_tokens"] = d.generated_tokens
    return usage


class AnthropicRoutes:
    """/v1/messages and /v1/messages/count_tokens over the OpenAI routes' handler object
    (engine.server.app._Api)."""

    def __init__(self, api):
        self.api = api

    async def count_tokens(self, request: Request) -> Response:
        body = await self.api._json(request)
        if isinstance(body, dict) and "max_tokens" not in body:
            body = {**body, "max_tokens": 1}  # count_tokens takes no max_tokens
        req = parse_messages(body, self.api.engine.n_ctx)
        params, _, _ = await self.api.prepare_chat(req, split=False)
        if params.release is not None:
            params.release()
        return JSONResponse({"input_tokens": len(params.prompt_ids)})

    async def messages(self, request: Request) -> Response:
        req = parse_messages(await self.api._json(request), self.api.engine.n_ctx)
        params, split, opened = await self.api.prepare_chat(req)
        reply = _Reply(self.api, req, split, opened, len(params.prompt_ids))
        job, q = await self.api._submit(params)
        if req.stream:
            return StreamingResponse(reply.stream(job, q), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(reply.whole(await self.api._collect(request, job, q)))


class _Reply:
    """One message reply: its events while it streams, or the whole message."""

    def __init__(self, api, req: protocol.ChatRequest, split: bool, opened: bool, n_prompt: int):
        self.api, self.req = api, req
        self.thinking = ReasoningStream(opened) if split else None
        self.gate = tools.ToolCallStream(api.tool_format) if req.tools else None
        self.head = {"id": protocol.new_id("msg"), "type": "message", "role": "assistant", "model": req.model}
        self.n_prompt = n_prompt

    def _split(self, d: Delta) -> tuple[str, str]:
        if self.thinking is None:
            return "", d.text
        thinking, text = self.thinking.feed(d.text)
        if d.finish_reason is not None:
            rest = self.thinking.flush()
            thinking, text = thinking + rest[0], text + rest[1]
        return thinking, text

    def whole(self, deltas: list[Delta]) -> dict:
        thinking = text = ""
        for d in deltas:
            t, a = self._split(d)
            thinking, text = thinking + t, text + a
        calls: list[tools.ToolCall] = []
        if self.req.tools:
            text, calls = tools.parse_tool_calls(text, self.api.tool_format)
        content: list[dict] = []
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": ""})
        if text:
            content.append({"type": "text", "text": text})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls]
        last = deltas[-1]
        reason, sequence = _stop_reason(last, calls)
        return {**self.head, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(last)}

    async def stream(self, job, q: asyncio.Queue) -> AsyncIterator[str]:
        index = -1
        open_kind: str | None = None

        def start(kind: str, block: dict) -> list[str]:
            nonlocal index, open_kind
            stop = {"type": "content_block_stop", "index": index}
            out = [_sse("content_block_stop", stop)] if open_kind else []
            index += 1
            open_kind = kind
            return out + [_sse("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": block})]

        def delta(kind: str, piece: str) -> list[str]:
            out = start(kind, {"type": kind, kind: ""}) if open_kind != kind else []
            key = "thinking_delta" if kind == "thinking" else "text_delta"
            return out + [_sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                        "delta": {"type": key, kind: piece}})]

        try:
            message = {**self.head, "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}
            yield _sse("message_start", {"type": "message_start", "message": message})
            while True:
                d = await q.get()
                if d.error is not None:
                    yield _sse("error", error_body(d.error))
                    return
                thinking, text = self._split(d)
                if self.gate is not None:
                    text = self.gate.feed(text)
                for part in (delta("thinking", thinking) if thinking else []) + (
                        delta("text", text) if text else []):
                    yield part
                if d.finish_reason is None:
                    continue
                calls: list[tools.ToolCall] = []
                if self.gate is not None:
                    rest, calls = self.gate.finish()
                    for part in delta("text", rest) if rest else []:
                        yield part
                for call in calls:
                    block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                    for part in start("tool_use", block):
                        yield part
                    yield _sse("content_block_delta", {
                        "type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta",
                                  "partial_json": json.dumps(call.arguments, ensure_ascii=False)}})
                if open_kind:
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                reason, sequence = _stop_reason(d, calls)
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                             "usage": _usage(d)})
                yield _sse("message_stop", {"type": "message_stop"})
                return
        finally:
            job.cancel()  # the client went away (or the reply ended: then a no-op)
