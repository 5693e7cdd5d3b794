"""Screenshots of each window (main window with a sample chat, library, Convert, chat options, settings) for
the README.

Runs under Xvfb when `xvfb-run` is installed (`apt-get install xvfb`; real X11 rendering), else on
Qt's offscreen platform. No engine is started: the chat shown is a stored sample conversation; the
library lists the starter model from the test-model cache when it is there (and Convert shows its formats).

    .venv/bin/python scripts/screenshots.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = [
    ("user", "How do I read a file line by line in Python?"),
    (
        "assistant",
        'Open it in a `with` block and iterate:\n\n```python\nwith open("notes.txt") as f:\n'
        "    for line in f:\n        print(line.rstrip())\n```\n\n- the file closes by itself\n"
        "- lines keep their `\\n`, hence `rstrip()`",
    ),
]


def shoot(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ["HEARTH_HOME"] = tempfile.mkdtemp(prefix="hearth-shots-")
    from app.chat_store import ChatStore
    from app.library_window import LibraryWindow
    from app.main_window import MainWindow
    from app.qt import QApplication
    from app.settings import Settings
    from app.settings_dialog import SettingsDialog

    app = QApplication.instance() or QApplication([])
    settings, store = Settings(), ChatStore()
    chat = store.create_chat("Reading files in Python")
    for role, text in SAMPLE:
        store.add_message(chat.id, role, text)
    w = MainWindow(settings, store, model="")
    w.show()
    for _ in range(20):
        app.processEvents()
    out.mkdir(parents=True, exist_ok=True)
    w.grab().save(str(out / "main-window.png"))
    import time

    def settle(cond=lambda: True, seconds: float = 20.0) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not cond():
            app.processEvents()
            time.sleep(0.01)
        for _ in range(10):
            app.processEvents()

    from models.library import Library
    from models.starter import starter_path

    name = starter_path("smollm2-135m-instruct").name
    starter = Path.home() / ".cache" / "hearth-test-models" / "starter" / name
    if starter.is_file():
        Library().import_path(starter)
    lib = LibraryWindow(settings, downloads=w.downloads)
    lib.tabs.setCurrentIndex(2)
    lib.show()
    settle(lambda: lib.local.count() > 0, 5.0)
    lib.local.setCurrentRow(0)
    settle()
    lib.grab().save(str(out / "library.png"))
    if lib.entries:
        convert = lib.convert_selected()
        convert.resize(900, 520)
        settle(lambda: convert.table.rowCount() > 0, 60.0)
        convert.grab().save(str(out / "convert.png"))
        convert.close()
    from app.chat_options import ChatOptionsDialog
    from models.library import Preset

    pirate = {"temperature": 0.9, "top_k": 50, "stop": ["Captain:"]}
    if starter.is_file():  # a preset over the starter, listed by the dialog's Preset box
        Library().save_preset(Preset("pirate", str(starter), "You are a pirate. Answer like one.",
                                     parameters=pirate))
    options = ChatOptionsDialog("You are a pirate. Answer like one.", pirate, settings, w,
                                model_path=str(starter) if starter.is_file() else None)
    options.show()
    settle()
    options.grab().save(str(out / "chat-options.png"))
    options.close()
    dialog = SettingsDialog(settings, w, cuda_available=w.cuda_ok, cuda_reason=w.cuda_reason)
    dialog.show()
    settle()
    dialog.grab().save(str(out / "settings.png"))
    lib.shutdown()
    w.close()
    store.close()
    print("\n".join(str(p) for p in sorted(out.glob("*.png"))))


def main() -> int:
    ap = argparse.ArgumentParser(description="screenshots of Hearth's windows")
    ap.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inner and shutil.which("xvfb-run") and not os.environ.get("DISPLAY"):
        cmd = [
            "xvfb-run",
            "-a",
            "-s",
            "-screen 0 1280x900x24",
            sys.executable,
            __file__,
            "--inner",
            "--out",
            args.out,
        ]
        return subprocess.call(cmd)
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    shoot(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
