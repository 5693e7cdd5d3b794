"""The main window's shortcuts, the Serve toggle, downloads that resume at launch, closing mid-work, and
settings that reach the real engine (SmolLM2, greedy, short replies), offscreen."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from app.qt import QApplication, Qt
from models.downloads import DownloadJob, state_path
from models.library import Library
from tests.app.windows import open_window
from tests.models.hubserver import HubServer, isolate_hf

pytestmark = pytest.mark.gui
FAKE_SERVE = [sys.executable, str(Path(__file__).with_name("fake_serve.py"))]


def _window(qtbot, engine=None, model="", **settings):
    return open_window(qtbot, engine, model, serve_command=FAKE_SERVE, **settings)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_keyboard_shortcuts(qtbot, engine):
    w, store = _window(qtbot, engine)
    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=5000)
    ctrl = Qt.KeyboardModifier.ControlModifier
    before = len(store.list_chats())
    qtbot.keyClick(w, Qt.Key.Key_N, ctrl)
    assert len(store.list_chats()) == before + 1 and w.chat_list.count() == before + 1
    qtbot.keyClick(w, Qt.Key.Key_F, ctrl)
    assert w.search.hasFocus()
    qtbot.keyClick(w, Qt.Key.Key_Comma, ctrl)
    qtbot.waitUntil(lambda: w.settings_dialog is not None and w.settings_dialog.isVisible(), timeout=5000)
    w.settings_dialog.reject()
    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=5000)
    qtbot.keyClick(w, Qt.Key.Key_L, ctrl | Qt.KeyboardModifier.ShiftModifier)
    qtbot.waitUntil(lambda: w.library_window is not None and w.library_window.isVisible(), timeout=5000)
    w.library_window.close()
    from models.version import VERSION

    assert f"Hearth {VERSION}" in w.about_text()
    w.close()
    store.close()


def test_serve_toggle_shows_the_url_and_stops_the_server(qtbot, engine):
    port = _free_port()
    w, store = _window(qtbot, engine, serve_port=port)
    assert w.serve_button.isEnabled()
    with qtbot.waitSignal(w.server.stateChanged, timeout=30000, check_params_cb=lambda s, *_: s == "running"):
        w.serve_button.click()
    url = w.serve_label.text()
    assert url == f"http://127.0.0.1:{port}/v1" and w.serve_button.isChecked()
    assert f"Ollama clients (OLLAMA_HOST): http://127.0.0.1:{port}" in w.serve_label.toolTip()
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    pid = w.server.proc.processId()
    with qtbot.waitSignal(w.server.stateChanged, timeout=10000, check_params_cb=lambda s, *_: s == "stopped"):
        w.serve_button.click()
    assert not _alive(pid) and w.serve_label.text() == "" and not w.serve_button.isChecked()
    assert "stopped" in w.server.output, "the server got SIGTERM and exited on its own"

    # quitting the app stops a running server
    with qtbot.waitSignal(w.server.stateChanged, timeout=30000, check_params_cb=lambda s, *_: s == "running"):
        w.serve_button.click()
    pid = w.server.proc.processId()
    w.close()
    assert not _alive(pid)
    store.close()


def test_serve_failure_is_shown(qtbot, engine):
    w, store = _window(qtbot, engine)
    w.server.command = [*FAKE_SERVE, "--fail"]
    with qtbot.waitSignal(w.server.stateChanged, timeout=30000, check_params_cb=lambda s, *_: s == "failed"):
        w.serve_button.click()
    assert "already in use" in w.serve_label.toolTip() and not w.serve_button.isChecked()
    w.close()
    store.close()


def test_real_hearth_serve(qtbot, engine):
    from app.serve import serve_available

    ok, why = serve_available()
    if not ok:
        pytest.skip(why)
    w, store = _window(qtbot, engine, serve_port=_free_port())
    w.server.command = None
    with qtbot.waitSignal(
        w.server.stateChanged, timeout=120000, check_params_cb=lambda s, *_: s == "running"
    ):
        w.serve_button.click()
    base = w.serve_label.text().rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert r.status == 200
    pid = w.server.proc.processId()
    w.close()
    assert not _alive(pid)
    store.close()


def test_closing_mid_reply_saves_it_and_exits_cleanly(qtbot, engine):
    w, store = _window(qtbot, engine, max_tokens=400)
    w.composer.setPlainText("Write a long story about a lighthouse.")
    w.send()
    qtbot.waitUntil(lambda: w.controller._text.count(" ") >= 3, timeout=60000)
    chat_id = w.controller.chat.id
    w.close()
    reply = store.messages(chat_id)[-1]
    assert reply.role == "assistant" and reply.state == "stopped" and reply.content
    qtbot.waitUntil(lambda: not engine.generating, timeout=10000)
    store.close()


def _gguf_bytes(path: Path, nbytes: int) -> bytes:
    """A valid GGUF file of about `nbytes` (random F32 weights), as bytes."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(256)
    w.add_head_count(4)
    rows = nbytes // (256 * 4)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).normal(size=(rows, 256)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_downloads_resume_at_launch_after_closing_mid_download(qtbot, monkeypatch, tmp_path):
    server = HubServer()
    isolate_hf(monkeypatch, tmp_path, server)
    data = _gguf_bytes(tmp_path / "src.gguf", 3 << 20)
    server.add_repo("org/Resume-GGUF", {"m-Q4_0.gguf": data})
    server.throttle = 1 << 20
    try:
        w, store = _window(qtbot)
        job = w.downloads.add(
            DownloadJob(
                "org/Resume-GGUF", "m-Q4_0.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest()
            )
        )
        seen = []
        w.downloads.progress.connect(lambda _id, done, _total: seen.append(done))
        qtbot.waitUntil(lambda: bool(seen) and seen[-1] > 0, timeout=20000)
        w.close()  # mid-download: paused, remembered as queued
        store.close()
        saved = json.loads(state_path().read_text())["jobs"]
        assert [(j["filename"], j["state"]) for j in saved] == [("m-Q4_0.gguf", "queued")]
        server.throttle = None
        w2, store2 = _window(qtbot)  # the library window is never opened
        manager = w2.downloads.manager
        qtbot.waitUntil(lambda: manager.get(job.id).state not in ("queued", "running"), timeout=30000)
        assert manager.get(job.id).state == "done", manager.get(job.id).error
        qtbot.waitUntil(lambda: any(e.file == "m-Q4_0.gguf" for e in Library().entries()), timeout=5000)
        entry = next(e for e in Library().entries() if e.file == "m-Q4_0.gguf")
        assert Path(entry.path).read_bytes() == data
        assert w2.downloads.manager.get(job.id).state == "done"
        ranges = [r.get("range") for r in server.log if r.get("path", "").endswith("m-Q4_0.gguf")]
        assert any(r for r in ranges), "the second run resumed with a Range request"
        w2.close()
        store2.close()
    finally:
        server.close()


def test_settings_reach_the_engine(qtbot, engine):
    w, store = _window(qtbot, engine)
    assert w.model_info is not None

    # device: CUDA is listed but disabled, with the reason, and a saved "cuda" shows as CPU
    dialog = w.open_settings()
    box = dialog.editors["device"]
    cuda = box.model().item(box.findData("cuda"))
    assert not cuda.isEnabled() and "CUDA" in cuda.toolTip() and dialog.device_note.text()
    layers = dialog.editors["gpu_layers"]
    assert not layers.isEnabled() and layers.text() == "all"  # -1: every layer, where CUDA works
    dialog.reject()
    w.settings.set("device", "cuda")
    qtbot.waitUntil(lambda: "CUDA unavailable" in w.status_device.text(), timeout=5000)

    # a machine where the app sees a GPU: device and GPU layers reach the worker, which runs the
    # model there (or, where the GPU is not usable after all, on the CPU with its reason shown)
    from engine.backends.cuda.device import probe

    w.cuda_ok, w.cuda_reason = True, ""
    w.settings.set("device", "cpu")
    with qtbot.waitSignal(engine.loaded, timeout=60000) as loaded:
        w.settings.update({"device": "cuda", "gpu_layers": 12})
    options = w.load_options()
    assert options.device == "cuda" and options.gpu_layers == 12
    info = loaded.args[0]
    qtbot.waitUntil(lambda: w.model_info is info, timeout=5000)
    if probe(0) is None:
        assert info.device == "cuda:0 (12/30 layers)" and w.status_device.text() == f"GPU {info.device}"
    else:
        assert info.device == "cpu" and w.status_device.text() == "CPU (CUDA unavailable)"
        assert w.status_device.toolTip().startswith("CUDA unavailable: ")
    w.cuda_ok, w.cuda_reason = False, "no GPU here"
    w.settings.update({"device": "cpu", "gpu_layers": -1})
    assert w.load_options().device == "cpu" and w.load_options().gpu_layers is None

    # context length, KV precision and KV reuse budget reload the model with them
    with qtbot.waitSignal(engine.loaded, timeout=60000) as loaded:
        w.settings.update({"n_ctx": 768, "kv_dtype": "f16", "prefix_cache_mb": 16})
    info = loaded.args[0]
    assert info.n_ctx == 768 and 0 < info.prefix_cache_bytes <= 16 << 20
    qtbot.waitUntil(lambda: w.model_info is info, timeout=5000)
    status = engine.client.status()
    assert status.models[-1]["n_ctx"] == 768

    # threads restart the worker with that many threads
    pid = engine.client.pid
    with qtbot.waitSignal(engine.loaded, timeout=60000):
        w.settings.set("threads", 1)
    assert engine.client.pid != pid and engine.client.threads == 1

    # sampling defaults apply to the next reply
    w.settings.set("max_tokens", 3)
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as done:
        w.composer.setPlainText("Count to twenty.")
        w.send()
    assert done.args[0].stats["generated_tokens"] <= 3

    # prompt lookup: its figures reach the status bar and the stored reply
    w.settings.update({"speculation": "prompt-lookup", "max_tokens": 24})
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as done:
        w.composer.setPlainText(f"Repeat exactly: {text}. Again: {text}.")
        w.send()
    stats = done.args[0].stats
    assert stats.get("speculation") == "prompt-lookup", stats
    assert w.status_spec.text().startswith("speculation prompt-lookup")

    # a draft model that is not there: the reply fails with the engine's message, the model stays
    w.settings.update({"speculation": "draft", "draft_model": str(Path(store.path).parent / "nope.gguf")})
    with qtbot.waitSignal(w.controller.messageDone, timeout=60000) as done:
        w.composer.setPlainText("Hi")
        w.send()
    assert done.args[0].state == "error" and "nope.gguf" in w.view.notice_label.text()
    w.close()
    store.close()


def test_fit_label_follows_the_device(qtbot, engine, smollm2_path, monkeypatch):
    """The fit label gives the GPU's verdict where the model will run on the GPU, the RAM's elsewhere,
    and is redone when the device or the context changes."""
    from models import fit

    little_ram = fit.MemoryInfo(
        total_ram=64 << 20, available_ram=32 << 20, total_vram=80 << 30, free_vram=80 << 30
    )
    monkeypatch.setattr(fit, "system_memory", lambda: little_ram)
    w, store = _window(qtbot, engine)
    w.model_box.addItem(smollm2_path.name, str(smollm2_path))
    w.model_box.setCurrentIndex(w.model_box.findData(str(smollm2_path)))
    w.cuda_ok, w.cuda_reason = True, ""
    w.settings.set("n_ctx", 1024)  # redone for the context: RAM, since the device is the CPU
    qtbot.waitUntil(lambda: w.fit_label.text() == "too large", timeout=10000)
    w.settings.set("device", "cuda")
    qtbot.waitUntil(lambda: w.fit_label.text() == "fits (GPU)", timeout=10000)
    assert "GPU: fits" in w.fit_label.toolTip()
    w.cuda_ok = False  # CUDA unusable: the model runs on the CPU, so RAM decides
    w.settings.set("n_ctx", 2048)
    qtbot.waitUntil(lambda: w.fit_label.text() == "too large", timeout=10000)
