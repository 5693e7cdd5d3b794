"""The library window against the loopback Hub: search, variants with fit, download, local list, delete."""

from __future__ import annotations

import pytest

from app.downloads import DownloadService
from app.library_window import LibraryWindow
from app.settings import Settings
from models.downloads import DownloadManager, DownloadSettings
from tests.models.hubserver import HubServer, isolate_hf
from tests.models.test_library import write_gguf

pytestmark = pytest.mark.gui


@pytest.fixture
def server(monkeypatch, tmp_path):
    s = HubServer()
    isolate_hf(monkeypatch, tmp_path, s)
    q4 = write_gguf(tmp_path / "src" / "Tiny-Q4_K_M.gguf").read_bytes()
    s.add_repo("org/Tiny-GGUF", {"Tiny-Q4_K_M.gguf": q4}, tags=("gguf",), downloads=9)
    yield s
    s.close()


def test_search_download_use_and_delete(qtbot, server):
    mgr = DownloadManager(settings=DownloadSettings(backoff_base=0.0), autostart=False)
    downloads = DownloadService(manager=mgr)
    win = LibraryWindow(Settings(), downloads=downloads)
    qtbot.addWidget(win)
    win.show()
    win.query.setText("tiny")
    with qtbot.waitSignal(win.relay.searched, timeout=10000):
        win.search_button.click()
    assert win.results.count() == 1 and "org/Tiny-GGUF" in win.results.item(0).text()
    with qtbot.waitSignal(win.relay.variants, timeout=10000):
        win.results.setCurrentRow(0)
    assert win.variants.count() == 1
    text = win.variants.item(0).text()
    assert text.startswith("Q4_K_M") and ("fits" in text or "tight" in text or "too large" in text)
    win.variants.setCurrentRow(0)
    with qtbot.waitSignal(win.localChanged, timeout=20000):
        win.download_button.click()
        qtbot.waitSignal(win.modelsChanged, timeout=20000).wait()
    qtbot.waitUntil(lambda: win.local.count() == 1, timeout=5000)
    assert win.local.count() == 1 and "Tiny-Q4_K_M.gguf" in win.local.item(0).text()
    win.local.setCurrentRow(0)
    with qtbot.waitSignal(win.useModel) as used:
        win.use_selected()
    assert used.args[0].endswith("Tiny-Q4_K_M.gguf")
    with qtbot.waitSignal(win.localChanged, timeout=5000):
        win.delete_selected(confirm=False)
    assert win.local.count() == 0
    win.shutdown()
    downloads.close()


def test_import_a_hugging_face_folder_and_chat_with_it(qtbot, tmp_path, monkeypatch):
    """Import folder… indexes a safetensors folder in place; "Chat with it" hands its path to the app (the
    engine loads folders as it loads GGUF files); a folder that is no model is refused with a message."""
    import shutil
    from pathlib import Path

    from app import library_window

    folder = tmp_path / "Tiny-Qwen3-MoE"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3moe", folder)
    win = LibraryWindow(Settings())
    qtbot.addWidget(win)
    with qtbot.waitSignal(win.localChanged, timeout=10000):
        win.import_folder(str(folder))
    def rows():
        return [i for i in range(win.local.count()) if "Tiny-Qwen3-MoE" in win.local.item(i).text()]

    qtbot.waitUntil(lambda: bool(rows()))
    row = rows()[0]
    win.local.setCurrentRow(row)
    with qtbot.waitSignal(win.useModel) as used:
        win.use_selected()
    assert Path(used.args[0]) == folder, used.args
    warnings = []
    monkeypatch.setattr(library_window.QMessageBox, "warning", lambda *a: warnings.append(a[2]))
    (tmp_path / "empty").mkdir()
    win.import_folder(str(tmp_path / "empty"))
    assert warnings and "empty" in warnings[0]
    win.shutdown()
