"""The model library window: Hub search, a repo's GGUF variants with size and fit, the download queue
(progress, pause / resume / cancel) and the local models (use, delete with confirmation, show in folder,
import a file).

A repo's vision towers (llama.cpp's mmproj GGUFs) are listed as such, not as models; downloading a GGUF
model also queues the repo's vision tower (F16 preferred) as its own row, into the model's folder, unless
that folder has one already or the tower's header (read first, with a Range request) names a projector
Hearth does not run: then the variant is listed as "text only" and the model's queue row says "vision tower
not fetched: ...". The model and its tower are checked for free space together before either is queued.
Cancelling, pausing or resuming the model's row does the same to its tower's row; the tower's own buttons
leave the model alone, and deleting a model cancels a tower still on its way to its folder. A local model
with a tower beside it is marked "reads images".

Hub calls run in threads; downloads belong to the app's DownloadService (app.downloads, started with
the main window so unfinished downloads resume at launch), whose callbacks reach the GUI as queued
signals. "Convert…" opens app.convert_dialog (the conversion runs in a `hearth convert` child process).
Closing the app pauses running downloads (they resume on the next start) and cancels conversions.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from app.qt import (
    QDesktopServices,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QObject,
    QProgressBar,
    QPushButton,
    Qt,
    QTabWidget,
    QUrl,
    QVBoxLayout,
    QWidget,
    Signal,
    Slot,
)
from app.settings import Settings
from models.errors import HearthError


class _Relay(QObject):
    """Carries the window's background threads' results to the GUI thread (queued connections)."""

    searched = Signal(object, str)  # list[RepoSummary] | None, error
    variants = Signal(str, object, str)  # repo, list[_FileRow], error
    local = Signal(object)  # list[(ModelEntry, reads images: bool)]
    planned = Signal(object, object, str)  # model jobs, their vision tower job or None, error

    def send(self, name: str, *args) -> None:
        """Emit signal `name` from a background thread; nothing when the window closed meanwhile (Qt deleted
        the relay: its thread's result has nobody to go to)."""
        with contextlib.suppress(RuntimeError):
            getattr(self, name).emit(*args)


@dataclass(frozen=True)
class _FileRow:
    """One line of a repo's files: a GGUF model variant with its fit, or a vision tower."""

    repo: str
    commit: str | None
    variant: object  # models.hub.GGUFVariant
    text: str
    repo_files: tuple  # every models.hub.RemoteFile of the repo (to find the model's vision tower)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


class LibraryWindow(QWidget):
    """Signals:
    modelsChanged(): a download or conversion finished or a model was imported/deleted.
    useModel(path: str): the user asked to chat with a local model.
    localChanged(): the list of local models was refreshed.
    """

    modelsChanged = Signal()
    useModel = Signal(str)
    localChanged = Signal()

    def __init__(self, settings: Settings, parent=None, downloads=None):
        super().__init__(parent, Qt.WindowType.Window)
        self.setWindowTitle("Model library")
        self.resize(820, 560)
        self.settings = settings
        self.relay = _Relay(self)
        self.relay.searched.connect(self._on_searched)
        self.relay.variants.connect(self._on_variants)
        self.relay.local.connect(self._on_local)
        self.relay.planned.connect(self._on_planned)
        self._owns_downloads = downloads is None
        if downloads is None:
            from app.downloads import DownloadService

            downloads = DownloadService(models_folder(settings), parent=self)
        self.downloads = downloads
        downloads.progress.connect(self._on_progress)
        downloads.state.connect(self._on_state)
        downloads.modelsChanged.connect(self._on_downloaded)
        downloads.error.connect(self._on_download_error)
        self.bars: dict[str, QProgressBar] = {}
        self.labels: dict[str, QLabel] = {}
        self.variant_items: list = []
        self.convert_dialogs: list = []
        self.entries: list = []
        tabs = QTabWidget(self)
        tabs.addTab(self._hub_tab(), "Hub")
        tabs.addTab(self._downloads_tab(), "Downloads")
        tabs.addTab(self._local_tab(), "On this computer")
        self.tabs = tabs
        QVBoxLayout(self).addWidget(tabs)
        for job in self.downloads.jobs():
            self._add_job_row(job)
        self.refresh_local()

    # ---- hub
    def _hub_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        row = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setAccessibleName("Search the Hub")
        self.query.setPlaceholderText("Search models on the Hugging Face Hub")
        self.search_button = QPushButton("Search")
        self.search_button.setAccessibleName("Search")
        row.addWidget(self.query, 1)
        row.addWidget(self.search_button)
        v.addLayout(row)
        self.results = QListWidget()
        self.results.setAccessibleName("Search results")
        self.variants = QListWidget()
        self.variants.setAccessibleName("Files of the repository")
        self.hub_status = QLabel("")
        self.download_button = QPushButton("Download")
        self.download_button.setAccessibleName("Download the selected file")
        v.addWidget(self.results, 1)
        v.addWidget(QLabel("Variants (size · fits this computer?)"))
        v.addWidget(self.variants, 1)
        v.addWidget(self.hub_status)
        v.addWidget(self.download_button)
        self.search_button.clicked.connect(self.search)
        self.query.returnPressed.connect(self.search)
        self.results.currentItemChanged.connect(self._on_repo_selected)
        self.download_button.clicked.connect(self.download_selected)
        return page

    @Slot()
    def search(self) -> None:
        text = self.query.text().strip()
        self.hub_status.setText("Searching…")

        def run():
            from models.hub import search

            try:
                self.relay.send("searched", search(text, fmt="gguf"), "")
            except HearthError as e:
                self.relay.send("searched", None, str(e))

        threading.Thread(target=run, daemon=True).start()

    @Slot(object, str)
    def _on_searched(self, hits, error: str) -> None:
        self.results.clear()
        if error:
            self.hub_status.setText(error)
            return
        for h in hits:
            item = QListWidgetItem(
                f"{h.repo_id}  ·  {h.downloads:,} downloads{'  · gated' if h.gated else ''}"
            )
            item.setData(Qt.ItemDataRole.UserRole, h.repo_id)
            self.results.addItem(item)
        self.hub_status.setText(f"{len(hits)} repositories" if hits else "No models found")

    @Slot(object, object)
    def _on_repo_selected(self, item, _prev) -> None:
        if item is None:
            return
        repo = item.data(Qt.ItemDataRole.UserRole)
        n_ctx = self.settings.get("n_ctx")

        def run():
            from models import fit, hub

            def unreadable(tower) -> str | None:
                """The projector of `tower` when Hearth cannot read images with it, from its header (read once
                per tower); None when it can, or when the header could not be read."""
                if tower.path not in unsupported:
                    meta = hub.remote_gguf_metadata(repo, tower.path, details.commit or "main", tower.size)
                    header = hub.tower_header(meta) if meta is not None else None
                    bad = header is not None and header.unsupported is not None
                    unsupported[tower.path] = (header.projector_type or "(none named)") if bad else None
                return unsupported[tower.path]

            unsupported: dict[str, str | None] = {}
            try:
                details = hub.repo_details(repo, with_card=False)
                rows = []
                for v in hub.gguf_variants(details.files):
                    if v.mmproj:
                        text = f"vision tower (mmproj)  ·  {v.quant}  ·  {_mib(v.size)}"
                    else:
                        est = fit.fit_for_remote(v.size, n_ctx, v.quant)
                        text = f"{v.quant}  ·  {_mib(v.size)}  ·  {est.verdict}"
                        if not v.complete:
                            text += " (incomplete split set)"
                        tower = hub.pick_mmproj(details.files, v.files[0].path)
                        if tower is not None and (kind := unreadable(tower)):
                            text += f"  ·  text only (its vision tower's projector {kind} "
                            text += "is not read by Hearth)"
                        elif tower is not None:
                            text += f"  ·  reads images (+ vision tower, {_mib(tower.size or 0)})"
                    rows.append(_FileRow(repo, details.commit, v, text, details.files))
                self.relay.send("variants", repo, rows, "")
            except HearthError as e:
                self.relay.send("variants", repo, [], str(e))

        threading.Thread(target=run, daemon=True).start()

    @Slot(str, object, str)
    def _on_variants(self, repo: str, rows, error: str) -> None:
        self.variants.clear()
        self.variant_items = []
        if error:
            self.hub_status.setText(error)
        for row in rows:
            self.variants.addItem(QListWidgetItem(row.text))
            self.variant_items.append(row)

    @Slot()
    def download_selected(self) -> None:
        """Queue the selected variant's files and its vision tower. The tower's header is read and the free
        space checked in a thread (network, disk); the rows appear when that is done (relay.planned)."""
        row = self.variants.currentRow()
        if row < 0:
            return
        from models.downloads import DownloadJob

        item = self.variant_items[row]
        revision = item.commit or "main"
        jobs = [
            DownloadJob(item.repo, f.path, revision=revision, size=f.size, sha256=f.sha256, blob_id=f.blob_id)
            for f in item.variant.files
        ]
        root = self.downloads.root
        self.hub_status.setText(f"Preparing the download of {PurePosixPath(jobs[0].filename).name}…")

        def run():
            from models.downloads import check_free_space, vision_tower

            try:
                choice = vision_tower(item.repo, item.repo_files, item.variant.files[0].path, revision, root)
                jobs[0].note = choice.note
                check_free_space(jobs + ([choice.job] if choice.job else []), root)
            except HearthError as e:
                self.relay.send("planned", jobs, None, str(e))
                return
            self.relay.send("planned", jobs, choice.job, "")

        threading.Thread(target=run, daemon=True, name="hearth-download-plan").start()

    @Slot(object, object, str)
    def _on_planned(self, jobs, tower, error: str) -> None:
        if error:
            self.hub_status.setText(error)
            return
        for job in jobs:
            self._add_job_row(self.downloads.add(job))
        if tower is not None:
            self._add_job_row(self.downloads.add(tower))
        note = jobs[0].note
        self.hub_status.setText(note or f"Downloading {PurePosixPath(jobs[0].filename).name}")

    # ---- downloads
    def _downloads_tab(self) -> QWidget:
        page = QWidget()
        self.jobs_layout = QVBoxLayout(page)
        self.jobs_layout.addStretch(1)
        return page

    def _add_job_row(self, job) -> None:
        if job.id in self.bars:
            return
        row = QWidget()
        h = QHBoxLayout(row)
        label = QLabel(_row_text(job))
        label.setWordWrap(True)
        h.addWidget(label, 1)
        bar = QProgressBar()
        bar.setAccessibleName(f"Download progress of {job.filename}")
        bar.setFormat(job.state)
        h.addWidget(bar, 2)
        for text, fn in (
            ("Pause", self.downloads.pause),
            ("Resume", self.downloads.resume),
            ("Cancel", self.downloads.cancel),
        ):
            b = QPushButton(text)
            b.setAccessibleName(f"{text} {job.filename}")
            b.clicked.connect(lambda _=False, f=fn, i=job.id: self._job_action(f, i))
            h.addWidget(b)
        self.bars[job.id] = bar
        self.labels[job.id] = label
        self.jobs_layout.insertWidget(self.jobs_layout.count() - 1, row)

    def _job_action(self, fn, job_id: str) -> None:
        with contextlib.suppress(KeyError):  # a job this manager no longer knows
            fn(job_id)

    @Slot(str, int, int)
    def _on_progress(self, job_id: str, done: int, total: int) -> None:
        bar = self.bars.get(job_id)
        if bar is not None and total:
            bar.setMaximum(1000)
            bar.setValue(int(1000 * done / total))

    @Slot(object)
    def _on_state(self, job) -> None:
        if job.id not in self.bars:
            self._add_job_row(job)
        bar = self.bars[job.id]
        bar.setFormat(f"{job.state} %p%" if job.state != "failed" else f"failed: {job.error}")
        self.labels[job.id].setText(_row_text(job))
        if job.state == "done":
            bar.setMaximum(1000)
            bar.setValue(1000)

    @Slot()
    def _on_downloaded(self) -> None:
        self.refresh_local()
        self.modelsChanged.emit()

    @Slot(str)
    def _on_download_error(self, message: str) -> None:
        self.hub_status.setText(message)

    # ---- local
    def _local_tab(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        self.local = QListWidget()
        self.local.setAccessibleName("Local models")
        v.addWidget(self.local, 1)
        row = QHBoxLayout()
        for text, slot in (
            ("Chat with it", self.use_selected),
            ("Convert…", self.convert_selected),
            ("Import…", self.import_file),
            ("Import folder…", self.import_folder),
            ("Show in folder", self.show_selected),
            ("Delete…", self.delete_selected),
        ):
            b = QPushButton(text)
            b.setAccessibleName(text.rstrip("…"))
            b.clicked.connect(lambda _=False, s=slot: s())
            row.addWidget(b)
        v.addLayout(row)
        return page

    def refresh_local(self) -> None:
        """Re-read the library in a thread (it also indexes starter models present on disk)."""

        def run():
            from models.library import Library

            try:
                lib = Library()
                lib.register_starters()
                entries = [(e, e.reads_images) for e in lib.entries() if e.exists]
            except HearthError:
                entries = []
            self.relay.send("local", entries)

        threading.Thread(target=run, daemon=True, name="hearth-library").start()

    @Slot(object)
    def _on_local(self, entries) -> None:
        current = self._selected()
        self.entries = [e for e, _ in entries]
        self.local.clear()
        for e, reads_images in entries:
            images = "  ·  reads images" if reads_images else ""
            item = QListWidgetItem(
                f"{e.name}  ·  {e.quant or e.format}  ·  {_mib(e.size)}  ·  {e.source}{images}"
            )
            item.setData(Qt.ItemDataRole.UserRole, e.id)
            item.setData(Qt.ItemDataRole.UserRole + 1, e.path)
            self.local.addItem(item)
            if current and current[0] == e.id:
                self.local.setCurrentItem(item)
        self.localChanged.emit()

    def _selected(self) -> tuple[int, str] | None:
        item = self.local.currentItem()
        if item is None:
            return None
        return item.data(Qt.ItemDataRole.UserRole), item.data(Qt.ItemDataRole.UserRole + 1)

    def use_selected(self) -> None:
        if sel := self._selected():
            self.useModel.emit(sel[1])

    def show_selected(self) -> None:
        if sel := self._selected():
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(Path(sel[1]).parent)))

    def import_file(self, path: str | None = None) -> None:
        """Index a .gguf file in place (a file dialog when path is None)."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Import a model", str(Path.home()), "GGUF (*.gguf)")
            if not path:
                return
        self._import(path)

    def import_folder(self, path: str | None = None) -> None:
        """Index a Hugging Face model folder (config.json, safetensors, tokenizer.json) in place."""
        if path is None:
            path = QFileDialog.getExistingDirectory(self, "Import a model folder", str(Path.home()))
            if not path:
                return
        self._import(path)

    def _import(self, path: str) -> None:
        from models.library import Library

        try:
            Library().import_path(path)
        except HearthError as e:
            QMessageBox.warning(self, "Import failed", str(e))
            return
        self.refresh_local()
        self.modelsChanged.emit()

    def delete_selected(self, confirm: bool = True) -> None:
        sel = self._selected()
        if sel is None:
            return
        if confirm:
            answer = QMessageBox.question(
                self,
                "Delete model",
                f"Forget {Path(sel[1]).name}? Files Hearth downloaded are deleted (with the vision tower "
                "beside it, once no model of that folder is left); imported files stay where they are.",
            )
            if answer != QMessageBox.StandardButton.Yes:
                return
        from models.library import Library

        try:
            Library().remove(sel[0])
        except HearthError as e:
            QMessageBox.warning(self, "Delete failed", str(e))
        else:
            # a vision tower still on its way to the deleted model's folder is not wanted any more
            self.downloads.manager.cancel_lone_towers(Path(sel[1]).parent)
        self.refresh_local()
        self.modelsChanged.emit()

    def convert_selected(self):
        """Open the Convert dialog for the selected local model; returns it (None without a selection)."""
        sel = self._selected()
        if sel is None:
            QMessageBox.information(self, "Convert", "Select a model on this computer first.")
            return None
        from app.convert_dialog import ConvertDialog

        entry = next((e for e in self.entries if e.id == sel[0]), None)
        dialog = ConvertDialog(
            sel[1],
            entry.params if entry else None,
            self.settings.get("quant_format"),
            models_folder(self.settings),
            self.settings.get("threads") or None,
            self,
        )
        dialog.converted.connect(self._on_converted)
        self.convert_dialogs = [d for d in self.convert_dialogs if d.isVisible() or d.running] + [dialog]
        dialog.show()
        return dialog

    @Slot(str)
    def _on_converted(self, _path: str) -> None:
        self.refresh_local()
        self.modelsChanged.emit()

    def shutdown(self) -> None:
        """Cancel conversions (no partial file stays) and, when the window owns them, pause downloads."""
        for dialog in self.convert_dialogs:
            dialog.shutdown()
        if self._owns_downloads:
            self.downloads.close(timeout=5.0)


def _row_text(job) -> str:
    """A queue row's label: the file, whose tower it is, and its note (why the model's tower is not
    fetched, or why a tower was not kept)."""
    text = job.filename
    if job.beside:
        text += f"  (vision tower of {PurePosixPath(job.beside).name})"
    if job.note:
        text += f"  ·  {job.note}"
    return text


def models_folder(settings: Settings) -> Path:
    """Where downloads and conversions go: the settings' models folder, else the library folder."""
    from models.paths import models_dir

    folder = settings.get("models_folder")
    return Path(folder).expanduser() if folder else models_dir()
