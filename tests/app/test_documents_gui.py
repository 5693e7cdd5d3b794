"""Chat with documents in the real window: attach (button, drop, paste), chips, refusals in the note, reading
off the GUI thread, the prompt the engine gets (whole documents, or the chunks that answer the question),
the Sources line under the reply, later turns, regenerate, edit, and a restart. The window and store are
real (HEARTH_HOME in a temp dir) over the engine with SmolLM2 loaded (n_ctx 1024); most tests record the
conversation instead of generating, and one lets SmolLM2 answer for real."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path

import pytest

import app.composer as composer
from app.composer import NO_VISION
from app.qt import (
    QApplication,
    QDragEnterEvent,
    QDropEvent,
    QFileDialog,
    QMimeData,
    QPointF,
    Qt,
    QUrl,
)
from tests.app.windows import open_window, record_replies, wait_checked
from tests.engine.test_documents import make_pdf

pytestmark = pytest.mark.gui

ANSWER = "The vault's launch code is 7741. Only the night porter knows it."


_window = open_window
_checked = wait_checked


@pytest.fixture
def replies(engine, monkeypatch):
    """The conversations sent to the engine (as the worker gets them); each is answered "Noted."."""
    return record_replies(engine, monkeypatch, "Noted.")


@pytest.fixture
def files(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("Meeting notes. The wifi password is swordfish.\n")
    report = tmp_path / "report.pdf"
    report.write_bytes(make_pdf(["Quarterly report.", "Revenue grew nine percent."]))
    from pypdf import PdfWriter

    scan = tmp_path / "scan.pdf"
    writer = PdfWriter()
    writer.add_blank_page(612, 792)
    with scan.open("wb") as f:
        writer.write(f)
    picture = tmp_path / "picture.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n")
    paras = [
        ANSWER if i == 27 else f"Section {i} talks about gardens, weather and the history of the town. " * 4
        for i in range(40)
    ]
    essay = tmp_path / "essay.txt"
    essay.write_text("\n\n".join(paras))
    return {"notes": notes, "report": report, "scan": scan, "picture": picture, "essay": essay}


def _drop(widget, paths) -> None:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    at = QPointF(widget.rect().center())
    buttons, keys = Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    enter = QDragEnterEvent(at.toPoint(), Qt.DropAction.CopyAction, mime, buttons, keys)
    QApplication.sendEvent(widget, enter)
    assert enter.isAccepted()
    QApplication.sendEvent(widget, QDropEvent(at, Qt.DropAction.CopyAction, mime, buttons, keys))


def test_attach_documents_and_the_prompt_holds_them_whole(qtbot, engine, replies, files, monkeypatch):
    threads = []
    real = composer.read_document

    def read(path, stopped=None):
        threads.append(threading.current_thread())
        return real(path, stopped)

    monkeypatch.setattr(composer, "read_document", read)
    import app.controller as controller

    chosen_in = []
    real_with = controller.with_documents

    def with_documents(*args, **kwargs):
        chosen_in.append(threading.current_thread())
        return real_with(*args, **kwargs)

    monkeypatch.setattr(controller, "with_documents", with_documents)
    counters = []
    real_counter = controller.model_token_counter

    def counter(path):
        counters.append((path, real_counter(path)))
        return counters[-1][1]

    monkeypatch.setattr(controller, "model_token_counter", counter)
    w, store = _window(qtbot, engine)
    box = w.composer_box
    assert not engine.model.vision and w.attach_button.isEnabled(), "documents go with any model"
    asked = []

    def pick(parent, caption, folder, filters):
        asked.append(filters)
        return [str(files["notes"]), str(files["scan"]), str(files["picture"])], filters

    monkeypatch.setattr(QFileDialog, "getOpenFileNames", pick)
    w.attach_button.click()
    _checked(qtbot, box)
    assert "*.pdf" in asked[0] and "*.docx" in asked[0] and "*.txt" in asked[0]
    assert [d.name for d in box.documents] == ["notes.txt"]
    assert threads and all(t is not threading.main_thread() for t in threads), "read off the GUI thread"
    note = box.note.text()
    assert "scan.pdf has no text layer" in note and "OCR" in note and NO_VISION in note
    assert box.doc_strip.isVisible() and not box.strip.isVisible()

    _drop(w.composer.viewport(), [files["report"]])  # dropped on the editor
    _checked(qtbot, box)
    mime = QMimeData()  # a file copied in a file manager and pasted
    mime.setUrls([QUrl.fromLocalFile(str(files["essay"]))])
    QApplication.clipboard().setMimeData(mime)
    w.composer.paste()
    _checked(qtbot, box)
    assert [d.name for d in box.documents] == ["notes.txt", "report.pdf", "essay.txt"]
    chips = box._chips()
    assert "report.pdf" in chips[1].label.text() and "2 pages" in chips[1].label.text()
    assert "KB" in chips[2].label.text() or "bytes" in chips[2].label.text()
    assert chips[2].remove_button.accessibleName() == "Remove document 3 (essay.txt)"
    chips[2].remove_button.click()
    assert [d.name for d in box.documents] == ["notes.txt", "report.pdf"]

    w.composer.setPlainText("What is the wifi password?")
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    (turn,) = replies[-1]
    text = turn["content"]
    assert text.startswith('<documents>\n<document name="notes.txt" part="whole document">\n')
    assert "The wifi password is swordfish." in text and "Revenue grew nine percent." in text
    assert text.endswith("</documents>\n\nWhat is the wifi password?")
    assert box.documents == [] and not box.doc_strip.isVisible() and w.composer.toPlainText() == ""
    assert chosen_in and threading.main_thread() not in chosen_in, "documents chosen off the GUI thread"
    assert counters and counters[0][0] == engine.model.path and counters[0][1] is not None, "SmolLM2's tokens"

    user, reply = store.messages(w.controller.chat.id)
    assert [d.name for d in user.documents] == ["notes.txt", "report.pdf"] and user.content.startswith("What")
    assert reply.stats["sources"] == [
        {"name": "notes.txt", "whole": True, "chunks": []},
        {"name": "report.pdf", "whole": True, "chunks": []},
    ]
    shown = w.view.widgets[reply.id].sources_label
    assert shown.isVisible() and shown.toolTip() == "notes.txt (whole document); report.pdf (whole document)"
    attached = w.view.widgets[user.id].documents_label
    assert attached is not None and "notes.txt" in attached.text() and "2 pages" in attached.text()

    # the next turn: the documents stay whole in the first message (its KV cache is reused)
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.composer.setPlainText("Thanks. And the revenue?")
        w.send()
    assert replies[-1][0]["content"] == text
    assert replies[-1][2] == {"role": "user", "content": "Thanks. And the revenue?"}
    w.close()
    store.close()


def test_a_long_document_sends_the_chunks_that_answer(qtbot, engine, replies, files):
    w, store = _window(qtbot, engine)
    w.composer_box.offer([str(files["essay"])])
    _checked(qtbot, w.composer_box)
    w.composer.setPlainText("What is the vault launch code?")
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.send()
    (turn,) = replies[-1]
    assert "7741" in turn["content"] and turn["content"].endswith("\n\nWhat is the vault launch code?")
    assert "Section 3 talks" not in turn["content"], "not the whole essay: it does not fit 1024 tokens"
    assert 'part="chunk ' in turn["content"]
    chat_id = w.controller.chat.id
    reply = store.messages(chat_id)[1]
    (source,) = reply.stats["sources"]
    assert source["name"] == "essay.txt" and not source["whole"] and source["of"] > 5
    label = w.view.widgets[reply.id].sources_label
    assert label.isVisible() and label.toolTip().startswith("essay.txt (chunk")

    # a later question: retrieval again, over the chat's documents, into the new question's turn
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.composer.setPlainText("Who knows the launch code?")
        w.send()
    first, _, last = replies[-1]
    assert first == {"role": "user", "content": "What is the vault launch code?"}
    assert "night porter" in last["content"] and last["content"].endswith("Who knows the launch code?")

    # regenerate: the same prompt again
    before = replies[-1]
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.view.widgets[store.messages(chat_id)[-1].id].regenerate_button.click()
    assert replies[-1] == before

    # edit the first message: its document stays with it
    first_msg = store.messages(chat_id)[0]
    w.view.widgets[first_msg.id].start_edit()
    w.view.widgets[first_msg.id].editor.setPlainText("Tell me the launch code.")
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.view.widgets[first_msg.id]._resend()
    (turn,) = replies[-1]
    assert "7741" in turn["content"] and turn["content"].endswith("Tell me the launch code.")
    edited = store.messages(chat_id)[0]
    assert [d.name for d in edited.documents] == ["essay.txt"]
    w.close()
    store.close()

    w2, store2 = _window(qtbot, engine)  # a new start: the Sources line and the attachment come back
    w2.controller.open_chat(chat_id)
    user, reply = store2.messages(chat_id)
    assert w2.view.widgets[reply.id].sources_label.toolTip().startswith("essay.txt (chunk")
    assert "essay.txt" in w2.view.widgets[user.id].documents_label.text()
    w2.close()
    store2.close()


@pytest.mark.slow
def test_smollm2_reads_an_attached_document(qtbot, engine, files, monkeypatch):
    """The real engine: the conversation the worker gets holds the document, and the reply ends done."""
    sent: list[list[dict]] = []
    real = engine.client.generate

    def generate(conversation, params=None, **kwargs):
        sent.append(pickle.loads(pickle.dumps(conversation)))
        yield from real(conversation, params, **kwargs)

    monkeypatch.setattr(engine.client, "generate", generate)
    w, store = _window(qtbot, engine, max_tokens=16)
    w.composer_box.offer([str(files["notes"])])
    _checked(qtbot, w.composer_box)
    w.composer.setPlainText("What is the wifi password?")
    with qtbot.waitSignal(w.controller.messageDone, timeout=120000) as done:
        w.send()
    reply = done.args[0]
    assert reply.state == "done" and reply.content.strip()
    assert "The wifi password is swordfish." in sent[-1][-1]["content"]
    assert reply.stats["prompt_tokens"] > 40, "the document's tokens were in the prompt the worker read"
    assert w.view.widgets[reply.id].sources_label.toolTip() == "notes.txt (whole document)"
    w.close()
    store.close()


def test_a_message_of_documents_alone_waits_for_the_reading(qtbot, engine, replies, files, monkeypatch):
    gate = threading.Event()
    real = composer.read_document

    def read(path, stopped=None):
        assert gate.wait(20), "never released"
        return real(path, stopped)

    monkeypatch.setattr(composer, "read_document", read)
    w, store = _window(qtbot, engine)
    box = w.composer_box
    box.offer([str(files["notes"]), str(files["report"])])
    assert box.checking and box.documents == []
    assert [c.label.text() for c in box._chips(pending=True)] == ["Reading notes.txt…", "Reading report.pdf…"]
    box._chips(pending=True)[1].remove_button.click()  # removed while being read: its answer is dropped
    w.send()  # nothing typed: the documents alone, once read
    assert replies == [] and "Sending when" in w.statusBar().currentMessage()
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        gate.set()
    (turn,) = replies[-1]
    assert turn["content"].startswith("<documents>") and turn["content"].endswith("</documents>")
    assert "swordfish" in turn["content"] and "Quarterly" not in turn["content"]
    assert w.controller.chat.title == "notes.txt"
    user = store.messages(w.controller.chat.id)[0]
    assert user.content == "" and w.view.widgets[user.id].body.isHidden(), "no empty text box"
    w.close()
    store.close()


def test_closing_the_window_stops_a_long_pdf_being_read(qtbot, engine, tmp_path, monkeypatch):
    """The window closes without waiting for a long PDF's reading: it stops at the next page, and nothing
    is attached."""
    from pypdf import PageObject

    long = tmp_path / "long.pdf"
    long.write_bytes(make_pdf([f"Page {i}: minutes of the meeting." for i in range(40)]))
    started, read = threading.Event(), []
    real = PageObject.extract_text

    def slow(page, *args, **kwargs):  # a page of a big scan-heavy PDF takes a while
        read.append(1)
        started.set()
        threading.Event().wait(0.2)
        return real(page, *args, **kwargs)

    monkeypatch.setattr(PageObject, "extract_text", slow)
    w, store = _window(qtbot, engine)
    box = w.composer_box
    box.offer([str(long)])
    assert started.wait(10)
    w.close()
    assert box._pool.waitForDone(5000), "the reading ended"
    assert len(read) < 5 and box.documents == [], f"{len(read)} of 40 pages read after the close"


BERT = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "bert-embed"


def test_chunks_are_ranked_with_the_chosen_embedding_model(qtbot, engine, replies, files, monkeypatch):
    """The setting names the tiny BERT: the worker embeds the chunks and the question (the chunks once: a
    follow-up embeds only itself), and the Sources line says the chunks were ranked with it."""
    asked: list[tuple[str, list[str], str | None]] = []
    real = engine.client.embed

    def embed(model_path, texts, prompt_name=None, **kw):
        asked.append((str(model_path), list(texts), kw.get("task")))
        return real(model_path, texts, prompt_name, **kw)

    monkeypatch.setattr(engine.client, "embed", embed)
    w, store = _window(qtbot, engine)
    w.settings.set("document_search", str(BERT))
    w.composer_box.offer([str(files["essay"])])
    _checked(qtbot, w.composer_box)
    w.composer.setPlainText("What is the vault launch code?")
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
        w.send()
    (turn,) = replies[-1]
    assert "7741" in turn["content"], "the keyword match still gets in"
    assert [(path, task) for path, _, task in asked] == [(str(BERT), "document"), (str(BERT), "query")]
    assert len(asked[0][1]) > 5 and asked[1][1] == ["What is the vault launch code?"]
    reply = store.messages(w.controller.chat.id)[1]
    (source,) = reply.stats["sources"]
    assert source["ranked_by"] == "keywords and bert-embed"
    label = w.view.widgets[reply.id].sources_label
    assert label.toolTip().startswith("essay.txt (chunk")
    assert label.toolTip().endswith(" · ranked by keywords and bert-embed")
    assert "ranked by keywords and bert-embed" in label.text()
    assert engine.client.status().embedding_model["name"] == "bert-embed", "kept loaded beside SmolLM2"

    asked.clear()
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
        w.composer.setPlainText("Who knows the launch code?")
        w.send()
    assert [task for _, _, task in asked] == ["query"], "the chunks' vectors were kept"
    w.close()
    store.close()


def test_a_broken_search_model_falls_back_to_keywords_with_a_notice(qtbot, engine, replies, files, tmp_path):
    broken = tmp_path / "broken-embed.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    w, store = _window(qtbot, engine)
    w.settings.set("document_search", str(broken))
    w.composer_box.offer([str(files["essay"])])
    _checked(qtbot, w.composer_box)
    w.composer.setPlainText("What is the vault launch code?")
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as done:
        w.send()
    assert done.args[0].state == "done", "the message is answered all the same"
    (turn,) = replies[-1]
    assert "7741" in turn["content"]
    message = w.statusBar().currentMessage()
    assert "broken-embed.gguf could not be loaded" in message and "ranked by keywords" in message
    label = w.view.widgets[done.args[0].id].sources_label
    assert label.toolTip().endswith(" · ranked by keywords")
    w.close()
    store.close()


def test_stop_while_the_search_model_reads_the_documents(qtbot, engine, replies, files, monkeypatch):
    """The search model embeds a long document's chunks a few at a time, the status bar counting them; Stop
    in the middle ends the reading and the reply, and nothing reaches the engine. The next question embeds
    only the chunks left (the read ones are kept) and is answered."""
    import app.controller as controller
    import engine.document_context as document_context

    monkeypatch.setattr(controller, "EMBED_BATCH", 2)
    monkeypatch.setattr(document_context, "CHUNK_VECTORS", document_context.VectorCache())  # none read yet
    batches: list[int] = []
    real = engine.client.embed

    def embed(model_path, texts, prompt_name=None, **kw):
        if kw.get("task") == "document":
            batches.append(len(texts))
            time.sleep(0.2)  # a slow model: time for Stop to come between two batches
        return real(model_path, texts, prompt_name, **kw)

    monkeypatch.setattr(engine.client, "embed", embed)
    w, store = _window(qtbot, engine)
    w.settings.set("document_search", str(BERT))
    w.composer_box.offer([str(files["essay"])])
    _checked(qtbot, w.composer_box)
    w.composer.setPlainText("What is the vault launch code?")
    seen: list[tuple[int, int]] = []
    w.bridge.preparing.connect(lambda _turn, done, total: seen.append((done, total)))
    w.send()
    qtbot.waitUntil(lambda: len(seen) >= 3, timeout=60000)
    assert w.statusBar().currentMessage().startswith("Reading the documents for the search: ")
    total = seen[0][1]
    assert total > 6 and [d for d, _ in seen[:3]] == [0, 2, 4]
    with qtbot.waitSignal(w.controller.messageDone, timeout=30000) as done:
        w.controller.stop()
    assert done.args[0].state == "stopped" and replies == [], "nothing went to the engine"
    read = sum(batches)
    assert read < total, "Stop ended the reading"

    batches.clear()
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as done:
        w.composer.setPlainText("Who knows the launch code?")
        w.send()
    assert done.args[0].state == "done" and len(replies) == 1
    assert sum(batches) == total - read, "the chunks read before the Stop were kept"
    w.close()
    store.close()
