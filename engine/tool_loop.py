"""The tool loop of a chat: offer tools, find the calls in a reply, ask the user, run, hand the results back.

One round: the model's reply holds tool calls (engine.tools) -> each call is allowed once, always (for that
tool, this session) or denied by the user -> allowed calls run on their MCP server (engine.mcp_client) ->
the assistant turn with its calls and one "tool" message per call join the conversation -> the model
replies again. After `max_rounds` rounds the loop stops with a notice, so a model that keeps calling tools
cannot run forever.

`ToolSession` holds what the rounds share (the tools offered, the "always" choices) and is used by both the
terminal chat (`run_tool_loop`, blocking) and the desktop app (which drives the same steps from Qt events).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import tools
from engine.mcp_client import ToolCallError, ToolHost, ToolServerError
from engine.reasoning import split_reasoning

MAX_ROUNDS = 8
DECLINED = "The user declined to run this tool call."
CANCELLED = "The tool call was stopped by the user before it finished."
ALLOW_ONCE, ALLOW_ALWAYS, DENY = "once", "always", "deny"


def rounds_notice(limit: int) -> str:
    return f"Stopped after {limit} rounds of tool calls (the limit); send a message to let the model go on."


@dataclass
class CallOutcome:
    """A tool call with what came of it (stored with the chat)."""

    call: tools.ToolCall
    decision: str = ""  # ALLOW_ONCE, ALLOW_ALWAYS, DENY; "" while undecided
    result: str = ""  # the full text the tool gave (the model gets at most result_chars of it)
    is_error: bool = False
    done: bool = False

    def to_dict(self) -> dict:
        return {**self.call.to_dict(), "decision": self.decision, "result": self.result,
                "is_error": self.is_error, "done": self.done}

    @classmethod
    def from_dict(cls, d: dict) -> CallOutcome:
        return cls(tools.ToolCall.from_dict(d), str(d.get("decision", "")), str(d.get("result", "")),
                   bool(d.get("is_error", False)), bool(d.get("done", False)))


@dataclass
class ToolSession:
    """The tools a chat offers and the user's standing choices.

    Args:
        host: the running MCP servers.
        fmt: engine.tools.tool_format of the model's template (None: it takes no tools).
        max_rounds: rounds of calls per user message before the loop stops.
        result_chars: characters of a result the model gets (the rest is cut, with a note).
    """

    host: ToolHost
    fmt: str | None
    max_rounds: int = MAX_ROUNDS
    result_chars: int = tools.MAX_RESULT_CHARS
    always: set[str] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.fmt is not None and bool(self.host.tools())

    def template_vars(self) -> dict:
        """What the chat template gets so that the prompt lists the tools ({} when none)."""
        if not self.active:
            return {}
        return {"tools": [t.schema() for t in self.host.tools()]}

    def calls_in(self, reply: str) -> tuple[str, list[tools.ToolCall]]:
        """(the reply's answer without its calls, the calls) of a stored reply (thinking block and all)."""
        if self.fmt is None:
            return reply, []
        split = split_reasoning(reply)
        rest, calls = tools.parse_tool_calls(split.answer, self.fmt)
        return rest, calls

    def decide(self, outcome: CallOutcome, decision: str) -> None:
        outcome.decision = decision
        if decision == ALLOW_ALWAYS:
            self.always.add(outcome.call.name)

    def preapproved(self, call: tools.ToolCall) -> bool:
        return call.name in self.always

    def run(self, outcome: CallOutcome, timeout: float | None = None) -> CallOutcome:
        """Run an allowed call (blocking); a denied one gets the declined note. Errors become the result
        the model reads (so it can recover), marked is_error."""
        if outcome.decision == DENY:
            outcome.result, outcome.is_error = DECLINED, True
        else:
            future = self.host.call(outcome.call.name, outcome.call.arguments, timeout)
            try:
                result = future.result()
                outcome.result, outcome.is_error = result.text, result.is_error
            except KeyboardInterrupt:  # the terminal's Ctrl-C stops the call, not just the wait
                future.cancel()
                raise
            except (ToolCallError, ToolServerError) as e:
                outcome.result, outcome.is_error = f"Error: {e}", True
        outcome.done = True
        return outcome

    def model_text(self, outcome: CallOutcome) -> str:
        return tools.clip_result(outcome.result, self.result_chars)


def round_messages(answer: str, outcomes: list[CallOutcome], session: ToolSession) -> list[dict]:
    """The messages one round adds: the assistant's turn with its calls, then each call's result."""
    calls = [o.call for o in outcomes]
    return [tools.assistant_message(answer, calls), *(tools.tool_message(o.call, session.model_text(o))
                                                        for o in outcomes)]


def history_messages(content: str, outcomes: list[dict]) -> list[dict]:
    """A stored reply's messages for the template: a reply that made calls (outcomes, as stored) becomes
    its assistant turn with tool_calls and the results; other replies stay one message."""
    if not outcomes:
        return [{"role": "assistant", "content": content}]
    done = [CallOutcome.from_dict(o) for o in outcomes]
    calls = [o.call for o in done]
    out = [tools.assistant_message(content, calls)]
    for o in done:
        text = o.result if o.done else CANCELLED
        out.append(tools.tool_message(o.call, tools.clip_result(text)))
    return out


def describe(call: tools.ToolCall) -> str:
    """A call as a person reads it: name and arguments as indented JSON."""
    return f"{call.name}\n{json.dumps(call.arguments, indent=2, ensure_ascii=False)}"


def run_tool_loop(
    messages: list[dict],
    reply: Callable[[list[dict], dict], str],
    session: ToolSession,
    ask: Callable[[tools.ToolCall], str],
    on_result: Callable[[CallOutcome], None] = lambda o: None,
) -> tuple[str, str]:
    """Answer the last message of `messages`, running the tools the model calls, until it answers without
    calls or `session.max_rounds` rounds have passed.

    Args:
        messages: the conversation; the rounds' messages are appended to it, and the final reply.
        reply: (messages, template_vars) -> the model's reply text (the engine's generation).
        ask: the user's decision for a call that is not always allowed: ALLOW_ONCE, ALLOW_ALWAYS or DENY.
        on_result: told of each call once it ran (or was denied).

    Returns:
        (the final reply text, a notice: "" or the round-limit notice)
    """
    rounds = 0
    while True:
        text = reply(messages, session.template_vars())
        answer, calls = session.calls_in(text)
        if not calls:
            messages.append({"role": "assistant", "content": text})
            return text, ""
        if rounds >= session.max_rounds:
            messages.append({"role": "assistant", "content": text})
            return text, rounds_notice(session.max_rounds)
        outcomes = []
        for call in calls:
            outcome = CallOutcome(call)
            session.decide(outcome, ALLOW_ALWAYS if session.preapproved(call) else ask(call))
            on_result(session.run(outcome))
            outcomes.append(outcome)
        messages.extend(round_messages(answer, outcomes, session))
        rounds += 1
