"""The real main window driving the real engine (SmolLM2, greedy, short replies), offscreen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from app.chat_store import ChatStore
from app.markdown_view import MarkdownView, fences, split_stable
from app.qt import QApplication, Qt, QVBoxLayout, QWidget
from app.settings import Settings
from tests.app.windows import open_window

pytestmark = pytest.mark.gui


_window = open_window


def _send(qtbot, w, text, timeout=60000):
    with qtbot.waitSignal(w.controller.messageDone, timeout=timeout) as done:
        w.composer.setPlainText(text)
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    return done.args[0]


def test_split_stable_and_fences():
    text = "# T\n\npara\n\n```py\nx = 1\n\ny = 2\n```\ntail"
    blocks, tail = split_stable(text)
    assert "".join(blocks) + tail == text
    assert blocks[-1] == "```py\nx = 1\n\ny = 2\n```\n" and tail == "tail"
    assert fences(text) == ["x = 1\n\ny = 2"]
    assert split_stable("```\nopen fence\n\nstill code")[0] == []


def test_incremental_render_matches_and_is_throttled(qtbot):
    host = QWidget()
    QVBoxLayout(host).addWidget(view := MarkdownView())
    qtbot.addWidget(host)
    host.show()
    text = "# Title\n\nSome **bold** text\n\n```python\ndef f():\n    return 1\n```\n\n- a\n- b\n\nend"
    for i in range(1, len(text) + 1):
        view.set_markdown_text(text[:i])
    qtbot.waitUntil(lambda: view.source_text == text, timeout=2000)
    assert view.renders < 10, "updates are coalesced"
    plain = view.plain_text()
    for piece in ("Title", "Some bold text", "def f():", "    return 1", "Copy code", "a", "b", "end"):
        assert piece in plain
    code = view.document().findBlock(plain.index("def f():"))
    assert code.layout().formats(), "the code block is highlighted"
    view._on_anchor(__import__("app.qt", fromlist=["QUrl"]).QUrl("hearth-copy:0"))
    assert QApplication.clipboard().text() == "def f():\n    return 1"


def test_tags_in_a_reply_show_as_text(qtbot):
    view = MarkdownView()
    qtbot.addWidget(view)
    text = "Models write <think> first, then <div>x</div>.\n\n**bold** and `<b>`"
    view.set_markdown_text(text, immediate=True)
    plain = view.plain_text()
    assert "Models write <think> first, then <div>x</div>." in plain and "bold and <b>" in plain


def test_send_stream_regenerate_edit_continue_and_restart(qtbot, engine):
    w, store = _window(qtbot, engine)
    chunks = []
    w.controller.messageText.connect(lambda _id, text: chunks.append(text))
    reply = _send(qtbot, w, "What is the capital of France?")
    assert reply.state == "done" and reply.content.strip()
    assert chunks and chunks[-1] == reply.content
    assert w.composer.toPlainText() == ""
    chat = w.controller.chat
    assert chat.title == "What is the capital of France?"
    saved = store.messages(chat.id)
    assert [(m.role, m.state) for m in saved] == [("user", "done"), ("assistant", "done")]
    assert saved[1].content == reply.content and saved[1].stats["ttft_s"] > 0
    assert "tok/s" in w.status_speed.text() and "context" in w.status_context.text()

    first = reply.content
    widget = w.view.widgets[reply.id]
    assert widget.regenerate_button.isVisible()
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as again:
        widget.regenerate_button.click()
    assert again.args[0].content == first, "greedy regeneration gives the same reply"
    assert len(store.messages(chat.id)) == 2

    user = store.messages(chat.id)[0]
    w.view.widgets[user.id].start_edit()
    w.view.widgets[user.id].editor.setPlainText("Name a colour.")
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
        w.view.widgets[user.id]._resend()
    msgs = store.messages(chat.id)
    assert [m.content for m in msgs][0] == "Name a colour." and len(msgs) == 2

    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as cont:
        assert w.controller.continue_reply()
    assert cont.args[0].content.startswith(msgs[1].content) and len(cont.args[0].content) > len(
        msgs[1].content
    )

    w.close()
    store.close()
    # a new start shows the same chat
    w2, store2 = _window(qtbot, engine)
    assert w2.controller.chat.id == chat.id
    assert [x.message.content for x in w2.view.widgets.values()] == [
        m.content for m in store2.messages(chat.id)
    ]
    w2.close()
    store2.close()


def test_stop_keeps_the_partial_reply(qtbot, engine):
    w, store = _window(qtbot, engine, max_tokens=400)
    w.composer.setPlainText("Write a long story about a dragon.")
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as done:
        w.send()
        qtbot.waitUntil(lambda: w.controller._text.count(" ") >= 3, timeout=60000)
        assert w.stop_button.isEnabled()
        qtbot.keyClick(w, Qt.Key.Key_Escape)
    msg = done.args[0]
    assert msg.state == "stopped" and msg.content
    assert store.messages(w.controller.chat.id)[-1].content == msg.content
    assert w.send_button.isEnabled() and not w.stop_button.isEnabled()
    w.close()
    store.close()


def test_delete_with_undo_search_and_export_import(qtbot, engine, tmp_path):
    w, store = _window(qtbot, engine)
    _send(qtbot, w, "Say hello.")
    chat_id = w.controller.chat.id
    w.search.setText("hello")
    assert w.chat_list.count() == 1
    w.search.setText("zebra-not-there")
    assert w.chat_list.count() == 0
    w.search.clear()
    md = w.export_chat("md", path=str(tmp_path / "c.md"))
    js = w.export_chat("json", path=str(tmp_path / "c.json"))
    assert md.read_text().startswith("# Say hello.") and json.loads(js.read_text())["messages"]
    w.delete_chat(chat_id)
    assert w.chat_list.count() == 0 and w.undo_button.isVisible()
    w.undo_button.click()
    assert w.chat_list.count() == 1 and w.controller.chat.id == chat_id
    new_id = w.import_chat(str(js))
    assert new_id != chat_id and w.chat_list.count() == 2
    w.close()
    store.close()


def test_settings_dialog_round_trip(qtbot, engine):
    w, store = _window(qtbot, engine)
    dialog = w.open_settings()
    qtbot.addWidget(dialog)
    box = dialog.editors["theme"]
    box.setCurrentIndex(box.findData("dark"))
    dialog.editors["n_ctx"].setValue(2048)
    quant = dialog.editors["quant_format"]
    quant.setCurrentIndex(quant.findData("Q8_0"))
    assert dialog.quant_hint.text()
    dialog.accept()
    again = Settings()
    assert (again.get("theme"), again.get("n_ctx"), again.get("quant_format")) == ("dark", 2048, "Q8_0")
    w.close()
    store.close()


def test_worker_crash_is_reported_and_the_chat_survives(qtbot, engine):
    w, store = _window(qtbot, engine, max_tokens=400)
    _send(qtbot, w, "Hi")
    chat_id = w.controller.chat.id
    w.composer.setPlainText("Tell me a long story.")
    with qtbot.waitSignal(engine.restarted, timeout=120000):
        w.send()
        qtbot.waitUntil(lambda: bool(w.controller._text), timeout=60000)
        os.kill(engine.client.pid, signal.SIGKILL)
    assert "engine" in w.view.notice_label.text().lower()
    msgs = store.messages(chat_id)
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[-1].state == "error" and msgs[-1].content
    reply = _send(qtbot, w, "Hi again", timeout=120000)
    assert reply.state == "done"
    w.close()
    store.close()


@pytest.mark.slow
def test_kill_9_mid_reply_loses_at_most_a_second(smollm2_path, tmp_path):
    env = dict(os.environ, HEARTH_HOME=str(tmp_path / "home"), QT_QPA_PLATFORM="offscreen")
    settings = tmp_path / "home" / "config" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"values": {"max_tokens": 2000, "temperature": 0.0}}))
    cmd = [
        sys.executable,
        "-m",
        "app.main",
        "--model",
        str(smollm2_path),
        "--send",
        "Write a long essay about the sea.",
        "--print-stream",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    seen: list[tuple[float, str]] = []
    try:
        start = None
        for line in proc.stdout:
            event = json.loads(line)
            if "text" in event:
                now = time.monotonic()
                seen.append((now, event["text"]))
                start = start or now
                if now - start > 3.0:
                    break
        assert seen, "the reply streamed"
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
    finally:
        proc.kill()
        proc.wait(10)
    store = ChatStore(tmp_path / "home" / "data" / "chats.sqlite3")
    (chat,) = store.list_chats()
    user, reply = store.messages(chat.id)
    assert user.content == "Write a long essay about the sea."
    on_screen_a_second_before = [t for when, t in seen if when <= killed - 1.0][-1]
    assert reply.content.startswith(on_screen_a_second_before[: len(reply.content)])
    assert len(reply.content) >= len(on_screen_a_second_before), "at most the last second is lost"
    store.close()


@pytest.mark.parametrize("thinking", [True, False])
def test_the_thinking_setting_reaches_the_template(qtbot, engine, monkeypatch, thinking):
    calls = []
    generate = engine.client.generate

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine.client, "generate", spy)
    w, _ = _window(qtbot, engine, thinking=thinking)
    reply = _send(qtbot, w, "Hi")
    assert reply.state == "done"
    # off: Qwen3-style templates get enable_thinking false, gpt-oss a low effort (others ignore them)
    off = {"enable_thinking": False, "reasoning_effort": "low"}
    assert calls[-1].get("template_vars") == (None if thinking else off)
