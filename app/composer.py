"""The composer: the message editor, the images and documents waiting to go with the message, and Attach.

Images come from the Attach button (a file dialog), a paste (an image, or files copied in a file manager)
or files dropped on the composer. They wait as thumbnails above the editor, each removable, and go with the
next message. Only a model that reads images (ModelInfo.vision) takes them: otherwise the button's tip says
so (the button stays on for documents), and a pasted or dropped image is refused with a note, never dropped
silently. A refused file (not an image, over 20 MB) is named in the note; the typed text stays.

Each offered image is checked (read, decoded whole, a paste encoded as PNG, its thumbnail made) with Pillow
in a worker thread of the box's own QThreadPool, one at a time so they keep their order; the GUI thread never
decodes an attachment, and the worker touches no Qt object (app.images says why). Meanwhile a placeholder
("…") holds its place in the strip, `checking` is true, and `checked` fires when the last check is done.
The main window's Send waits for that (app.main_window).

Documents (PDF, Word .docx, HTML, text and source files: engine.documents) come the same ways, whatever the
model: an offered file whose suffix is not an image's is read as a document, in the same worker thread, and
waits as a chip (name, size, pages) in a row of its own, removable like an image. A file that cannot be read
is named in the note with what to do; a document read with a guessed encoding says so there too.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path

from app.chat_store import MessageImage, describe_document
from app.images import (
    FILE_FILTER,
    AttachmentError,
    Pixels,
    image_from_file,
    image_from_pixels,
    offered_items,
    pixels_of,
    pixmap_of,
    thumbnail_pixels,
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
from engine.documents import DOCUMENT_SUFFIXES, Document, DocumentError, read_document

THUMB_SIDE = 56
NO_VISION = "The loaded model does not read images: load a vision model (such as Gemma 3 4B) to attach them."
ATTACH_TIP = (
    "Attach documents (PDF, Word .docx, HTML, text, source code; up to 50 MB each) and images (PNG, JPEG, "
    "WebP, GIF, BMP; up to 20 MB each). You can also paste or drop them."
)
ATTACH_TIP_NO_VISION = (
    "Attach documents (PDF, Word .docx, HTML, text, source code; up to 50 MB each). You can also paste or "
    "drop them. Images need a vision model (such as Gemma 3 4B)."
)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".ico", ".heic", ".avif"}
_DOC_PATTERNS = " ".join(sorted(f"*{s}" for s in DOCUMENT_SUFFIXES))
DOCUMENT_FILTER = f"Documents ({_DOC_PATTERNS})"
FILE_FILTER_ALL = (
    f"Documents and images ({_DOC_PATTERNS} *.png *.jpg *.jpeg *.webp *.gif *.bmp *.tif *.tiff);;"
    f"{DOCUMENT_FILTER};;{FILE_FILTER}"
)


def is_image_item(item) -> bool:
    """Whether an offered item goes the image way: a pasted picture, or a file with an image's suffix."""
    return not isinstance(item, str) or Path(item).suffix.lower() in IMAGE_SUFFIXES


class Composer(QPlainTextEdit):
    """The message editor: Enter sends, Shift+Enter starts a new line. A paste or drop that holds images or
    files is offered as attachments instead of being inserted as text.

    Signals:
        submitted(): Enter was pressed.
        imagesOffered(items: list): images (Pixels: a paste's, copied out) or file paths (str: images and
            documents) pasted or dropped, in order.
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

    def __init__(self, image: MessageImage | None, parent=None, picture: Pixels | None = None):
        # picture: the image's thumbnail_pixels at THUMB_SIDE (None: shown without a picture)
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
            # `picture` (thumbnail_pixels) was made in the check's worker thread: here it becomes a pixmap
            self.picture.setPixmap(pixmap_of(picture, self.devicePixelRatioF()))
            self.picture.setToolTip(f"{image.mime}, {len(image.data) / 1024:,.0f} KB")
        self.remove_button = QToolButton(self)
        self.remove_button.setText("×")
        self.remove_button.setAutoRaise(True)
        self.remove_button.setToolTip("Remove this image")
        row.addWidget(self.picture)
        row.addWidget(self.remove_button, 0, Qt.AlignmentFlag.AlignTop)


class _DocChip(QFrame):
    """A pending document: its name, size and pages, and a × that removes it. Without a document, a
    placeholder for one still being read."""

    def __init__(self, document: Document | None, parent=None, name: str = ""):
        super().__init__(parent)
        self.document = document
        self.setFrameShape(QFrame.Shape.StyledPanel)
        row = QHBoxLayout(self)
        row.setContentsMargins(4, 1, 2, 1)
        row.setSpacing(2)
        if document is None:
            self.label = QLabel(f"Reading {name}…", self)
            self.label.setToolTip("Reading the text of this document…")
        else:
            self.label = QLabel(f"\N{PAGE FACING UP} {describe_document(document)}", self)
            self.label.setToolTip(f"{len(document.text):,} characters of text")
        self.remove_button = QToolButton(self)
        self.remove_button.setText("×")
        self.remove_button.setAutoRaise(True)
        self.remove_button.setToolTip("Remove this document")
        row.addWidget(self.label)
        row.addWidget(self.remove_button)


class _CheckRelay(QObject):
    """Carries a check's result from the worker thread to the GUI thread (a queued connection).

    Signals:
        done(token: int, item: MessageImage | Document | None, picture: Pixels | None, problem: str)
    """

    done = Signal(int, object, object, str)


def check_image(item: Pixels | str, dpr: float) -> tuple[MessageImage, Pixels | None]:
    """Read and check one offered item (a pasted image's pixels or a file path) and make its thumbnail; the
    work the composer's worker thread does, with no Qt object (app.images says why).

    Raises:
        AttachmentError: the item cannot be attached (the message says why).
    """
    image = image_from_pixels(item) if isinstance(item, Pixels) else image_from_file(item)
    return image, thumbnail_pixels(image.data, THUMB_SIDE, dpr)


def _run_read(token: int, path: str, relay: _CheckRelay, stop: threading.Event) -> None:
    """One offered document's reading, on the composer's pool thread (as _run_check); `stop` set ends a
    PDF's reading at its next page (the window is closing)."""
    doc, problem = None, ""
    try:
        doc = read_document(path, stop.is_set)
    except DocumentError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - the box waits for every answer: never leave it without one
        problem = f"{Path(path).name} could not be read ({e!r})"
    with contextlib.suppress(RuntimeError):
        relay.done.emit(token, doc, None, problem)


def _run_check(token: int, item: Pixels | str, dpr: float, relay: _CheckRelay) -> None:
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
        self.notices: list[str] = []  # read, but with something to know (a guessed encoding)


class ComposerBox(QWidget):
    """The editor with its pending images and documents, a note line for refused attachments, and Attach.

    Signals:
        notice(text: str): an attachment was refused (why); also shown in the box's note line.
        checked(refused: bool): the last check running (image or document) is done; refused says whether an
            attachment offered since the box was last idle was refused (its note says which and why).
    """

    notice = Signal(str)
    checked = Signal(bool)

    def __init__(self, parent=None):
        super().__init__(parent)
        # created first, so it is destroyed (waiting for a running check) before the relay it reports to
        self._pool = QThreadPool(self)
        self._pool.setMaxThreadCount(1)  # one at a time: results come back in the order offered
        self._stop = threading.Event()  # set when the window closes: a long PDF's reading ends at a page
        self._relay = _CheckRelay(self)
        self._relay.done.connect(self._on_checked)
        self._next_token = 0
        self._pending: dict[int, tuple[_Thumb, _Offer]] = {}  # token -> (placeholder, its offer)
        self._refused = False
        self.images: list[MessageImage] = []
        self.documents: list[Document] = []
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
        self.doc_strip = QWidget(self)
        self.doc_strip.setAccessibleName("Documents to send")
        self._doc_row = QHBoxLayout(self.doc_strip)
        self._doc_row.setContentsMargins(0, 0, 0, 0)
        self._doc_row.addStretch(1)
        self.doc_strip.hide()
        self.editor = Composer(self)
        self.editor.setAccessibleName("Message")
        self.editor.setPlaceholderText("Write a message. Enter sends, Shift+Enter adds a line.")
        self.editor.setMaximumHeight(140)
        self.attach_button = QToolButton(self)
        self.attach_button.setText("Attach…")
        self.attach_button.setAccessibleName("Attach documents or images")
        self.attach_button.setAutoRaise(True)
        tools = QHBoxLayout()
        tools.addWidget(self.attach_button)
        tools.addStretch(1)
        for w in (self.note, self.strip, self.doc_strip, self.editor):
            layout.addWidget(w)
        layout.addLayout(tools)
        self.setAcceptDrops(True)  # files dropped beside the editor (on the strip, the tool row) count too
        self.attach_button.clicked.connect(self.choose_images)
        self.editor.imagesOffered.connect(self.offer)
        self.set_vision(False)

    def set_vision(self, on: bool) -> None:
        """Whether the loaded model reads images (documents go with any model)."""
        self.vision = bool(on)
        self.attach_button.setToolTip(ATTACH_TIP if self.vision else ATTACH_TIP_NO_VISION)

    @Slot()
    def choose_images(self) -> None:
        """Pick documents and image files in a dialog and attach them."""
        filters = FILE_FILTER_ALL if self.vision else f"{DOCUMENT_FILTER};;All files (*)"
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach documents or images", self.folder, filters)
        if paths:
            self.folder = str(Path(paths[0]).parent)
            self.offer(paths)

    @property
    def checking(self) -> bool:
        """Whether offered images or documents are still being checked (not in `images`/`documents` yet)."""
        return bool(self._pending)

    @Slot(object)
    def offer(self, items: list) -> None:
        """Attach images (Pixels or QImage), image files and documents (paths), in order, each checked in a
        worker thread; a placeholder holds its place meanwhile. What cannot be attached is named in the note
        once the offer's checks are done (images at once while the model reads none)."""
        if not items:
            return
        # a QImage's pixels are copied out here: no Qt object goes to the worker thread
        items = [pixels_of(item) if isinstance(item, QImage) else item for item in items]
        refuse_images = not self.vision and any(is_image_item(item) for item in items)
        if refuse_images:
            items = [item for item in items if not is_image_item(item)]
            if not items:
                self.show_note(NO_VISION)
                return
        offer = _Offer(len(items))
        if refuse_images:  # said with the documents' refusals, once they are read
            offer.problems.append(NO_VISION)
            self._refused = True
        dpr = self.devicePixelRatioF()
        for item in items:
            token = self._next_token
            self._next_token += 1
            if is_image_item(item):
                placeholder = self._insert(_Thumb(None, self.strip))
                self._pool.start(functools.partial(_run_check, token, item, dpr, self._relay))
            else:
                placeholder = self._insert_doc(_DocChip(None, self.doc_strip, Path(item).name))
                self._pool.start(functools.partial(_run_read, token, item, self._relay, self._stop))
            self._pending[token] = (placeholder, offer)
        self._relabel()

    @Slot(int, object, object, str)
    def _on_checked(self, token: int, image, picture, problem: str) -> None:
        entry = self._pending.pop(token, None)
        if entry is None:
            return  # removed, or the message went, while it was being checked
        placeholder, offer = entry
        if isinstance(image, Document):
            chip = _DocChip(image, self.doc_strip)
            chip.remove_button.clicked.connect(self._on_remove)
            self._doc_row.insertWidget(self._doc_row.indexOf(placeholder), chip)
            self.documents.append(image)  # in the order offered, as images
            if image.notice:
                offer.notices.append(image.notice)
        elif image is not None:
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
            self.show_note(" ".join(offer.problems + offer.notices))
        self._relabel()
        if not self._pending:
            refused, self._refused = self._refused, False
            self.checked.emit(refused)

    def add(self, image: MessageImage) -> None:
        """Add one image that is checked already (decoded by the caller), before those being checked."""
        self.images.append(image)
        picture = thumbnail_pixels(image.data, THUMB_SIDE, self.devicePixelRatioF())
        self._insert(_Thumb(image, self.strip, picture), before_pending=True)
        self._relabel()

    def _insert(self, thumb: _Thumb, before_pending: bool = False) -> _Thumb:
        thumb.remove_button.clicked.connect(self._on_remove)
        at = self._strip_row.count() - 1  # before the stretch
        if before_pending and self._placeholders():
            at = min(self._strip_row.indexOf(p) for p in self._placeholders())
        self._strip_row.insertWidget(at, thumb)
        self.strip.show()
        return thumb

    def _insert_doc(self, chip: _DocChip) -> _DocChip:
        chip.remove_button.clicked.connect(self._on_remove)
        self._doc_row.insertWidget(self._doc_row.count() - 1, chip)
        self.doc_strip.show()
        return chip

    def _drop(self, thumb: _Thumb | _DocChip) -> None:
        thumb.setParent(None)
        thumb.deleteLater()
        self.strip.setVisible(bool(self._thumbs() or self._placeholders()))
        self.doc_strip.setVisible(bool(self._chips(pending=None)))

    def remove(self, index: int) -> None:
        """Drop the pending image at `index`."""
        thumb = self._thumbs()[index]
        del self.images[index]
        self._drop(thumb)
        self._relabel()

    def remove_document(self, index: int) -> None:
        """Drop the pending document at `index`."""
        chip = self._chips()[index]
        del self.documents[index]
        self._drop(chip)
        self._relabel()

    @Slot()
    def _on_remove(self) -> None:
        button = self.sender()
        for i, thumb in enumerate(self._thumbs()):
            if thumb.remove_button is button:
                self.remove(i)
                return
        for i, chip in enumerate(self._chips()):
            if chip.remove_button is button:
                self.remove_document(i)
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

    def _chips(self, pending: bool | None = False) -> list[_DocChip]:
        """The document chips in order: read ones (pending False), placeholders (True) or all (None)."""
        items = (self._doc_row.itemAt(i).widget() for i in range(self._doc_row.count()))
        chips = [w for w in items if isinstance(w, _DocChip)]
        return chips if pending is None else [c for c in chips if (c.document is None) == pending]

    def _relabel(self) -> None:
        for i, thumb in enumerate(self._thumbs()):
            thumb.remove_button.setAccessibleName(f"Remove image {i + 1}")
            thumb.picture.setAccessibleName(f"Image {i + 1} to send")
        for i, thumb in enumerate(self._placeholders()):
            thumb.remove_button.setAccessibleName(f"Remove image being checked {i + 1}")
            thumb.picture.setAccessibleName(f"Image being checked {i + 1}")
        for i, chip in enumerate(self._chips()):
            chip.remove_button.setAccessibleName(f"Remove document {i + 1} ({chip.document.name})")
            chip.label.setAccessibleName(f"Document {i + 1} to send")
        for i, chip in enumerate(self._chips(pending=True)):
            chip.remove_button.setAccessibleName(f"Remove document being read {i + 1}")

    def show_note(self, text: str) -> None:
        """Show why something was not attached ("" hides the note); notice carries it to the status bar."""
        self.note.setText(text)
        self.note.setVisible(bool(text))
        if text:
            self.notice.emit(text)

    def clear(self) -> None:
        """Empty the editor and the pending images and documents (the message went); checks still running are
        forgotten."""
        self.editor.clear()
        for thumb in self._thumbs() + self._placeholders() + self._chips(pending=None):
            thumb.setParent(None)
            thumb.deleteLater()
        self.images = []
        self.documents = []
        was_checking = bool(self._pending)
        self._pending.clear()
        self.strip.hide()
        self.doc_strip.hide()
        self.show_note("")
        if was_checking:
            self._refused = False
            self.checked.emit(False)

    def shutdown(self) -> None:
        """The window is closing: drop the checks not started yet, and stop a document being read at its
        next page (a running image check, under a second, is waited for)."""
        self._stop.set()
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
