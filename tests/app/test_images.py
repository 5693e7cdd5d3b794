"""Images in chats: the composer's Attach (button, paste, drop) following the model's vision, files
refused with a message, the message parts the engine gets, thumbnails in the conversation and after a
restart. The real window and store (HEARTH_HOME in a temp dir) over the engine with SmolLM2 loaded; the
tests that send swap the client's generate for a recording stand-in, since SmolLM2 reads no images."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from app.chat_store import MessageImage
from app.chat_view import IMAGE_SIDE
from app.composer import NO_VISION
from app.qt import (
    QApplication,
    QBuffer,
    QColor,
    QDragEnterEvent,
    QDropEvent,
    QFileDialog,
    QImage,
    QIODevice,
    QMimeData,
    QPointF,
    QSize,
    Qt,
    QUrl,
)
from tests.app.windows import open_window, record_replies, wait_checked

pytestmark = pytest.mark.gui


def _encoded(width: int, height: int, color: str, fmt: str = "PNG") -> bytes:
    image = QImage(width, height, QImage.Format.Format_RGB32)
    image.fill(QColor(color))
    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    assert image.save(buf, fmt)
    return bytes(buf.data())


_window = open_window
_checked = wait_checked


@pytest.fixture
def vision(engine, monkeypatch):
    """The loaded model as one that reads images (what the worker reports for a vision model)."""
    info = replace(engine.model, vision=True)
    monkeypatch.setattr(engine, "model", info)
    return info


@pytest.fixture
def replies(engine, monkeypatch):
    """The conversations sent to the engine; each is answered "A red box."."""
    return record_replies(engine, monkeypatch, "A red box.")


@pytest.fixture
def files(tmp_path):
    wide = tmp_path / "wide.png"
    wide.write_bytes(_encoded(200, 100, "red"))
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(_encoded(90, 120, "blue", "JPEG"))
    scan = tmp_path / "scan.tiff"
    scan.write_bytes(_encoded(30, 30, "green", "TIFF"))
    notes = tmp_path / "notes.png"
    notes.write_text("not an image at all, whatever the name says")
    big = tmp_path / "big.png"
    with big.open("wb") as f:
        f.truncate(21 << 20)
    return {"wide": wide, "photo": photo, "scan": scan, "notes": notes, "big": big}


def test_attach_follows_the_models_vision(qtbot, engine, files):
    w, store = _window(qtbot, engine)
    box = w.composer_box
    # Attach stays on for documents; the tooltip says images need a vision model
    assert not engine.model.vision and w.attach_button.isEnabled()
    assert "Images need a vision model" in w.attach_button.toolTip()
    w.composer.setPlainText("What is this?")
    QApplication.clipboard().setImage(QImage(str(files["wide"])))
    w.composer.paste()
    assert box.images == [] and box.note.isVisible() and box.note.text() == NO_VISION
    assert w.statusBar().currentMessage() == NO_VISION
    assert w.composer.toPlainText() == "What is this?", "the image was not pasted as text either"

    seeing = replace(engine.model, vision=True)
    engine.loaded.emit(seeing)
    assert w.attach_button.isEnabled() and "paste or drop" in w.attach_button.toolTip()
    w.composer.paste()
    _checked(qtbot, box)
    assert len(box.images) == 1 and not box.note.isVisible()

    # the model changes to one without vision: the tooltip says so, and Enter sends nothing yet
    engine.loaded.emit(replace(seeing, vision=False))
    assert "Images need a vision model" in w.attach_button.toolTip()
    before = len(store.list_chats())
    qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    assert "does not read images" in w.view.notice_label.text()
    assert len(store.list_chats()) == before and not w.controller.busy
    assert w.composer.toPlainText() == "What is this?" and len(box.images) == 1, "nothing is lost"
    w.close()
    store.close()


def test_attach_by_button_paste_and_drop_and_refusals(qtbot, engine, vision, files, monkeypatch):
    w, store = _window(qtbot, engine)
    box = w.composer_box
    assert w.attach_button.isEnabled()
    w.composer.setPlainText("Compare them")
    asked = []

    def pick(parent, caption, folder, filters):
        asked.append(filters)
        return [str(files["wide"]), str(files["notes"]), str(files["big"])], filters

    monkeypatch.setattr(QFileDialog, "getOpenFileNames", pick)
    w.attach_button.click()
    _checked(qtbot, box)
    assert "*.png" in asked[0] and "*.webp" in asked[0] and "*.jpg" in asked[0]
    assert box.images == [MessageImage(files["wide"].read_bytes(), "image/png")], "the file's own bytes"
    assert "notes.png is not an image" in box.note.text() and box.note.isVisible()
    assert "big.png is 21.0 MB; images up to 20 MB" in box.note.text()
    assert "notes.png" in w.statusBar().currentMessage()
    assert w.composer.toPlainText() == "Compare them", "the typed text stays"

    pasted = QImage(64, 32, QImage.Format.Format_ARGB32)
    pasted.fill(QColor("yellow"))
    QApplication.clipboard().setImage(pasted)
    w.composer.paste()
    _checked(qtbot, box)
    assert len(box.images) == 2 and box.images[1].mime == "image/png"
    assert QImage.fromData(box.images[1].data).size() == QSize(64, 32)
    assert not box.note.isVisible(), "a good attachment clears the last refusal"

    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(files["photo"])), QUrl.fromLocalFile(str(files["scan"]))])
    center = QPointF(w.composer.viewport().rect().center())
    buttons, keys = Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    enter = QDragEnterEvent(center.toPoint(), Qt.DropAction.CopyAction, mime, buttons, keys)
    QApplication.sendEvent(w.composer.viewport(), enter)
    assert enter.isAccepted(), "the composer takes dropped files"
    QApplication.sendEvent(
        w.composer.viewport(), QDropEvent(center, Qt.DropAction.CopyAction, mime, buttons, keys)
    )
    _checked(qtbot, box)
    assert [im.mime for im in box.images] == ["image/png", "image/png", "image/jpeg", "image/png"]
    assert box.images[2].data == files["photo"].read_bytes()
    assert QImage.fromData(box.images[3].data).size() == QSize(30, 30), "a TIFF is kept as PNG"
    assert w.composer.toPlainText() == "Compare them", "no file path was dropped into the text"

    # dropped on the conversation instead: the same attachments, in the composer
    drop_on_chat = QMimeData()
    drop_on_chat.setUrls([QUrl.fromLocalFile(str(files["wide"]))])
    middle = QPointF(w.view.viewport().rect().center())
    enter = QDragEnterEvent(middle.toPoint(), Qt.DropAction.CopyAction, drop_on_chat, buttons, keys)
    QApplication.sendEvent(w.view.viewport(), enter)
    assert enter.isAccepted(), "the conversation takes dropped pictures too"
    QApplication.sendEvent(
        w.view.viewport(), QDropEvent(middle, Qt.DropAction.CopyAction, drop_on_chat, buttons, keys)
    )
    _checked(qtbot, box)
    assert len(box.images) == 5 and box.images[4].data == files["wide"].read_bytes()
    box.remove(4)

    thumbs = box._thumbs()
    assert box.strip.isVisible() and len(thumbs) == 4
    assert thumbs[0].picture.pixmap().size() == QSize(56, 28), "scaled to fit, aspect kept"
    thumbs[1].remove_button.click()
    assert [im.mime for im in box.images] == ["image/png", "image/jpeg", "image/png"]
    assert [t.remove_button.accessibleName() for t in box._thumbs()] == [
        "Remove image 1",
        "Remove image 2",
        "Remove image 3",
    ]
    w.close()
    store.close()


def test_images_reach_the_engine_as_parts_and_survive_a_restart(qtbot, engine, vision, replies, files):
    wide = files["wide"].read_bytes()
    image_part = {"type": "image", "image": wide}
    w, store = _window(qtbot, engine)
    w.composer_box.offer([str(files["wide"])])
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.composer.setPlainText("What is this?")
        qtbot.keyClick(w.composer, Qt.Key.Key_Return)
    assert replies[-1] == [
        {"role": "user", "content": [image_part, {"type": "text", "text": "What is this?"}]}
    ]
    assert w.composer.toPlainText() == "" and w.composer_box.images == []
    assert not w.composer_box.strip.isVisible()
    chat_id = w.controller.chat.id
    user, reply = store.messages(chat_id)
    assert user.images == [MessageImage(wide, "image/png")] and reply.content == "A red box."
    buttons = w.view.widgets[user.id].image_buttons
    assert len(buttons) == 1 and buttons[0].iconSize() == QSize(IMAGE_SIDE, IMAGE_SIDE // 2)
    assert not w.view.widgets[reply.id].image_buttons

    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.composer.setPlainText("And now?")
        w.send()
    assert replies[-1][1:] == [
        {"role": "assistant", "content": "A red box."},
        {"role": "user", "content": "And now?"},
    ], "messages without images stay strings"
    assert replies[-1][0]["content"][0] == image_part

    last = store.messages(chat_id)[-1]
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.view.widgets[last.id].regenerate_button.click()
    assert replies[-1][0]["content"] == [image_part, {"type": "text", "text": "What is this?"}]

    first = store.messages(chat_id)[0]
    w.view.widgets[first.id].start_edit()
    w.view.widgets[first.id].editor.setPlainText("What colour is it?")
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.view.widgets[first.id]._resend()
    assert replies[-1] == [
        {"role": "user", "content": [image_part, {"type": "text", "text": "What colour is it?"}]}
    ]
    edited = store.messages(chat_id)[0]
    assert edited.content == "What colour is it?" and edited.images == [MessageImage(wide, "image/png")]

    w.controller.new_chat()  # a message of images alone
    w.composer_box.offer([str(files["photo"]), str(files["wide"])])
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.send()
    photo_part = {"type": "image", "image": files["photo"].read_bytes()}
    assert replies[-1] == [{"role": "user", "content": [photo_part, image_part]}]
    assert w.controller.chat.title == "2 images"
    alone = w.view.widgets[store.messages(w.controller.chat.id)[0].id]
    assert len(alone.image_buttons) == 2 and alone.body.isHidden(), "no empty text box under the images"
    assert alone.image_buttons[0].iconSize() == QSize(90, 120), "a small image is not enlarged"
    w.close()
    store.close()

    w2, store2 = _window(qtbot, engine)  # a new start shows them again, from the store
    w2.controller.open_chat(chat_id)
    (shown,) = [x for x in w2.view.widgets.values() if x.message.role == "user"]
    assert shown.message.images == [MessageImage(wide, "image/png")]
    assert len(shown.image_buttons) == 1 and not shown.image_buttons[0].icon().isNull()
    assert shown.image_buttons[0].iconSize() == QSize(IMAGE_SIDE, IMAGE_SIDE // 2)
    assert "image/png, 200×100" in shown.image_buttons[0].toolTip()
    shown.image_buttons[0].click()  # seen whole, in its own window
    assert shown.viewer.isVisible() and shown.viewer.picture.pixmap().size() == QSize(200, 100)
    shown.viewer.close()
    w2.close()
    store2.close()


def test_a_vision_model_answers_an_attached_image(qtbot, tmp_path):
    """End to end with the real engine: the tiny Gemma 3 with a vision tower
    (tests/fixtures/tiny/gemma3-vision) loads as a model that reads images, and a message with an attached
    picture gets a reply."""
    from pathlib import Path

    from app.engine_bridge import EngineBridge
    from engine.client import LoadOptions

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "gemma3-vision"
    bridge = EngineBridge()
    try:
        info = bridge.client.load_and_wait(folder, LoadOptions(n_ctx=256, batch_size=8, prefix_cache_mb=0))
        assert info.vision
        bridge.model = info
        w, store = _window(qtbot, bridge)
        assert w.attach_button.isEnabled()
        w.composer_box.offer([str(folder / "image0.png")])
        with qtbot.waitSignal(w.controller.messageDone, timeout=60000):
            w.composer.setPlainText("What is this?")
            qtbot.keyClick(w.composer, Qt.Key.Key_Return)
        user, reply = store.messages(w.controller.chat.id)
        assert user.images[0].data == (folder / "image0.png").read_bytes()
        assert reply.role == "assistant" and reply.state == "done" and reply.content
        w.close()
        store.close()
    finally:
        bridge.shutdown()


def test_a_chat_with_images_goes_on_with_a_text_model(qtbot, engine, vision, replies, files, monkeypatch):
    """The chat's earlier images are left out, with a notice, once the loaded model reads none."""
    w, store = _window(qtbot, engine)
    w.composer_box.offer([str(files["wide"])])
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.composer.setPlainText("What is this?")
        w.send()
    w.composer_box.offer([str(files["photo"])])  # an image-only message too
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.send()
    monkeypatch.setattr(engine, "model", replace(vision, vision=False))
    notices = []
    w.controller.notice.connect(notices.append)
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        w.composer.setPlainText("And now?")
        w.send()
    sent = replies[-1]
    assert sent[0] == {"role": "user", "content": "What is this?"}
    assert [m["content"] for m in sent if m["role"] == "user"] == ["What is this?", "And now?"]
    assert any("2 image(s) are left out" in text for text in notices)
    assert "2 image(s) are left out" in w.view.notice_label.text(), "shown while the reply streams"
    assert len(store.messages(w.controller.chat.id)[0].images) == 1, "the stored images stay"
    w.close()
    store.close()


@pytest.fixture
def held(monkeypatch):
    """The composer's image check, held until the test lets it go (`release`); records its threads."""
    import threading

    import app.composer as composer

    gate = threading.Event()
    threads = []
    real = composer.check_image

    def check(item, dpr):
        threads.append(threading.current_thread())
        assert gate.wait(20), "never released"
        return real(item, dpr)

    monkeypatch.setattr(composer, "check_image", check)
    yield gate, threads
    gate.set()


def test_images_are_checked_off_the_gui_thread_and_send_waits_for_them(
    qtbot, engine, vision, replies, files, held
):
    import threading

    gate, threads = held
    w, store = _window(qtbot, engine)
    box = w.composer_box
    w.composer.setPlainText("What is this?")
    box.offer([str(files["wide"]), str(files["photo"])])
    assert box.checking and box.images == [] and box.strip.isVisible()
    assert [t.picture.text() for t in box._placeholders()] == ["…", "…"], "their places are held"
    qtbot.waitUntil(lambda: len(threads) == 1, timeout=5000)
    assert threads[0] is not threading.main_thread(), "offer() returned while the check is held elsewhere"

    qtbot.keyClick(w.composer, Qt.Key.Key_Return)  # Send while the images are being checked: it waits
    assert replies == [] and not w.controller.busy and w.composer.toPlainText() == "What is this?"
    assert "Sending when the attached images and documents are checked" in w.statusBar().currentMessage()
    with qtbot.waitSignal(w.controller.messageDone, timeout=20000):
        gate.set()
    wide, photo = files["wide"].read_bytes(), files["photo"].read_bytes()
    assert replies[-1] == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": wide},
                {"type": "image", "image": photo},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ], "both images went, in the order offered"
    assert all(t is not threading.main_thread() for t in threads) and len(threads) == 2
    assert box.images == [] and not box.strip.isVisible() and w.composer.toPlainText() == ""
    w.close()
    store.close()


def test_a_refused_image_stops_a_waiting_send_and_a_removed_check_is_ignored(
    qtbot, engine, vision, replies, files, held
):
    gate, threads = held
    w, store = _window(qtbot, engine)
    box = w.composer_box
    w.composer.setPlainText("Look")
    box.offer([str(files["notes"])])
    w.send()
    with qtbot.waitSignal(box.checked, timeout=10000) as done:
        gate.set()
    assert done.args == [True]
    assert replies == [] and "notes.png is not an image" in box.note.text() and box.note.isVisible()
    assert "Not sent" in w.statusBar().currentMessage() and w.composer.toPlainText() == "Look"

    # a placeholder removed while its image is checked: the answer is dropped, nothing waits for it
    gate.clear()
    box.offer([str(files["wide"])])
    (placeholder,) = box._placeholders()
    assert placeholder.remove_button.accessibleName() == "Remove image being checked 1"
    with qtbot.waitSignal(box.checked, timeout=5000):
        placeholder.remove_button.click()
    assert not box.checking and not box.strip.isVisible()
    gate.set()
    qtbot.waitUntil(lambda: len(threads) == 2, timeout=5000)
    qtbot.wait(200)  # the check's answer arrives, and is ignored
    assert box.images == [] and not box._thumbs()
    w.close()
    store.close()


def _jpeg_turned(width: int, height: int, orientation: int) -> bytes:
    """A JPEG stored width × height whose EXIF says to turn it (orientation 6: a phone held upright)."""
    from PIL import Image

    exif = Image.Exif()
    exif[274] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


def test_image_checks_make_no_qt_call(qapp, files):
    """The composer's worker-thread check reads, converts and thumbnails with Pillow alone: a Qt call from a
    Python thread holds the GIL, and one taking Qt's internal locks (an image reader's) deadlocked against
    the GUI thread destroying a widget."""
    import sys

    from app.composer import check_image
    from app.images import pixels_of

    pasted = QImage(40, 20, QImage.Format.Format_ARGB32)
    pasted.fill(QColor(0, 0, 255, 128))
    items = [str(files["wide"]), str(files["photo"]), str(files["scan"]), pixels_of(pasted)]
    qt_calls: list[str] = []

    def profile(frame, event, arg):
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = type(owner).__module__ if owner is not None else getattr(arg, "__module__", "")
            if str(module).startswith(("PySide6", "shiboken6")):
                qt_calls.append(getattr(arg, "__qualname__", repr(arg)))

    results = []
    sys.setprofile(profile)
    try:
        for item in items:
            results.append(check_image(item, 1.0))
    finally:
        sys.setprofile(None)
    assert qt_calls == []
    assert [image.mime for image, _ in results] == ["image/png", "image/jpeg", "image/png", "image/png"]
    assert [(p.width, p.height) for _, p in results] == [(56, 28), (42, 56), (30, 30), (40, 20)]
    back = QImage.fromData(results[3][0].data)
    assert back.size() == QSize(40, 20) and back.pixelColor(3, 3).alpha() == 128, "the paste keeps its alpha"


def test_a_turned_photo_is_kept_as_is_and_shown_upright(qapp):
    from app.images import image_from_bytes, image_size, thumbnail_pixels

    data = _jpeg_turned(120, 60, 6)
    assert image_from_bytes(data) == MessageImage(data, "image/jpeg"), "the file's own bytes go"
    assert image_size(data) == QSize(60, 120)
    pixels = thumbnail_pixels(data, 30)
    assert (pixels.width, pixels.height) == (15, 30)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # app.images silences it at import
def test_broken_and_oversized_images_are_refused_with_what_to_do(qapp, files):
    from PIL import Image

    from app.images import AttachmentError, image_from_bytes, image_size, thumbnail, thumbnail_pixels

    whole = files["wide"].read_bytes()
    with pytest.raises(AttachmentError, match="cut.png is not an image Hearth can read"):
        image_from_bytes(whole[: len(whole) - 40], "cut.png")
    with pytest.raises(AttachmentError, match=r"notes.txt is not an image Hearth can read \(PNG, JPEG"):
        image_from_bytes(b"plain words", "notes.txt")
    buf = io.BytesIO()
    Image.new("1", (12000, 9000)).save(buf, "PNG")  # 108 M pixels in a small file
    huge = buf.getvalue()
    with pytest.raises(AttachmentError, match="12000×9000 pixels, too large to read; scale it down"):
        image_from_bytes(huge, "huge.png")
    assert thumbnail_pixels(huge, 64) is None and thumbnail(b"plain words", 64).isNull()
    assert not image_size(b"plain words").isValid()
