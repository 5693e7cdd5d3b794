"""The library window against the loopback Hub: search, variants with fit, download, local list, delete."""

from __future__ import annotations

import pytest

from app.downloads import DownloadService
from app.library_window import LibraryWindow
from app.settings import Settings
from models.downloads import DownloadManager, DownloadSettings
from tests.models.hubserver import HubServer, isolate_hf, mmproj_bytes
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
        "mmproj-model-f16.gguf": mmproj_bytes(tmp_path / "src" / "t16.gguf", "gemma3", 100_000),
        "mmproj-model-Q8_0.gguf": mmproj_bytes(tmp_path / "src" / "t8.gguf", "gemma3", 50_000),
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


def _window(qtbot, chunk_size: int = 1 << 20):
    mgr = DownloadManager(settings=DownloadSettings(backoff_base=0.0, chunk_size=chunk_size), autostart=False)
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
    with qtbot.waitSignal(win.relay.planned, timeout=10000):
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
    with qtbot.waitSignal(win.relay.planned, timeout=10000):
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


def _buttons(win, job_id: str) -> dict:
    from app.qt import QPushButton

    row = win.bars[job_id].parentWidget()
    return {b.text(): b for b in row.findChildren(QPushButton)}


def test_a_tower_hearth_cannot_read_is_not_fetched_and_the_models_row_says_so(qtbot, server, tmp_path):
    import hashlib

    from models.paths import models_dir

    tower = mmproj_bytes(tmp_path / "src" / "llava.gguf", "llava", 300_000)
    model = write_gguf(tmp_path / "src" / "m.gguf").read_bytes()
    files = {"m-Q4_K_M.gguf": model, "mmproj-f16.gguf": tower}
    server.add_repo("org/Llava-vision-GGUF", files, tags=("gguf",))
    win, downloads = _window(qtbot)
    _open_repo(qtbot, win, "org/Llava-vision-GGUF")
    listed = win.variants.item(0).text()
    assert "text only (its vision tower's projector llava is not read by Hearth)" in listed
    assert "reads images" not in listed
    win.variants.setCurrentRow(0)
    with qtbot.waitSignal(win.relay.planned, timeout=10000):
        win.download_button.click()
    (job,) = downloads.jobs()
    assert job.filename == "m-Q4_K_M.gguf" and set(win.bars) == {job.id}
    said = "vision tower not fetched: projector llava is not one Hearth reads"
    assert said in win.labels[job.id].text() and said in win.hub_status.text()
    qtbot.waitUntil(lambda: job.state == "done", timeout=20000)
    folder = models_dir() / "hub" / "org" / "Llava-vision-GGUF"
    assert [p.name for p in folder.iterdir()] == ["m-Q4_K_M.gguf"]
    sha = hashlib.sha256(tower).hexdigest()
    assert [e["range"] for e in server.log if e["path"] == f"/cdn/{sha}"] == ["bytes=0-65535"] * 2, (
        "its header, read for the listing and again for the download; never the whole tower"
    )
    win.shutdown()
    downloads.close()


def test_cancelling_a_towers_row_leaves_the_model_and_a_models_row_cancels_its_tower(
    qtbot, server, vision_repo, tmp_path
):
    from models.paths import models_dir

    folder = models_dir() / "hub" / "org" / "Vision-GGUF"
    server.throttle = 100_000  # the tower takes about a second
    win, downloads = _window(qtbot)
    _open_repo(qtbot, win, "org/Vision-GGUF")
    win.variants.setCurrentRow(0)
    with qtbot.waitSignal(win.relay.planned, timeout=10000):
        win.download_button.click()
    model, tower = downloads.jobs()
    qtbot.waitUntil(lambda: tower.state == "running", timeout=10000)
    _buttons(win, tower.id)["Cancel"].click()
    qtbot.waitUntil(lambda: tower.state == "cancelled", timeout=10000)
    qtbot.waitUntil(lambda: model.state == "done", timeout=20000)
    assert [p.name for p in folder.iterdir()] == ["model-Q4_K_M.gguf"], "the model stays, its tower is gone"
    qtbot.waitUntil(lambda: win.bars[tower.id].format().startswith("cancelled"), timeout=5000)

    # the model cancelled while it and its tower run: both go, nothing is left in the folder
    from tests.models.hubserver import payload

    slow_tower = mmproj_bytes(tmp_path / "src" / "slow.gguf", "gemma3", 600_000)
    slow = {"slow-Q4_K_M.gguf": payload(400_000, 1), "mmproj-slow-f16.gguf": slow_tower}
    server.add_repo("org/Slow-vision-GGUF", slow, tags=("gguf",))
    server.throttle = 200_000
    _open_repo(qtbot, win, "org/Slow-vision-GGUF")
    win.variants.setCurrentRow(0)
    with qtbot.waitSignal(win.relay.planned, timeout=10000):
        win.download_button.click()
    model2, tower2 = downloads.jobs()[2:]
    assert tower2.beside == model2.filename == "slow-Q4_K_M.gguf"
    qtbot.waitUntil(lambda: model2.state == tower2.state == "running", timeout=10000)
    _buttons(win, model2.id)["Cancel"].click()
    qtbot.waitUntil(lambda: model2.state == tower2.state == "cancelled", timeout=10000)
    slow_folder = folder.parent / "Slow-vision-GGUF"
    assert not slow_folder.exists() or not list(slow_folder.iterdir())
    qtbot.waitUntil(lambda: win.bars[tower2.id].format().startswith("cancelled"), timeout=5000)
    win.shutdown()
    downloads.close()


def test_the_model_and_its_tower_must_fit_together_before_either_is_queued(
    qtbot, server, vision_repo, monkeypatch
):
    from collections import namedtuple

    from models import downloads as dl

    model, tower = len(vision_repo["model-Q4_K_M.gguf"]), len(vision_repo["mmproj-model-f16.gguf"])
    free = model + tower + dl.DownloadSettings().disk_margin - 1
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: usage(10**12, 0, free))
    win, downloads = _window(qtbot)
    _open_repo(qtbot, win, "org/Vision-GGUF")
    win.variants.setCurrentRow(0)
    with qtbot.waitSignal(win.relay.planned, timeout=10000):
        win.download_button.click()
    text = win.hub_status.text()
    assert f"the model needs {model / 2**20:,.1f} MiB and its vision tower {tower / 2**20:,.1f} MiB" in text
    assert f"{free / 2**20:,.1f} MiB free" in text
    assert downloads.jobs() == [] and win.bars == {}
    win.shutdown()
    downloads.close()


def test_deleting_a_model_whose_tower_is_still_coming_cancels_the_tower(qtbot, server, vision_repo):
    import hashlib

    from models.paths import models_dir

    folder = models_dir() / "hub" / "org" / "Vision-GGUF"
    win, downloads = _window(qtbot, chunk_size=8192)  # a stop is seen after each chunk
    _open_repo(qtbot, win, "org/Vision-GGUF")
    server.throttle = 30_000  # the tower takes seconds, the model a moment
    win.variants.setCurrentRow(0)
    with qtbot.waitSignal(win.relay.planned, timeout=20000):
        win.download_button.click()
    model, tower = downloads.jobs()
    qtbot.waitUntil(lambda: model.state == "done" and win.local.count() == 1, timeout=20000)
    assert tower.state == "running"
    win.local.setCurrentRow(0)
    win.delete_selected(confirm=False)
    qtbot.waitUntil(lambda: tower.state == "cancelled", timeout=5000)
    assert not folder.exists() or not list(folder.iterdir()), "no model, no tower, no partial"
    sha = hashlib.sha256(vision_repo["mmproj-model-f16.gguf"]).hexdigest()
    (fetch,) = [e for e in server.log if e["path"] == f"/cdn/{sha}" and e["range"] is None]
    assert fetch["sent"] < len(vision_repo["mmproj-model-f16.gguf"]), "stopped, not fetched to the end"
    win.shutdown()
    downloads.close()
