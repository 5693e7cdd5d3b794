"""The tool loop (engine.tool_loop) with a real MCP server and a real chat template.

The model's side is scripted: which reply a model gives is its own choice, and no small model at hand
reliably calls a tool, so each test lists the replies a Qwen2.5-style model would write (the format
its template teaches, engine.tools) and checks what the loop does with them. Every prompt the loop
builds is rendered with Qwen2.5's real template, so the messages it adds are ones templates take.
"""

import json
import sys
from pathlib import Path

import pytest

from engine import tools
from engine.chat_template import ChatTemplate
from engine.mcp_client import ServerConfig, ToolHost
from engine.tool_loop import (
    ALLOW_ALWAYS,
    ALLOW_ONCE,
    DECLINED,
    DENY,
    ToolSession,
    history_messages,
    run_tool_loop,
)

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
QWEN = ChatTemplate((Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja").read_text())


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def host():
    with ToolHost([ServerConfig("test", command=sys.executable, args=[SERVER])]) as h:
        assert h.start() == {"test": None}
        yield h


class Script:
    """The model's replies in order; records each prompt (rendered with Qwen2.5's template)."""

    def __init__(self, *replies: str):
        self.replies = list(replies)
        self.prompts: list[str] = []

    def __call__(self, messages, template_vars):
        self.prompts.append(QWEN.render(messages, add_generation_prompt=True, **template_vars))
        return self.replies.pop(0)


def test_an_allowed_call_runs_and_its_result_reaches_the_model(host):
    session = ToolSession(host, tools.tool_format(QWEN.source))
    script = Script("Let me add.\n" + call("add", a=2, b=3), "2 + 3 = 5.")
    asked, seen = [], []
    messages = [{"role": "user", "content": "What is 2+3?"}]
    ask = lambda c: asked.append(c) or ALLOW_ONCE  # noqa: E731
    text, notice = run_tool_loop(messages, script, session, ask, seen.append)
    assert (text, notice) == ("2 + 3 = 5.", "")
    assert [c.name for c in asked] == ["add"] and seen[0].result == "5.0"
    assert '"name": "add"' in script.prompts[0]  # the tools were offered
    assert "<tool_response>\n5.0\n</tool_response>" in script.prompts[1]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == "Let me add."


def test_deny_sends_the_declined_note(host):
    session = ToolSession(host, tools.HERMES)
    script = Script(call("add", a=1, b=1), "As you wish.")
    messages = [{"role": "user", "content": "add"}]
    run_tool_loop(messages, script, session, lambda c: DENY)
    assert messages[2] == {"role": "tool", "tool_call_id": messages[1]["tool_calls"][0]["id"], "name": "add",
                           "content": DECLINED}
    assert DECLINED in script.prompts[1]


def test_always_allow_asks_once_per_tool(host):
    session = ToolSession(host, tools.HERMES)
    script = Script(call("add", a=1, b=1), call("add", a=2, b=2) + call("pid"), "done")
    asked = []

    def ask(c):
        asked.append(c.name)
        return ALLOW_ALWAYS if c.name == "add" else ALLOW_ONCE

    run_tool_loop([{"role": "user", "content": "go"}], script, session, ask)
    assert asked == ["add", "pid"]  # the second add ran without asking
    assert session.always == {"add"}


def test_errors_of_tools_go_back_to_the_model(host):
    session = ToolSession(host, tools.HERMES)
    script = Script(call("fail"), call("nope"), "sorry")
    messages = [{"role": "user", "content": "go"}]
    run_tool_loop(messages, script, session, lambda c: ALLOW_ONCE)
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert "Error executing tool fail" in results[0]
    assert results[1].startswith("Error: no running tool server offers a tool named 'nope'")


def test_the_loop_stops_after_max_rounds(host):
    session = ToolSession(host, tools.HERMES, max_rounds=3)
    script = Script(*[call("add", a=i, b=1) for i in range(10)])
    text, notice = run_tool_loop([{"role": "user", "content": "go"}], script, session, lambda c: ALLOW_ONCE)
    assert len(script.prompts) == 4 and "after 3 rounds" in notice
    assert text == call("add", a=3, b=1)  # the fourth reply's call is shown, not run


def test_a_huge_result_is_cut_for_the_model(host):
    session = ToolSession(host, tools.HERMES, result_chars=1000)
    script = Script(call("big", n=50_000), "long")
    seen = []
    messages = [{"role": "user", "content": "go"}]
    run_tool_loop(messages, script, session, lambda c: ALLOW_ONCE, seen.append)
    assert len(seen[0].result) == 50_000  # the user's copy is whole
    sent = messages[2]["content"]
    assert sent.startswith("x" * 1000) and "49000 more characters of the result were cut" in sent
    assert len(sent) < 1100


def test_a_template_without_tools_gets_none(host):
    session = ToolSession(host, None)
    assert session.template_vars() == {} and not session.active
    assert session.calls_in(call("add", a=1, b=2))[1] == []


def test_stored_rounds_render_back(host):
    stored = [{"id": "abc123XYZ", "name": "add", "arguments": {"a": 1}, "decision": "once", "result": "1.0",
               "is_error": False, "done": True}]
    messages = [{"role": "user", "content": "go"}, *history_messages("", stored)]
    prompt = QWEN.render(messages, add_generation_prompt=True)
    assert '{"name": "add", "arguments": {"a": 1}}' in prompt and "<tool_response>\n1.0" in prompt
