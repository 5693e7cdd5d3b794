"""The model library window: Hub search, a repo's GGUF variants with size and fit, the download queue
(progress, pause / resume / cancel) and the local models (use, delete with confirmation, show in folder,
import a file).

Hub calls run in threads; DownloadManager runs its own worker threads and its callbacks reach the GUI
as queued signals. Closing the app pauses running downloads; they resume on the next start.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

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
    searched = Signal(object, str)  # list[RepoSummary] | None, error
    variants = Signal(str, object, str)  # repo, list[(variant, fit label)], error
    progress = Signal(str, int, int)  # job id, done, total
    state = Signal(object)  # DownloadJob


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


class LibraryWindow(QWidget):
    """Signals:
    modelsChanged(): a download finished or a model was imported/deleted.
    useModel(path: str): the user asked to chat with a local model.
    """

    modelsChanged = Signal()
    useModel = Signal(str)

    def __init__(self, settings: Settings, parent=None, manager=None):
        super().__init__(parent, Qt.WindowType.Window)
        self.setWindowTitle("Model library")
        self.resize(820, 560)
        self.settings = settings
        self.relay = _Relay(self)
        self.relay.searched.connect(self._on_searched)
        self.relay.variants.connect(self._on_variants)
        self.relay.progress.connect(self._on_progress)
        self.relay.state.connect(self._on_state)
        from models.downloads import DownloadManager

        self.manager = manager or DownloadManager(
            on_progress=lambda p: self.relay.progress.emit(p.job_id, p.done, p.total or 0),
            on_state=lambda job: self.relay.state.emit(job),
        )
        self.bars: dict[str, QProgressBar] = {}
        self.variant_items: list = []
        tabs = QTabWidget(self)
        tabs.addTab(self._hub_tab(), "Hub")
        tabs.addTab(self._downloads_tab(), "Downloads")
        tabs.addTab(self._local_tab(), "On this computer")
        QVBoxLayout(self).addWidget(tabs)
        for job in self.manager.jobs():
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
                self.relay.searched.emit(search(text, fmt="gguf"), "")
            except HearthError as e:
                self.relay.searched.emit(None, str(e))

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

            try:
                details = hub.repo_details(repo, with_card=False)
                rows = []
                for v in hub.gguf_variants(details.files):
                    if v.mmproj:
                        continue
                    est = fit.fit_for_remote(v.size, n_ctx, v.quant)
                    rows.append((v, est.verdict, details.commit))
                self.relay.variants.emit(repo, rows, "")
            except HearthError as e:
                self.relay.variants.emit(repo, [], str(e))

        threading.Thread(target=run, daemon=True).start()

    @Slot(str, object, str)
    def _on_variants(self, repo: str, rows, error: str) -> None:
        self.variants.clear()
        self.variant_items = []
        if error:
            self.hub_status.setText(error)
        for v, verdict, commit in rows:
            note = "" if v.complete else " (incomplete split set)"
            item = QListWidgetItem(f"{v.quant}  ·  {_mib(v.size)}  ·  {verdict}{note}")
            self.variants.addItem(item)
            self.variant_items.append((repo, v, commit))

    @Slot()
    def download_selected(self) -> None:
        row = self.variants.currentRow()
        if row < 0:
            return
        from models.downloads import DownloadJob

        repo, variant, commit = self.variant_items[row]
        for f in variant.files:
            job = DownloadJob(
                repo, f.path, revision=commit or "main", size=f.size, sha256=f.sha256, blob_id=f.blob_id
            )
            self._add_job_row(self.manager.add(job))

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
        h.addWidget(QLabel(job.filename), 1)
        bar = QProgressBar()
        bar.setAccessibleName(f"Download progress of {job.filename}")
        bar.setFormat(job.state)
        h.addWidget(bar, 2)
        for text, fn in (
            ("Pause", self.manager.pause),
            ("Resume", self.manager.resume),
            ("Cancel", self.manager.cancel),
        ):
            b = QPushButton(text)
            b.setAccessibleName(f"{text} {job.filename}")
            b.clicked.connect(lambda _=False, f=fn, i=job.id: self._job_action(f, i))
            h.addWidget(b)
        self.bars[job.id] = bar
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
        bar = self.bars.get(job.id)
        if bar is not None:
            bar.setFormat(f"{job.state} %p%" if job.state != "failed" else f"failed: {job.error}")
        if job.state == "done" and job.path:
            try:
                from models.library import Library

                Library().add(
                    job.path,
                    repo=job.repo_id,
                    revision=job.commit,
                    file=job.filename,
                    sha256=job.sha256,
                    source="download",
                )
            except HearthError as e:
                self.hub_status.setText(str(e))
            self.refresh_local()
            self.modelsChanged.emit()

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
            ("Import…", self.import_file),
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
        from models.library import Library

        self.local.clear()
        try:
            entries = Library().entries()
        except HearthError:
            entries = []
        for e in entries:
            item = QListWidgetItem(f"{e.name}  ·  {e.quant or e.format}  ·  {_mib(e.size)}  ·  {e.source}")
            item.setData(Qt.ItemDataRole.UserRole, e.id)
            item.setData(Qt.ItemDataRole.UserRole + 1, e.path)
            self.local.addItem(item)

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
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Import a model", str(Path.home()), "GGUF (*.gguf)")
            if not path:
                return
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
                f"Forget {Path(sel[1]).name}? Files Hearth "
                "downloaded are deleted; imported files stay where they are.",
            )
            if answer != QMessageBox.StandardButton.Yes:
                return
        from models.library import Library

        try:
            Library().remove(sel[0])
        except HearthError as e:
            QMessageBox.warning(self, "Delete failed", str(e))
        self.refresh_local()
        self.modelsChanged.emit()

    def shutdown(self) -> None:
        """Pause running downloads (they resume on the next start) and stop the download threads."""
        self.manager.close(timeout=5.0)
