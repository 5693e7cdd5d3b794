"""Rendering a Markdown reply as it streams, without re-laying-out what is already on screen.

A reply is split into *stable* blocks (everything before the last blank line outside a code fence, or
before the end of a closed fence) and a *tail* (the block still being written). Stable blocks are
rendered once, appended to the document as fragments; only the tail is replaced on each update, so
the cost of an update does not grow with the reply's length and Qt lays out only the changed end.
Updates are throttled (RENDER_INTERVAL_MS). Closed code fences get a "Copy code" link.
"""

from __future__ import annotations

import re

from app.highlight import CodeHighlighter
from app.qt import (
    QFrame,
    QGuiApplication,
    QSizePolicy,
    QTextBlockFormat,
    QTextBrowser,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextDocumentFragment,
    QTimer,
    QUrl,
    Signal,
    Slot,
)

RENDER_INTERVAL_MS = 60
COPY_SCHEME = "hearth-copy"
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def split_stable(text: str) -> tuple[list[str], str]:
    """Split Markdown into complete blocks and the unfinished tail.

    Returns:
        (blocks, tail): blocks end at a blank line outside a fence or at a closed fence's last line;
        joining blocks and tail gives back `text` (blocks keep their own trailing newlines).
    """
    blocks: list[str] = []
    start = 0
    fence: str | None = None
    pos = 0
    lines = text.splitlines(keepends=True)
    for line in lines:
        end = pos + len(line)
        complete = line.endswith("\n")
        m = _FENCE.match(line)
        if fence is None:
            if m and complete:
                fence = m.group(1)
                if pos > start:  # text before the fence is a block of its own
                    blocks.append(text[start:pos])
                    start = pos
            elif complete and not line.strip() and pos > start:
                blocks.append(text[start:end])
                start = end
        elif (
            m
            and complete
            and m.group(1)[0] == fence[0]
            and len(m.group(1)) >= len(fence)
            and not line[m.end() :].strip()
        ):
            fence = None
            blocks.append(text[start:end])
            start = end
        pos = end
    return blocks, text[start:]


def fences(text: str) -> list[str]:
    """The code of each closed fenced block of `text`, in order."""
    out, code, fence = [], [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence, code = m.group(1), []
        elif (
            m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line[m.end() :].strip()
        ):
            out.append("\n".join(code))
            fence = None
        else:
            code.append(line)
    return out


def _close_open_fence(tail: str) -> str:
    """The tail, with an open fence closed so it renders as code while it streams."""
    blocks, rest = split_stable(tail + "\n")
    del blocks
    m = _FENCE.match(rest)
    if m:
        return tail.rstrip("\n") + "\n" + m.group(1) + "\n"
    return tail


# GitHub's dialect with raw HTML shown as text: a reply that writes "<think>" or "<div>" outside a code
# span would otherwise lose the tag and the rest of its paragraph (Qt takes it for markup)
_FEATURE = QTextDocument.MarkdownFeature
MARKDOWN_FEATURES = _FEATURE(_FEATURE.MarkdownDialectGitHub.value | _FEATURE.MarkdownNoHTML.value)


class MarkdownView(QTextBrowser):
    """A read-only Markdown view that grows with its content (no scroll bar of its own).

    Signals:
        codeCopied(code: str): a "Copy code" link was followed; the code is on the clipboard.
    """

    codeCopied = Signal(str)

    def __init__(self, parent=None, dark: bool = False):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        self.setVerticalScrollBarPolicy(self.verticalScrollBarPolicy().ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(self.horizontalScrollBarPolicy().ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.highlighter = CodeHighlighter(self.document(), dark)
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self.source_text = ""
        self._rendered_blocks: list[str] = []
        self._tail_start = 0  # document position where the tail's rendering begins
        self._fence_count = 0
        self._pending: str | None = None
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(RENDER_INTERVAL_MS)
        self._timer.timeout.connect(self.render_pending)
        self.renders = 0  # how many times the tail was rendered (tests check the throttle)

    # ---- public
    def set_markdown_text(self, text: str, immediate: bool = False) -> None:
        """Show `text`; while it only grows, just the new part is rendered (throttled unless immediate)."""
        self._pending = text
        if immediate:
            self._timer.stop()
            self.render_pending()
        elif not self._timer.isActive():
            self._timer.start()

    @Slot()
    def render_pending(self) -> None:
        """Render the latest text now."""
        text, self._pending = self._pending, None
        if text is None:
            return
        if not text.startswith("".join(self._rendered_blocks)):
            self._reset()
        self.source_text = text
        blocks, tail = split_stable(text)
        doc = self.document()
        cursor = QTextCursor(doc)
        cursor.beginEditBlock()
        cursor.setPosition(self._tail_start)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        for block in blocks[len(self._rendered_blocks) :]:
            md = block
            if _FENCE.match(block):
                md = block.rstrip("\n") + f"\n\n[Copy code]({COPY_SCHEME}:{self._fence_count})\n"
                self._fence_count += 1
            self._append(cursor, md)
            self._rendered_blocks.append(block)
        self._tail_start = self._end_position()
        if tail.strip():
            self._append(cursor, _close_open_fence(tail))
        cursor.endEditBlock()
        self.renders += 1

    def plain_text(self) -> str:
        return self.document().toPlainText()

    # ---- internals
    def _reset(self) -> None:
        self.document().clear()
        self._rendered_blocks = []
        self._tail_start = 0
        self._fence_count = 0

    def _end_position(self) -> int:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor.position()

    def _append(self, cursor: QTextCursor, markdown: str) -> None:
        """Append a Markdown fragment as its own block(s), keeping its first block's format."""
        tmp = QTextDocument()
        tmp.setMarkdown(markdown, MARKDOWN_FEATURES)
        if tmp.isEmpty():
            return
        doc = self.document()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if not doc.isEmpty():
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        start = cursor.position()
        cursor.insertFragment(QTextDocumentFragment(tmp))
        # the fragment's first block merged into the block inserted above: give it its own format back
        first = tmp.begin()
        fix = QTextCursor(doc)
        fix.setPosition(start)
        if start > 0 and not fix.block().text() and fix.block().next().isValid() and first.text():
            # Qt kept the fragment's first block separate (lists do): drop the empty block made above
            fix.setPosition(start - 1)
            fix.setPosition(start, QTextCursor.MoveMode.KeepAnchor)
            fix.removeSelectedText()
            cursor.movePosition(QTextCursor.MoveOperation.End)
            return
        fix.setBlockFormat(first.blockFormat())
        if first.textList() is not None:
            nxt = fix.block().next()
            if nxt.isValid() and nxt.textList() is not None and fix.block().textList() is None:
                nxt.textList().add(fix.block())
            elif fix.block().textList() is None:
                fix.createList(first.textList().format())
        cursor.movePosition(QTextCursor.MoveOperation.End)

    @Slot()
    def _fit_height(self, *args) -> None:
        h = (
            int(self.document().size().height())
            + self.contentsMargins().top()
            + self.contentsMargins().bottom()
        )
        if h != self.height():
            self.setFixedHeight(max(h, 8))

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        width = self.viewport().width()
        if width != self.document().textWidth():  # a height change must not re-lay-out the whole reply
            self.document().setTextWidth(width)

    @Slot(QUrl)
    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == COPY_SCHEME:
            try:
                code = fences(self.source_text)[int(url.path())]
            except (ValueError, IndexError):
                return
            QGuiApplication.clipboard().setText(code)
            self.codeCopied.emit(code)
        elif url.scheme() in ("http", "https"):
            from app.qt import QDesktopServices

            QDesktopServices.openUrl(url)
