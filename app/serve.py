"""The app's "Serve" toggle: `hearth serve -m MODEL --host H --port P` as a child process (QProcess).

The server is the CLI's own (engine.server, an OpenAI-compatible HTTP API); the app only starts it,
waits for its ready line (the first line holding an http:// URL), shows that URL, and stops it with
SIGTERM (the server exits cleanly on it; killed after STOP_TIMEOUT_S if not) when toggled off or when
the app quits. Everything is asynchronous (QProcess signals): the GUI thread never waits on the server
except for a bounded wait at quit.
"""

from __future__ import annotations

import re
from collections import deque

from app.conversion import ROOT, child_environment, hearth_command
from app.qt import QObject, QProcess, QTimer, Signal, Slot

STOP_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0  # the server loads the model before it is ready
_URL = re.compile(r"https?://[^\s\"'<>]+")


def serve_available() -> tuple[bool, str]:
    """Whether this build's CLI has `hearth serve`, and why not."""
    try:
        from engine.cli import HANDLERS
    except Exception as e:  # noqa: BLE001 - a broken CLI only disables the toggle
        return False, f"the hearth command could not be loaded ({e})"
    if "serve" not in HANDLERS:
        return False, "this version of Hearth has no `hearth serve` command yet"
    return True, ""


class ServeController(QObject):
    """Starts and stops one server process.

    Args:
        command: argv prefix to run instead of `hearth` (tests run a stand-in); None: the real CLI.

    Signals:
        stateChanged(state: str, url: str, message: str): state is "stopped", "starting", "running",
            "stopping" or "failed"; url is set while running; message says why it failed or stopped.
    """

    stateChanged = Signal(str, str, str)

    def __init__(self, command: list[str] | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.command = command
        self.state = "stopped"
        self.url = ""
        self.proc: QProcess | None = None
        self.output: deque[str] = deque(maxlen=40)
        self._buffer = ""
        self._stopping = False
        self._kill_timer = QTimer(self)
        self._kill_timer.setSingleShot(True)
        self._kill_timer.timeout.connect(self._kill)
        self._start_timer = QTimer(self)
        self._start_timer.setSingleShot(True)
        self._start_timer.timeout.connect(self._start_timed_out)

    def arguments(self, model: str, host: str, port: int) -> list[str]:
        base = list(self.command) if self.command else [*hearth_command(), "serve"]
        return [*base, "-m", model, "--host", host, "--port", str(port)]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.state() != QProcess.ProcessState.NotRunning

    def start(self, model: str, host: str = "127.0.0.1", port: int = 8080) -> None:
        """Start serving `model` (returns at once; stateChanged follows)."""
        if self.running:
            return
        argv = self.arguments(model, host, port)
        self.proc = QProcess(self)
        self.proc.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        self.proc.setProcessEnvironment(child_environment())
        self.proc.setWorkingDirectory(str(ROOT))
        self.proc.readyReadStandardOutput.connect(self._on_output)
        self.proc.finished.connect(self._on_finished)
        self.proc.errorOccurred.connect(self._on_error)
        self.output.clear()
        self._buffer, self._stopping, self.url = "", False, ""
        self._set("starting", "", f"starting {' '.join(argv[-6:])}")
        self._start_timer.start(int(START_TIMEOUT_S * 1000))
        self.proc.start(argv[0], argv[1:])

    def stop(self) -> None:
        """Ask the server to stop (SIGTERM); it is killed if still there after STOP_TIMEOUT_S."""
        if not self.running:
            return
        self._stopping = True
        self._start_timer.stop()
        self._set("stopping", self.url, "")
        self.proc.terminate()
        self._kill_timer.start(int(STOP_TIMEOUT_S * 1000))

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop and wait (for quitting the app); no process is left running."""
        if not self.running:
            return
        self._stopping = True
        self._start_timer.stop()
        self.proc.terminate()
        if not self.proc.waitForFinished(int(timeout * 1000)):
            self.proc.kill()
            self.proc.waitForFinished(2000)

    def _set(self, state: str, url: str, message: str) -> None:
        self.state, self.url = state, url
        self.stateChanged.emit(state, url, message)

    @Slot()
    def _on_output(self) -> None:
        self._buffer += bytes(self.proc.readAllStandardOutput()).decode("utf-8", "replace")
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            line = line.strip()
            if not line:
                continue
            self.output.append(line)
            m = _URL.search(line)
            if m and self.state == "starting":
                self._start_timer.stop()
                self._set("running", m.group(0).rstrip(".,;)"), line)

    @Slot()
    def _start_timed_out(self) -> None:
        if self.state == "starting" and self.running:
            self.output.append(f"no ready line within {START_TIMEOUT_S:.0f} s")
            self.stop()

    @Slot()
    def _kill(self) -> None:
        if self.running:
            self.proc.kill()

    @Slot(object)
    def _on_error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self._start_timer.stop()
            self._set("failed", "", f"could not start the server: {self.proc.errorString()}")

    @Slot(int, object)
    def _on_finished(self, code: int, _status) -> None:
        self._kill_timer.stop()
        self._start_timer.stop()
        if self._buffer.strip():
            self.output.append(self._buffer.strip())
        if self._stopping and not (self.output and self.output[-1].startswith("no ready line")):
            self._set("stopped", "", "")
            return
        last = next((x for x in reversed(self.output) if x), "")
        self._set("failed", "", f"the server exited (code {code}): {last}" if last else f"exit code {code}")
