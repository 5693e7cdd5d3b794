"""The conversation column: one MessageWidget per message, in a scroll area that follows the stream.

Each message shows its role, its images (thumbnails: click one to see it whole), its documents (name,
size, pages), its Markdown
(app.markdown_view) and buttons: Copy for every message, Edit for the user's, Regenerate and Continue
for the last reply. A reply that starts with a reasoning block (engine.reasoning) shows its thinking in
a collapsed section above the answer. The view never talks to the store or the engine: it emits signals
the window forwards to the controller. A reply that read documents says which under it ("Sources:", the
file names and the chunks it got, or "whole document").
"""

from __future__ import annotations

from html import escape

from app.chat_store import Message, MessageImage, describe_document
from app.images import image_size, offered_items, thumbnail
from app.markdown_view import MarkdownView
from app.qt import (
    QDialog,
    QFrame,
    QGuiApplication,
    QHBoxLayout,
    QIcon,
    QLabel,
    QPalette,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    Qt,
    QTimer,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
    Slot,
)
from app.tool_card import PendingCallCard, ToolCallCard
from engine.document_context import sources_text
from engine.reasoning import Reasoning, split_reasoning, starts_opening

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}
STATE_NOTES = {"stopped": "stopped", "error": "interrupted", "streaming": "writing…"}
IMAGE_SIDE = 192  # a message's image thumbnails fit this square (logical pixels)


def describe_image(image: MessageImage) -> str:
    """'image/png, 640×480, 120 KB'."""
    size = image_size(image.data)
    pixels = f"{size.width()}×{size.height()}, " if size.isValid() else ""
    return f"{image.mime}, {pixels}{max(1, round(len(image.data) / 1024)):,} KB"


class ImageViewer(QDialog):
    """One image whole (scaled down to fit the screen), in its own window."""

    def __init__(self, image: MessageImage, title: str, parent=None):
        super().__init__(parent)
        self.setWindowTitle(f"{title} ({describe_image(image)})")
        screen = (parent.screen() if parent is not None else QGuiApplication.primaryScreen()).availableSize()
        side = int(min(screen.width(), screen.height()) * 0.9)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.picture = QLabel(self)
        self.picture.setAccessibleName(title)
        self.picture.setAlignment(Qt.AlignmentFlag.AlignCenter)
        pixmap = thumbnail(image.data, side, self.devicePixelRatioF())
        if pixmap.isNull():
            self.picture.setText("This image cannot be shown.")
        else:
            self.picture.setPixmap(pixmap)
        layout.addWidget(self.picture)


class MessageWidget(QFrame):
    """One message.

    Signals:
        editRequested(message_id: int, text: str): the user edited this message and pressed Resend.
        toolDecision(message_id: int, call_id: str, decision: str): a tool call card's button was pressed.
    """

    editRequested = Signal(int, str)
    toolDecision = Signal(int, str, str)

    def __init__(self, message: Message, dark: bool = False, parent=None):
        super().__init__(parent)
        self.message = message
        self.setObjectName(f"message-{message.role}")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)
        head = QHBoxLayout()
        self.role_label = QLabel(f"<b>{ROLE_NAMES.get(message.role, message.role)}</b>")
        self.state_label = QLabel("")
        self.state_label.setAccessibleName("Message state")
        head.addWidget(self.role_label)
        head.addWidget(self.state_label)
        head.addStretch(1)
        self.copy_button = self._button("Copy", "Copy this message")
        self.copy_button.clicked.connect(self.copy)
        self.edit_button = self._button("Edit", "Edit this message and send it again")
        self.edit_button.clicked.connect(self.start_edit)
        self.edit_button.setVisible(message.role == "user")
        self.regenerate_button = self._button("Regenerate", "Write this reply again")
        self.continue_button = self._button("Continue", "Let the model go on writing this reply")
        self.regenerate_button.hide()
        self.continue_button.hide()
        for b in (self.copy_button, self.edit_button, self.regenerate_button, self.continue_button):
            head.addWidget(b)
        layout.addLayout(head)
        self.image_buttons: list[QToolButton] = []
        if message.images:
            self._build_images(layout)
        self.documents_label: QLabel | None = None
        if message.documents:
            self.documents_label = QLabel(
                " · ".join(f"\N{PAGE FACING UP} {describe_document(d)}" for d in message.documents), self
            )
            self.documents_label.setAccessibleName("Attached documents")
            self.documents_label.setWordWrap(True)
            layout.addWidget(self.documents_label)
        self.viewer: ImageViewer | None = None
        self.thinking_section: QWidget | None = None
        if message.role == "assistant":
            self._build_thinking(layout)
        self._thinking_text: str | None = None
        self._answer: str | None = None  # the reply without its thinking block; None: it has none
        self.body = MarkdownView(self, dark)
        self.body.setAccessibleName(f"{ROLE_NAMES.get(message.role, message.role)} message")
        layout.addWidget(self.body)
        self.sources_label = QLabel("", self)
        self.sources_label.setAccessibleName("Sources")
        self.sources_label.setWordWrap(True)
        self.sources_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.sources_label.hide()
        layout.addWidget(self.sources_label)
        self.set_sources(message.stats.get("sources") or [])
        self.editor: QPlainTextEdit | None = None
        self.tool_cards: dict[str, ToolCallCard] = {}
        self.pending_card: PendingCallCard | None = None  # a call the streaming reply is writing
        self.set_text(message.content, immediate=True)
        self.set_state(message.state)
        if message.tool_calls:
            self.set_tool_calls(message.tool_calls, waiting=False)

    def set_tool_calls(self, calls: list[dict], waiting: bool) -> None:
        """Show the reply's tool calls as cards (added below its text, updated in place)."""
        self.message.tool_calls = calls
        self.set_pending_call(False)
        for call in calls:
            card = self.tool_cards.get(str(call.get("id")))
            if card is None:
                card = ToolCallCard(self.message.id, call, waiting, self)
                card.decided.connect(self.toolDecision)
                self.tool_cards[card.call_id] = card
                self.layout().addWidget(card)
                card.setVisible(True)  # now, not when the layout gets to it (a card of a shown message)
            else:
                card.update_call(call, waiting)

    def set_pending_call(self, pending: bool, name: str = "") -> None:
        """Show (or take away) the "Preparing a tool call…" placeholder below the reply's text."""
        if pending and self.pending_card is None:
            self.pending_card = PendingCallCard(self)
            self.layout().addWidget(self.pending_card)
            self.pending_card.setVisible(True)
        if pending:
            self.pending_card.set_name(name)
        elif self.pending_card is not None:
            self.pending_card.setParent(None)
            self.pending_card.deleteLater()
            self.pending_card = None

    def set_sources(self, sources: list[dict]) -> None:
        """Show which documents (and chunks of them) the reply read; [] hides the line."""
        text = sources_text(sources)
        self.sources_label.setText(f"<small>Sources: {escape(text)}</small>" if text else "")
        self.sources_label.setToolTip(text)
        self.sources_label.setVisible(bool(text))

    def _button(self, text: str, accessible: str) -> QToolButton:
        b = QToolButton(self)
        b.setText(text)
        b.setAccessibleName(accessible)
        b.setToolTip(accessible)
        b.setAutoRaise(True)
        return b

    def _build_images(self, layout: QVBoxLayout) -> None:
        """A row of thumbnails (aspect kept), above the text as the images went to the model."""
        row = QHBoxLayout()
        dpr = self.devicePixelRatioF()
        n = len(self.message.images)
        for i, image in enumerate(self.message.images):
            b = QToolButton(self)
            b.setAutoRaise(True)
            pixmap = thumbnail(image.data, IMAGE_SIDE, dpr)
            if pixmap.isNull():
                b.setText(f"[image: {len(image.data):,} bytes, {image.mime}, unreadable]")
            else:
                b.setIcon(QIcon(pixmap))
                b.setIconSize(pixmap.deviceIndependentSize().toSize())
            b.setAccessibleName(f"Image {i + 1} of {n}")
            b.setToolTip(f"{describe_image(image)}. Click to see it whole.")
            b.clicked.connect(self._on_image_clicked)
            self.image_buttons.append(b)
            row.addWidget(b)
        row.addStretch(1)
        layout.addLayout(row)

    @Slot()
    def _on_image_clicked(self) -> None:
        i = self.image_buttons.index(self.sender())
        self.viewer = ImageViewer(self.message.images[i], f"Image {i + 1} of {len(self.image_buttons)}", self)
        self.viewer.open()

    def _build_thinking(self, layout: QVBoxLayout) -> None:
        """The collapsible thinking section: an arrow button over a muted, selectable label."""
        self.thinking_section = QWidget(self)
        box = QVBoxLayout(self.thinking_section)
        box.setContentsMargins(0, 0, 0, 0)
        self.thinking_button = QToolButton(self.thinking_section)
        self.thinking_button.setCheckable(True)
        self.thinking_button.setArrowType(Qt.ArrowType.RightArrow)
        self.thinking_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.thinking_button.setAutoRaise(True)
        self.thinking_button.setAccessibleName("Show thinking")
        self.thinking_button.setToolTip("Show the model's thinking")
        self.thinking_button.toggled.connect(self._on_thinking_toggled)
        self.thinking_label = QLabel(self.thinking_section)
        self.thinking_label.setAccessibleName("Thinking")
        self.thinking_label.setTextFormat(Qt.TextFormat.PlainText)
        self.thinking_label.setWordWrap(True)
        self.thinking_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.thinking_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)  # muted, follows the theme
        font = self.thinking_label.font()
        font.setItalic(True)
        self.thinking_label.setFont(font)
        self.thinking_label.hide()
        box.addWidget(self.thinking_button, 0, Qt.AlignmentFlag.AlignLeft)
        box.addWidget(self.thinking_label)
        self.thinking_section.hide()
        layout.addWidget(self.thinking_section)

    def set_text(self, text: str, immediate: bool = False) -> None:
        """Show `text` (raw, streaming or whole); a reply's thinking goes above, its answer in the body."""
        self.message.content = text
        if self.thinking_section is not None:
            split = split_reasoning(text)
            self._show_thinking(split)
            self._answer = None if split.thinking is None else split.answer
            text = split.answer
            if self.message.state == "streaming" and split.thinking is None and starts_opening(text):
                text = ""  # "<thi" may be a thinking block arriving in pieces: show it once it is one
            if self.body.isHidden() == bool(text or split.thinking is None):
                self.body.setVisible(bool(text or split.thinking is None))  # no empty box while thinking
        elif (self.message.images or self.message.documents) and self.editor is None:
            self.body.setVisible(bool(text))  # attachments alone: no empty text box under them
        self.body.set_markdown_text(text, immediate=immediate)

    def _show_thinking(self, split: Reasoning) -> None:
        # called on every streamed piece: a widget is touched only when what it shows changes
        has = split.thinking is not None
        if self.thinking_section.isHidden() == has:
            self.thinking_section.setVisible(has)
        if not has:
            return
        title = "Thoughts" if split.thinking_done else "Thinking…"
        if self.thinking_button.text() != title:
            self.thinking_button.setText(title)
        if split.thinking != self._thinking_text:
            self._thinking_text = split.thinking
            self.thinking_label.setText(split.thinking)

    @Slot(bool)
    def _on_thinking_toggled(self, shown: bool) -> None:
        self.thinking_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        self.thinking_label.setVisible(shown)

    def set_state(self, state: str) -> None:
        self.message.state = state
        self.state_label.setText(STATE_NOTES.get(state, ""))

    @Slot()
    def copy(self) -> None:
        """Copy the message; of a reply with a thinking block, just its answer."""
        QGuiApplication.clipboard().setText(self.message.content if self._answer is None else self._answer)

    @Slot()
    def start_edit(self) -> None:
        """Swap the rendered text for an editor with Resend / Cancel."""
        if self.editor is not None:
            return
        self.editor = QPlainTextEdit(self)
        self.editor.setAccessibleName("Edit message")
        self.editor.setPlainText(self.message.content)
        row = QHBoxLayout()
        resend = QPushButton("Resend", self)
        resend.setAccessibleName("Send the edited message")
        cancel = QPushButton("Cancel", self)
        resend.clicked.connect(self._resend)
        cancel.clicked.connect(self._cancel_edit)
        row.addStretch(1)
        row.addWidget(cancel)
        row.addWidget(resend)
        self._edit_row = QWidget(self)
        self._edit_row.setLayout(row)
        self.layout().addWidget(self.editor)
        self.layout().addWidget(self._edit_row)
        self.body.hide()
        self.editor.setFocus()

    @Slot()
    def _resend(self) -> None:
        if self.editor is not None:
            self.editRequested.emit(self.message.id, self.editor.toPlainText())

    @Slot()
    def _cancel_edit(self) -> None:
        if self.editor is not None:
            self.editor.deleteLater()
            self._edit_row.deleteLater()
            self.editor = None
            attached = self.message.images or self.message.documents
            self.body.setVisible(bool(self.message.content) or not attached)


class ChatView(QScrollArea):
    """The messages of the current chat.

    Signals:
        editRequested(message_id: int, text: str)
        regenerateRequested()
        continueRequested()
        imagesDropped(items: list): images or files (images, documents) dropped on the conversation (for the
            composer)
        toolDecision(message_id: int, call_id: str, decision: str): Allow once / Always allow / Deny
    """

    editRequested = Signal(int, str)
    toolDecision = Signal(int, str, str)
    regenerateRequested = Signal()
    continueRequested = Signal()
    imagesDropped = Signal(list)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setAccessibleName("Conversation")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.dark = False
        self._inner = QWidget()
        self._column = QVBoxLayout(self._inner)
        self._column.setContentsMargins(12, 12, 12, 12)
        self._column.setSpacing(8)
        self.notice_label = QLabel("")
        self.notice_label.setWordWrap(True)
        self.notice_label.setAccessibleName("Notice")
        self.notice_label.hide()
        self._column.addStretch(1)
        self._column.addWidget(self.notice_label)
        self.setWidget(self._inner)
        self.widgets: dict[int, MessageWidget] = {}
        self._follow = True
        self.setAcceptDrops(True)  # a picture dropped anywhere on the chat goes to the composer
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.verticalScrollBar().rangeChanged.connect(self._on_range)

    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt override
        if offered_items(event.mimeData()):
            event.acceptProposedAction()

    def dragMoveEvent(self, event) -> None:  # noqa: N802 - Qt override
        if offered_items(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt override
        items = offered_items(event.mimeData())
        if items:
            event.acceptProposedAction()
            self.imagesDropped.emit(items)

    def clear(self) -> None:
        for w in self.widgets.values():
            w.setParent(None)
            w.deleteLater()
        self.widgets.clear()
        self.show_notice("")
        self._follow = True

    def set_messages(self, messages: list[Message]) -> None:
        """Show a whole chat."""
        self.clear()
        for m in messages:
            self.add_message(m, update=False)
        self._update_actions()

    def add_message(self, message: Message, update: bool = True) -> MessageWidget:
        w = MessageWidget(message, self.dark, self._inner)
        w.editRequested.connect(self.editRequested)
        w.toolDecision.connect(self.toolDecision)
        w.regenerate_button.clicked.connect(self.regenerateRequested)
        w.continue_button.clicked.connect(self.continueRequested)
        self._column.insertWidget(self._column.count() - 1, w)
        self.widgets[message.id] = w
        if update:
            self._follow = True
            self._update_actions()
        return w

    def set_text(self, message_id: int, text: str) -> None:
        w = self.widgets.get(message_id)
        if w is not None:
            w.set_text(text)

    @Slot(object, bool)
    def show_tool_calls(self, message: Message, waiting: bool) -> None:
        """A reply's tool calls changed (controller.toolCallsChanged)."""
        w = self.widgets.get(message.id)
        if w is not None:
            w.set_tool_calls(message.tool_calls, waiting)
            self._follow = True

    @Slot(int, bool, str)
    def show_pending_call(self, message_id: int, pending: bool, name: str) -> None:
        """The streaming reply started (or stopped) writing a tool call (controller.toolCallPending)."""
        w = self.widgets.get(message_id)
        if w is not None:
            w.set_pending_call(pending, name)

    @Slot(object)
    def show_sources(self, message: Message) -> None:
        """The streaming reply's Sources line (controller.sourcesChanged)."""
        w = self.widgets.get(message.id)
        if w is not None:
            w.set_sources(message.stats.get("sources") or [])

    def finish(self, message: Message) -> None:
        w = self.widgets.get(message.id)
        if w is not None:
            w.set_pending_call(False)
            w.set_state(message.state)  # first: a finished reply shows all its text
            w.set_sources(message.stats.get("sources") or [])
            w.set_text(message.content, immediate=True)
        self._update_actions()

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._update_actions()

    def show_notice(self, text: str) -> None:
        self.notice_label.setText(text)
        self.notice_label.setVisible(bool(text))

    def _update_actions(self) -> None:
        busy = getattr(self, "_busy", False)
        items = list(self.widgets.values())
        for i, w in enumerate(items):
            last = i == len(items) - 1
            is_reply = w.message.role == "assistant"
            w.regenerate_button.setVisible(last and is_reply and not busy)
            can_continue = bool(w.message.content) and not w.message.tool_calls
            w.continue_button.setVisible(last and is_reply and not busy and can_continue)
            w.edit_button.setVisible(w.message.role == "user" and not busy)

    @Slot(int)
    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 24

    @Slot(int, int)
    def _on_range(self, lo: int, hi: int) -> None:
        if self._follow:
            QTimer.singleShot(0, self._to_bottom)

    @Slot()
    def _to_bottom(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())
