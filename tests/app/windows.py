"""The real main window for GUI tests: over a test's engine bridge, with a fresh chat store (HEARTH_HOME is a
temp dir), shown; greedy replies of 12 tokens unless the settings given say otherwise."""

from __future__ import annotations

import pickle

from app.chat_store import ChatStore
from app.main_window import MainWindow
from app.settings import Settings
from engine.client import ChatEvent


def open_window(qtbot, engine=None, model: str = "", serve_command=None, **settings):
    """(window, store). engine: an EngineBridge (None: the window makes its own); serve_command: the API
    server's command line (the window's default when None)."""
    s = Settings()
    s.update({"temperature": 0.0, "max_tokens": 12, **settings})
    store = ChatStore()
    extra = {} if serve_command is None else {"serve_command": serve_command}
    w = MainWindow(s, store, bridge=engine, model=model, **extra)
    qtbot.addWidget(w)
    w.show()
    return w, store


def wait_checked(qtbot, box) -> None:
    """Wait for the composer's attachment checks (they run in its worker thread)."""
    qtbot.waitUntil(lambda: not box.checking, timeout=10000)


def record_replies(engine, monkeypatch, answer: str, params: list | None = None) -> list[list[dict]]:
    """Swap the engine's generate for a stand-in that records each conversation as the worker would get it
    (through its pipe) and answers `answer`; returns the recorded conversations (and appends each reply's
    GenerationParams to `params` when given)."""
    calls: list[list[dict]] = []

    def generate(conversation, params_=None, **_kwargs):
        calls.append(pickle.loads(pickle.dumps(conversation)))
        if params is not None:
            params.append(params_)
        yield ChatEvent(text=answer, token=1, generated_tokens=1)
        yield ChatEvent(finish_reason="stop", generated_tokens=1)

    monkeypatch.setattr(engine.client, "generate", generate)
    return calls
