"""GUI event-loop latency of the real main window during background work, and launch-to-first-token.

Phases (each measured with a 5 ms QTimer probe; latency = how late each tick fires):
    load        the window loads the starter model in the engine worker
    generation  a long greedy reply streams into the chat view (Markdown rendered as it arrives)
    download    models.downloads.DownloadManager fetches a throttled file from a loopback Hub server,
                its progress callbacks driving a progress bar in the window
    conversion  the Convert dialog converts the model (default to Q4_K_M) in a `hearth convert` child
                process, its progress lines driving the dialog's progress bar
Then `--first-token` runs `python -m app.main` in a fresh process N times and reports launch -> first
streamed token (warm Numba cache: HEARTH_KERNEL_CACHE, default the test models' cache).

    .venv/bin/python scripts/gui_latency.py [-r 3] [--model PATH] [--convert-to FORMAT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
CACHE = Path.home() / ".cache" / "hearth-test-models"
os.environ.setdefault("HEARTH_KERNEL_CACHE", str(CACHE / "numba-cache"))
PROBE_MS = 5


class Probe:
    def __init__(self):
        from app.qt import QTimer

        self.timer = QTimer()
        self.timer.setInterval(PROBE_MS)
        self.timer.timeout.connect(self._tick)
        self.samples: list[float] = []
        self.last = None

    def _tick(self):
        now = time.perf_counter()
        if self.last is not None:
            self.samples.append(max(0.0, (now - self.last) * 1000 - PROBE_MS))
        self.last = now

    def start(self):
        self.samples, self.last = [], None
        self.timer.start()

    def stop(self) -> list[float]:
        self.timer.stop()
        return self.samples


def summary(name: str, samples: list[float]) -> str:
    if not samples:
        return f"{name:<11} no samples"
    s = sorted(samples)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return f"{name:<11} n={len(s):5d}  p50 {p(0.5):6.1f} ms  p99 {p(0.99):6.1f} ms  max {s[-1]:6.1f} ms"


def wait(app, cond, timeout):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        app.processEvents()
        time.sleep(0.001)
    if not cond():
        raise SystemExit("timed out")


def measure_window(model: str, fmt: str = "Q4_K_M") -> dict[str, list[float]]:
    from app.chat_store import ChatStore
    from app.main_window import MainWindow
    from app.qt import QApplication, QProgressBar
    from app.settings import Settings

    app = QApplication.instance() or QApplication([])
    settings = Settings()
    settings.update({"temperature": 0.0, "max_tokens": 300})
    store = ChatStore()
    results: dict[str, list[float]] = {}
    probe = Probe()
    w = MainWindow(settings, store, model="")
    w.show()
    app.processEvents()
    probe.start()  # the window is up; from here on the load runs in the engine worker
    w.load_model(model)
    loaded = []
    w.bridge.loaded.connect(lambda info: loaded.append(info))
    wait(app, lambda: bool(loaded), 300)
    results["load"] = probe.stop()

    done = []
    w.controller.messageDone.connect(lambda m: done.append(m))
    probe.start()
    w.composer.setPlainText("Write a long essay about rivers, with headings and a list.")
    w.send()
    wait(app, lambda: bool(done), 300)
    results["generation"] = probe.stop()

    from models.downloads import DownloadJob
    from tests.models.hubserver import HubServer

    server = HubServer()
    data = os.urandom(24 << 20)
    server.add_repo("org/Big-GGUF", {"big-Q4_0.gguf": data})
    server.throttle = 8 << 20
    os.environ["HF_ENDPOINT"] = server.url

    # the app's own download service (what the library window's queue shows), its progress in a bar
    bar = QProgressBar()
    w.statusBar().addWidget(bar)
    w.downloads.progress.connect(lambda _id, d, t: (bar.setMaximum(max(1, t >> 10)), bar.setValue(d >> 10)))
    import hashlib

    mgr = w.downloads.manager
    job = w.downloads.add(
        DownloadJob("org/Big-GGUF", "big-Q4_0.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest())
    )
    probe.start()
    wait(app, lambda: mgr.get(job.id).state not in ("queued", "running"), 120)
    results["download"] = probe.stop()
    state = mgr.get(job.id).state
    server.close()
    if state != "done":
        print(f"download ended {state}: {mgr.get(job.id).error}")

    # conversion: the library's Convert dialog runs `hearth convert` (a child process) on the model
    from app.convert_dialog import ConvertDialog

    out_dir = Path(tempfile.mkdtemp(prefix="hearth-lat-convert-"))
    dialog = ConvertDialog(model, None, fmt, out_dir, parent=w)
    dialog.show()
    wait(app, lambda: dialog.table.rowCount() > 0, 120)
    dialog.select_format(fmt)
    probe.start()
    dialog.start()
    wait(app, lambda: dialog.last_result is not None, 600)
    results["conversion"] = probe.stop()
    r = dialog.last_result
    print(f"conversion to {fmt}: {r.state} in {r.seconds:.1f} s ({r.nbytes / 2**20:,.1f} MiB) {r.error}")
    dialog.close()
    w.close()
    store.close()
    return results


def first_token(model: str, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        home = tempfile.mkdtemp(prefix="hearth-ft-")
        env = dict(os.environ, HEARTH_HOME=home)
        Path(home, "config").mkdir(parents=True)
        Path(home, "config", "settings.json").write_text(
            json.dumps({"values": {"temperature": 0.0, "max_tokens": 8}})
        )
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app.main",
                "--model",
                model,
                "--send",
                "Hi",
                "--print-stream",
                "--quit-after-reply",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = None
        for line in proc.stdout:
            if first is None and '"text"' in line:
                first = time.perf_counter() - t0
        proc.wait(60)
        out.append(first if first is not None else float("nan"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--repeat", type=int, default=3, help="first-token runs")
    ap.add_argument("--model", default=str(CACHE / "starter" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--skip-window", action="store_true")
    ap.add_argument("--convert-to", default="Q4_K_M", help="target format of the conversion phase")
    args = ap.parse_args()
    os.environ["HEARTH_HOME"] = tempfile.mkdtemp(prefix="hearth-lat-")
    if not args.skip_window:
        for name, samples in measure_window(args.model, args.convert_to).items():
            print(summary(name, samples), flush=True)
    times = first_token(args.model, args.repeat)
    print(
        "first token "
        + "  ".join(f"{t:.2f} s" for t in times)
        + f"  (median {statistics.median(times):.2f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
