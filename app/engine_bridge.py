"""Qt signals over engine.client: every call that can block runs in a background thread.

The engine itself runs in its worker process (engine.worker); this module owns the EngineClient, runs
load / generate / status / restart in Python threads and hands results to the GUI thread as queued
signals. Streamed text is batched (at most one `chunk` signal per STREAM_BATCH_S) so a fast model never
floods the event loop. After the worker dies mid-reply the bridge reports it and restarts the worker
(which reloads the models that were loaded).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Sequence

from app.qt import QObject, Signal
from engine.client import (
    ChatEvent,
    EngineClient,
    LoadOptions,
    LoadProgress,
    ModelInfo,
    WorkerDiedError,
)
from engine.generate import GenerationParams
from models.errors import HearthError

STREAM_BATCH_S = 0.03


class PrepareStopped(Exception):
    """Raised by a prepare step's progress report once the reply was stopped."""


class EngineBridge(QObject):
    """The GUI's handle on the engine.

    Signals:
        loadProgress(stage: str, fraction: float, message: str): a step of a load.
        loaded(info: ModelInfo): a load finished (also after a restart reloaded the model).
        loadFailed(message: str): a load failed; the models loaded before stay loaded.
        chunk(turn: int, text: str, event: ChatEvent): new reply text (batched) and the latest event.
        progress(turn: int, event: ChatEvent): prefill progress of a reply (no text yet).
        finished(turn: int, event: ChatEvent): the reply's last event (finish_reason set).
        failed(turn: int, message: str, crashed: bool): the reply failed; crashed: the worker died.
        restarting(): the worker is being restarted after a crash.
        restarted(ok: bool, message: str): the restart ended.
        prepared(turn: int, info: object): what a reply's `prepare` step said (before its first chunk).
        preparing(turn: int, done: int, total: int): how far a reply's `prepare` step is (its own units).
        statusReady(status: EngineStatus): an answer to poll_status().
    """

    loadProgress = Signal(str, float, str)
    loaded = Signal(object)
    loadFailed = Signal(str)
    chunk = Signal(int, str, object)
    progress = Signal(int, object)
    finished = Signal(int, object)
    failed = Signal(int, str, bool)
    restarting = Signal()
    restarted = Signal(bool, str)
    statusReady = Signal(object)
    prepared = Signal(int, object)
    preparing = Signal(int, int, int)

    def __init__(self, threads: int | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.client = EngineClient(threads=threads or None, start=False)
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._status_busy = threading.Lock()
        self.generating = False
        self.model: ModelInfo | None = None
        self._stopping = threading.Event()  # cancel() during a reply's prepare step

    def _spawn(self, target, *args) -> None:
        if self._closing:
            return
        t = threading.Thread(target=target, args=args, daemon=True, name="hearth-engine-call")
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _emit(self, signal, *args) -> None:
        if not self._closing:
            signal.emit(*args)

    # ---- loading
    def load(self, model: str, options: LoadOptions) -> None:
        """Load `model` (path or starter name) in the worker; progress and result come as signals."""
        self._spawn(self._load, model, options)

    def _load(self, model: str, options: LoadOptions) -> None:
        try:
            for event in self.client.load(model, options):
                if isinstance(event, LoadProgress):
                    self._emit(self.loadProgress, event.stage, float(event.fraction), event.message)
                elif isinstance(event, ModelInfo):
                    self.model = event
                    self._emit(self.loaded, event)
        except (HearthError, ValueError) as e:
            self._emit(self.loadFailed, str(e))
        except Exception as e:  # noqa: BLE001 - shown in the window, never a traceback dialog
            self._emit(self.loadFailed, f"the model could not be loaded: {e!r}")

    def reload(self, model: str, options: LoadOptions, threads: int | None = None) -> None:
        """Load `model` again with new options; a changed thread count restarts the worker first (its
        thread pools are sized when it starts)."""
        self._spawn(self._reload, model, options, threads or None)

    def _reload(self, model: str, options: LoadOptions, threads: int | None) -> None:
        if threads != self.client.threads:
            self.client.threads = threads
            try:
                self.client.restart(reload=False)
            except Exception as e:  # noqa: BLE001 - shown in the window
                self._emit(self.loadFailed, f"the engine could not be restarted: {e}")
                return
        self._load(model, options)

    # ---- replies
    def generate(
        self,
        turn: int,
        conversation: Sequence[dict],
        params: GenerationParams,
        chat_id: str | None,
        context_policy: str = "truncate-middle",
        speculation=None,
        template_vars: dict | None = None,
        prepare=None,
    ) -> None:
        """Stream a reply; `turn` tags every signal of it. `speculation`: engine SpeculationOptions;
        `template_vars`: further chat template variables (enable_thinking); `prepare`: (conversation,
        report) -> (conversation, info), run in the call's thread before the request (work too slow for the
        GUI thread, such as choosing what of a chat's documents goes in), its info sent as `prepared`;
        report(done, total) sends its progress as `preparing` and raises PrepareStopped once cancel() was
        called (the reply then ends cancelled without reaching the engine)."""
        self.generating = True
        self._stopping.clear()
        self._spawn(
            self._generate,
            turn,
            [dict(m) for m in conversation],
            params,
            chat_id,
            context_policy,
            speculation,
            template_vars,
            prepare,
        )

    def _generate(
        self, turn, conversation, params, chat_id, policy, speculation=None, template_vars=None, prepare=None
    ) -> None:
        pending: list[str] = []
        last_emit = 0.0
        last: ChatEvent | None = None
        try:
            if prepare is not None:
                try:
                    conversation, info = prepare(conversation, functools.partial(self._report, turn))
                except Exception:
                    if not self._stopping.is_set():
                        raise
                if self._stopping.is_set():  # Stop came while preparing: nothing goes to the engine
                    self.generating = False
                    self._emit(self.finished, turn, ChatEvent(finish_reason="cancelled"))
                    return
                self._emit(self.prepared, turn, info)
            extra = {"speculation": speculation} if speculation is not None else {}
            if template_vars:
                extra["template_vars"] = template_vars
            stream = self.client.generate(
                conversation, params, chat_id=chat_id, context_policy=policy, **extra
            )
            late = True  # a Stop that came before the request was out: cancelled at the first event
            for event in stream:
                if late and self._stopping.is_set():
                    self.client.cancel()
                late = False
                last = event
                if event.text:
                    pending.append(event.text)
                now = time.monotonic()
                if event.finish_reason:
                    break
                if pending and now - last_emit >= STREAM_BATCH_S:
                    self._emit(self.chunk, turn, "".join(pending), event)
                    pending.clear()
                    last_emit = now
                elif event.token is None and not pending:
                    self._emit(self.progress, turn, event)
            if pending:
                self._emit(self.chunk, turn, "".join(pending), last)
            self.generating = False
            self._emit(self.finished, turn, last or ChatEvent(finish_reason="stop"))
        except WorkerDiedError as e:
            if pending:
                self._emit(self.chunk, turn, "".join(pending), last)
            self.generating = False
            self._emit(self.failed, turn, str(e), True)
            self._restart()
        except Exception as e:  # noqa: BLE001 - typed errors carry a user message; others too
            if pending:
                self._emit(self.chunk, turn, "".join(pending), last)
            self.generating = False
            self._emit(self.failed, turn, str(e) if isinstance(e, HearthError) else repr(e), False)

    def _restart(self) -> None:
        if self._closing:
            return
        self._emit(self.restarting)
        try:
            infos = self.client.restart(reload=True)
        except Exception as e:  # noqa: BLE001
            self._emit(self.restarted, False, f"the engine could not be restarted: {e}")
            return
        for info in infos:
            self.model = info
            self._emit(self.loaded, info)
        self._emit(self.restarted, True, "")

    def _report(self, turn: int, done: int, total: int) -> None:
        """A prepare step's progress (its thread)."""
        self._emit(self.preparing, turn, done, total)
        if self._stopping.is_set():
            raise PrepareStopped("the reply was stopped")

    def cancel(self) -> None:
        """Stop the reply in progress (returns at once; `finished` follows with finish_reason cancelled)."""
        self._stopping.set()
        self.client.cancel()

    # ---- status
    def poll_status(self) -> None:
        """Ask the worker for memory and context use; answered with statusReady (skipped while one is out)."""
        if self.client.pid is None or not self._status_busy.acquire(blocking=False):
            return
        self._spawn(self._status)

    def _status(self) -> None:
        try:
            if self.client.alive:
                self._emit(self.statusReady, self.client.status(timeout=2.0))
        except (HearthError, OSError):
            pass
        finally:
            self._status_busy.release()

    # ---- shutdown
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop replies, shut the worker down and wait for the bridge's threads (no signal after this)."""
        self._closing = True
        with contextlib.suppress(Exception):  # closing anyway
            self.client.cancel()
        self.client.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
