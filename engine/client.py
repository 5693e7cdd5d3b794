"""Qt-free client of the engine worker process (engine.worker).

The GUI (or any caller) talks to models only through EngineClient. The worker runs in its own
process, started with the "spawn" method (the same on every OS), so a crash or an out-of-memory
kill there never takes the caller down: the client raises WorkerDiedError, whatever events the
caller already received stay valid, and the next call (or restart()) starts a fresh worker and
reloads the models that were loaded.

Protocol (tuples over one multiprocessing Pipe):
    client -> worker: (op, req_id, payload) with op in load, generate, embed, unload, status, cancel,
        shutdown
    worker -> client: (kind, req_id, payload) with kind in progress, loaded, event, embedded, done, status,
        error
A receiver thread in the client routes worker messages into one queue per request.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.generate import GenerationParams
from models.errors import HearthError

# LoadOptions.kv_dtype -> the KV cache's element type
KV_DTYPES = {"f32": np.float32, "f16": np.float16}
CANCEL_GRACE_S = 0.05  # how long cancel() waits for the worker's own final event before returning


class WorkerDiedError(HearthError):
    """The engine process ended while a request was in flight (crash, kill, out of memory)."""


class EngineError(HearthError):
    """An error raised in the worker whose type has no counterpart importable here.

    Attributes:
        kind: the original exception's class name.
        details: its traceback text (for bug reports), empty for user errors.
    """

    def __init__(self, message: str, kind: str = "", details: str = ""):
        self.kind = kind
        self.details = details
        super().__init__(message)


class NoModelLoadedError(HearthError):
    """A reply was requested but no (or no such) model is loaded."""


@dataclass
class LoadOptions:
    """How to load a model.

    Args:
        n_ctx: context length in tokens.
        batch_size: prefill batch (tokens per forward pass); cancel is checked between batches.
        threads: Numba threads for this model's kernels (None: all the worker has).
        prefix_cache_mb: RAM for KV states of other conversations (0 disables it); lowered
            automatically when memory is short.
        name: key to address the model by (default: the file name without extension).
        kv_dtype: KV cache precision, "f16" (the default, as llama.cpp's and Ollama's: half the
            memory per token of context, and faster decoding at long contexts, where attention reads
            the cache: SmolLM2 at 4000 keys 25.7 -> 20.0 ms a token) or "f32"; attention sums in
            float32 either way.
        device: "cpu", "cuda" or "cuda:N". Without CuPy or a usable GPU the model runs on the CPU
            and the load reports why (a "warning" progress step).
        gpu_layers: with a CUDA device, how many layers go to the GPU (None: all; 0: none); the
            others run on the CPU (partial offload).
    """

    n_ctx: int = 4096
    batch_size: int = 256
    threads: int | None = None
    prefix_cache_mb: int = 512
    name: str | None = None
    kv_dtype: str = "f16"
    device: str = "cpu"
    gpu_layers: int | None = None

    def __post_init__(self):
        if self.n_ctx < 16:
            raise ValueError("n_ctx must be at least 16 tokens")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.prefix_cache_mb < 0:
            raise ValueError("prefix_cache_mb must be >= 0")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        from engine.backends.cuda.device import DeviceSpecError, parse_device  # no CuPy import

        try:
            parse_device(self.device)
        except DeviceSpecError as e:
            raise ValueError(str(e)) from None
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise ValueError("gpu_layers must be >= 0 (None: all layers)")

    @property
    def kv_numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the KV cache these options ask for."""
        return np.dtype(KV_DTYPES[self.kv_dtype])


# SpeculationOptions.mode values ("lookup" is accepted as a short form of "prompt-lookup")
SPECULATION_MODES = ("off", "draft", "prompt-lookup")


@dataclass
class SpeculationOptions:
    """Speculative decoding for one reply (EngineClient.generate's `speculation`).

    The reply is the target model's either way (greedy: token for token the same; sampling: the
    same distribution); speculation only makes it faster when the drafts are often right.

    Args:
        mode: "off", "draft" (a small model with the target's tokenizer proposes tokens) or
            "prompt-lookup" (tokens copied from the conversation itself: rewrites, quotes, code edits).
        draft_model: the draft's file path or starter name (mode "draft"); loaded in the worker on
            first use and kept for later replies. Load and compatibility failures come back as
            engine.speculative.DraftLoadError / IncompatibleDraftError from the reply's stream.
        k: draft length to start from (1..15).
        adaptive: adapt k to the measured acceptance and switch speculation off for the rest of
            a stretch when it would be slower than plain decoding.
    """

    mode: str = "off"
    draft_model: str | None = None
    k: int = 4
    adaptive: bool = True

    def __post_init__(self):
        if self.mode == "lookup":
            self.mode = "prompt-lookup"
        if self.mode not in SPECULATION_MODES:
            modes = ", ".join(SPECULATION_MODES)
            raise ValueError(f"speculation mode must be one of {modes}, got {self.mode!r}")
        if self.mode == "draft" and not self.draft_model:
            raise ValueError("speculation mode 'draft' needs draft_model (a model path or starter name)")
        if not 1 <= self.k <= 15:
            raise ValueError(f"speculation k must be between 1 and 15, got {self.k}")


@dataclass
class LoadProgress:
    """A step of a load: stage in resolve, download, check, map, warmup; fraction 0..1 of the load."""

    stage: str
    fraction: float
    message: str = ""


@dataclass
class ModelInfo:
    """A loaded model, as the worker reports it (the final event of a load)."""

    key: str
    name: str
    path: str
    n_ctx: int
    trained_ctx: int
    file_size: int
    load_s: float
    prefix_cache_bytes: int
    estimated_bytes: int
    warnings: list[str] = field(default_factory=list)
    device: str = "cpu"  # where it runs: "cpu", "cuda:0", "cuda:0 (12/28 layers)"
    vision: bool = False  # it reads images in messages (engine.vision)
    tool_format: str = ""  # how its chat template has it call tools (engine.tools.tool_format); "": no tools


@dataclass
class ChatEvent:
    """One step of a reply.

    Events with token None and finish_reason None report prefill progress (prefilled of
    to_prefill). The last event has finish_reason set: "stop", "length", "context" (window full) or
    "cancelled"; its counters are final.
    """

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0  # prompt length after the context policy
    cached_tokens: int = 0  # prompt tokens reused (live cache or prefix store), not prefilled
    restored_tokens: int = 0  # of those, copied from the prefix store (another chat's state)
    to_prefill: int = 0
    prefilled: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    context_size: int = 0
    context_before: int = 0  # tokens in context when the reply starts (the prompt)
    context_after: int = 0  # tokens in context after this event
    dropped_messages: int = 0  # messages the context policy left out
    # images of the prompt the vision tower encodes before the prefill (0: none new), and how far it is
    # (1.5: the first done, the second half way)
    images_to_read: int = 0
    images_read: float = 0.0
    peak_memory_mb: float = 0.0
    # Speculative decoding (all zero / "" when the reply runs without it); running figures of the reply.
    speculation: str = ""  # the mode in use: "draft" or "prompt-lookup"
    from_draft: bool = False  # this event's token was drafted and accepted by the target
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / drafted
    tokens_per_pass: float = 0.0  # tokens emitted per target forward pass (1.0 = plain decoding)
    speedup_estimate: float = 0.0  # modelled speed over plain decoding from measured pass times
    draft_k: int = 0  # draft length in use now (0: switched off for the moment)
    target_passes: int = 0


@dataclass
class EngineStatus:
    """Worker state: memory, loaded models with their context use, whether it is busy.

    busy stays True for a moment after a reply's last event, while the turn is filed in the
    prefix store; a request sent then simply queues behind it.
    """

    pid: int
    rss_mb: float
    busy: bool
    models: list[dict]
    embedding_model: dict | None = None  # the embedder kept loaded ({"path", "name", "bytes"}), if any


def _worker_entry(conn, threads: int | None) -> None:
    """Process target (module-level and light, so the parent never imports the heavy engine)."""
    if threads:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            os.environ[var] = str(threads)
    from engine.worker import serve

    serve(conn)


_DIED = object()
_CANCELLED = object()
# modules whose error classes may be rebuilt here; any other type arrives as EngineError
_ERROR_MODULES = (
    "models.errors",
    "engine.errors",
    "engine.memory_guard",
    "engine.context_policy",
    "engine.chat_template",
    "engine.client",
    "engine.speculative",
    "engine.backends.cuda.device",
)


def _rebuild_error(payload: dict) -> Exception:
    """The worker's exception as the same HearthError subclass when it is importable, else EngineError."""
    module, kind, message = payload["module"], payload["kind"], payload["message"]
    if payload.get("user") and module in _ERROR_MODULES:
        import importlib

        cls = getattr(importlib.import_module(module), kind, None)
        if isinstance(cls, type) and issubclass(cls, HearthError):
            exc = BaseException.__new__(cls)  # cls.__new__ would be MemoryError's for one that is one too
            Exception.__init__(exc, message)
            exc.__dict__.update(payload.get("attrs") or {})
            return exc
    if payload.get("builtin") in ("ValueError", "TypeError"):
        return ValueError(message)
    return EngineError(message, kind, payload.get("details", ""))


def describe_exit(exitcode: int | None) -> str:
    """Human words for a process exit code."""
    if exitcode is None:
        return "its connection closed"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (the system may have run out of memory)" if name == "SIGKILL" else ""
        return f"it was killed by {name}{hint}"
    return f"it exited with code {exitcode}"


class EngineClient:
    """Owns one worker process and talks to it. Thread-safe; usable as a context manager.

    Args:
        threads: CPU threads for the worker (None: all cores).
        start: start the worker now (otherwise on first use).
    """

    def __init__(self, threads: int | None = None, start: bool = True):
        self.threads = threads
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._queues: dict[int, queue.Queue] = {}
        self._active_generations: set[int] = set()
        self._cancelled: set[int] = set()
        self._loaded: dict[str, tuple[str, LoadOptions]] = {}  # key -> (model spec, options) for restarts
        self._proc = None
        self._conn = None
        self._receiver = None
        self._dead_reason: str | None = None
        if start:
            self._start()

    # -- process management -------------------------------------------------------------------

    def _start(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_entry, args=(child, self.threads), daemon=True)
        proc.start()
        child.close()  # only the worker holds it now, so its death shows here as EOF
        self._proc, self._conn, self._dead_reason = proc, parent, None
        self._receiver = threading.Thread(target=self._receive, args=(parent, proc), daemon=True)
        self._receiver.start()

    def _receive(self, conn, proc) -> None:
        while True:
            try:
                kind, req_id, payload = conn.recv()
            except (EOFError, OSError):
                break
            q = self._queues.get(req_id)
            if q is not None:
                q.put((kind, payload))
        with self._lock:
            stopping = self._proc is not proc
        if stopping:  # _stop reaps it: two threads waiting on one child race for its exit code
            return
        proc.join(timeout=2.0)
        with self._lock:
            if self._proc is proc:
                self._dead_reason = describe_exit(proc.exitcode)
                waiting = list(self._queues.values())
            else:
                waiting = []
        for q in waiting:
            q.put((_DIED, None))

    @property
    def alive(self) -> bool:
        """Whether the worker process is running."""
        return self._proc is not None and self._proc.is_alive() and self._dead_reason is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def restart(self, reload: bool = True) -> list[ModelInfo]:
        """Stop the worker (killing it if it does not stop) and start a fresh one.

        Args:
            reload: load again the models that were loaded, with the same options.

        Returns:
            the reloaded models.
        """
        self._stop(timeout=2.0)
        self._start()
        infos = []
        if reload:
            for key, (spec, options) in list(self._loaded.items()):
                try:
                    infos.append(self.load_and_wait(spec, options))
                except HearthError:
                    self._loaded.pop(key, None)
        return infos

    def _ensure(self) -> None:
        # held through a restart, so two threads finding the worker dead start only one
        with self._lock:
            if self._proc is None:
                self._start()
            elif not self.alive:
                self.restart(reload=True)

    def _stop(self, timeout: float) -> None:
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        with self._lock:
            self._proc = None
        try:
            with self._send_lock:
                conn.send(("shutdown", 0, None))
        except (OSError, ValueError):
            pass
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout)
        conn.close()
        for q in list(self._queues.values()):
            q.put((_DIED, None))

    def close(self) -> None:
        """Shut the worker down (models are unloaded)."""
        self._stop(timeout=5.0)
        self._loaded.clear()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------

    def _request(self, op: str, payload: Any) -> tuple[int, queue.Queue]:
        self._ensure()
        req_id = next(self._ids)
        q: queue.Queue = queue.Queue()
        self._queues[req_id] = q
        try:
            with self._send_lock:
                self._conn.send((op, req_id, payload))
        except (OSError, ValueError, BrokenPipeError):
            self._queues.pop(req_id, None)
            raise WorkerDiedError(self._died_message()) from None
        return req_id, q

    def _died_message(self) -> str:
        reason = self._dead_reason or describe_exit(self._proc.exitcode if self._proc else None)
        return (
            f"the engine process stopped unexpectedly: {reason}. What was already received is kept; "
            "the engine restarts (and reloads its models) on the next request"
        )

    def _get(self, q: queue.Queue, timeout: float | None = None):
        kind, payload = q.get(timeout=timeout)
        if kind is _DIED:
            raise WorkerDiedError(self._died_message())
        if kind == "error":
            raise _rebuild_error(payload)
        return kind, payload

    def load(
        self, model: str | Path, options: LoadOptions | None = None
    ) -> Iterator[LoadProgress | ModelInfo]:
        """Load a model (a path or a starter model's name) in the worker; the request is sent now.

        Yields:
            LoadProgress events, then one ModelInfo.

        Raises (while iterating):
            ModelNotFoundError, ModelFormatError, InsufficientMemoryError, WorkerDiedError, ...
            A failed load leaves the models already loaded as they were.
        """
        options = options or LoadOptions()
        req_id, q = self._request("load", {"model": str(model), "options": options})

        def events():
            try:
                while True:
                    kind, payload = self._get(q)
                    if kind == "progress":
                        yield payload
                    elif kind == "loaded":
                        self._loaded[payload.key] = (str(model), options)
                        yield payload
                        return
            finally:
                self._queues.pop(req_id, None)

        return events()

    def load_and_wait(
        self,
        model: str | Path,
        options: LoadOptions | None = None,
        on_progress: Callable[[LoadProgress], None] | None = None,
    ) -> ModelInfo:
        """load(), consumed: calls on_progress for each step and returns the ModelInfo."""
        for event in self.load(model, options):
            if isinstance(event, ModelInfo):
                return event
            if on_progress is not None:
                on_progress(event)
        raise WorkerDiedError("the load ended without a result")

    def generate(
        self,
        conversation: Sequence[dict],
        params: GenerationParams | None = None,
        *,
        model: str | None = None,
        chat_id: str | None = None,
        context_policy: str = "truncate-middle",
        reuse: bool = True,
        speculation: SpeculationOptions | None = None,
        template_vars: dict | None = None,
    ) -> Iterator[ChatEvent]:
        """Stream the reply to a conversation (list of {"role", "content"}; the last one is answered).

        The request is sent now. Args: model (key; default the last loaded), chat_id (the chat's
        identity for its context policy state), context_policy ("stop", "truncate-middle",
        "rolling-window"), reuse (False: prefill from scratch, for benchmarks), speculation
        (draft model or prompt lookup for this reply; its stats arrive in the ChatEvents),
        template_vars (further chat template variables, e.g. {"enable_thinking": False}).

        Yields:
            ChatEvent; the last has finish_reason set. After cancel() the stream ends within
            CANCEL_GRACE_S with finish_reason "cancelled".

        Raises (while iterating):
            ContextFullError, TemplateError, WorkerDiedError, DraftLoadError, IncompatibleDraftError, ...
        """
        from engine.context_policy import check_policy

        check_policy(context_policy)
        payload = {
            "messages": [dict(m) for m in conversation],
            "params": params or GenerationParams(),
            "model": model,
            "chat_id": chat_id,
            "policy": context_policy,
            "reuse": reuse,
            "template_vars": dict(template_vars or {}),
            "speculation": speculation,
        }
        req_id, q = self._request("generate", payload)
        self._active_generations.add(req_id)
        return self._stream(req_id, q)

    def _stream(self, req_id: int, q: queue.Queue) -> Iterator[ChatEvent]:
        last = ChatEvent()
        try:
            while True:
                kind, payload = q.get() if req_id not in self._cancelled else (_CANCELLED, None)
                if kind is _CANCELLED:
                    yield self._finish_cancelled(q, last)
                    return
                if kind is _DIED:
                    raise WorkerDiedError(self._died_message())
                if kind == "error":
                    raise _rebuild_error(payload)
                last = payload
                yield payload
                if payload.finish_reason:
                    return
        finally:
            self._active_generations.discard(req_id)
            self._cancelled.discard(req_id)
            self._queues.pop(req_id, None)

    def _finish_cancelled(self, q: queue.Queue, last: ChatEvent) -> ChatEvent:
        """The final event of a cancelled stream, within CANCEL_GRACE_S.

        No text is shown after the user pressed stop: tokens the worker produced meanwhile are
        dropped here (the next turn's prompt then diverges from the KV cache only at that point).
        The worker's own final event supplies exact counters when it arrives in time.
        """
        deadline = time.perf_counter() + CANCEL_GRACE_S
        while (left := deadline - time.perf_counter()) > 0:
            try:
                kind, payload = self._get(q, timeout=left)
            except queue.Empty:
                break
            if kind == "event":
                last = payload
                if payload.finish_reason:
                    break
        return replace(last, text="", token=None, finish_reason="cancelled")

    def cancel(self) -> None:
        """Stop every reply in progress. Returns at once; their streams end within CANCEL_GRACE_S."""
        ids = list(self._active_generations)
        if not ids:
            return
        try:
            with self._send_lock:
                self._conn.send(("cancel", 0, ids))
        except (OSError, ValueError):
            pass  # the worker is gone; the streams learn that from the receiver
        self._cancelled.update(ids)
        for req_id in ids:
            q = self._queues.get(req_id)
            if q is not None:
                q.put((_CANCELLED, None))  # wakes a stream blocked waiting for the next event

    def unload(self, model: str | None = None) -> None:
        """Unload one model (by key) or, with None, all of them (the embedding model too)."""
        req_id, q = self._request("unload", model)
        try:
            self._get(q)
        finally:
            self._queues.pop(req_id, None)
        if model is None:
            self._loaded.clear()
        else:
            self._loaded.pop(model, None)

    def embed(
        self,
        model_path: str | Path,
        texts: Sequence[str],
        prompt_name: str | None = None,
        *,
        task: str | None = None,
        truncate: bool = False,
        timeout: float = 600.0,
    ) -> np.ndarray:
        """Embeddings of texts with an embedding model, which the worker loads on first use and keeps
        beside the chat models (one at a time: asking for another replaces it; unload() drops it).

        Served on the worker's own embedding thread: a reply being written goes on untouched.

        Args:
            model_path: the embedding model's file or folder (or a starter name).
            texts: the inputs.
            prompt_name: one of the model's sentence-transformers prompts (None: its default, if any).
            task: "query" or "document": the model's prompt for that search task (engine.embed.task_prompt)
                when prompt_name is None.
            truncate: cut inputs longer than the model takes instead of refusing them.
            timeout: seconds to wait for the vectors.

        Returns:
            (len(texts), dims) float32, one unit vector a row.

        Raises:
            EmbeddingModelError: the model is missing, broken, gives no embeddings, does not fit in memory,
                or did not answer in time. EmbeddingInputError, WorkerDiedError.
        """
        from engine.errors import EmbeddingModelError

        payload = {"model": str(model_path), "texts": [str(t) for t in texts], "prompt_name": prompt_name,
                   "task": task, "truncate": truncate}
        req_id, q = self._request("embed", payload)
        try:
            return self._get(q, timeout=timeout)[1]
        except queue.Empty:
            raise EmbeddingModelError(
                f"the embedding model {model_path} did not answer within {timeout:.0f} s", str(model_path)
            ) from None
        finally:
            self._queues.pop(req_id, None)

    def status(self, timeout: float = 5.0) -> EngineStatus:
        """Memory, loaded models and their context use; answered even while a reply is generated."""
        req_id, q = self._request("status", None)
        try:
            return self._get(q, timeout=timeout)[1]
        except queue.Empty:
            raise WorkerDiedError("the engine process did not answer a status request in time") from None
        finally:
            self._queues.pop(req_id, None)


def error_payload(exc: BaseException) -> dict:
    """How the worker describes an exception to the client (see _rebuild_error)."""
    user = isinstance(exc, HearthError)
    attrs = {}
    for key, value in getattr(exc, "__dict__", {}).items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - anything that does not travel stays behind
            continue
        attrs[key] = value
    return {
        "module": type(exc).__module__,
        "kind": type(exc).__name__,
        "message": str(exc),
        "user": user,
        "builtin": type(exc).__name__ if type(exc).__module__ == "builtins" else None,
        "attrs": attrs,
        "details": "" if user else "".join(traceback.format_exception(exc)),
    }
