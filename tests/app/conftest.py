"""GUI test fixtures: Qt warnings fail the test; one engine (SmolLM2 loaded) shared per module."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from app.qt import QtMsgType, qInstallMessageHandler  # noqa: E402

_FAILING = (QtMsgType.QtWarningMsg, QtMsgType.QtCriticalMsg, QtMsgType.QtFatalMsg)
# the offscreen platform plugin says these whenever a window's size limits change or a window is raised;
# not the app's fault
_PLATFORM_NOISE = (
    "This plugin does not support propagateSizeHints()",
    "This plugin does not support raise()",
)


@pytest.fixture(autouse=True)
def fail_on_qt_warnings(qapp):
    """Every Qt warning/critical message during a test fails it (a clean app emits none)."""
    seen: list[str] = []

    def handler(kind, context, message):
        if kind in _FAILING and message not in _PLATFORM_NOISE:
            seen.append(f"{kind.name}: {message}")

    previous = qInstallMessageHandler(handler)
    yield seen
    qapp.processEvents()
    qInstallMessageHandler(previous)
    assert not seen, "Qt warnings: " + "; ".join(seen)


@pytest.fixture(scope="module")
def engine(qapp, smollm2_path):
    """An EngineBridge with SmolLM2 loaded (n_ctx 1024), shared by a module's tests."""
    from app.engine_bridge import EngineBridge
    from engine.client import LoadOptions

    bridge = EngineBridge()
    info = bridge.client.load_and_wait(
        smollm2_path, LoadOptions(n_ctx=1024, batch_size=64, prefix_cache_mb=64)
    )
    bridge.model = info
    yield bridge
    bridge.shutdown()
