"""The composer: the message editor, the images waiting to go with the message, and Attach image.

Images come from the Attach image button (a file dialog), a paste (an image, or files copied in a file
manager) or files dropped on the composer. They wait as thumbnails above the editor, each removable, and
go with the next message. Only a model that reads images (ModelInfo.vision) takes them: otherwise the
button is disabled and says why, and a pasted or dropped image is refused with a note, never dropped
silently. A refused file (not an image, over 20 MB) is named in the note; the typed text stays.
"""

from __future__ import annotations

from pathlib import Path

from app.chat_store import MessageImage
from app.images import (
    FILE_FILTER,
    AttachmentError,
    image_from_file,
    image_from_qimage,
    offered_items,
    thumbnail,
)
from app.qt import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QImage,
    QLabel,
    QPlainTextEdit,
    Qt,
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
    """A pending image: its thumbnail and a × that removes it."""

    def __init__(self, image: MessageImage, parent=None):
        super().__init__(parent)
        self.image = image
        self.setFrameShape(QFrame.Shape.StyledPanel)
        row = QHBoxLayout(self)
        row.setContentsMargins(2, 2, 2, 2)
        row.setSpacing(0)
        self.picture = QLabel(self)
        self.picture.setPixmap(thumbnail(image.data, THUMB_SIDE, self.devicePixelRatioF()))
        self.picture.setToolTip(f"{image.mime}, {len(image.data) / 1024:,.0f} KB")
        self.remove_button = QToolButton(self)
        self.remove_button.setText("×")
        self.remove_button.setAutoRaise(True)
        self.remove_button.setToolTip("Remove this image")
        row.addWidget(self.picture)
        row.addWidget(self.remove_button, 0, Qt.AlignmentFlag.AlignTop)


class ComposerBox(QWidget):
    """The editor with its pending images, a note line for refused attachments, and Attach image.

    Signals:
        notice(text: str): an attachment was refused (why); also shown in the box's note line.
    """

    notice = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
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

    @Slot(object)
    def offer(self, items: list) -> None:
        """Attach images (QImage) and image files (paths), in order; what cannot be attached is named in the
        note (all of it while the model reads no images)."""
        if not self.vision:
            self.show_note(NO_VISION)
            return
        problems = []
        for item in items:
            try:
                self.add(image_from_qimage(item) if isinstance(item, QImage) else image_from_file(item))
            except AttachmentError as e:
                problems.append(str(e))
        self.show_note(" ".join(problems))

    def add(self, image: MessageImage) -> None:
        """Add one pending image."""
        self.images.append(image)
        thumb = _Thumb(image, self.strip)
        thumb.remove_button.clicked.connect(self._on_remove)
        self._strip_row.insertWidget(self._strip_row.count() - 1, thumb)
        self._relabel()
        self.strip.show()

    def remove(self, index: int) -> None:
        """Drop the pending image at `index`."""
        thumb = self._thumbs()[index]
        del self.images[index]
        thumb.setParent(None)
        thumb.deleteLater()
        self._relabel()
        self.strip.setVisible(bool(self.images))

    @Slot()
    def _on_remove(self) -> None:
        button = self.sender()
        for i, thumb in enumerate(self._thumbs()):
            if thumb.remove_button is button:
                self.remove(i)
                return

    def _thumbs(self) -> list[_Thumb]:
        items = (self._strip_row.itemAt(i).widget() for i in range(self._strip_row.count()))
        return [w for w in items if isinstance(w, _Thumb)]

    def _relabel(self) -> None:
        for i, thumb in enumerate(self._thumbs()):
            thumb.remove_button.setAccessibleName(f"Remove image {i + 1}")
            thumb.picture.setAccessibleName(f"Image {i + 1} to send")

    def show_note(self, text: str) -> None:
        """Show why something was not attached ("" hides the note); notice carries it to the status bar."""
        self.note.setText(text)
        self.note.setVisible(bool(text))
        if text:
            self.notice.emit(text)

    def clear(self) -> None:
        """Empty the editor and the pending images (the message went)."""
        self.editor.clear()
        for thumb in self._thumbs():
            thumb.setParent(None)
            thumb.deleteLater()
        self.images = []
        self.strip.hide()
        self.show_note("")

    # ---- drops on the box around the editor (the editor handles its own, through insertFromMimeData)
    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt override
        if offered_items(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt override
        items = offered_items(event.mimeData())
        if items:
            event.acceptProposedAction()
            self.offer(items)
