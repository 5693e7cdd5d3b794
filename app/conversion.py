"""A model conversion run as `hearth convert` in a child process, reported as Qt signals.

The conversion (reading, quantizing and writing every tensor) never runs in the GUI process: a
QProcess runs `hearth convert SRC --to FORMAT -o OUT --json`, whose progress lines on stderr
("\\r 42.0% [116/272] blk.2.attn_output.weight -> Q8_0") move the progress bar and whose JSON on stdout
names the result. The CLI writes under a temporary name next to OUT and renames it only when done.

Cancel sends SIGINT: the CLI's KeyboardInterrupt path deletes its temporary file. If the process has
to be killed instead (it did not stop in time, or on platforms without SIGINT), the job deletes the
temporary file itself (`.OUT.part-PID`, the CLI's naming). Either way nothing partial is left. A cancel
that lands after the CLI renamed its file to OUT (the conversion had just finished) deletes OUT too, when
it was not there before the job started: a cancelled job leaves nothing, whenever the cancel came.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from app.qt import QObject, QProcess, QProcessEnvironment, Signal, Slot

ROOT = Path(__file__).resolve().parents[1]
_PROGRESS = re.compile(r"^\s*(\d+(?:\.\d+)?)% (.*)$")


def hearth_command() -> list[str]:
    """The argv prefix that runs the `hearth` CLI: the bundled executable when frozen, else this Python."""
    if getattr(sys, "frozen", False):
        exe = Path(sys.executable).with_name("hearth" + (".exe" if os.name == "nt" else ""))
        if exe.is_file():
            return [str(exe)]
    return [sys.executable, "-m", "engine.cli"]


def child_environment() -> QProcessEnvironment:
    """This process's environment, with the source tree importable by the child."""
    env = QProcessEnvironment.systemEnvironment()
    path = env.value("PYTHONPATH", "")
    env.insert("PYTHONPATH", str(ROOT) + (os.pathsep + path if path else ""))
    env.insert("PYTHONUNBUFFERED", "1")
    return env


@dataclass
class ConversionResult:
    """How a conversion ended.

    Attributes:
        state: "done", "cancelled" or "failed".
        output: the converted file (or folder) when done.
        error: the CLI's message when failed.
        seconds: the conversion's own time (from the CLI) when done, else wall time.
        nbytes: size of the output when done.
    """

    state: str
    output: str = ""
    error: str = ""
    seconds: float = 0.0
    nbytes: int = 0


def temp_output(output: Path, pid: int) -> Path:
    """The temporary name `hearth convert` writes to before renaming (engine.convert's convention)."""
    return output.parent / f".{output.name}.part-{pid}"


class ConversionJob(QObject):
    """One conversion of `source` to format `fmt` written to `output`.

    Args:
        source: GGUF file or Hugging Face folder.
        fmt: a target format name as `hearth convert --to` takes it ("Q8_0", "mixed:4.5").
        output: the file/folder to write (must not exist).
        threads: CPU threads for the conversion (None: all cores).

    Signals:
        progress(fraction: float, message: str): a step (fraction 0..1).
        finished(result: ConversionResult): the conversion ended; a done output is already in the library.
    """

    progress = Signal(float, str)
    finished = Signal(object)
    _indexed = Signal(object)

    def __init__(
        self, source: str | Path, fmt: str, output: str | Path, threads: int | None = None, parent=None
    ):
        super().__init__(parent)
        self.source, self.fmt, self.output = Path(source), fmt, Path(output)
        self.threads = threads
        self.proc: QProcess | None = None
        self.pid = 0
        self.fraction = 0.0
        self.message = ""
        self.result: ConversionResult | None = None
        self._cancelled = False
        self._stderr = ""
        self._stdout = b""
        self._errors: list[str] = []
        self._t0 = 0.0
        self._output_existed = True  # set at start: a cancel deletes only an output this job made
        self._indexed.connect(self._finish)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.state() != QProcess.ProcessState.NotRunning

    def arguments(self) -> list[str]:
        """The full command line."""
        args = [*hearth_command(), "convert", str(self.source), "--to", self.fmt, "-o", str(self.output)]
        if self.threads:
            args += ["-t", str(self.threads)]
        return [*args, "--json"]

    def start(self) -> None:
        """Start the child process (returns at once)."""
        argv = self.arguments()
        self.proc = QProcess(self)
        self.proc.setProcessEnvironment(child_environment())
        self.proc.setWorkingDirectory(str(ROOT))
        self.proc.readyReadStandardError.connect(self._on_stderr)
        self.proc.readyReadStandardOutput.connect(self._on_stdout)
        self.proc.finished.connect(self._on_finished)
        self.proc.errorOccurred.connect(self._on_error)
        self._t0 = time.monotonic()
        self._output_existed = self.output.exists()
        self.proc.start(argv[0], argv[1:])
        self.pid = int(self.proc.processId() or 0)

    def cancel(self) -> None:
        """Stop the conversion; `finished` follows with state "cancelled" and no file left behind."""
        if not self.running:
            return
        self._cancelled = True
        if hasattr(signal, "SIGINT") and os.name != "nt" and self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGINT)
        else:
            self.proc.kill()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel and wait for the process (killing it after `timeout`); for closing windows."""
        if self.running:
            self.cancel()
            if not self.proc.waitForFinished(int(timeout * 1000)):
                self.proc.kill()
                self.proc.waitForFinished(2000)
        self._cleanup()

    def _cleanup(self) -> None:
        if self.pid:
            tmp = temp_output(self.output, self.pid)
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)

    @Slot()
    def _on_stderr(self) -> None:
        self._stderr += bytes(self.proc.readAllStandardError()).decode("utf-8", "replace")
        *pieces, self._stderr = re.split(r"[\r\n]", self._stderr)
        latest = None
        for piece in pieces:
            m = _PROGRESS.match(piece)
            if m:
                latest = (float(m.group(1)) / 100.0, m.group(2).strip())
            elif piece.strip():
                self._errors.append(piece.strip())
        if latest is not None:
            self.fraction, self.message = latest
            self.progress.emit(*latest)

    @Slot()
    def _on_stdout(self) -> None:
        self._stdout += bytes(self.proc.readAllStandardOutput())

    @Slot(object)
    def _on_error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self._done(ConversionResult("failed", error=f"could not start {self.arguments()[0]}"))

    @Slot(int, object)
    def _on_finished(self, code: int, _status) -> None:
        self._on_stderr()
        if self._stderr.strip():
            self._errors.append(self._stderr.strip())
        self._cleanup()
        wall = time.monotonic() - self._t0
        if self._cancelled:
            if not self._output_existed and self.output.exists():  # finished just before the cancel
                if self.output.is_dir():
                    shutil.rmtree(self.output, ignore_errors=True)
                else:
                    self.output.unlink(missing_ok=True)
            self._done(ConversionResult("cancelled", seconds=wall))
            return
        if code != 0:
            message = next((e for e in reversed(self._errors) if e.startswith("hearth:")), None)
            message = message or (self._errors[-1] if self._errors else f"hearth convert exited with {code}")
            self._done(
                ConversionResult("failed", error=message.removeprefix("hearth:").strip(), seconds=wall)
            )
            return
        try:
            data = json.loads(self._stdout.decode("utf-8"))
            result = ConversionResult("done", data["output"], "", float(data["seconds"]), int(data["bytes"]))
        except (ValueError, KeyError, TypeError) as e:
            self._done(ConversionResult("failed", error=f"unexpected output of hearth convert ({e})"))
            return
        threading.Thread(target=self._index, args=(result,), daemon=True, name="hearth-index").start()

    def _index(self, result: ConversionResult) -> None:
        """Add the output to the library (reads its header: off the GUI thread)."""
        try:
            from models.library import Library

            Library().add(result.output, source="import")
        except Exception as e:  # noqa: BLE001 - the file is fine; say why it is not listed
            result.error = f"converted, but not added to the library: {e}"
        self._indexed.emit(result)

    @Slot(object)
    def _finish(self, result: ConversionResult) -> None:
        self._done(result)

    def _done(self, result: ConversionResult) -> None:
        if self.result is None:
            self.result = result
            self.finished.emit(result)
