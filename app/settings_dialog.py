"""The settings dialog, generated from app.settings.SCHEMA (one editor per field, grouped by section).

Choices become combo boxes, ints/floats spin boxes with the schema's limits, bools check boxes, folders
and files a line edit with a Browse button; the quantization field is a picker showing bits per weight,
the estimated size for the current model and a plain-language hint. The Tools tab adds the MCP servers of
mcp.json, each with its own switch and, once running, its tools (or why it is not running), and an
"Edit mcp.json…" button. OK validates everything through Settings.update (one write); Cancel changes nothing.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from app import quant_info
from app.controller import model_display_name
from app.qt import (
    QCheckBox,
    QComboBox,
    QDesktopServices,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QObject,
    QPushButton,
    QSpinBox,
    Qt,
    QTabWidget,
    QTreeWidget,
    QTreeWidgetItem,
    QUrl,
    QVBoxLayout,
    QWidget,
    Signal,
    Slot,
)
from app.settings import SCHEMA, SEARCH_AUTO, SEARCH_KEYWORDS, Settings, SettingsError, default


class _Relay(QObject):
    drafts = Signal(object)  # list[engine.draft_pairing.DraftCandidate], from a worker thread


class SettingsDialog(QDialog):
    """Edit the settings. `editors[key]` is the widget of each setting (tests drive them)."""

    def __init__(
        self,
        settings: Settings,
        parent=None,
        model_params: int | None = None,
        cuda_available: bool = False,
        cuda_reason: str = "",
        model_path: str | None = None,
        tools=None,
    ):
        super().__init__(parent)
        self.tools = tools  # app.tools.ToolManager: the servers' state for the Tools tab (None: not shown)
        self.model_path = model_path
        self.draft_suggestions: QComboBox | None = None  # filled with draft_candidates(model_path)
        self._relay = _Relay()
        self._relay.drafts.connect(self._on_drafts)
        self.setWindowTitle("Settings")
        self.setAccessibleName("Settings")
        self.settings = settings
        self.model_params = model_params
        self.cuda_reason = cuda_reason or "CUDA is not available on this computer."
        self.editors: dict[str, QWidget] = {}
        self.error_label = QLabel("")
        self.error_label.setWordWrap(True)
        tabs = QTabWidget(self)
        forms: dict[str, QFormLayout] = {}
        for key, f in SCHEMA.items():
            meta = f.metadata
            if meta.get("hidden"):
                continue
            section = meta["section"]
            if section not in forms:
                page = QWidget()
                forms[section] = QFormLayout(page)
                tabs.addTab(page, section)
            editor, row = self._editor(key, meta, settings.get(key), cuda_available)
            editor.setAccessibleName(meta["label"])
            editor.setToolTip(meta["description"])
            self.editors[key] = editor
            forms[section].addRow(meta["label"], row)
            if key == "quant_format":
                self.quant_hint = QLabel("")
                self.quant_hint.setWordWrap(True)
                self.quant_hint.setAccessibleName("Quantization hint")
                forms[section].addRow("", self.quant_hint)
                editor.currentIndexChanged.connect(self._quant_changed)
                self._quant_changed()
            if key == "device" and not cuda_available:
                self.device_note = QLabel(f"CUDA: {self.cuda_reason}")
                self.device_note.setWordWrap(True)
                self.device_note.setAccessibleName("Why CUDA is unavailable")
                forms[section].addRow("", self.device_note)
        self.servers: QTreeWidget | None = None
        if "Tools" in forms:
            self._build_servers(forms["Tools"])
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok
            | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.RestoreDefaults
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self.restore_defaults)
        layout = QVBoxLayout(self)
        layout.addWidget(tabs)
        layout.addWidget(self.error_label)
        layout.addWidget(buttons)

    def _build_servers(self, form: QFormLayout) -> None:
        """The MCP servers of mcp.json: a switch each, their tools (or errors) below, and Edit mcp.json…"""
        self.servers = QTreeWidget()
        self.servers.setHeaderLabels(["MCP server / tool", "Details"])
        self.servers.setAccessibleName("MCP servers")
        self.servers.setMinimumHeight(160)
        form.addRow(self.servers)
        row = QWidget()
        h = QHBoxLayout(row)
        h.setContentsMargins(0, 0, 0, 0)
        self.edit_mcp_button = QPushButton("Edit mcp.json…")
        self.edit_mcp_button.setAccessibleName("Edit mcp.json")
        self.edit_mcp_button.setToolTip("Open mcp.json (Claude Desktop's format) in your editor")
        self.edit_mcp_button.clicked.connect(self.edit_mcp_json)
        reload = QPushButton("Reload")
        reload.setAccessibleName("Read mcp.json again")
        reload.clicked.connect(self.refresh_servers)
        h.addWidget(self.edit_mcp_button)
        h.addWidget(reload)
        h.addStretch(1)
        form.addRow(row)
        try:
            self._disabled = set(json.loads(self.settings.get("mcp_disabled") or "[]"))
        except ValueError:
            self._disabled = set()
        self.refresh_servers()

    @Slot()
    def refresh_servers(self) -> None:
        """Fill the server list from mcp.json and the running servers' tools and errors."""
        from engine.mcp_client import MCPConfigError, config_path, load_config

        if self.servers is None:
            return
        self._disabled = self._all_disabled()  # keep the switches the user changed in this dialog
        self.servers.clear()
        try:
            configs = load_config(config_path())
        except MCPConfigError as e:
            QTreeWidgetItem(self.servers, ["mcp.json", str(e)])
            return
        if not configs:
            QTreeWidgetItem(self.servers, ["(no servers)", f"add them to {config_path()}"])
            return
        running = {}
        errors = {}
        if self.tools is not None:
            for t in self.tools.tools():
                running.setdefault(t.server, []).append(t)
            errors = self.tools.errors()
        for name, c in configs.items():
            where = c.url or " ".join([c.command, *c.args])
            item = QTreeWidgetItem(self.servers, [name, where])
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            off = name in self._disabled
            item.setCheckState(0, Qt.CheckState.Unchecked if off else Qt.CheckState.Checked)
            item.setData(0, Qt.ItemDataRole.UserRole, name)
            for t in running.get(name, []):
                QTreeWidgetItem(item, [t.name, t.description.splitlines()[0] if t.description else ""])
            if name in errors:
                QTreeWidgetItem(item, ["(not running)", errors[name]])
            item.setExpanded(True)

    def disabled_servers(self) -> list[str]:
        """The servers whose switch is off."""
        out = []
        for i in range(self.servers.topLevelItemCount() if self.servers is not None else 0):
            item = self.servers.topLevelItem(i)
            name = item.data(0, Qt.ItemDataRole.UserRole)
            if name and item.checkState(0) == Qt.CheckState.Unchecked:
                out.append(name)
        return out

    @Slot()
    def edit_mcp_json(self) -> Path:
        """Open mcp.json in the system's editor (an empty one is created first)."""
        from engine.mcp_client import write_default_config

        path = write_default_config()
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))
        return path

    def _editor(self, key: str, meta: dict, value: Any, cuda: bool) -> tuple[QWidget, QWidget]:
        kind = type(default(key))
        if meta.get("kind") == "embedding_model":
            box = self._search_box(str(value))
            return box, box
        if meta.get("kind") == "quant":
            box = QComboBox()
            for c in quant_info.choices():
                box.addItem(f"{c.name}  ({c.bits:.2f} bits/weight)", c.name)
            if box.findData(value) < 0:
                box.addItem(str(value), value)
            box.setCurrentIndex(box.findData(value))
            return box, box
        if meta.get("choices"):
            box = QComboBox()
            for choice in meta["choices"]:
                box.addItem(choice, choice)
                if key == "device" and choice == "cuda" and not cuda:
                    item = box.model().item(box.count() - 1)
                    item.setEnabled(False)
                    item.setToolTip(self.cuda_reason)
                    box.setItemText(box.count() - 1, "cuda (unavailable)")
            index = box.findData(value)
            if key == "device" and value == "cuda" and not cuda:
                index = box.findData("cpu")  # a saved "cuda" runs on the CPU until CUDA is there
            box.setCurrentIndex(max(0, index))
            return box, box
        if kind is bool:
            check = QCheckBox()
            check.setChecked(bool(value))
            return check, check
        if kind is int:
            spin = QSpinBox()
            spin.setRange(int(meta.get("min", -(2**31))), int(meta.get("max", 2**31 - 1)))
            spin.setValue(int(value))
            if key in ("threads", "font_size"):
                spin.setSpecialValueText("automatic" if key == "threads" else "system")
            if key == "gpu_layers":
                spin.setSpecialValueText("all")  # -1, the minimum
                if not cuda:
                    spin.setEnabled(False)
                    spin.setToolTip(self.cuda_reason)
            return spin, spin
        if kind is float:
            spin = QDoubleSpinBox()
            spin.setDecimals(2)
            spin.setSingleStep(0.05)
            spin.setRange(float(meta.get("min", -1e9)), float(meta.get("max", 1e9)))
            spin.setValue(float(value))
            return spin, spin
        line = QLineEdit(str(value))
        if meta.get("kind") in ("dir", "path", "model"):
            row = QWidget()
            h = QHBoxLayout(row)
            h.setContentsMargins(0, 0, 0, 0)
            h.addWidget(line)
            browse = QPushButton("Browse…")
            browse.setAccessibleName(f"Browse for {meta['label']}")
            kind_name = meta.get("kind") or ""
            browse.clicked.connect(lambda _=False, ln=line, k=kind_name: self._browse(ln, k))
            h.addWidget(browse)
            if key == "draft_model":
                h.addWidget(self._draft_box(line))
            return line, row
        return line, line

    def _search_box(self, value: str) -> QComboBox:
        """Automatic, Keywords only, and the library's embedding models (and the saved one, should it no
        longer be in the library)."""
        from models.library import Library

        box = QComboBox()
        box.addItem("Automatic (the library's first embedding model)", SEARCH_AUTO)
        box.addItem("Keywords only", SEARCH_KEYWORDS)
        try:
            found = Library().embedding_models()
        except Exception:  # noqa: BLE001 - an unreadable library lists none
            found = []
        for entry in found:
            box.addItem(f"{model_display_name(entry.path)} · {entry.size / 2**20:,.0f} MiB", entry.path)
        if box.findData(value) < 0:
            box.addItem(f"{model_display_name(value)} (not in the library)", value)
        box.setCurrentIndex(box.findData(value))
        return box

    def _draft_box(self, line: QLineEdit) -> QComboBox:
        """Local models that can draft for the loaded one, smallest first; picking one fills `line`."""
        box = QComboBox()
        box.setAccessibleName("Compatible draft models")
        box.addItem("finding compatible drafts…" if self.model_path else "load a model to see drafts", "")
        box.setEnabled(False)
        box.activated.connect(lambda i, b=box, ln=line: b.itemData(i) and ln.setText(b.itemData(i)))
        self.draft_suggestions = box
        if self.model_path:
            # reading every library model's tokenizer takes a while: off the GUI thread
            threading.Thread(target=self._find_drafts, daemon=True, name="hearth-drafts").start()
        return box

    def _find_drafts(self) -> None:
        from engine.draft_pairing import draft_candidates

        try:
            found = draft_candidates(Path(self.model_path))
        except (OSError, ValueError):
            found = []
        self._relay.drafts.emit(found)

    @Slot(object)
    def _on_drafts(self, found) -> None:
        box = self.draft_suggestions
        box.clear()
        if not found:
            box.addItem("no compatible draft in the library", "")
            return
        box.addItem(f"{len(found)} compatible draft{'s' if len(found) > 1 else ''}…", "")
        for c in found:
            same = ", same model" if c.same_model else ""
            box.addItem(f"{c.name} · {c.quantization} · {c.size_bytes / 2**20:,.0f} MiB{same}", str(c.path))
        box.setEnabled(True)

    def _browse(self, line: QLineEdit, kind: str) -> None:
        if kind == "dir":
            path = QFileDialog.getExistingDirectory(self, "Choose a folder", line.text())
        else:
            path, _ = QFileDialog.getOpenFileName(
                self, "Choose a model", line.text(), "Models (*.gguf);;All (*)"
            )
        if path:
            line.setText(path)

    @Slot()
    def _quant_changed(self) -> None:
        name = self.editors["quant_format"].currentData()
        found = next((c for c in quant_info.choices() if c.name == name), None)
        if found is None:
            self.quant_hint.setText("")
            return
        text = found.hint
        size = quant_info.size_estimate(self.model_params, found.bits)
        if size:
            text += f" The current model would take about {size / 2**20:,.0f} MiB."
        if found.description and found.description != "GGUF " + found.name:
            text += f" ({found.description})"
        self.quant_hint.setText(text)

    def values(self) -> dict[str, Any]:
        """What the editors hold, by key."""
        out: dict[str, Any] = {}
        for key, w in self.editors.items():
            if isinstance(w, QComboBox):
                out[key] = w.currentData()
            elif isinstance(w, QCheckBox):
                out[key] = w.isChecked()
            elif isinstance(w, (QSpinBox, QDoubleSpinBox)):
                out[key] = w.value()
            else:
                out[key] = w.text()
        if self.servers is not None:
            out["mcp_disabled"] = json.dumps(sorted(self._all_disabled()))
        return out

    def _all_disabled(self) -> set[str]:
        """The switched-off servers: those of the list, and earlier ones no longer in mcp.json."""
        listed = {self.servers.topLevelItem(i).data(0, Qt.ItemDataRole.UserRole)
                  for i in range(self.servers.topLevelItemCount())}
        return (self._disabled - listed) | set(self.disabled_servers())

    @Slot()
    def restore_defaults(self) -> None:
        for key, w in self.editors.items():
            value = default(key)
            if isinstance(w, QComboBox):
                w.setCurrentIndex(max(0, w.findData(value)))
            elif isinstance(w, QCheckBox):
                w.setChecked(bool(value))
            elif isinstance(w, (QSpinBox, QDoubleSpinBox)):
                w.setValue(value)
            else:
                w.setText(str(value))

    def accept(self) -> None:
        try:
            self.settings.update(self.values())
        except SettingsError as e:
            self.error_label.setText(str(e))
            return
        super().accept()
