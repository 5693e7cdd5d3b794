"""The composer: the message editor, the images waiting to go with the message, and Attach image.

Images come from the Attach image button (a file dialog), a paste (an image, or files copied in a file
manager) or files dropped on the composer. They wait as thumbnails above the editor, each removable, and
go with the next message. Only a model that reads images (ModelInfo.vision) takes them: otherwise the
button is disabled and says why, and a pasted or dropped image is refused with a note, never dropped
silently. A refused file (not an image, over 20 MB) is named in the note; the typed text stays.

Each offered image is checked (read, decoded whole, a paste encoded as PNG, its thumbnail made) in a worker
thread of the box's own QThreadPool, one at a time so they keep their order; the GUI thread never decodes an
attachment. Meanwhile a placeholder ("…") holds its place in the strip, `checking` is true, and `checked`
fires when the last check is done. The main window's Send waits for that (app.main_window).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from app.chat_store import MessageImage
from app.images import (
    FILE_FILTER,
    AttachmentError,
    image_from_file,
    image_from_qimage,
    offered_items,
    pixmap_of,
    thumbnail_image,
)
from app.qt import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QImage,
    QLabel,
    QObject,
    QPlainTextEdit,
    Qt,
    QThreadPool,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
    Slot,
)

THUMB_SIDE = 56
NO_VISION = "The loaded model does not read images: load a vision model (such as Gemma 3 4B) to attach them."
ATTACH_TIP = "Attach images (PNG, JPEG, WebP, GIF, BMP; up to 20 MB each). You can also paste or drop them."


class Composer(QPlainTextEdit):
    """The message editor: Enter sends, Shift+Enter starts a new line. A paste or drop that holds images or
    files is offered as attachments instead of being inserted as text.

    Signals:
        submitted(): Enter was pressed.
        imagesOffered(items: list): images (QImage) or file paths (str) pasted or dropped, in order.
    """

    submitted = Signal()
    imagesOffered = Signal(object)

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self.submitted.emit()
            return
        super().keyPressEvent(event)

    def canInsertFromMimeData(self, source) -> bool:  # noqa: N802 - Qt override
        return bool(offered_items(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source) -> None:  # noqa: N802 - Qt override (paste and drop)
        items = offered_items(source)
        if items:
            self.imagesOffered.emit(items)
        else:
            super().insertFromMimeData(source)


class _Thumb(QFrame):
    """A pending image: its thumbnail and a × that removes it. Without an image, a placeholder for one whose
    check is still running."""

    def __init__(self, image: MessageImage | None, parent=None, picture: QImage | None = None):
        # picture: the image's thumbnail_image at THUMB_SIDE (required with an image)
        super().__init__(parent)
        self.image = image
        self.setFrameShape(QFrame.Shape.StyledPanel)
        row = QHBoxLayout(self)
        row.setContentsMargins(2, 2, 2, 2)
        row.setSpacing(0)
        self.picture = QLabel(self)
        if image is None:
            self.picture.setText("…")
            self.picture.setFixedSize(THUMB_SIDE, THUMB_SIDE)
            self.picture.setAlignment(Qt.AlignmentFlag.AlignCenter)
            self.picture.setToolTip("Checking this image…")
        else:
            # `picture` (thumbnail_image) was made in the check's worker thread: here it is only wrapped
            self.picture.setPixmap(pixmap_of(picture, self.devicePixelRatioF()))
            self.picture.setToolTip(f"{image.mime}, {len(image.data) / 1024:,.0f} KB")
        self.remove_button = QToolButton(self)
        self.remove_button.setText("×")
        self.remove_button.setAutoRaise(True)
        self.remove_button.setToolTip("Remove this image")
        row.addWidget(self.picture)
        row.addWidget(self.remove_button, 0, Qt.AlignmentFlag.AlignTop)


class _CheckRelay(QObject):
    """Carries a check's result from the worker thread to the GUI thread (a queued connection).

    Signals:
        done(token: int, image: MessageImage | None, picture: QImage | None, problem: str)
    """

    done = Signal(int, object, object, str)


def check_image(item: QImage | str, dpr: float) -> tuple[MessageImage, QImage]:
    """Read and check one offered item (a pasted image or a file path) and make its thumbnail; the work the
    composer's worker thread does. Raises AttachmentError."""
    image = image_from_qimage(item) if isinstance(item, QImage) else image_from_file(item)
    return image, thumbnail_image(image.data, THUMB_SIDE, dpr)


def _run_check(token: int, item: QImage | str, dpr: float, relay: _CheckRelay) -> None:
    """One offered item's check, on the composer's pool thread; its answer goes back through `relay`. Started
    as a plain callable, so PySide owns the runnable that wraps it (a Python QRunnable subclass, auto-deleted
    by the pool on its thread while Python also holds its wrapper, is a known way to crash PySide)."""
    image = picture = None
    problem = ""
    try:
        image, picture = check_image(item, dpr)
    except AttachmentError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - the box waits for every answer: never leave it without one
        problem = f"{item if isinstance(item, str) else 'the image'} could not be read ({e!r})"
    with contextlib.suppress(RuntimeError):  # the composer is gone (its window closed meanwhile)
        relay.done.emit(token, image, picture, problem)


class _Offer:
    """One offer's checks (a paste, a drop, the files picked at once): their refusals, shown together."""

    def __init__(self, n: int):
        self.left = n
        self.problems: list[str] = []


class ComposerBox(QWidget):
    """The editor with its pending images, a note line for refused attachments, and Attach image.

    Signals:
        notice(text: str): an attachment was refused (why); also shown in the box's note line.
        checked(refused: bool): the last image check running is done; refused says whether an image offered
            since the box was last idle was refused (its note says which and why).
    """

    notice = Signal(str)
    checked = Signal(bool)

    def __init__(self, parent=None):
        super().__init__(parent)
        # created first, so it is destroyed (waiting for a running check) before the relay it reports to
        self._pool = QThreadPool(self)
        self._pool.setMaxThreadCount(1)  # one at a time: results come back in the order offered
        self._relay = _CheckRelay(self)
        self._relay.done.connect(self._on_checked)
        self._next_token = 0
        self._pending: dict[int, tuple[_Thumb, _Offer]] = {}  # token -> (placeholder, its offer)
        self._refused = False
        self.images: list[MessageImage] = []
        self.vision = False
        self.folder = str(Path.home())
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.note = QLabel("")
        self.note.setAccessibleName("Attachment note")
        self.note.setWordWrap(True)
        self.note.hide()
        self.strip = QWidget(self)
        self.strip.setAccessibleName("Images to send")
        self._strip_row = QHBoxLayout(self.strip)
        self._strip_row.setContentsMargins(0, 0, 0, 0)
        self._strip_row.addStretch(1)
        self.strip.hide()
        self.editor = Composer(self)
        self.editor.setAccessibleName("Message")
        self.editor.setPlaceholderText("Write a message. Enter sends, Shift+Enter adds a line.")
        self.editor.setMaximumHeight(140)
        self.attach_button = QToolButton(self)
        self.attach_button.setText("Attach image…")
        self.attach_button.setAccessibleName("Attach image")
        self.attach_button.setAutoRaise(True)
        tools = QHBoxLayout()
        tools.addWidget(self.attach_button)
        tools.addStretch(1)
        for w in (self.note, self.strip, self.editor):
            layout.addWidget(w)
        layout.addLayout(tools)
        self.setAcceptDrops(True)  # files dropped beside the editor (on the strip, the tool row) count too
        self.attach_button.clicked.connect(self.choose_images)
        self.editor.imagesOffered.connect(self.offer)
        self.set_vision(False)

    def set_vision(self, on: bool) -> None:
        """Whether the loaded model reads images: enables Attach image and paste/drop of images."""
        self.vision = bool(on)
        self.attach_button.setEnabled(self.vision)
        self.attach_button.setToolTip(ATTACH_TIP if self.vision else NO_VISION)

    @Slot()
    def choose_images(self) -> None:
        """Pick image files in a dialog and attach them."""
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", self.folder, FILE_FILTER)
        if paths:
            self.folder = str(Path(paths[0]).parent)
            self.offer(paths)

    @property
    def checking(self) -> bool:
        """Whether offered images are still being checked (they are not in `images` yet)."""
        return bool(self._pending)

    @Slot(object)
    def offer(self, items: list) -> None:
        """Attach images (QImage) and image files (paths), in order, each checked in a worker thread; a
        placeholder holds its place meanwhile. What cannot be attached is named in the note once the offer's
        checks are done (all of it at once while the model reads no images)."""
        if not self.vision:
            self.show_note(NO_VISION)
            return
        if not items:
            return
        offer = _Offer(len(items))
        dpr = self.devicePixelRatioF()
        for item in items:
            token = self._next_token
            self._next_token += 1
            placeholder = self._insert(_Thumb(None, self.strip))
            self._pending[token] = (placeholder, offer)
            self._pool.start(functools.partial(_run_check, token, item, dpr, self._relay))
        self._relabel()

    @Slot(int, object, object, str)
    def _on_checked(self, token: int, image, picture, problem: str) -> None:
        entry = self._pending.pop(token, None)
        if entry is None:
            return  # removed, or the message went, while it was being checked
        placeholder, offer = entry
        if image is not None:
            thumb = _Thumb(image, self.strip, picture)
            thumb.remove_button.clicked.connect(self._on_remove)
            self._strip_row.insertWidget(self._strip_row.indexOf(placeholder), thumb)
            self.images.append(image)  # checks end in the order offered: every earlier image is in already
        else:
            offer.problems.append(problem)
            self._refused = True
        self._settle(placeholder, offer)

    def _settle(self, placeholder: _Thumb, offer: _Offer) -> None:
        """A check ended (or its placeholder was removed): the offer's note once its last check is done, and
        `checked` once no check is left."""
        self._drop(placeholder)
        offer.left -= 1
        if not offer.left:
            self.show_note(" ".join(offer.problems))
        self._relabel()
        if not self._pending:
            refused, self._refused = self._refused, False
            self.checked.emit(refused)

    def add(self, image: MessageImage) -> None:
        """Add one image that is checked already (decoded by the caller), before those being checked."""
        self.images.append(image)
        picture = thumbnail_image(image.data, THUMB_SIDE, self.devicePixelRatioF())
        self._insert(_Thumb(image, self.strip, picture), before_pending=True)
        self._relabel()

    def _insert(self, thumb: _Thumb, before_pending: bool = False) -> _Thumb:
        thumb.remove_button.clicked.connect(self._on_remove)
        at = self._strip_row.count() - 1  # before the stretch
        if before_pending and self._pending:
            at = min(self._strip_row.indexOf(p) for p, _ in self._pending.values())
        self._strip_row.insertWidget(at, thumb)
        self.strip.show()
        return thumb

    def _drop(self, thumb: _Thumb) -> None:
        thumb.setParent(None)
        thumb.deleteLater()
        self.strip.setVisible(bool(self.images or self._pending))

    def remove(self, index: int) -> None:
        """Drop the pending image at `index`."""
        thumb = self._thumbs()[index]
        del self.images[index]
        self._drop(thumb)
        self._relabel()

    @Slot()
    def _on_remove(self) -> None:
        button = self.sender()
        for i, thumb in enumerate(self._thumbs()):
            if thumb.remove_button is button:
                self.remove(i)
                return
        for token, (placeholder, offer) in list(self._pending.items()):
            if placeholder.remove_button is button:  # still being checked: its answer will be ignored
                del self._pending[token]
                self._settle(placeholder, offer)
                return

    def _thumbs(self) -> list[_Thumb]:
        """The checked images' thumbnails, in the order of `images` (placeholders left out)."""
        items = (self._strip_row.itemAt(i).widget() for i in range(self._strip_row.count()))
        return [w for w in items if isinstance(w, _Thumb) and w.image is not None]

    def _placeholders(self) -> list[_Thumb]:
        items = (self._strip_row.itemAt(i).widget() for i in range(self._strip_row.count()))
        return [w for w in items if isinstance(w, _Thumb) and w.image is None]

    def _relabel(self) -> None:
        for i, thumb in enumerate(self._thumbs()):
            thumb.remove_button.setAccessibleName(f"Remove image {i + 1}")
            thumb.picture.setAccessibleName(f"Image {i + 1} to send")
        for i, thumb in enumerate(self._placeholders()):
            thumb.remove_button.setAccessibleName(f"Remove image being checked {i + 1}")
            thumb.picture.setAccessibleName(f"Image being checked {i + 1}")

    def show_note(self, text: str) -> None:
        """Show why something was not attached ("" hides the note); notice carries it to the status bar."""
        self.note.setText(text)
        self.note.setVisible(bool(text))
        if text:
            self.notice.emit(text)

    def clear(self) -> None:
        """Empty the editor and the pending images (the message went); checks still running are forgotten."""
        self.editor.clear()
        for thumb in self._thumbs() + self._placeholders():
            thumb.setParent(None)
            thumb.deleteLater()
        self.images = []
        was_checking = bool(self._pending)
        self._pending.clear()
        self.strip.hide()
        self.show_note("")
        if was_checking:
            self._refused = False
            self.checked.emit(False)

    def shutdown(self) -> None:
        """Drop the image checks not started yet (the window is closing): only a running one is waited for."""
        self._pool.clear()
        self._pending.clear()

    # ---- drops on the box around the editor (the editor handles its own, through insertFromMimeData)
    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt override
        if offered_items(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt override
        items = offered_items(event.mimeData())
        if items:
            event.acceptProposedAction()
            self.offer(items)
