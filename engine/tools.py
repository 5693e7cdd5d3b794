"""Tool calls in a model's reply, and the messages that carry them (and their results) back to the template.

Each template family teaches its model one way to call a tool; the format is read off the chat template's
source (`tool_format`) and the reply parsed accordingly (`parse_tool_calls`):

- "hermes" (Hermes, Qwen2.5, Qwen3, SmolLM3, ...): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, any number, amid text. gpt-oss's harmony replies arrive in this form too: engine.harmony's
  decoder writes a message to `functions.NAME` as such a block.
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]` (Mistral 7B v0.3, Nemo) or
  `[TOOL_CALLS]name[ARGS]{...}` repeated (Mistral Small 3.2, Devstral, Magistral; `[CALL_ID]id` may sit
  between name and `[ARGS]`).
- "llama3" (Llama 3.1/3.2/3.3): the whole reply is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`; several calls may be separated by `;`.

A block whose JSON does not parse is left in the text, so the user sees what the model wrote.

Results go back as the OpenAI message shapes every tool-aware template reads: the assistant's message with
`tool_calls` ([{"id", "type": "function", "function": {"name", "arguments": {...}}}], arguments as an
object, which is what Llama's and Mistral's templates `tojson`), then one `{"role": "tool",
"tool_call_id", "name", "content"}` per call. Call ids are 9 letters and digits, the only form Mistral's
templates accept.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field

HERMES, MISTRAL, LLAMA3, HARMONY = "hermes", "mistral", "llama3", "harmony"
FORMATS = (HERMES, MISTRAL, LLAMA3, HARMONY)

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh tool call id: 9 letters and digits (Mistral's templates reject any other shape)."""
    return "".join(random.choices(_ID_CHARS, k=9))


@dataclass
class ToolCall:
    """One call the model asked for. arguments: the parsed JSON object (a reply that gave a non-object
    is kept under "value" so nothing the model wrote is lost)."""

    name: str
    arguments: dict = field(default_factory=dict)
    id: str = field(default_factory=new_call_id)

    def openai(self, arguments_as_text: bool = True) -> dict:
        """The call as OpenAI writes it in a response (arguments a JSON string) or, with
        arguments_as_text False, as chat templates read it (arguments an object)."""
        args = json.dumps(self.arguments, ensure_ascii=False) if arguments_as_text else self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, d: dict) -> ToolCall:
        args = dict(d.get("arguments") or {})
        return cls(name=str(d["name"]), arguments=args, id=str(d.get("id") or new_call_id()))


def tool_format(template_source: str | None) -> str | None:
    """The call format a chat template teaches, or None when it takes no tools.

    Read from the template's own text: the markers it writes for an assistant's tool calls.
    """
    src = template_source or ""
    if "tools" not in src and "tool_calls" not in src:
        return None
    if "<|channel|>" in src and "functions." in src:
        return HARMONY
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<tool_call>" in src:
        return HERMES
    if "<|python_tag|>" in src or '"parameters"' in src or "<|start_header_id|>ipython" in src:
        return LLAMA3
    if "tool_calls" in src:  # takes tools in some form we do not know: Hermes is what most fine-tunes learn
        return HERMES
    return None


def parse_tool_calls(text: str, fmt: str | None = None) -> tuple[str, list[ToolCall]]:
    """Split the tool calls out of a reply.

    Args:
        text: the reply's answer (its thinking block already split off).
        fmt: a tool_format; None tries each format in turn (the API server, whose callers declare
            tools for any model).

    Returns:
        (the remaining text, stripped, or `text` unchanged when no call was found; the calls in order)
    """
    parsers = {HERMES: _hermes, HARMONY: _hermes, MISTRAL: _mistral, LLAMA3: _llama3}
    for name in (fmt,) if fmt else (HERMES, MISTRAL, LLAMA3):
        rest, calls = parsers[name](text)
        if calls:
            return rest, calls
    return text, []


def _call(obj, id_: object = None) -> ToolCall | None:
    """A ToolCall from a parsed {"name", "arguments" | "parameters"} object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        args = {"value": args}
    id_ = id_ or obj.get("id")
    return ToolCall(obj["name"], args, str(id_) if id_ else new_call_id())


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        try:
            call = _call(json.loads(m.group(1)))
        except ValueError:
            call = None
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    return "".join(kept).strip(), calls


_DECODER = json.JSONDecoder()


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    marker = "[TOOL_CALLS]"
    at = text.find(marker)
    if at < 0:
        return text, []
    before, body = text[:at], text[at + len(marker) :]
    calls: list[ToolCall] = []
    if body.lstrip().startswith("["):  # v3 / Nemo: one JSON list of calls
        try:
            items, end = _DECODER.raw_decode(body.lstrip())
        except ValueError:
            return text, []
        found = [_call(item) for item in items] if isinstance(items, list) else []
        if not found or any(c is None for c in found):
            return text, []
        rest = body.lstrip()[end:]
        return (before + rest).strip(), found
    # v11+: name[ARGS]{...} (or name[CALL_ID]id[ARGS]{...}), each call after its own [TOOL_CALLS]
    for chunk in body.split(marker):
        name, sep, args = chunk.partition("[ARGS]")
        if not sep:
            return text, []
        name, _, call_id = name.partition("[CALL_ID]")
        try:
            obj, end = _DECODER.raw_decode(args.lstrip())
        except ValueError:
            return text, []
        call = _call({"name": name.strip(), "arguments": obj}, call_id.strip() or None)
        if call is None:
            return text, []
        calls.append(call)
        before += args.lstrip()[end:]
    return before.strip(), calls


def _llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj) if "parameters" in obj or "arguments" in obj else None
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return "", calls


# --- results back into the conversation ----------------------------------------------------------------


def assistant_message(content: str, calls: Sequence[ToolCall]) -> dict:
    """The assistant's turn that made `calls`, as chat templates read it."""
    return {"role": "assistant", "content": content, "tool_calls": [c.openai(False) for c in calls]}


def tool_message(call: ToolCall, content: str) -> dict:
    """The result of `call` (text) as the "tool" message templates read."""
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def tool_schema(name: str, description: str, parameters: dict | None) -> dict:
    """A tool as the `tools` template variable lists it (OpenAI's function tool)."""
    params = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    function = {"name": name, "description": description or "", "parameters": params}
    return {"type": "function", "function": function}


# What goes back to the model of a result: a long one is cut (the model's context is finite) with a note.
MAX_RESULT_CHARS = 16_000


def clip_result(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    """`text` cut to `limit` characters, with a note of how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters of the result were cut ...]"
