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


@pytest.fixture
def vision_repo(server, tmp_path):
    files = {
        "model-Q4_K_M.gguf": write_gguf(tmp_path / "src" / "model-Q4_K_M.gguf", arch="gemma3").read_bytes(),
        "mmproj-model-f16.gguf": write_gguf(tmp_path / "src" / "t16.gguf", arch="clip").read_bytes(),
        "mmproj-model-Q8_0.gguf": write_gguf(
            tmp_path / "src" / "t8.gguf", arch="clip", n_layer=3
        ).read_bytes(),
    }
    server.add_repo("org/Vision-GGUF", files, tags=("gguf",), downloads=1)
    return files


def _open_repo(qtbot, win, repo: str) -> None:
    win.query.setText("vision")
    with qtbot.waitSignal(win.relay.searched, timeout=10000):
        win.search_button.click()
    row = next(i for i in range(win.results.count()) if repo in win.results.item(i).text())
    with qtbot.waitSignal(win.relay.variants, timeout=10000):
        win.results.setCurrentRow(row)


def _window(qtbot):
    mgr = DownloadManager(settings=DownloadSettings(backoff_base=0.0), autostart=False)
    downloads = DownloadService(manager=mgr)
    win = LibraryWindow(Settings(), downloads=downloads)
    qtbot.addWidget(win)
    win.show()
    return win, downloads


def test_a_models_vision_tower_comes_along_in_its_own_row(qtbot, server, vision_repo):
    from models.paths import models_dir

    win, downloads = _window(qtbot)
    _open_repo(qtbot, win, "org/Vision-GGUF")
    texts = [win.variants.item(i).text() for i in range(win.variants.count())]
    assert texts[0].startswith("Q4_K_M") and "reads images" in texts[0]
    assert sorted(t.split("  ·  ")[:2] for t in texts[1:]) == [
        ["vision tower (mmproj)", "F16"],
        ["vision tower (mmproj)", "Q8_0"],
    ]
    win.variants.setCurrentRow(0)
    win.download_button.click()
    jobs = downloads.jobs()
    assert [(j.filename, j.beside) for j in jobs] == [
        ("model-Q4_K_M.gguf", None),
        ("mmproj-model-f16.gguf", "model-Q4_K_M.gguf"),
    ]
    assert set(win.bars) == {j.id for j in jobs}, "each file has its queue row"
    qtbot.waitUntil(lambda: all(j.state == "done" for j in jobs), timeout=20000)
    folder = models_dir() / "hub" / "org" / "Vision-GGUF"
    assert sorted(p.name for p in folder.iterdir()) == ["mmproj-model-f16.gguf", "model-Q4_K_M.gguf"]
    qtbot.waitUntil(
        lambda: win.local.count() == 1 and "reads images" in win.local.item(0).text(), timeout=5000
    )
    assert "model-Q4_K_M.gguf" in win.local.item(0).text() and "mmproj" not in win.local.item(0).text()

    win.variants.setCurrentRow(0)
    win.download_button.click()
    assert len(downloads.jobs()) == 2, "the folder has its tower: nothing more is queued"
    win.local.setCurrentRow(0)
    win.delete_selected(confirm=False)
    qtbot.waitUntil(lambda: win.local.count() == 0, timeout=5000)
    assert not folder.exists() or not list(folder.iterdir()), "the model's tower goes with it"
    win.shutdown()
    downloads.close()


def test_a_failed_vision_tower_is_reported_and_the_model_stays(qtbot, server, vision_repo):
    import hashlib

    good = vision_repo["mmproj-model-f16.gguf"]
    server.blobs[hashlib.sha256(good).hexdigest()] = good[:-100]  # a truncated tower
    win, downloads = _window(qtbot)
    _open_repo(qtbot, win, "org/Vision-GGUF")
    win.variants.setCurrentRow(0)
    with qtbot.waitSignal(downloads.error, timeout=20000) as failed:
        win.download_button.click()
    model, tower = downloads.jobs()
    assert "mmproj-model-f16.gguf" in failed.args[0] and "works for text" in failed.args[0]
    qtbot.waitUntil(lambda: model.state == "done" and win.local.count() == 1, timeout=20000)
    assert tower.state == "failed"
    # the row's bar follows the job's state through the queue's own signal, which may come a moment later
    qtbot.waitUntil(lambda: "failed" in win.bars[tower.id].format(), timeout=5000)
    qtbot.waitUntil(lambda: "works for text" in win.hub_status.text(), timeout=5000)
    assert "reads images" not in win.local.item(0).text()
    win.shutdown()
    downloads.close()
