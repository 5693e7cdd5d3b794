"""A reasoning reply in the chat view: its thinking in a collapsed section above the answer, offscreen."""

from __future__ import annotations

import pytest

from app.chat_store import Message
from app.chat_view import MessageWidget
from app.qt import QApplication

pytestmark = pytest.mark.gui

FINISHED = "<think>\nThe user asks for the capital of France.\n</think>\n\nParis is the capital."


def _widget(qtbot, content: str, role: str = "assistant", state: str = "done") -> MessageWidget:
    w = MessageWidget(Message(id=1, chat_id="c", position=1, role=role, content=content, state=state))
    qtbot.addWidget(w)
    w.resize(500, 300)
    w.show()
    return w


def test_finished_reply_shows_collapsed_thoughts_above_the_answer(qtbot):
    w = _widget(qtbot, FINISHED)
    assert w.thinking_section.isVisible()
    assert w.thinking_button.isCheckable() and not w.thinking_button.isChecked()
    assert w.thinking_button.accessibleName() == "Show thinking"
    assert w.thinking_button.text() == "Thoughts"
    assert not w.thinking_label.isVisible(), "collapsed by default"
    assert w.body.plain_text() == "Paris is the capital."
    assert w.message.content == FINISHED, "the raw reply is what is kept"

    w.thinking_button.click()
    assert w.thinking_label.isVisible()
    assert w.thinking_label.accessibleName() == "Thinking"
    assert w.thinking_label.text() == "The user asks for the capital of France."
    w.thinking_button.click()
    assert not w.thinking_label.isVisible()


def test_streaming_reply_inside_its_block_then_closing_it(qtbot):
    w = _widget(qtbot, "", state="streaming")
    assert not w.thinking_section.isVisible(), "nothing to think about yet"
    w.set_text("<think>\nThe us", immediate=True)
    assert w.thinking_section.isVisible()
    assert w.thinking_button.text() == "Thinking…"
    assert w.thinking_label.text() == "The us"
    assert w.body.plain_text() == "" and not w.body.isVisible(), "no empty answer box while thinking"
    w.set_text("<think>\nThe user asks.", immediate=True)
    assert w.thinking_label.text() == "The user asks."
    w.set_text("<think>\nThe user asks.\n</think>\n\nPar", immediate=True)
    assert w.thinking_button.text() == "Thoughts"
    assert w.body.plain_text() == "Par" and w.body.isVisible()
    w.set_text(FINISHED)  # throttled, like the stream's own updates
    qtbot.waitUntil(lambda: w.body.plain_text() == "Paris is the capital.", timeout=2000)
    assert w.thinking_label.text() == "The user asks for the capital of France."
    assert w.message.content == FINISHED


def test_reply_without_thinking_has_no_section(qtbot):
    text = "Paris is the capital.\n\nIt is on the Seine."
    w = _widget(qtbot, text)
    assert not w.thinking_section.isVisible()
    assert w.body.plain_text() == "Paris is the capital.\nIt is on the Seine."
    w.copy()
    assert QApplication.clipboard().text() == text


def test_copy_takes_only_the_answer(qtbot):
    w = _widget(qtbot, FINISHED)
    w.copy_button.click()
    assert QApplication.clipboard().text() == "Paris is the capital."


def test_think_tag_later_in_the_answer_is_text(qtbot):
    text = "Thoughts open with `<think>`:\n\n`<think>` is not a block here `</think>`"
    w = _widget(qtbot, text)
    assert not w.thinking_section.isVisible()
    assert w.body.plain_text() == "Thoughts open with <think>:\n<think> is not a block here </think>"
    w.copy()
    assert QApplication.clipboard().text() == text


def test_user_messages_have_no_thinking_section(qtbot):
    w = _widget(qtbot, "<think>\nnot a reply\n</think>", role="user")
    assert w.thinking_section is None
    assert "not a reply" in w.body.plain_text()
    assert w.edit_button.isVisible()


def test_streaming_the_answer_leaves_the_thinking_label_alone(qtbot):
    w = _widget(qtbot, "<think>\nShort.\n</think>\n\n", state="streaming")
    texts = []
    w.thinking_label.setText = texts.append
    for n in range(1, 6):
        w.set_text("<think>\nShort.\n</think>\n\n" + "word " * n)
    assert texts == [], "the thinking did not change"
    w.set_text("<think>\nLonger.\n</think>")
    assert texts == ["Longer."]


def test_a_tag_arriving_in_pieces_is_not_shown_as_text(qtbot):
    w = _widget(qtbot, "", state="streaming")
    w.set_text("<thi", immediate=True)
    assert w.body.plain_text() == "" and not w.thinking_section.isVisible()
    w.set_text("<think>\nHm", immediate=True)
    assert w.thinking_label.text() == "Hm"
    # a finished reply that really is "<thi" shows as written
    assert _widget(qtbot, "<thi").body.plain_text() == "<thi"


GEMMA = "<|channel>thought\nThe user asks for the capital of France.<channel|>Paris is the capital."


def test_a_gemma_thought_channel_shows_as_thoughts(qtbot):
    w = _widget(qtbot, GEMMA)
    assert w.thinking_section.isVisible() and w.thinking_button.text() == "Thoughts"
    assert w.body.plain_text() == "Paris is the capital."
    w.thinking_button.click()
    assert w.thinking_label.text() == "The user asks for the capital of France."

    w = _widget(qtbot, "", state="streaming")
    w.set_text("<|chan", immediate=True)
    assert w.body.plain_text() == "" and not w.thinking_section.isVisible()
    w.set_text("<|channel>thought", immediate=True)  # the marker's newline is still to come
    assert w.body.plain_text() == "" and not w.thinking_section.isVisible()
    w.set_text("<|channel>thought\nThe us", immediate=True)
    assert w.thinking_button.text() == "Thinking…" and w.thinking_label.text() == "The us"
    w.set_text("<|channel>thought\nThe user asks.<channel|>Par", immediate=True)
    assert w.thinking_button.text() == "Thoughts" and w.body.plain_text() == "Par"
