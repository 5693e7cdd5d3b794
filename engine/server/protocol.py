"""The OpenAI wire format: request validation (typed, bounded) and response / chunk bodies.

Every field a request may carry is checked for type and range here, so the engine only ever sees
values it can honour; anything else becomes an APIError (400) naming the field. Unknown fields are
ignored, as OpenAI-compatible servers do (clients send vendor extras). Images come as `image_url` content
parts holding a base64 data URL and leave here as the engine's image parts (engine.vision), the file's
bytes; the server fetches no URL.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine import tools
from engine.server.errors import APIError, invalid

MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 2048
MAX_TOP_LOGPROBS = 20
MAX_IMAGES = 16  # images per request
MAX_IMAGE_BYTES = 20 << 20  # one image's file, decoded (OpenAI's limit is 20 MB)
MAX_BODY_BYTES = 32 << 20  # a request body (hearth serve's default): room for one such image as base64
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Common:
    """Fields chat and text completions share."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None, or how many alternatives to report per token (0: only the chosen)
    ignore_eos: bool  # vLLM's extension: keep generating past end-of-turn (benchmarks)
    top_k: int = 0  # llama.cpp's and vLLM's extensions: the k most likely tokens only (0: off)
    min_p: float = 0.0  # tokens less likely than min_p times the most likely are dropped


@dataclass
class ChatRequest(Common):
    messages: list[dict] = field(default_factory=list)
    response_format: dict = field(default_factory=dict)
    tools: list[dict] | None = None
    tool_choice: Any = None
    template_vars: dict = field(default_factory=dict)  # chat_template_kwargs (e.g. enable_thinking)


@dataclass
class CompletionRequest(Common):
    prompt: str | list[int] = ""


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or v != v:
        raise invalid(f"'{name}' must be a number", name)
    if v > hi or v < lo or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise invalid(f"'{name}' must be in {bound}, got {v}", name)
    return float(v)


def _common(body: Any, n_ctx: int, max_tokens_names: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: a model id from GET /v1/models", "model")
    max_tokens = None
    for name in max_tokens_names:
        v = body.get(name)
        if v is None:
            continue
        if not is_int(v) or v < 1:
            raise invalid(f"'{name}' must be a positive integer, got {v!r}", name)
        if v > n_ctx:
            raise invalid(
                f"'{name}' is {v}, more than this server's context of {n_ctx} tokens",
                name,
                "context_length_exceeded",
            )
        max_tokens = v
    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise invalid("only n=1 is supported", "n")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**64):
        raise invalid("'seed' must be an integer", "seed")
    if seed is not None and seed < 0:
        seed = seed % 2**64
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise invalid(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise invalid(f"each stop string must be at most {MAX_STOP_CHARS} characters", "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("'ignore_eos' must be true or false", "ignore_eos")
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, 0.0, -2.0, 2.0)  # accepted for compatibility; not applied
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise invalid(f"'top_k' must be an integer >= 0 (0: off), got {top_k!r}", "top_k")
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    if min_p == 1.0:
        raise invalid("'min_p' must be below 1", "min_p")
    return dict(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        stop=[s for s in stop if s],
        stream=stream,
        include_usage=include_usage,
        logprobs=None,
        ignore_eos=ignore_eos,
        top_k=top_k or 0,
        min_p=min_p,
    )


_PARTS_HINT = (
    "{'type': 'text', 'text': ...} or "
    "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}"
)


def _content(content: Any, n: int, role: str) -> str | list[dict] | None:
    """A message's content as the engine takes it (engine.vision): a string, or, when it holds images, a
    list of {'type': 'text', 'text': str} and {'type': 'image', 'image': bytes} parts."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"messages[{n}].content must be a string or a list of content parts", "messages")
    parts: list[dict] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            where = f"messages[{n}].content[{k}]"
            if role != "user":
                raise invalid(f"{where}: images go in user messages only, not in {role} messages", "messages")
            parts.append({"type": "image", "image": _image(part.get("image_url"), where)})
        else:
            raise invalid(f"messages[{n}].content[{k}] must be {_PARTS_HINT}", "messages")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _image(spec: Any, where: str) -> bytes:
    """The image file of an image_url part: {'url': 'data:image/...;base64,...'} or that URL as a string
    (as some clients send it). Remote URLs are refused: the server fetches nothing."""
    url = spec.get("url") if isinstance(spec, dict) else spec
    field = f"{where}.image_url.url" if isinstance(spec, dict) else f"{where}.image_url"
    return image_bytes(url, field)


def image_bytes(url: Any, field: str) -> bytes:
    """The image file a data URL holds, checked (base64, size); `field` names it in the 400s."""
    if not isinstance(url, str) or not url:
        raise invalid(
            f"{field} must be a data URL such as 'data:image/png;base64,...'", field, "invalid_image_url"
        )
    if url[:8].lower().startswith(("http://", "https://")):
        raise invalid(
            f"{field} is a web address; this server does not fetch images: send the image itself as a "
            "data URL, 'data:image/png;base64,...'",
            field,
            "invalid_image_url",
        )
    header, comma, data = url.partition(",")
    media, *params = header.lower().split(";")
    if not comma or not media.startswith("data:image/") or params[-1:] != ["base64"]:
        raise invalid(
            f"{field} must be a base64 data URL of an image, 'data:image/<type>;base64,<data>'; got "
            f"{header[:40]!r}",
            field,
            "invalid_image_url",
        )
    data = "".join(data.split())  # some clients wrap base64 in lines
    too_large = f"{field} holds an image over the limit of {MAX_IMAGE_BYTES >> 20} MiB"
    if len(data) > 4 * -(-MAX_IMAGE_BYTES // 3):  # decodes to more than the limit (if it decodes)
        raise invalid(too_large, field, "image_too_large")
    try:
        image = base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid(f"{field} is not valid base64 ({e})", field, "invalid_image_url") from e
    if not image:
        raise invalid(f"{field} holds no image data", field, "invalid_image_url")
    if len(image) > MAX_IMAGE_BYTES:
        raise invalid(too_large, field, "image_too_large")
    return image


# template variables the server sets itself
RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


def parse_chat(body: Any, n_ctx: int) -> ChatRequest:
    """Validate a /v1/chat/completions body.

    Raises:
        APIError (400): a missing, mistyped or out-of-range field (the message names it).
    """
    fields = _common(body, n_ctx, ("max_tokens", "max_completion_tokens"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise invalid(f"at most {MAX_MESSAGES} messages per request", "messages")
    clean = []
    n_images = 0
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{n}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{n}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        content = _content(m.get("content"), n, role)
        if isinstance(content, list):
            n_images += sum(p["type"] == "image" for p in content)
            if n_images > MAX_IMAGES:
                raise invalid(f"at most {MAX_IMAGES} images per request", "messages", "too_many_images")
        out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise invalid(f"messages[{n}].content is required", "messages")
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise invalid(f"messages[{n}].tool_calls must be a list of objects", "messages")
            out["tool_calls"] = [_template_tool_call(c, n) for c in calls]
        if role == "tool":
            out["tool_call_id"] = str(m.get("tool_call_id") or "")
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        clean.append(out)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("'logprobs' must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if top and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    fields["logprobs"] = (top or 0) if logprobs else None
    response_format = body.get("response_format")
    if response_format is None:
        response_format = {}
    if not isinstance(response_format, dict):
        raise invalid(
            "'response_format' must be an object such as {'type': 'json_object'}", "response_format"
        )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(_valid_tool(t) for t in tools):
            raise invalid(
                "'tools' must be a list of {'type': 'function', 'function': {'name': ..., "
                "'parameters': {...}}}",
                "tools",
            )
        if not tools:
            tools = None
    tool_choice = body.get("tool_choice")
    if (
        tool_choice is not None
        and tool_choice not in ("none", "auto", "required")
        and not (isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict))
    ):
        raise invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', ...}", "tool_choice"
        )
    template_vars = body.get("chat_template_kwargs")
    if template_vars is None:
        template_vars = {}
    if not isinstance(template_vars, dict) or not all(
        isinstance(k, str) and k.isidentifier() and k not in RESERVED_TEMPLATE_VARS for k in template_vars
    ):
        raise invalid(
            "'chat_template_kwargs' must be an object of template variables such as "
            f"{{'enable_thinking': false}} (not {', '.join(RESERVED_TEMPLATE_VARS)})",
            "chat_template_kwargs",
        )
    effort = body.get("reasoning_effort")  # OpenAI's parameter; gpt-oss's template reads it
    if effort is not None:
        if effort not in ("low", "medium", "high"):
            raise invalid("'reasoning_effort' must be 'low', 'medium' or 'high'", "reasoning_effort")
        template_vars = {"reasoning_effort": effort, **template_vars}
    return ChatRequest(
        **fields, messages=clean, response_format=response_format, tools=tools, tool_choice=tool_choice,
        template_vars=template_vars,
    )


def _valid_tool(t: Any) -> bool:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        return False
    f = t["function"]
    return isinstance(f.get("name"), str) and bool(f["name"]) and isinstance(f.get("parameters", {}), dict)


def _template_tool_call(call: dict, n: int) -> dict:
    """An OpenAI tool call in the form HF chat templates read (arguments as an object)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(f"messages[{n}].tool_calls[].function must have a 'name'", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise invalid(
                f"messages[{n}].tool_calls[].function.arguments is not JSON: {e}", "messages"
            ) from e
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def parse_completion(body: Any, n_ctx: int) -> CompletionRequest:
    """Validate a /v1/completions body (prompt: a string, a one-string list, or token ids).

    Raises:
        APIError (400): a missing, mistyped or out-of-range field.
    """
    fields = _common(body, n_ctx, ("max_tokens",))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(is_int(t) for t in prompt):
            raise invalid("'prompt' must be a string or a non-empty list of token ids (one prompt)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise invalid("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    for name, ok in (("echo", False), ("best_of", 1), ("suffix", None)):
        if body.get(name) not in (None, ok):
            raise invalid(f"'{name}' is not supported by this server", name)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= 5):
        raise invalid("'logprobs' must be an integer in [0, 5]", "logprobs")
    fields["logprobs"] = logprobs
    return CompletionRequest(**fields, prompt=prompt)


# --- tool calls in the reply ------------------------------------------------------------------

def parse_tool_calls(text: str, fmt: str | None = None) -> tuple[str, list[dict]]:
    """Split the tool calls out of a reply (engine.tools: Hermes/Qwen `<tool_call>` blocks, gpt-oss's as its
    decoder writes them, Mistral `[TOOL_CALLS]`, Llama 3.1 JSON). fmt: the model template's
    engine.tools.tool_format, None to try each. Returns (remaining text, OpenAI tool_calls)."""
    rest, calls = tools.parse_tool_calls(text, fmt)
    return rest, [c.openai() for c in calls]


# --- bodies ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI names it."""
    return {"context": "length", "cancelled": "stop"}.get(reason, reason)


def model_object(
    name: str, created: int, vision: bool = False, embedding: bool = False, completion: bool = True
) -> dict:
    """One GET /v1/models entry: OpenAI's model object, with llama.cpp's `capabilities` ("multimodal": the
    model reads images in chat messages; "embedding": an embedding model, for /v1/embeddings; no
    "completion" for one that cannot generate, a BERT encoder)."""
    capabilities = ["completion"] if completion else []
    capabilities += ["multimodal"] if vision else []
    capabilities += ["embedding"] if embedding else []
    return {
        "id": name, "object": "model", "created": created, "owned_by": "hearth", "capabilities": capabilities
    }


def now() -> int:
    return int(time.time())


def error_body(e: APIError) -> dict:
    return e.body()
