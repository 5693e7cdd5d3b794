"""The models one `hearth serve` answers for: the library's, loaded when a request names one.

Ollama and LM Studio users pick a model per request (Open WebUI's model menu, `ollama run NAME`, an
editor plugin's setting) and expect the server to load it then. So, besides the model given to
`hearth serve -m` (loaded at start and kept), every model in Hearth's library is listed (GET
/v1/models, /api/tags) and loaded on its first request:

- A model's id is its starter name (smollm2-135m-instruct) or its file name without .gguf (a folder's
  name for a Hugging Face folder); the library's display name (repo:file) and the path are accepted too,
  and ids match without regard to case. Two files with one stem get the library id as a suffix.
- Loads run one at a time on a worker thread (ChatRunner.load: memory check, chat template, warm-up);
  requests for a model being loaded wait for that load, not for a second one.
- At most `max_loaded` models are loaded together. To load another, or when the memory check says the
  new one does not fit, the least recently used idle model is unloaded first (an idle model runs no
  request). With every loaded model busy, the load waits for one to finish, for up to `wait_s`.
  The memory check plans with what the OS reports available less the weights of the models already
  loaded: their mapped pages count as "available" to the OS, but taking them would page them out.
- A preset (Ollama's created model, engine.server.modelfile) is listed under its own name and served on
  its base model's engine: a request for it loads the base (once, under the base's id) or uses it loaded.
- A model is kept `keep_alive_s` after its last request ends (Ollama's keep_alive, LM Studio's ttl; per
  request, or the server's default), then unloaded. The -m model is kept until the server stops, unless
  a request sets a keep-alive for it.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine import memory_guard
from engine.server import protocol
from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics
from engine.server.scheduler import Engine

# architectures (GGUF general.architecture, or a folder's model_type) of encoders: embeddings only
ENCODER_ARCHITECTURES = ("bert", "nomic-bert", "nomic_bert", "xlm-roberta", "xlm_roberta", "modernbert",
                         "modern-bert")


@dataclass(frozen=True)
class CatalogEntry:
    """A model the server may load: its id, the other names it answers to, its file and what the library
    knows of it (models.library.ModelEntry; None for a model given by path). A preset's entry has its base
    model's path and entry, the preset (models.library.Preset) and the base's id."""

    id: str
    path: Path
    aliases: tuple[str, ...] = ()
    entry: object | None = None
    preset: object | None = None
    base: str = ""

    def answers(self, name: str) -> bool:
        folded = name.casefold()
        return any(folded == n.casefold() for n in (self.id, *self.aliases))


@dataclass(eq=False)
class Served:
    """A loaded model: its engine (running its own thread), the LoadedModel and the route handlers the
    application attached (engine.server.app.attach)."""

    id: str
    names: list[str]
    path: Path
    engine: Engine
    lm: object
    weights_bytes: int = 0
    pinned: bool = False  # kept until the server stops (unless a request sets a keep-alive)
    load_s: float = 0.0
    handlers: object = None
    variants: dict = field(default_factory=dict)  # presets' route handlers over this engine, by preset
    leases: int = 0
    expires_at: float | None = None  # monotonic time it is unloaded at when idle; None: never
    unloading: bool = False  # asked to go (Ollama's keep_alive 0): it goes once idle
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float = field(default_factory=time.time)

    def answers(self, name: str) -> bool:
        folded = name.casefold()
        return any(folded == n.casefold() for n in self.names)

    @property
    def idle(self) -> bool:
        return self.leases == 0 and self.engine.running == 0


class ModelNotServedError(APIError):
    def __init__(self, name: str, hint: str):
        message = f"the model {name!r} does not exist on this server; {hint}"
        super().__init__(404, message, "invalid_request_error", "model", "model_not_found")


class FairLock:
    """A lock handed out in arrival order: the loaded models' engines take turns at computing (a plain lock
    lets the thread that just released it take it again at once, starving the others)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._next = 0
        self._serving = 0

    def __enter__(self):
        with self._cv:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cv.wait()
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._serving += 1
            self._cv.notify_all()


def _kernels_exclusive() -> bool:
    """Whether Numba's parallel kernels must never run on two threads at once (cpu.kernels_exclusive)."""
    from engine.backends import cpu

    return cpu.kernels_exclusive()


def library_catalog() -> list[CatalogEntry]:
    """The present models of Hearth's library (starters included), with unique ids."""
    from models.library import Library
    from models.starter import STARTERS, starter_path

    lib = Library()
    lib.register_starters()
    starters = {str(starter_path(n).absolute()): n for n in STARTERS}
    out: list[CatalogEntry] = []
    taken: set[str] = set()
    for e in reversed(lib.entries()):  # oldest first: a model keeps its id when a namesake arrives
        if not e.exists:
            continue
        path = Path(e.path)
        stem = path.name if path.is_dir() else path.name.removesuffix(".gguf")
        stem = _split_suffix(stem)
        model_id = starters.get(str(path.absolute()), stem)
        if model_id.casefold() in taken:
            model_id = f"{model_id}-{e.id}"
        taken.add(model_id.casefold())
        # the stem answers too when a starter name is the id (`hearth serve -m` names a model by its stem);
        # a Hub model also answers to the name Ollama's Hub integration pulls it by, hf.co/REPO:QUANT
        hub = [f"hf.co/{e.repo}:{e.quant}", f"{e.repo}:{e.quant}"] if e.repo and e.quant else []
        hub += [f"hf.co/{e.repo}"] if e.repo else []
        aliases = tuple(dict.fromkeys(a for a in (stem, e.name, str(path), *hub) if a != model_id))
        out.append(CatalogEntry(model_id, path, aliases, e))
    out.reverse()  # most recently used first, as `hearth ls` lists them
    by_path = {_key(e.path): e for e in out}
    for p in lib.presets():  # a preset whose base is gone, or whose name a model took since, is not served
        base = by_path.get(_key(Path(p.base)))
        if base is not None and p.name.casefold() not in taken and not any(e.answers(p.name) for e in out):
            taken.add(p.name.casefold())
            out.append(CatalogEntry(p.name, base.path, (), base.entry, preset=p, base=base.id))
    return out


def _split_suffix(stem: str) -> str:
    """'Model-Q4_K_M-00001-of-00003' -> 'Model-Q4_K_M' (a split set is one model)."""
    head, sep, tail = stem.rpartition("-of-")
    if sep and tail.isdigit() and len(tail) == 5 and head[-6:-5] == "-" and head[-5:].isdigit():
        return head[:-6]
    return stem


class ModelPool:
    """The loaded models and the catalog of loadable ones (thread-safe; blocking calls run on worker
    threads).

    Args:
        load: loads a catalog entry, planning with `available` bytes of RAM; returns it Served (its engine
            started). Its errors (InsufficientMemoryError, ModelFormatError, ...) reach the request.
        catalog: the loadable models (default: none; only models added with add()).
        max_loaded: models loaded together at most.
        keep_alive_s: how long an on-demand model stays loaded after its last request (math.inf:
            forever; 0: unloaded as soon as it is idle).
        wait_s: how long a load waits for a busy model to make room.
        available: the OS's available RAM now (memory_guard.available_bytes; tests give their own).
        metrics: the server's figures (every model's engine counts into them).
        precheck: reads an entry's header before anything is unloaded for it (a broken file fails
            without costing a loaded model); raises the load's errors.
    """

    CATALOG_TTL_S = 5.0

    def __init__(
        self,
        load: Callable[[CatalogEntry, int], Served] | None = None,
        catalog: Callable[[], list[CatalogEntry]] | None = None,
        max_loaded: int = 3,
        keep_alive_s: float = 300.0,
        wait_s: float = 600.0,
        available: Callable[[], int] = memory_guard.available_bytes,
        metrics: ServerMetrics | None = None,
        precheck: Callable[[CatalogEntry], None] | None = None,
    ):
        if max_loaded < 1:
            raise ValueError("max_loaded must be at least 1")
        self._load = load
        self._catalog_fn = catalog
        self.max_loaded = max_loaded
        self.keep_alive_s = keep_alive_s
        self.wait_s = wait_s
        self._available = available
        self.metrics = metrics or ServerMetrics()
        self._precheck = precheck
        # the engines' compute steps take turns (engine.server.scheduler.Engine's compute_lock)
        self.compute_lock = FairLock()
        self._served: list[Served] = []
        self._loading: dict[str, CatalogEntry] = {}
        self._catalog: list[CatalogEntry] = []
        self._catalog_at = -math.inf
        self._cv = threading.Condition()
        self._closed = False
        self.prepare: Callable[[Served], None] = lambda s: None  # the app attaches its handlers
        self.log: Callable[[str], None] = lambda line: None  # `hearth serve` prints loads and unloads
        self.loads = 0  # models loaded on demand (tests look at it)
        self._reaper: threading.Thread | None = None  # started with the first expiry

    def set_prepare(self, prepare: Callable[[Served], None]) -> None:
        """What every loaded model gets before it serves (the app's route handlers), the ones loaded
        already included."""
        self.prepare = prepare
        for s in self.loaded():
            prepare(s)

    # --- what is served ---

    def add(self, served: Served) -> None:
        """A model loaded by the caller (the -m model)."""
        self.prepare(served)
        with self._cv:
            self._served.append(served)
            self._changed()

    def loaded(self) -> list[Served]:
        with self._cv:
            return list(self._served)

    @property
    def default(self) -> Served | None:
        """The first model added (the -m model), while it is loaded, else the most recently used one."""
        with self._cv:
            pinned = [s for s in self._served if s.pinned]
            if pinned:
                return pinned[0]
            return max(self._served, key=lambda s: s.last_used, default=None)

    def catalog(self, refresh: bool = False) -> list[CatalogEntry]:
        if self._catalog_fn is None:
            return []
        now = time.monotonic()
        if refresh or now - self._catalog_at > self.CATALOG_TTL_S:
            try:
                self._catalog = self._catalog_fn()
            except Exception:  # noqa: BLE001 - an unreadable library: the loaded models are still served
                self._catalog = []
            self._catalog_at = now
        return self._catalog

    def listing(self) -> list[tuple[str, Served | None, CatalogEntry | None]]:
        """Every model served: (id, the loaded model or None, its catalog entry or None), loaded first."""
        loaded = self.loaded()
        out = [(s.id, s, self._entry_of(s)) for s in loaded]
        paths = {_key(s.path) for s in loaded}
        ids = {s.id.casefold() for s in loaded}
        for e in self.catalog():
            if e.preset is not None or (_key(e.path) not in paths and e.id.casefold() not in ids):
                out.append((e.id, None, e))
        return out

    def _entry_of(self, served: Served) -> CatalogEntry | None:
        key = _key(served.path)
        return next((e for e in self.catalog() if e.preset is None and _key(e.path) == key), None)

    def preset(self, name: str) -> CatalogEntry | None:
        """The catalog entry of the preset answering `name` (or `name` without ":latest"); None when no preset
        does, or a loaded model answers the name."""
        names = list(dict.fromkeys((name, name.removesuffix(":latest"))))
        with self._cv:
            if any(self._find_loaded(n) is not None for n in names):
                return None
        for refresh in (False, True):  # the catalog is read again only when nothing answers
            catalog = self.catalog(refresh)
            entry = next((e for n in names for e in catalog if e.answers(n)), None)
            if entry is not None:
                return entry if entry.preset is not None else None
        return None

    def base_of(self, preset: CatalogEntry) -> CatalogEntry | None:
        """The catalog entry of a preset's base model."""
        return next((e for e in self.catalog() if e.preset is None and _key(e.path) == _key(preset.path)),
                    None)

    def _find_loaded(self, name: str) -> Served | None:
        for s in self._served:
            if s.answers(name):
                return s
        return None

    def _resolve(self, name: str) -> tuple[Served | None, CatalogEntry | None]:
        """The loaded model answering `name`, or the catalog entry to load (refreshing the catalog once
        for a name it lacks: a model downloaded since). Both None: nothing answers."""
        for refresh in (False, True):
            with self._cv:
                served = self._find_loaded(name)
            if served is not None:
                return served, None
            entry = next((e for e in self.catalog(refresh) if e.answers(name)), None)
            if entry is not None and entry.preset is not None:  # a preset runs on its base's engine
                entry = self.base_of(entry) or CatalogEntry(entry.base, entry.path, (), entry.entry)
            if entry is not None:
                with self._cv:  # the -m model may be this entry under another name: it answers to it too
                    same = next((s for s in self._served if _key(s.path) == _key(entry.path)), None)
                    if same is not None:
                        same.names += [n for n in (entry.id, *entry.aliases) if not same.answers(n)]
                return (same, None) if same is not None else (None, entry)
        return None, None

    def find(self, name: str) -> tuple[Served | None, CatalogEntry | None]:
        """The loaded model answering `name` (or `name` without Ollama's ":latest"), else the library
        entry that would be loaded; (None, None) when nothing answers. Loads nothing."""
        found = self._resolve(name)
        if found == (None, None) and name.endswith(":latest"):
            found = self._resolve(name.removesuffix(":latest"))
        return found

    def not_served(self, name: str) -> ModelNotServedError:
        if self._catalog_fn is None:
            names = ", ".join(repr(s.id) for s in self.loaded())
            return ModelNotServedError(name, f"it serves {names} (GET /v1/models)")
        return ModelNotServedError(
            name, "GET /v1/models (or /api/tags) lists the models in Hearth's library; add one with "
            "`hearth pull` or the app's library"
        )

    # --- leases ---

    def acquire(self, name: str) -> tuple[Served, float]:
        """The model answering `name`, loaded (loading it if need be), with a lease: it is not unloaded
        until release(); and the seconds its load took when this call loaded it (else 0). Blocking.

        Raises:
            ModelNotServedError (404), APIError 503 (no room while other models stay busy), and the load's
            own errors (engine.errors / models.errors).
        """
        deadline = time.monotonic() + self.wait_s
        checked = False
        while True:
            served, entry = self._resolve(name)
            if served is None and entry is None:
                raise self.not_served(name)
            if served is None and not checked and self._precheck is not None:
                self._precheck(entry)
                checked = True
            with self._cv:
                if served is not None and served in self._served:
                    served.leases += 1
                    served.last_used = time.monotonic()
                    return served, 0.0
                if served is not None:  # unloaded meanwhile: look again
                    continue
                if entry.id in self._loading:  # another request loads it: wait for that load
                    self._wait(deadline, f"loading {entry.id}")
                    continue
                if len(self._served) + len(self._loading) >= self.max_loaded:
                    if not self._evict_one():
                        self._wait(deadline, self._busy_reason(entry))
                    continue
                self._loading[entry.id] = entry
            started = time.monotonic()
            self.log(f"loading {entry.id} (requested)")
            try:
                served = self._load_with_room(entry, deadline)
            finally:
                with self._cv:
                    self._loading.pop(entry.id, None)
                    self._cv.notify_all()
            served.leases = 1
            self.prepare(served)
            with self._cv:
                if self._closed:
                    served.engine.stop()
                    raise APIError(503, "the server is shutting down", "server_error")
                self._served.append(served)
                self.loads += 1
                self._changed()
            load_s = time.monotonic() - started
            self.log(f"loaded {served.id} in {load_s:.1f} s")
            return served, load_s

    def release(self, served: Served, keep_alive_s: float | None = None) -> None:
        """A request on `served` ended; with keep_alive_s (a request's own), that sets how long it stays."""
        with self._cv:
            served.leases = max(0, served.leases - 1)
            served.last_used = time.monotonic()
            if served.unloading:
                served.expires_at = served.last_used
            elif keep_alive_s is not None:
                served.pinned = False
                served.expires_at = served.last_used + keep_alive_s if math.isfinite(keep_alive_s) else None
            elif not served.pinned:
                ka = self.keep_alive_s
                served.expires_at = served.last_used + ka if math.isfinite(ka) else None
            if served.expires_at is not None:
                self._start_reaper()
            self._cv.notify_all()
        if served.expires_at is not None and served.expires_at <= time.monotonic():
            self._reap_once()

    def unload(self, name: str) -> bool:
        """Unload the model answering `name` once it is idle (Ollama's keep_alive 0 with no prompt).
        Returns whether it was loaded."""
        with self._cv:
            served = self._find_loaded(name)
            if served is None:
                return False
            served.pinned = False
            served.unloading = True
            served.expires_at = time.monotonic()
            self._start_reaper()
        self._reap_once()
        return True

    def unload_now(self, path: Path) -> bool:
        """Unload the model loaded from `path` if it is idle (its file is about to go). Returns False when
        it is busy (it stays), True when it was unloaded or not loaded."""
        with self._cv:
            served = next((s for s in self._served if _key(s.path) == _key(path)), None)
            if served is None:
                return True
            if not served.idle:
                return False
            self._served.remove(served)
            self._stop(served)
            return True

    @property
    def serves_library(self) -> bool:
        """Whether models come from a catalog (the library), not only those added."""
        return self._catalog_fn is not None

    def close(self) -> None:
        """Stop every engine (the server is stopping)."""
        with self._cv:
            self._closed = True
            served, self._served = self._served, []
            self._cv.notify_all()
        for s in served:
            s.engine.stop()

    # --- loading and unloading ---

    def _load_with_room(self, entry: CatalogEntry, deadline: float) -> Served:
        while True:
            with self._cv:
                held = sum(s.weights_bytes for s in self._served)
            available = max(0, int(self._available()) - held)
            # a load runs kernels (its warm-up): beside other models' steps only where that is safe
            exclusive = contextlib.nullcontext()
            if self._served and _kernels_exclusive():
                exclusive = self.compute_lock
            try:
                with exclusive:
                    return self._load(entry, available)
            except memory_guard.InsufficientMemoryError:
                with self._cv:
                    if self._evict_one():
                        continue
                    if not self._served:
                        raise  # it does not fit with nothing else loaded: the load's own message
                    self._wait(deadline, self._busy_reason(entry))

    def _busy_reason(self, entry: CatalogEntry) -> str:
        busy = ", ".join(s.id for s in self._served)
        return f"no room to load {entry.id}: the loaded models ({busy}) are all running requests"

    def _wait(self, deadline: float, reason: str) -> None:
        """Wait (lock held) for a change: a release, a load ending, an unload; raise 503 past the deadline."""
        left = deadline - time.monotonic()
        if left <= 0 or self._closed:
            raise APIError(503, f"{reason}; try again later", "server_error", code="server_busy")
        self._cv.wait(min(left, 1.0))

    def _evict_one(self) -> bool:
        """Unload the least recently used idle model (lock held). Returns whether one went."""
        idle = [s for s in self._served if s.idle]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        self._served.remove(victim)
        self._stop(victim)
        return True

    def _changed(self) -> None:
        """The loaded set changed (lock held): wake waiters, update the gauge."""
        self.metrics.loaded.set(len(self._served))
        self._cv.notify_all()

    def _stop(self, served: Served) -> None:
        self.log(f"unloading {served.id}")
        served.engine.stop()
        self.metrics.forget(served.engine)
        served.handlers = None
        served.variants = {}
        served.lm = None
        self._changed()
        with contextlib.suppress(Exception):
            gc.collect()  # the mapped weights and caches go now, not at some later collection

    def _reap_once(self) -> None:
        now = time.monotonic()
        with self._cv:
            for s in [s for s in self._served if s.idle and s.expires_at is not None and s.expires_at <= now]:
                self._served.remove(s)
                self._stop(s)

    def _start_reaper(self) -> None:
        """The thread that unloads expired models, started with the first expiry (lock held)."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_loop, name="hearth-models", daemon=True)
            self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._closed:
            time.sleep(0.5)
            self._reap_once()


def catalog_model_object(entry: CatalogEntry) -> dict:
    """The GET /v1/models entry of a model not loaded, from what the library knows of it."""
    e = entry.entry
    arch = (getattr(e, "architecture", None) or "").lower()
    encoder = arch in ENCODER_ARCHITECTURES
    created = int(entry.path.stat().st_mtime) if entry.path.exists() else protocol.now()
    return protocol.model_object(
        entry.id, created, vision=bool(e is not None and e.reads_images), embedding=encoder,
        completion=not encoder,
    )


def _key(path: Path) -> str:
    try:
        return str(Path(path).resolve())
    except OSError:
        return str(path)


def parse_duration(value, field_name: str = "keep_alive") -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "300ms", "-1"); a
    negative value keeps the model loaded for good (math.inf). None: not given.

    Raises:
        APIError (400): anything else.
    """
    from engine.server.errors import invalid

    if value is None:
        return None
    if isinstance(value, bool):
        raise invalid(f"'{field_name}' must be a number of seconds or a duration such as \"5m\"", field_name)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _go_duration(value.strip())
        if seconds is None:
            raise invalid(
                f"'{field_name}' {value!r} is no duration; use seconds or a duration such as \"5m\" or "
                "\"1h\" (negative: keep loaded)", field_name,
            )
    else:
        raise invalid(f"'{field_name}' must be a number of seconds or a duration such as \"5m\"", field_name)
    if math.isnan(seconds):
        raise invalid(f"'{field_name}' must be a number", field_name)
    return math.inf if seconds < 0 else seconds


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration(text: str) -> float | None:
    import re

    if re.fullmatch(r"[+-]?\d+(\.\d+)?", text):
        return float(text)
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", body)
    if not parts or "".join(n + u for n, u in parts) != body:
        return None
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)
