"""A tool call in the conversation: the tool's name, its arguments as formatted JSON, the user's choice
(Allow once / Always allow for this tool / Deny) while it waits, then what came of it (the result,
collapsed until asked for). While the model is still writing a call, a placeholder in the same style
(`PendingCallCard`) stands where its card will be.
"""

from __future__ import annotations

import json

from app.qt import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    Qt,
    QToolButton,
    QVBoxLayout,
    Signal,
    Slot,
)
from engine.tool_loop import ALLOW_ALWAYS, ALLOW_ONCE, CANCELLED, DENY

SHOWN_RESULT_CHARS = 100_000  # a longer result is cut in the card (the store keeps it whole)


class ToolCallCard(QFrame):
    """One tool call of a reply.

    Args:
        message_id: the reply the call belongs to.
        call: engine.tool_loop.CallOutcome.to_dict() of the call.
        waiting: the reply's calls are under way (a call without a decision shows the buttons).

    Signals:
        decided(message_id: int, call_id: str, decision: str): a button was pressed (ALLOW_ONCE,
            ALLOW_ALWAYS or DENY of engine.tool_loop).
    """

    decided = Signal(int, str, str)

    def __init__(self, message_id: int, call: dict, waiting: bool = False, parent=None):
        super().__init__(parent)
        self.message_id = message_id
        self.call_id = str(call.get("id", ""))
        self.setObjectName("tool-call")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setAccessibleName(f"Tool call {call.get('name')}")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)
        self.title = QLabel(f"Tool call: <b>{call.get('name')}</b>")
        self.title.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(self.title)
        self.arguments = QPlainTextEdit(json.dumps(call.get("arguments") or {}, indent=2, ensure_ascii=False))
        self.arguments.setReadOnly(True)
        self.arguments.setAccessibleName("Tool call arguments")
        lines = self.arguments.toPlainText().count("\n") + 1
        self.arguments.setFixedHeight(min(12, lines + 1) * self.fontMetrics().lineSpacing() + 12)
        layout.addWidget(self.arguments)
        self.buttons = QHBoxLayout()
        self.allow_once = QPushButton("Allow once")
        self.allow_always = QPushButton("Always allow for this tool")
        self.deny = QPushButton("Deny")
        choices = ((self.allow_once, ALLOW_ONCE), (self.allow_always, ALLOW_ALWAYS), (self.deny, DENY))
        for button, decision in choices:
            button.setAccessibleName(f"{button.text()}: {call.get('name')}")
            button.clicked.connect(lambda _=False, d=decision: self._decide(d))
            self.buttons.addWidget(button)
        self.buttons.addStretch(1)
        layout.addLayout(self.buttons)
        self.status = QLabel("")
        self.status.setAccessibleName("Tool call status")
        layout.addWidget(self.status)
        self.result_button = QToolButton()
        self.result_button.setText("Result")
        self.result_button.setCheckable(True)
        self.result_button.setArrowType(Qt.ArrowType.RightArrow)
        self.result_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.result_button.setAutoRaise(True)
        self.result_button.setAccessibleName("Show the tool's result")
        self.result_button.toggled.connect(self._on_result_toggled)
        layout.addWidget(self.result_button)
        self.result = QPlainTextEdit()
        self.result.setReadOnly(True)
        self.result.setAccessibleName("Tool result")
        self.result.hide()
        layout.addWidget(self.result)
        self.update_call(call, waiting)

    def update_call(self, call: dict, waiting: bool) -> None:
        """Show the call's current state."""
        decision, done = call.get("decision", ""), bool(call.get("done"))
        asking = waiting and not decision
        for b in (self.allow_once, self.allow_always, self.deny):
            b.setVisible(asking)
        result = str(call.get("result", ""))
        if asking:
            status = "Waiting for your decision."
        elif decision == DENY:
            status = "Denied."
        elif not done and waiting:
            status = "Running…"
        elif not done or result == CANCELLED:
            status = "Stopped."
        elif call.get("is_error"):
            status = "Failed."
        else:
            status = "Done" + (" (always allowed)." if decision == ALLOW_ALWAYS else ".")
        self.status.setText(status)
        has_result = done and decision != DENY and bool(result)
        self.result_button.setVisible(has_result)
        if has_result:
            shown = result[:SHOWN_RESULT_CHARS]
            if len(result) > SHOWN_RESULT_CHARS:
                shown += f"\n[... {len(result) - SHOWN_RESULT_CHARS:,} more characters not shown]"
            if self.result.toPlainText() != shown:
                self.result.setPlainText(shown)
            label = f"Result ({len(result):,} characters)" if len(result) > 200 else "Result"
            self.result_button.setText(label)
        else:
            self.result.hide()

    def _decide(self, decision: str) -> None:
        for b in (self.allow_once, self.allow_always, self.deny):
            b.setEnabled(False)  # one answer per call, even with a double click
        self.decided.emit(self.message_id, self.call_id, decision)

    @Slot(bool)
    def _on_result_toggled(self, shown: bool) -> None:
        self.result_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        self.result.setVisible(shown)


class PendingCallCard(QFrame):
    """A tool call the streaming reply is writing: "Preparing a tool call…" (with the tool's name once it
    has arrived) until the reply ends and the call's own card (ToolCallCard) replaces it."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("tool-call")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setAccessibleName("Tool call being prepared")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)
        self.status = QLabel("Preparing a tool call…")
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.status.setAccessibleName("Tool call status")
        layout.addWidget(self.status)

    def set_name(self, name: str) -> None:
        text = f"Preparing a tool call: {name}…" if name else "Preparing a tool call…"
        if self.status.text() != text:
            self.status.setText(text)
