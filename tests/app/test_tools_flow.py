"""Tool use in the desktop app: the real window, the real engine worker (SmolLM2), a real MCP server
(tests/engine/mcp_test_server.py, started from mcp.json in HEARTH_HOME) and the tool call cards.

Scripted part: SmolLM2-135M never chooses to call a tool, so the reply that calls one is scripted (the
Qwen/Hermes-format `<tool_call>` block a tool-using model writes, with the model info saying its template
takes tools; whole, or in pieces that stream as tokens would, which Stop ends); every other reply, including
the one after the tool results, comes from the real worker with the real conversation (assistant turn with
tool_calls, "tool" messages).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from app.chat_store import ChatStore
from app.main_window import MainWindow
from app.qt import Qt, QTimer
from app.settings import Settings
from app.tool_card import ToolCallCard
from engine.client import ChatEvent
from engine.mcp_client import config_path
from engine.tool_loop import CANCELLED, DECLINED

pytestmark = pytest.mark.gui

SERVER = str(Path(__file__).parents[1] / "engine" / "mcp_test_server.py")
PIECE_S = 0.08  # a streamed scripted reply's pieces come this far apart (each its own chunk on screen)


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def write_mcp_json(**servers) -> None:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"mcpServers": servers}))


@pytest.fixture
def scripted(engine, monkeypatch):
    """Replies scripted in order (then the real worker); the model's template said to take tools.
    Yields the list of scripted replies to fill (a text, or a list of pieces that stream PIECE_S apart until
    the user stops them) and the conversations every reply was asked for."""
    replies: list[str | list[str]] = []
    asked: list[dict] = []
    real, real_cancel = engine.client.generate, engine.client.cancel
    cancelled = threading.Event()

    def streamed(pieces: list[str]):
        cancelled.clear()
        for n, piece in enumerate(pieces):
            time.sleep(PIECE_S)
            if cancelled.is_set():
                yield ChatEvent(finish_reason="cancelled", generated_tokens=n)
                return
            yield ChatEvent(text=piece, token=1)
        yield ChatEvent(finish_reason="stop", generated_tokens=len(pieces))

    def generate(conversation, params=None, **kwargs):
        asked.append({"messages": [dict(m) for m in conversation], **kwargs})
        if replies:
            text = replies.pop(0)
            if isinstance(text, list):
                return streamed(text)
            return iter([ChatEvent(text=text, token=1), ChatEvent(finish_reason="stop", generated_tokens=9)])
        return real(conversation, params, **kwargs)

    def cancel():
        cancelled.set()
        real_cancel()

    monkeypatch.setattr(engine.client, "generate", generate)
    monkeypatch.setattr(engine.client, "cancel", cancel)
    assert engine.model.tool_format == ""  # the worker's word: SmolLM2's own template takes no tools
    monkeypatch.setattr(engine.model, "tool_format", "hermes")
    return replies, asked


def window(qtbot, engine, servers=None, **settings):
    write_mcp_json(**(servers or {"test": {"command": sys.executable, "args": [SERVER]}}))
    s = Settings()
    s.update({"temperature": 0.0, "max_tokens": 8, "tools_enabled": True, **settings})
    store = ChatStore()
    w = MainWindow(s, store, bridge=engine, model="")  # starts the servers: tools are on
    qtbot.addWidget(w)
    qtbot.waitUntil(lambda: not w.tools.starting, timeout=30000)
    w.show()
    return w, store


def send(qtbot, w, text):
    with qtbot.waitSignal(w.controller.toolCallsChanged, timeout=30000):
        w.composer.setPlainText(text)
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)


def cards(w) -> list[ToolCallCard]:
    return [c for mw in w.view.widgets.values() for c in mw.tool_cards.values()]


def test_allow_once_runs_the_tool_and_the_model_goes_on(qtbot, engine, scripted):
    replies, asked = scripted
    replies.append("Let me add.\n" + tool_call("add", a=2, b=3))
    w, store = window(qtbot, engine)
    assert [t.name for t in w.tools.tools()][:2] == ["add", "fail"]
    send(qtbot, w, "What is 2+3?")
    assert '"name": "add"' in json.dumps(asked[0]["template_vars"]["tools"])  # the prompt lists the tools
    [card] = cards(w)
    assert card.allow_once.isVisible() and card.deny.isVisible()
    assert json.loads(card.arguments.toPlainText()) == {"a": 2, "b": 3}
    assert "  \"a\": 2" in card.arguments.toPlainText()  # formatted
    assert w.controller.busy and w.stop_button.isEnabled()
    with qtbot.waitSignal(w.controller.busyChanged, timeout=60000):
        qtbot.mouseClick(card.allow_once, Qt.MouseButton.LeftButton)
    msgs = store.messages(w.controller.chat.id)
    assert [m.role for m in msgs] == ["user", "assistant", "assistant"]
    assert msgs[1].content == "Let me add." and msgs[1].stats["finish_reason"] == "tool_calls"
    assert msgs[1].tool_calls[0]["result"] == "5.0" and msgs[1].tool_calls[0]["decision"] == "once"
    assert msgs[2].state == "done" and msgs[2].content  # the real model's answer after the result
    second = asked[1]["messages"]
    assert second[-1] == {"role": "tool", "tool_call_id": msgs[1].tool_calls[0]["id"], "name": "add",
                          "content": "5.0"}
    assert second[-2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert not card.allow_once.isVisible() and card.status.text() == "Done."
    assert card.result_button.isVisible() and not card.result.isVisible()  # collapsed
    qtbot.mouseClick(card.result_button, Qt.MouseButton.LeftButton)
    assert card.result.isVisible() and card.result.toPlainText() == "5.0"

    # the chat reloads with its card and result; Regenerate replaces the whole turn, tool round included
    w.controller.open_chat(w.controller.chat.id)
    [again] = cards(w)
    assert again.status.text() == "Done." and not again.allow_once.isVisible()
    reopened = ChatStore(store.path)
    assert reopened.messages(w.controller.chat.id)[1].tool_calls == msgs[1].tool_calls
    reopened.close()
    exported = store.export_markdown(w.controller.chat.id)
    assert "**Tool call: `add`**" in exported and "5.0" in exported
    replies.append("plain answer")
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
        w.controller.regenerate()
    assert [(m.role, m.content) for m in store.messages(w.controller.chat.id)] == [
        ("user", "What is 2+3?"), ("assistant", "plain answer")
    ]


def test_deny_sends_the_declined_note(qtbot, engine, scripted):
    replies, asked = scripted
    replies.append(tool_call("add", a=1, b=1))
    w, store = window(qtbot, engine)
    send(qtbot, w, "add")
    [card] = cards(w)
    with qtbot.waitSignal(w.controller.busyChanged, timeout=60000):
        qtbot.mouseClick(card.deny, Qt.MouseButton.LeftButton)
    assert asked[1]["messages"][-1]["content"] == DECLINED
    assert card.status.text() == "Denied." and not card.result_button.isVisible()
    assert store.messages(w.controller.chat.id)[1].tool_calls[0]["decision"] == "deny"


def test_always_allow_runs_later_calls_of_that_tool_without_asking(qtbot, engine, scripted):
    replies, _ = scripted
    replies += [tool_call("add", a=1, b=1), tool_call("add", a=2, b=2)]
    w, store = window(qtbot, engine)
    send(qtbot, w, "add twice")
    [card] = cards(w)
    qtbot.mouseClick(card.allow_always, Qt.MouseButton.LeftButton)

    def results() -> list[str]:  # the rounds' results, as stored (busy may toggle between the rounds)
        msgs = store.messages(w.controller.chat.id)
        return [m.tool_calls[0]["result"] for m in msgs[1:] if m.tool_calls]

    try:
        qtbot.waitUntil(lambda: results() == ["2.0", "4.0"] and not w.controller.busy, timeout=60000)
    except qtbot.TimeoutError:  # say where it stood
        msgs = [(m.role, m.state, m.content[:60], m.tool_calls) for m in store.messages(w.controller.chat.id)]
        pytest.fail(f"results {results()}, busy {w.controller.busy}, messages {msgs}")
    msgs = store.messages(w.controller.chat.id)
    assert msgs[2].tool_calls[0]["decision"] == "always"  # not asked
    assert w.tools.always == {"add"}


def test_stop_during_a_tool_run_cancels_it(qtbot, engine, scripted):
    replies, _ = scripted
    replies.append(tool_call("sleep", seconds=30))
    w, store = window(qtbot, engine)
    send(qtbot, w, "wait")
    [card] = cards(w)
    qtbot.mouseClick(card.allow_once, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: card.status.text() == "Running…", timeout=5000)
    with qtbot.waitSignal(w.controller.busyChanged, timeout=5000):
        qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    [reply] = store.messages(w.controller.chat.id)[1:]
    assert reply.state == "stopped" and reply.tool_calls[0]["result"] == CANCELLED
    assert card.status.text() == "Stopped."
    assert w.tools.host.call("add", {"a": 1, "b": 1}).result(timeout=10).text == "2.0"  # the server goes on


def test_stop_while_a_call_waits_for_consent(qtbot, engine, scripted):
    replies, _ = scripted
    replies.append(tool_call("add", a=1, b=1))
    w, store = window(qtbot, engine)
    send(qtbot, w, "add")
    with qtbot.waitSignal(w.controller.busyChanged, timeout=5000):
        qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    call = store.messages(w.controller.chat.id)[1].tool_calls[0]
    assert call["decision"] == "" and not call["done"]  # never ran
    assert not cards(w)[0].allow_once.isVisible()
    assert not w.controller.continue_reply()  # a reply its calls ended is not continued


def test_a_tool_that_times_out_gives_the_model_an_error(qtbot, engine, scripted):
    replies, asked = scripted
    replies.append(tool_call("sleep", seconds=20))
    w, store = window(qtbot, engine, tool_timeout_s=1)
    send(qtbot, w, "wait")
    with qtbot.waitSignal(w.controller.busyChanged, timeout=60000):
        qtbot.mouseClick(cards(w)[0].allow_once, Qt.MouseButton.LeftButton)
    assert "did not answer within 1 s" in asked[1]["messages"][-1]["content"]
    assert cards(w)[0].status.text() == "Failed."


def test_a_huge_result_is_cut_for_the_model_and_kept_whole(qtbot, engine, scripted):
    replies, asked = scripted
    replies.append(tool_call("big", n=200_000))
    w, store = window(qtbot, engine)
    send(qtbot, w, "big")
    with qtbot.waitSignal(w.controller.busyChanged, timeout=60000):
        qtbot.mouseClick(cards(w)[0].allow_once, Qt.MouseButton.LeftButton)
    sent = asked[1]["messages"][-1]["content"]
    assert len(sent) < 16_100 and "184000 more characters of the result were cut" in sent
    assert len(store.messages(w.controller.chat.id)[1].tool_calls[0]["result"]) == 200_000


def test_the_round_limit_stops_the_loop_with_a_notice(qtbot, engine, scripted):
    replies, _ = scripted
    replies += [tool_call("add", a=i, b=0) for i in range(3)]
    w, store = window(qtbot, engine, tool_max_rounds=2)
    w.tools.always.add("add")
    with qtbot.waitSignal(w.controller.notice, timeout=60000) as notice:
        w.composer.setPlainText("loop")
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    assert "after 2 rounds" in notice.args[0] and not w.controller.busy
    assert [len(m.tool_calls) for m in store.messages(w.controller.chat.id)] == [0, 1, 1]


def test_a_server_that_fails_to_start_is_shown_with_its_stderr(qtbot, engine):
    w, _ = window(qtbot, engine, servers={"bad": {"command": sys.executable, "args": [SERVER, "broken"]}})
    qtbot.waitUntil(lambda: "failed to start" in w.view.notice_label.text(), timeout=10000)
    assert "missing API key HEARTH_TEST_KEY" in w.view.notice_label.text()


def test_settings_lists_servers_with_switches_and_tools(qtbot, engine, monkeypatch):
    opened = []
    monkeypatch.setattr("app.settings_dialog.QDesktopServices.openUrl", lambda url: opened.append(url))
    w, _ = window(qtbot, engine)
    dialog = w.open_settings()
    server = dialog.servers.topLevelItem(0)
    assert server.text(0) == "test" and server.checkState(0) == Qt.CheckState.Checked
    tools = [server.child(i).text(0) for i in range(server.childCount())]
    assert {"add", "fail", "sleep"} <= set(tools)
    server.setCheckState(0, Qt.CheckState.Unchecked)
    dialog.accept()
    assert json.loads(w.settings.get("mcp_disabled")) == ["test"]
    qtbot.waitUntil(lambda: not w.tools.starting and w.tools.host is None, timeout=15000)
    assert w.tools.tools() == []
    dialog = w.open_settings()
    assert dialog.edit_mcp_json() == config_path() and opened[0].toLocalFile() == str(config_path())
    dialog.reject()


def test_a_model_whose_template_takes_no_tools_replies_without_them(qtbot, engine, monkeypatch):
    calls = []
    real = engine.client.generate

    def spy(conversation, params=None, **kwargs):
        calls.append(kwargs)
        return real(conversation, params, **kwargs)

    monkeypatch.setattr(engine.client, "generate", spy)
    w, _ = window(qtbot, engine)
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
        w.composer.setPlainText("Hi")
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    assert "takes no tools" in w.view.notice_label.text()
    assert "tools" not in (calls[0].get("template_vars") or {})


def test_an_earlier_turns_calls_survive_edit_and_resend(qtbot, engine, scripted):
    replies, asked = scripted
    replies.append(tool_call("add", a=2, b=3))
    w, store = window(qtbot, engine)
    send(qtbot, w, "What is 2+3?")
    with qtbot.waitSignal(w.controller.busyChanged, timeout=60000):
        qtbot.mouseClick(cards(w)[0].allow_once, Qt.MouseButton.LeftButton)
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
        w.composer.setPlainText("And 3+4?")
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    second_user = store.messages(w.controller.chat.id)[3]
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
        w.controller.edit_and_resend(second_user.id, "And 4+4?")
    msgs = store.messages(w.controller.chat.id)
    assert [m.role for m in msgs] == ["user", "assistant", "assistant", "user", "assistant"]
    assert msgs[3].content == "And 4+4?" and msgs[1].tool_calls[0]["result"] == "5.0"
    roles = [m["role"] for m in asked[-1]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]  # the round goes to the model again
    assert len(cards(w)) == 1 and cards(w)[0].status.text() == "Done."


def test_a_server_that_dies_is_shown_with_its_stderr(qtbot, engine):
    import os
    import signal

    w, _ = window(qtbot, engine)
    pid = int(float(w.tools.host.call("pid", {}).result(timeout=20).text))
    os.kill(pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: "Tool server 'test': exited" in w.view.notice_label.text(), timeout=20000)
    assert not w.tools.active


def watch_reply(qtbot, w) -> list[tuple[str, str]]:
    """What the streaming reply's bubble shows, every few milliseconds and on every text change: (its
    rendered text, the "Preparing a tool call…" placeholder's text or "" when there is none)."""
    seen: list[tuple[str, str]] = []

    def look(*_):
        widgets = [mw for mw in w.view.widgets.values() if mw.message.role == "assistant"]
        if widgets and widgets[-1].message.state == "streaming":
            mw = widgets[-1]
            mw.body.render_pending()
            card = mw.pending_card
            seen.append((mw.body.plain_text(), card.status.text() if card and card.isVisible() else ""))

    timer = QTimer(w)
    timer.setInterval(5)
    timer.timeout.connect(look)
    timer.start()
    w.controller.messageText.connect(look)  # after the view's own slot: the text just set
    return seen


CALL_PIECES = ["Let me ", "add", " them.", "\n<tool_", 'call>\n{"name": "add", ', '"arguments": {"a": 2, ',
               '"b": 3}}\n</tool', "_call>"]
MARKUP = ("<tool", "{", "}", "call>", '"name"')


def test_a_streaming_call_never_shows_its_markup(qtbot, engine, scripted):
    replies, _ = scripted
    replies.append(CALL_PIECES)
    w, store = window(qtbot, engine)
    seen = watch_reply(qtbot, w)
    pending = []
    w.controller.toolCallPending.connect(lambda message_id, p, name: pending.append((p, name)))
    send(qtbot, w, "What is 2+3?")
    assert seen and not any(m in text for text, _ in seen for m in MARKUP), seen
    assert "Let me add" in [text for text, _ in seen]  # the text streamed before the call
    held = [text for text, card in seen if card]
    assert held and set(held) == {"Let me add them."}  # the placeholder, under the text, while the call came
    assert pending == [(True, "add"), (False, "")]  # the name came with the call's first piece
    assert {card for _, card in seen} == {"", "Preparing a tool call: add…"}
    reply = store.messages(w.controller.chat.id)[1]
    mw = w.view.widgets[reply.id]
    assert mw.pending_card is None and [c.call_id for c in cards(w)] == [reply.tool_calls[0]["id"]]
    assert reply.content == "Let me add them." and mw.body.plain_text() == "Let me add them."
    assert json.loads(cards(w)[0].arguments.toPlainText()) == {"a": 2, "b": 3}


def test_stop_while_a_call_is_being_written_keeps_what_arrived(qtbot, engine, scripted):
    replies, _ = scripted
    pieces = ["Sure.", "\n<tool_call>\n", '{"name": "add", "arguments": {'] + ['"a": 1, '] * 100
    replies.append(pieces)
    w, store = window(qtbot, engine)
    seen = watch_reply(qtbot, w)
    w.composer.setPlainText("add")
    qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    mw = list(w.view.widgets.values())[-1]
    qtbot.waitUntil(lambda: mw.pending_card is not None, timeout=10000)
    qtbot.wait(int(PIECE_S * 1000 * 5))  # a few pieces of the call
    assert seen[-1] == ("Sure.", "Preparing a tool call: add…")
    with qtbot.waitSignal(w.controller.busyChanged, timeout=5000):
        qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    assert not any(m in text for text, _ in seen for m in MARKUP)
    reply = store.messages(w.controller.chat.id)[1]
    # what arrived is kept as the model wrote it, unfinished call and all, and shown so: no call runs
    assert reply.state == "stopped" and reply.content.startswith('Sure.\n<tool_call>\n{"name": "add"')
    assert not reply.tool_calls and not cards(w) and mw.pending_card is None
    assert mw.body.plain_text().startswith("Sure. <tool_call> {\"name\": \"add\"")  # (Markdown joins lines)
    assert mw.continue_button.isVisible()  # Continue goes on writing the call


def test_thinking_streams_beside_a_call_being_written(qtbot, engine, scripted):
    """The thinking block shows as it comes (a marker inside it is thinking); the answer is gated."""
    replies, _ = scripted
    replies.append(["<think>", "\nI need <tool_call> add", ".\n</think>", "\n\nOk.", "\n<tool_call>",
                    '{"name": "add", "arguments": {"a": 1, "b": 1}}', "</tool_call>"])
    w, store = window(qtbot, engine)
    seen = watch_reply(qtbot, w)
    send(qtbot, w, "add")
    assert "Ok." in [text for text, _ in seen] and not any(m in text for text, _ in seen for m in MARKUP)
    reply = store.messages(w.controller.chat.id)[1]
    mw = w.view.widgets[reply.id]
    assert mw.thinking_label.text() == "I need <tool_call> add." and mw.body.plain_text() == "Ok."
    assert [c.call_id for c in cards(w)] == [reply.tool_calls[0]["id"]] and mw.pending_card is None


def test_a_call_result_is_written_on_the_gui_thread(qtbot):
    """The MCP loop's thread only reports a call's result; the outcome the GUI thread reads and saves is
    written there (a write from the loop's thread raced the controller's save of the round)."""
    import concurrent.futures

    from app.tools import ToolManager
    from engine.mcp_client import ToolResult
    from engine.tool_loop import CallOutcome
    from engine.tools import ToolCall

    class Host:
        def __init__(self):
            self.future = concurrent.futures.Future()

        def call(self, name, arguments, limit):
            return self.future

    manager = ToolManager(Settings())
    manager.host = host = Host()
    outcome = CallOutcome(ToolCall("add", {"a": 1, "b": 1}), decision="once")
    seen = []
    manager.callDone.connect(lambda o, text, error: seen.append((threading.current_thread(), o, text, error)))
    manager.call(outcome)
    loop = threading.Thread(target=host.future.set_result, args=(ToolResult("2.0"),))
    loop.start()
    loop.join()
    assert (outcome.result, outcome.done) == ("", False), "the loop's thread left the outcome alone"
    qtbot.waitUntil(lambda: bool(seen), timeout=5000)
    assert seen == [(threading.main_thread(), outcome, "2.0", False)]
    manager.host = None
