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


def _hermes_call(body: str) -> ToolCall | None:
    """The call a `<tool_call>` block's body holds, or None when its JSON is no call."""
    try:
        return _call(json.loads(body))
    except ValueError:
        return None


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        call = _hermes_call(m.group(1))
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


# --- streaming: the reply's text without its calls, as it arrives -------------------------------------------

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK, PYTHON_TAG = "[TOOL_CALLS]", "<|python_tag|>"


class ToolCallStream:
    """A reply's text as it streams, with its tool calls held back: the gate between the model and a screen
    (or an API client) that must never show call markup.

    `feed(delta)` returns the text that is safe to show now. Text that may be the start of a call marker
    (a "<tool_" at the end of a delta) is held until the next delta shows what it is; from a marker on,
    the call is held (a Hermes block until its `</tool_call>`: one whose JSON does not parse is shown as
    text, as parse_tool_calls leaves it; after Mistral's `[TOOL_CALLS]`, everything). A reply that starts
    with `{` or `<|python_tag|>` (Llama 3.1's bare JSON call; any format when fmt is None) is held until it
    is clearly no call. Whitespace at the end of what was shown is held too, since a reply that makes calls
    is stripped. `finish()` parses the whole reply (parse_tool_calls, so the calls are exactly the
    non-streamed reply's) and returns the text still to show with the calls.

    Everything shown, `finish()`'s text included, is parse_tool_calls' `rest` of the whole reply, with one
    exception: whitespace at the very start of a reply that goes on with text is shown with that text, so a
    reply "\n Sure. <tool_call>..." shows "\n Sure." where `rest` is "Sure.".

    Args:
        fmt: the model's tool_format; None for any format (the API server, as parse_tool_calls).
    """

    def __init__(self, fmt: str | None = None):
        self.fmt = fmt
        self._parts: list[str] = []  # everything fed
        self._shown: list[str] = []  # everything returned
        self._pending = ""  # fed, not yet shown or dropped
        self._ws = ""  # whitespace after the last text shown
        self._called = False  # a call has been taken out (a Hermes block that parsed)
        self._state = "start" if fmt in (LLAMA3, None) else "text"
        markers = {HERMES: (HERMES_OPEN,), HARMONY: (HERMES_OPEN,), MISTRAL: (MISTRAL_MARK,), LLAMA3: ()}
        self._markers = markers.get(fmt, (HERMES_OPEN, MISTRAL_MARK))

    @property
    def pending(self) -> bool:
        """Text is held because a call may be under way (a marker arrived, or a bare JSON reply began)."""
        if self._state == "start":
            return self._pending.lstrip().startswith(("{", PYTHON_TAG))
        return self._state in ("block", "held")

    @property
    def pending_name(self) -> str:
        """The tool the call being written is for, once its name has arrived ("" until then, or when no
        call is pending)."""
        if not self.pending:
            return ""
        m = _PENDING_NAME.search(self._pending)
        return (m.group(1) or m.group(2)) if m else ""

    def feed(self, delta: str) -> str:
        """Take the next piece of the reply; returns the text to show now ("" while it is held)."""
        self._parts.append(delta)
        self._pending += delta
        out = []
        while True:
            text = self._pending
            if self._state == "start":  # is the reply one bare JSON call (Llama 3.1)?
                verdict = _bare_json(text.lstrip())
                if verdict != "no":
                    return "".join(out)
                self._state = "text"
            elif self._state == "text":
                found = [(i, m) for m in self._markers if (i := text.find(m)) >= 0]
                if found:
                    at, marker = min(found)
                    out.append(self._show(text[:at]))
                    self._pending = text[at:]
                    self._state = "block" if marker == HERMES_OPEN else "held"
                    continue
                keep = max((_partial_suffix(text, m) for m in self._markers), default=0)
                out.append(self._show(text[: len(text) - keep]))
                self._pending = text[len(text) - keep :]
                return "".join(out)
            elif self._state == "block":  # a Hermes block: complete, it is a call or text
                end = text.find(HERMES_CLOSE, len(HERMES_OPEN))
                if end < 0:
                    return "".join(out)
                block = text[: end + len(HERMES_CLOSE)]
                self._pending, self._state = text[len(block) :], "text"
                if _hermes_call(_HERMES.match(block).group(1)) is not None:
                    self._called = True
                    self._markers = (HERMES_OPEN,)  # a Hermes call found: no other format counts
                    continue
                mark = block.find(MISTRAL_MARK) if MISTRAL_MARK in self._markers else -1
                if mark >= 0:  # not a Hermes call, but maybe Mistral's (fmt None): held from its marker
                    self._pending, self._state = text[mark:], "held"
                    block = block[:mark]
                out.append(self._show(block))
            else:  # "held": a call is under way; the rest is known at the end
                return "".join(out)

    def _show(self, text: str) -> str:
        """Text certain to be in the reply's rest; its trailing whitespace is held."""
        text = self._ws + text
        if self._called and not self._shown:
            text = text.lstrip()  # a reply with calls is stripped
        core = text.rstrip()
        self._ws = text[len(core) :]
        if core:
            self._shown.append(core)
        return core

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply is complete: (the text not shown yet, the calls), as parse_tool_calls finds them."""
        rest, calls = parse_tool_calls("".join(self._parts), self.fmt)
        shown = "".join(self._shown)
        if not rest.startswith(shown):
            shown = shown.lstrip()  # the one exception (see the class): whitespace shown at the start
        n = 0
        while n < min(len(shown), len(rest)) and shown[n] == rest[n]:
            n += 1
        tail = rest[n:]
        self._shown.append(tail)
        return tail, calls


# a call's name as it arrives: its JSON's "name", or Mistral's name before [ARGS] / [CALL_ID]
_PENDING_NAME = re.compile(
    r'"name"\s*:\s*"([^"\\]{1,100})"|\[TOOL_CALLS\]\s*([^\s\[\]{}"]{1,100})\s*\[(?:ARGS|CALL_ID)\]'
)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _bare_json(body: str) -> str:
    """Whether a reply beginning `body` (no leading whitespace) is Llama 3.1's bare JSON calls, as _llama3
    reads it: "no", "maybe" (more text will tell) or "call" (calls so far; text after them would undo it)."""
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    elif PYTHON_TAG.startswith(body):
        return "maybe"
    if not body:
        return "maybe"
    pos = 0
    while True:
        if body[pos] != "{":
            return "no"
        inner = body[pos + 1 :].lstrip()
        if inner and inner[0] not in '"}':  # no JSON object goes on like this
            return "no"
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except ValueError:
            return "maybe"  # not complete yet (or broken: the end tells)
        if ("parameters" not in obj and "arguments" not in obj) or _call(obj) is None:
            return "no"
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if not body[pos:].strip():
            return "call"


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
