"""The main window: chat list, conversation, composer, model picker and status bar.

Layout: a sidebar (search, New chat, the chat list) beside the chat column (model picker with load
progress and fit label, the Serve toggle, the conversation, the composer). Everything that can block
runs elsewhere: the engine in its worker process (app.engine_bridge), downloads in the app's download
threads (app.downloads, resumed at launch), conversions and the API server in child processes
(app.conversion, app.serve), fit estimates and library writes in threads.

Engine settings (context length, KV precision, KV reuse memory, threads, device) reload the loaded
model when they change (after the reply in progress, if any); sampling settings apply to the next reply.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from app.chat_options import ChatOptionsDialog
from app.chat_store import ChatStore, ChatStoreError, Message
from app.chat_view import ChatView
from app.composer import ComposerBox
from app.controller import ChatController
from app.downloads import DownloadService
from app.engine_bridge import EngineBridge
from app.qt import (
    QAction,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QKeySequence,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QObject,
    QProgressBar,
    QPushButton,
    QShortcut,
    QSplitter,
    Qt,
    QTimer,
    QVBoxLayout,
    QWidget,
    Signal,
    Slot,
)
from app.serve import ServeController, serve_available
from app.settings import ENGINE_KEYS, Settings, cuda_status, preset_overrides
from engine.client import ChatEvent, EngineStatus, LoadOptions, ModelInfo
from models.library import Library
from models.starter import STARTERS, starter_path
from models.version import VERSION

STATUS_POLL_MS = 2000
CONTEXT_WARN = 0.85  # warn when the context is this full
UNDO_MS = 10000
PRESET_ITEM = "preset:"  # the model picker's data for a preset: this, then its name


class _Relay(QObject):
    """Carries results of plain threads to the GUI thread."""

    fit = Signal(str, str)


class MainWindow(QMainWindow):
    """Hearth's main window.

    Args:
        settings: the app settings.
        store: the chat database.
        bridge: the engine (a fresh one when None).
        model: model to load at start (default: the settings' default model); "" loads nothing.
        downloads: the download queue (default: a new one, which resumes unfinished downloads now).
        serve_command: argv prefix run by the Serve toggle instead of `hearth serve` (tests).
    """

    def __init__(
        self,
        settings: Settings,
        store: ChatStore,
        bridge: EngineBridge | None = None,
        model: str | None = None,
        dark: bool = False,
        downloads: DownloadService | None = None,
        serve_command: list[str] | None = None,
    ):
        super().__init__()
        self.setWindowTitle("Hearth")
        self.resize(1100, 760)
        self.settings = settings
        self.store = store
        self._owns_bridge = bridge is None
        self.bridge = bridge or EngineBridge(threads=settings.get("threads") or None, parent=self)
        from app.tools import ToolManager

        self.tools = ToolManager(settings, self)  # MCP servers (Settings > Tools); none run with tools off
        self.controller = ChatController(store, self.bridge, settings, self, tools=self.tools)
        self.model_info: ModelInfo | None = None
        self.last_event: ChatEvent | None = None
        self.library_window = None
        self.settings_dialog = None
        self._relay = _Relay(self)
        self._relay.fit.connect(self._on_fit)
        self._deleted: str | None = None
        self._closing = False
        self._send_when_checked = False  # Send was pressed while attached images were still being checked
        self._engine_dirty = False
        self._tools_dirty = False
        self.cuda_ok, self.cuda_reason = cuda_status()
        self._device_notice = ""  # the worker's reason when a CUDA load fell back to the CPU
        self._owns_downloads = downloads is None
        if downloads is None:
            from app.library_window import models_folder

            downloads = DownloadService(models_folder(settings), parent=self)
        self.downloads = downloads
        self.server = ServeController(serve_command, self)
        self._build(dark)
        self._wire()
        self.refresh_chats()
        self.refresh_models()
        self._status_timer = QTimer(self)
        self._status_timer.setInterval(STATUS_POLL_MS)
        self._status_timer.timeout.connect(self.bridge.poll_status)
        self._status_timer.start()
        self._unsubscribe = settings.subscribe(self._on_setting)
        if settings.get("tools_enabled"):
            self.tools.restart()  # in the background: servers start while the model loads
        from app import quant_info

        QTimer.singleShot(3000, quant_info.prefetch)  # the format list, for settings and Convert
        chats = store.list_chats()
        if chats:
            self.controller.open_chat(chats[0].id)
        target = settings.get("default_model") if model is None else model
        if self.bridge.model is not None and not model:
            self._on_loaded(self.bridge.model)  # a shared engine with its model already loaded
        elif target:
            self.load_model(target)
        else:
            self._offer_starter()

    # ---- building
    def _build(self, dark: bool) -> None:
        side = QWidget()
        sv = QVBoxLayout(side)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats (Ctrl+F)")
        self.search.setAccessibleName("Search chats")
        self.new_button = QPushButton("New chat")
        self.new_button.setAccessibleName("New chat")
        self.chat_list = QListWidget()
        self.chat_list.setAccessibleName("Chats")
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.undo_button = QPushButton("Undo delete")
        self.undo_button.setAccessibleName("Undo delete")
        self.undo_button.hide()
        for w in (self.search, self.new_button, self.chat_list, self.undo_button):
            sv.addWidget(w)

        main = QWidget()
        mv = QVBoxLayout(main)
        top = QHBoxLayout()
        self.model_box = QComboBox()
        self.model_box.setAccessibleName("Model")
        self.model_box.setMinimumWidth(320)
        self.load_progress = QProgressBar()
        self.load_progress.setAccessibleName("Model load progress")
        self.load_progress.setRange(0, 100)
        self.load_progress.setMaximumWidth(180)
        self.load_progress.hide()
        self.fit_label = QLabel("")
        self.fit_label.setAccessibleName("Fits this machine")
        self.options_button = QPushButton("Chat options…")
        self.options_button.setAccessibleName("Chat options")
        self.serve_button = QPushButton("Serve API")
        self.serve_button.setCheckable(True)
        self.serve_button.setAccessibleName("Serve the model over a local API")
        ok, why = serve_available() if self.server.command is None else (True, "")
        self.serve_button.setEnabled(ok)
        self.serve_button.setToolTip(
            why or "Run a local API server (hearth serve): OpenAI's API at /v1, Ollama's at /api. The loaded "
            "model is kept loaded; the library's other models load when a request names them"
        )
        self.serve_label = QLabel("")
        self.serve_label.setAccessibleName("Server address")
        self.serve_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        top.addWidget(QLabel("Model:"))
        top.addWidget(self.model_box, 1)
        top.addWidget(self.load_progress)
        top.addWidget(self.fit_label)
        top.addWidget(self.options_button)
        top.addWidget(self.serve_button)
        top.addWidget(self.serve_label)
        mv.addLayout(top)
        self.view = ChatView()
        self.view.dark = dark
        mv.addWidget(self.view, 1)
        self.starter_button = QPushButton("Get the starter model (SmolLM2 135M, 94 MiB)")
        self.starter_button.setAccessibleName("Get the starter model")
        self.starter_button.hide()
        mv.addWidget(self.starter_button)
        bottom = QHBoxLayout()
        self.composer_box = ComposerBox()
        self.composer = self.composer_box.editor
        self.attach_button = self.composer_box.attach_button
        self.send_button = QPushButton("Send")
        self.send_button.setAccessibleName("Send message")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop the reply")
        self.stop_button.setEnabled(False)
        bottom.addWidget(self.composer_box, 1)
        col = QVBoxLayout()
        col.addWidget(self.send_button)
        col.addWidget(self.stop_button)
        col.addStretch(1)
        bottom.addLayout(col)
        mv.addLayout(bottom)

        split = QSplitter()
        split.addWidget(side)
        split.addWidget(main)
        split.setStretchFactor(1, 1)
        split.setSizes([260, 840])
        self.setCentralWidget(split)

        sb = self.statusBar()
        self.status_model = QLabel("no model")
        self.status_device = QLabel("CPU")
        self.status_speed = QLabel("")
        self.status_context = QLabel("")
        self.status_ram = QLabel("")
        self.status_spec = QLabel("")
        for w, name in (
            (self.status_model, "Loaded model"),
            (self.status_device, "Device"),
            (self.status_speed, "Speed"),
            (self.status_context, "Context use"),
            (self.status_ram, "Memory use"),
            (self.status_spec, "Speculative decoding"),
        ):
            w.setAccessibleName(name)
            sb.addPermanentWidget(w)
        self.status_spec.hide()

        menu = self.menuBar()
        file_menu = menu.addMenu("&File")
        self.act_new = self._action(
            file_menu, "&New chat", QKeySequence.StandardKey.New, self.controller.new_chat
        )
        self._action(file_menu, "&Import chat…", None, self.import_chat)
        self._action(file_menu, "Export as &Markdown…", None, lambda: self.export_chat("md"))
        self._action(file_menu, "Export as &JSON…", None, lambda: self.export_chat("json"))
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", QKeySequence.StandardKey.Quit, self.close)
        edit = menu.addMenu("&Edit")
        self._action(edit, "&Find chats", QKeySequence.StandardKey.Find, self.focus_search)
        self._action(edit, "&Stop reply", QKeySequence(Qt.Key.Key_Escape), self.controller.stop)
        self._action(edit, "&Undo delete", None, self.undo_delete)
        tools = menu.addMenu("&Tools")
        self._action(tools, "Model &library…", QKeySequence("Ctrl+Shift+L"), self.open_library)
        self._action(tools, "&Settings…", QKeySequence("Ctrl+,"), self.open_settings)
        help_menu = menu.addMenu("&Help")
        self._action(help_menu, "&About Hearth", None, self.about)

    def _action(self, menu: QMenu, text: str, shortcut, slot) -> QAction:
        act = QAction(text, self)
        if shortcut is not None:
            act.setShortcut(shortcut)
            act.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
        act.triggered.connect(lambda _=False: slot())
        menu.addAction(act)
        return act

    def _wire(self) -> None:
        c, b = self.controller, self.bridge
        self.search.textChanged.connect(self.refresh_chats)
        self.new_button.clicked.connect(c.new_chat)
        self.chat_list.currentItemChanged.connect(self._on_chat_selected)
        self.chat_list.customContextMenuRequested.connect(self._chat_menu)
        self.undo_button.clicked.connect(self.undo_delete)
        self.model_box.activated.connect(self._on_model_picked)
        self.options_button.clicked.connect(self.chat_options)
        self.serve_button.toggled.connect(self._on_serve_toggled)
        self.server.stateChanged.connect(self._on_serve_state)
        self.downloads.modelsChanged.connect(self.refresh_models)
        self.starter_button.clicked.connect(lambda: self.load_model("smollm2-135m-instruct"))
        self.composer.submitted.connect(self.send)
        self.composer_box.notice.connect(self._on_composer_notice)
        self.composer_box.checked.connect(self._on_images_checked)
        self.view.imagesDropped.connect(self.composer_box.offer)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(c.stop)
        self.view.editRequested.connect(c.edit_and_resend)
        self.view.regenerateRequested.connect(c.regenerate)
        self.view.continueRequested.connect(c.continue_reply)
        self.view.toolDecision.connect(c.decide)
        c.toolCallsChanged.connect(self.view.show_tool_calls)
        c.toolCallPending.connect(self.view.show_pending_call)
        self.tools.stateChanged.connect(self._on_tools_state)
        c.chatsChanged.connect(self.refresh_chats)
        c.chatOpened.connect(self._on_chat_opened)
        c.messageAdded.connect(self._on_message_added)
        c.messageText.connect(self.view.set_text)
        c.messageDone.connect(self.view.finish)
        c.sourcesChanged.connect(self.view.show_sources)
        c.busyChanged.connect(self._on_busy)
        c.busyChanged.connect(self._apply_engine_settings)
        c.busyChanged.connect(self.restart_tools)
        c.replyEvent.connect(self._on_reply_event)
        c.notice.connect(self.view.show_notice)
        c.statusMessage.connect(self._on_status_message)
        self._bridge_slots = [
            (b.loadProgress, self._on_load_progress),
            (b.loaded, self._on_loaded),
            (b.loadFailed, self._on_load_failed),
            (b.statusReady, self._on_status),
            (b.restarted, self._on_restarted),
            (b.chunk, c._on_chunk),
            (b.progress, c._on_progress),
            (b.finished, c._on_finished),
            (b.failed, c._on_failed),
        ]
        for signal, slot in self._bridge_slots[:5]:
            signal.connect(slot)

    # ---- chats
    @Slot()
    def refresh_chats(self, *_args) -> None:
        current = self.controller.chat.id if self.controller.chat else None
        self.chat_list.blockSignals(True)
        self.chat_list.clear()
        for chat in self.store.list_chats(self.search.text().strip()):
            item = QListWidgetItem(chat.title)
            item.setData(Qt.ItemDataRole.UserRole, chat.id)
            item.setToolTip(chat.title)
            self.chat_list.addItem(item)
            if chat.id == current:
                self.chat_list.setCurrentItem(item)
        self.chat_list.blockSignals(False)

    def focus_search(self) -> None:
        self.search.setFocus()
        self.search.selectAll()

    @Slot(object, object)
    def _on_chat_selected(self, item, _previous) -> None:
        if item is not None:
            chat_id = item.data(Qt.ItemDataRole.UserRole)
            if not self.controller.chat or self.controller.chat.id != chat_id:
                self.controller.open_chat(chat_id)

    @Slot(str)
    def _on_chat_opened(self, chat_id: str) -> None:
        self.view.set_messages(self.controller.messages() if chat_id else [])
        self.refresh_chats()
        self.composer.setFocus()

    @Slot(object)
    def _on_message_added(self, message: Message) -> None:
        self.view.show_notice("")
        self.view.add_message(message)

    def _chat_menu(self, pos) -> None:
        item = self.chat_list.itemAt(pos)
        if item is None:
            return
        chat_id = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename_chat(chat_id))
        menu.addAction("Delete", lambda: self.delete_chat(chat_id))
        menu.addAction("Export as Markdown…", lambda: self.export_chat("md", chat_id))
        menu.addAction("Export as JSON…", lambda: self.export_chat("json", chat_id))
        menu.exec(self.chat_list.mapToGlobal(pos))

    def rename_chat(self, chat_id: str, title: str | None = None) -> None:
        if title is None:
            old = self.store.get_chat(chat_id).title
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=old)
            if not ok:
                return
        self.controller.rename_chat(chat_id, title)

    def delete_chat(self, chat_id: str) -> None:
        """Delete a chat; an Undo button stays for UNDO_MS."""
        self.controller.delete_chat(chat_id)
        self._deleted = chat_id
        self.undo_button.show()
        self.statusBar().showMessage("Chat deleted", UNDO_MS)
        QTimer.singleShot(UNDO_MS, self._forget_undo)

    def undo_delete(self) -> None:
        if self._deleted:
            self.controller.undo_delete(self._deleted)
        self._forget_undo()

    def _forget_undo(self) -> None:
        self._deleted = None
        self.undo_button.hide()

    def export_chat(self, fmt: str, chat_id: str | None = None, path: str | None = None) -> Path | None:
        """Write a chat as Markdown or JSON (to `path`, or where the user picks)."""
        chat_id = chat_id or (self.controller.chat.id if self.controller.chat else None)
        if not chat_id:
            return None
        chat = self.store.get_chat(chat_id)
        if path is None:
            folder = self.settings.get("export_folder") or str(Path.home())
            safe = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in chat.title)[:60] or "chat"
            path, _ = QFileDialog.getSaveFileName(
                self,
                "Export chat",
                str(Path(folder) / f"{safe}.{fmt}"),
                "Markdown (*.md)" if fmt == "md" else "JSON (*.json)",
            )
            if not path:
                return None
        text = (
            self.store.export_markdown(chat_id)
            if fmt == "md"
            else json.dumps(self.store.export_json(chat_id), indent=1, ensure_ascii=False)
        )
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            QMessageBox.warning(self, "Export failed", f"{target}: {e}")
            return None
        self.statusBar().showMessage(f"Exported to {target}", 5000)
        return target

    def import_chat(self, path: str | None = None) -> str | None:
        """Import a chat exported as JSON; returns its id."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Import chat", str(Path.home()), "JSON (*.json)")
            if not path:
                return None
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            chat = self.store.import_json(data)
        except (OSError, ValueError, ChatStoreError) as e:
            QMessageBox.warning(self, "Import failed", f"{path}: {e}")
            return None
        self.refresh_chats()
        self.controller.open_chat(chat.id)
        return chat.id

    def chat_options(self) -> None:
        chat = self.controller.chat
        model = self.model_info.path if self.model_info else None
        dialog = ChatOptionsDialog(
            chat.system_prompt if chat else "", chat.overrides if chat else {}, self.settings, self, model
        )
        if dialog.exec():
            self.controller.set_chat_options(*dialog.result_values())
        if dialog.saved:  # the picker lists the presets saved there
            self.refresh_models()

    # ---- sending
    @Slot()
    def send(self) -> None:
        """Send the composer's text, images and documents. While an attachment is still being checked (in a
        worker thread), the message waits for it and goes when the checks are done; if one of them is
        refused, it does not go, so the note can say why first."""
        box = self.composer_box
        if box.checking:
            self._send_when_checked = True
            self.statusBar().showMessage("Sending when the attached images and documents are checked…", 8000)
            return
        if self.controller.send(self.composer.toPlainText(), box.images, box.documents):
            self.composer_box.clear()

    @Slot(bool)
    def _on_images_checked(self, refused: bool) -> None:
        if not self._send_when_checked or self._closing:
            return
        self._send_when_checked = False
        if refused:
            self.statusBar().showMessage(
                "Not sent: an attachment was refused (see the note above the message); "
                "send again to go without it", 8000
            )
            return
        self.send()

    @Slot(str)
    def _on_composer_notice(self, text: str) -> None:
        self.statusBar().showMessage(text, 8000)

    @Slot(str)
    def _on_status_message(self, text: str) -> None:
        self.statusBar().showMessage(text, 15000)

    @Slot(bool)
    def _on_busy(self, busy: bool) -> None:
        self.stop_button.setEnabled(busy)
        self.send_button.setEnabled(not busy)
        self.view.set_busy(busy)

    @Slot(object)
    def _on_reply_event(self, event: ChatEvent) -> None:
        self.last_event = event
        if event.token is None and not event.finish_reason and event.images_to_read:
            n, total = int(event.images_read), event.images_to_read
            image = f"image {min(n + 1, total)}/{total}" if total > 1 else "the image"
            self.status_speed.setText(f"reading {image} ({event.images_read / total:.0%})")
        elif event.token is None and not event.finish_reason and event.to_prefill:
            self.status_speed.setText(f"reading prompt {event.prefilled}/{event.to_prefill}")
        elif event.generated_tokens:
            self.status_speed.setText(f"TTFT {event.ttft_s:.2f} s · {event.generation_tps:.1f} tok/s")
        self._show_context(event.context_after, event.context_size)
        text = speculation_text(event)
        if text:
            self.status_spec.setText(text)
            self.status_spec.show()
        elif event.generated_tokens and event.token is not None:
            self.status_spec.hide()

    def _show_context(self, used: int, total: int) -> None:
        if not total:
            return
        warn = used >= CONTEXT_WARN * total
        text = f"context {used}/{total}"
        self.status_context.setText(
            ("⚠ " + text + " (nearly full: older turns will be dropped)") if warn else text
        )

    @Slot(object)
    def _on_status(self, status: EngineStatus) -> None:
        self.status_ram.setText(f"engine RAM {status.rss_mb:,.0f} MB")
        for m in status.models:
            if self.model_info and m.get("key") == self.model_info.key and not self.controller.busy:
                self._show_context(m.get("context_used", 0), m.get("n_ctx", 0))

    # ---- models
    def refresh_models(self) -> None:
        """Fill the picker: starter models, then the library's local models, then its presets (whose
        model is here)."""
        self.model_box.blockSignals(True)
        current = self.model_box.currentData()
        self.model_box.clear()
        self._preset_bases: dict[str, str] = {}
        for name, starter in STARTERS.items():
            here = starter_path(name).is_file()
            self.model_box.addItem(f"{starter.description}{'' if here else ' (download)'}", name)
        try:
            lib = Library()
            for entry in lib.entries():
                if entry.format == "gguf" and entry.source != "starter" and entry.exists:
                    self.model_box.addItem(entry.name, entry.path)
            for p in lib.presets():
                if Path(p.base).exists():
                    self._preset_bases[PRESET_ITEM + p.name] = p.base
                    self.model_box.addItem(f"{p.name} (preset of {Path(p.base).name})", PRESET_ITEM + p.name)
        except Exception:  # noqa: BLE001 - an unreadable library must not stop the window
            pass
        if current is not None and self.model_box.findData(current) >= 0:
            self.model_box.setCurrentIndex(self.model_box.findData(current))
        self.model_box.blockSignals(False)

    @Slot(int)
    def _on_model_picked(self, index: int) -> None:
        spec = self.model_box.itemData(index)
        if isinstance(spec, str) and spec.startswith(PRESET_ITEM):
            self.apply_preset(spec.removeprefix(PRESET_ITEM))
        elif spec and (not self.model_info or spec not in (self.model_info.path, self.model_info.key)):
            self.load_model(spec)

    def apply_preset(self, name: str) -> None:
        """Open a chat set up by the preset `name` (the current one while it is empty, else a new one): its
        system prompt, sampling options and opening messages; its model is loaded unless it is already."""
        try:
            preset = Library().find_preset(name)
        except Exception as e:  # noqa: BLE001 - an unreadable library: say so, change nothing
            QMessageBox.warning(self, "Preset", f"The library cannot be read: {e}")
            return
        if preset is None or not Path(preset.base).exists():
            gone = "is gone" if preset is None else f"has lost its model file {preset.base}"
            self.statusBar().showMessage(f"The preset {name} {gone}.", 8000)
            self.refresh_models()
            return
        self.controller.start_preset_chat(preset.system or "", preset_overrides(preset), preset.messages)
        if preset.template:
            self.view.show_notice(
                f"{preset.name} has its own chat template, which hearth serve and hearth chat use; the app "
                "uses the model's."
            )
        if not self.model_info or Path(self.model_info.path) != Path(preset.base):
            self.load_model(preset.base)
        self.model_box.setCurrentIndex(self.model_box.findData(PRESET_ITEM + preset.name))

    def load_model(self, spec: str) -> None:
        """Load a model (starter name or path) with the settings' options; progress shows in the top bar."""
        if self.model_box.findData(spec) < 0:
            self.model_box.addItem(Path(spec).name, spec)
        self.model_box.setCurrentIndex(self.model_box.findData(spec))
        self.starter_button.hide()
        self.load_progress.setValue(0)
        self.load_progress.show()
        self.status_model.setText(f"loading {Path(spec).name}…")
        self._loading = spec
        self.bridge.load(spec, self.load_options())
        self._estimate_fit(spec)

    def load_options(self) -> LoadOptions:
        """The engine options the settings ask for."""
        s = self.settings
        gpu_layers = s.get("gpu_layers")
        return LoadOptions(
            n_ctx=s.get("n_ctx"),
            threads=s.get("threads") or None,
            prefix_cache_mb=s.get("prefix_cache_mb"),
            kv_dtype=s.get("kv_dtype"),
            device="cuda" if self.cuda_ok and s.get("device") == "cuda" else "cpu",
            gpu_layers=None if gpu_layers < 0 else gpu_layers,
        )

    def _on_setting(self, key: str, _value) -> None:
        if self._closing:
            return
        if key in ENGINE_KEYS and self._changes_engine(key):
            self._engine_dirty = True
            QTimer.singleShot(0, self._apply_engine_settings)
        if key == "device":
            QTimer.singleShot(0, self._show_device)
        if key in ("device", "n_ctx"):
            QTimer.singleShot(0, self._refresh_fit)
        if key in ("tools_enabled", "mcp_disabled", "tool_timeout_s") and not self._tools_dirty:
            self._tools_dirty = True  # one restart for the dialog's several changes
            QTimer.singleShot(0, self.restart_tools)

    def restart_tools(self, *_args) -> None:
        """Start the enabled MCP servers again after the Tools settings changed; waits for the reply (and the
        tool calls) in progress, whose servers must not go away under them."""
        if not self._tools_dirty or self._closing or self.controller.busy:
            return
        self._tools_dirty = False
        self.tools.restart()

    @Slot()
    def _on_tools_state(self) -> None:
        """Servers started: tell what failed (with its stderr), never silently."""
        if self._closing:
            return
        errors = self.tools.errors()
        if errors and self.settings.get("tools_enabled"):
            self.view.show_notice("Tools: " + "\n".join(errors.values()))
        names = ", ".join(t.name for t in self.tools.tools())
        self.statusBar().showMessage(f"Tools: {names}" if names else "No tools are running", 8000)
        if self.settings_dialog is not None and hasattr(self.settings_dialog, "refresh_servers"):
            self.settings_dialog.refresh_servers()

    @Slot()
    def _refresh_fit(self) -> None:
        """The fit label again for the picked model (its verdict depends on the context and the device)."""
        spec = self.model_box.currentData()
        spec = self._preset_bases.get(spec, spec)  # a preset: its model's
        if spec and not self._closing:
            self._estimate_fit(spec)

    def _changes_engine(self, key: str) -> bool:
        """Whether a changed engine setting changes how the model runs (without CUDA: CPU either way)."""
        if key == "device":
            return self.cuda_ok
        if key == "gpu_layers":
            return self.cuda_ok and self.settings.get("device") == "cuda"
        return True

    @Slot()
    def _apply_engine_settings(self, *_args) -> None:
        """Reload the loaded model with the new engine settings (after the reply in progress)."""
        if not self._engine_dirty or self._closing or self.controller.busy or self.model_info is None:
            return
        self._engine_dirty = False
        spec = self.model_info.path
        self.load_progress.setValue(0)
        self.load_progress.show()
        self.status_model.setText(f"reloading {self.model_info.name} with the new settings…")
        self.bridge.reload(spec, self.load_options(), self.settings.get("threads") or None)

    def _show_device(self) -> None:
        where = self.model_info.device if self.model_info is not None else "cpu"
        if where != "cpu":
            self.status_device.setText(f"GPU {where}")
            self.status_device.setToolTip(f"The model runs on {where}")
        elif self.settings.get("device") == "cuda":
            self.status_device.setText("CPU (CUDA unavailable)")
            self.status_device.setToolTip(self.cuda_reason or self._device_notice)
        else:
            self.status_device.setText("CPU")
            self.status_device.setToolTip("The model runs on the CPU")

    def _estimate_fit(self, spec: str) -> None:
        n_ctx = self.settings.get("n_ctx")
        device = self.load_options().device  # the GPU's verdict only where the model will run there

        def run() -> None:
            from models import fit

            path = starter_path(spec) if spec in STARTERS else Path(spec)
            try:
                if path.exists():
                    est = fit.fit_for_file(path, n_ctx)
                    text, tip = fit.label(est, device), est.summary()
                else:
                    text, tip = "not downloaded yet", ""
            except Exception as e:  # noqa: BLE001 - a label, never an error dialog
                text, tip = "fit unknown", str(e)
            self._relay.fit.emit(text, tip)

        threading.Thread(target=run, daemon=True, name="hearth-fit").start()

    @Slot(str, str)
    def _on_fit(self, text: str, tip: str) -> None:
        if not self._closing:
            self.fit_label.setText(text)
            self.fit_label.setToolTip(tip)

    @Slot(str, float, str)
    def _on_load_progress(self, stage: str, fraction: float, message: str) -> None:
        self.load_progress.setValue(int(fraction * 100))
        if stage == "warning":
            self.statusBar().showMessage(message, 8000)
            if message.startswith("CUDA unavailable"):
                self._device_notice = message
        else:
            self.load_progress.setFormat(f"{stage} %p%")

    @Slot(object)
    def _on_loaded(self, info: ModelInfo) -> None:
        self.model_info = info
        self.composer_box.set_vision(info.vision)
        self.load_progress.hide()
        self.status_model.setText(f"{info.name} · loaded in {info.load_s:.1f} s")
        self._show_device()
        self._show_context(0, info.n_ctx)
        self.refresh_models()
        threading.Thread(target=_mark_used, args=(info.path,), daemon=True, name="hearth-used").start()

    @Slot(str)
    def _on_load_failed(self, message: str) -> None:
        self.load_progress.hide()
        self.status_model.setText("no model" if self.model_info is None else self.model_info.name)
        self.view.show_notice(f"The model could not be loaded: {message}")
        if self.model_info is None:
            self._offer_starter()

    def _offer_starter(self) -> None:
        self.starter_button.setVisible(True)
        if not starter_path("smollm2-135m-instruct").is_file():
            self.view.show_notice(
                "Hearth needs a model. The starter model is small and runs on any computer."
            )

    @Slot(bool, str)
    def _on_restarted(self, ok: bool, message: str) -> None:
        if ok:
            self.view.show_notice("The engine was restarted after a crash. Your chat is intact; send again.")
        else:
            self.view.show_notice(message)

    # ---- windows
    def open_library(self) -> None:
        from app.library_window import LibraryWindow

        if self.library_window is None:
            self.library_window = LibraryWindow(self.settings, self, downloads=self.downloads)
            self.library_window.modelsChanged.connect(self.refresh_models)
            self.library_window.useModel.connect(self.load_model)
        self.library_window.show()
        self.library_window.raise_()

    def open_settings(self):
        from app.settings_dialog import SettingsDialog

        params = None
        if self.model_info is not None and self.model_info.file_size:
            from models.fit import bits_per_weight

            quant = Path(self.model_info.path).stem.rsplit(".", 1)[-1]
            params = int(self.model_info.file_size * 8 / bits_per_weight(quant))
        dialog = SettingsDialog(
            self.settings,
            self,
            model_params=params,
            cuda_available=self.cuda_ok,
            cuda_reason=self.cuda_reason,
            model_path=self.model_info.path if self.model_info is not None else None,
            tools=self.tools,
        )
        dialog.open()
        self.settings_dialog = dialog
        return dialog

    def about_text(self) -> str:
        """The About box's text (the version is models.version.VERSION, as `hearth --version` prints)."""
        return (
            f"<b>Hearth {VERSION}</b><br>Chat with language models on "
            "your own machine. Engine, quantizers and converters are Hearth's own Python."
        )

    def about(self) -> None:
        QMessageBox.about(self, "About Hearth", self.about_text())

    # ---- the API server
    @Slot(bool)
    def _on_serve_toggled(self, on: bool) -> None:
        if on and not self.server.running:
            if self.model_info is None:
                self.serve_label.setText("load a model first")
                self.serve_button.setChecked(False)
                return
            s = self.settings
            self.server.start(self.model_info.path, s.get("serve_host"), s.get("serve_port"))
        elif not on and self.server.running:
            self.server.stop()

    @Slot(str, str, str)
    def _on_serve_state(self, state: str, url: str, message: str) -> None:
        if self._closing:
            return
        text = {
            "starting": "server starting…",
            "running": url,
            "stopping": "server stopping…",
            "stopped": "",
            "failed": "server failed",
        }.get(state, state)
        self.serve_label.setText(text)
        if state == "running" and url.endswith("/v1"):
            base = url.removesuffix("/v1")
            message = f"{message}\nOpenAI clients: {url}\nOllama clients (OLLAMA_HOST): {base}".strip()
        self.serve_label.setToolTip(message)
        if state in ("stopped", "failed"):
            self.serve_button.blockSignals(True)
            self.serve_button.setChecked(False)
            self.serve_button.blockSignals(False)
        if state == "failed":
            self.statusBar().showMessage(message, 10000)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt override
        """Stop the reply (its text is saved), cancel conversions, pause downloads (they resume next start),
        stop the API server and the engine."""
        self._closing = True
        self._unsubscribe()
        self._status_timer.stop()
        self.composer_box.shutdown()
        self.controller.stop()
        self.controller.flush()
        if self.controller._reply is not None:
            self.controller._end("stopped", None)
        if self.library_window is not None:
            self.library_window.shutdown()
            self.library_window.close()
        self.server.shutdown()
        self.tools.shutdown()  # the MCP servers' processes end with the app
        if self._owns_downloads:
            self.downloads.close(timeout=5.0)
        if self._owns_bridge:
            self.bridge.shutdown()
        else:
            self.bridge.cancel()
        for signal, slot in self._bridge_slots:
            signal.disconnect(slot)
        super().closeEvent(event)


def speculation_text(event) -> str:
    """'draft: 71% accepted · 2.4 tokens/pass · ≈1.6× faster' for an event of a speculative reply."""
    mode = getattr(event, "speculation", "")
    if not mode:
        return ""
    parts = [mode]
    drafted = getattr(event, "drafted_tokens", 0)
    if drafted:
        parts.append(f"{100 * getattr(event, 'acceptance_rate', 0.0):.0f}% of {drafted} drafts accepted")
    if getattr(event, "tokens_per_pass", 0.0):
        parts.append(f"{event.tokens_per_pass:.2f} tokens/pass")
    if getattr(event, "speedup_estimate", 0.0):
        parts.append(f"≈{event.speedup_estimate:.2f}× plain")
    if getattr(event, "draft_k", None) == 0 and drafted:
        parts.append("paused (not paying off)")
    return "speculation " + " · ".join(parts)


def _mark_used(path: str) -> None:
    """Library.mark_used in a thread (a SQLite write)."""
    try:
        from models.library import Library

        Library().mark_used(path)
    except Exception:  # noqa: BLE001 - a model outside the library simply has no row
        pass


def install_shortcut(window: QWidget, keys: str, slot) -> QShortcut:
    """A window-wide shortcut."""
    sc = QShortcut(QKeySequence(keys), window)
    sc.activated.connect(slot)
    return sc
