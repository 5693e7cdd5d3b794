"""The app's download queue: one models.downloads.DownloadManager for the whole app, started with it.

The main window creates the service at launch, so downloads left queued or running by the last run
(closed, crashed or killed) resume at once, not only when the library window is opened. The manager's
callbacks come from its worker threads; they become queued Qt signals here. A finished file is indexed
in the library in that worker thread (it reads the file's header), never in the GUI thread; a vision
tower (mmproj) is not indexed, it belongs to the model in its folder.
"""

from __future__ import annotations

from pathlib import Path

from app.qt import QObject, Signal
from models.errors import HearthError


class DownloadService(QObject):
    """Owns the DownloadManager.

    Args:
        root: the folder downloads go to (None: the library folder).
        manager: a ready manager to use instead (tests); its callbacks are replaced.

    Signals:
        progress(job_id: str, done: int, total: int): bytes of a running job.
        state(job: DownloadJob): a job changed state.
        modelsChanged(): a finished download was added to the library, or a vision tower beside its model.
        error(message: str): a finished file could not be indexed, or a model's vision tower failed.
    """

    progress = Signal(str, int, int)
    state = Signal(object)
    modelsChanged = Signal()
    error = Signal(str)

    def __init__(self, root: Path | None = None, manager=None, parent: QObject | None = None):
        super().__init__(parent)
        self._closed = False
        if manager is None:
            from models.downloads import DownloadManager

            manager = DownloadManager(root=root, autostart=False)
        manager.on_progress = self._on_progress
        manager.on_state = self._on_state
        self.manager = manager
        manager.start()  # resumes what an earlier run left queued or running

    def _on_progress(self, p) -> None:
        if not self._closed:
            self.progress.emit(p.job_id, p.done, p.total or 0)

    @property
    def root(self) -> Path:
        """The library folder downloads go to."""
        return self.manager.root

    def _on_state(self, job) -> None:
        from models.hub import is_mmproj

        tower = is_mmproj(job.filename)
        if tower and not self._closed:
            if job.state == "done":
                self.modelsChanged.emit()  # its model now reads images
            elif job.state == "failed" and job.beside:
                self.error.emit(
                    f"{job.error} — {Path(job.beside).name} works for text without its vision tower; "
                    "Resume fetches it"
                )
        elif job.state == "done" and job.path and not self._closed:
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
            except (HearthError, OSError) as e:
                self.error.emit(str(e))
            else:
                self.modelsChanged.emit()
        if not self._closed:
            self.state.emit(job)

    # the manager's API, for the window's buttons
    def add(self, job):
        return self.manager.add(job)

    def jobs(self) -> list:
        return self.manager.jobs()

    def pause(self, job_id: str) -> None:
        self.manager.pause(job_id)

    def resume(self, job_id: str) -> None:
        self.manager.resume(job_id)

    def cancel(self, job_id: str) -> None:
        self.manager.cancel(job_id)

    def close(self, timeout: float = 5.0) -> None:
        """Pause running downloads (they are queued again on the next start) and stop the threads."""
        self._closed = True
        self.manager.close(timeout=timeout)
