"""Continuous batching: one engine thread owns the model and advances every running sequence together.

Each iteration of the engine loop
  1. admits queued requests while fewer than `max_seqs` run: each gets its own KV cache (a free one
     that already holds the longest prefix of its prompt, else a fresh one), then the shared prefix
     store (engine.prefix_cache) fills in whatever longer prefix it holds -- a system prompt that
     another request prefilled is copied, not computed again. When a fresh cache does not fit in
     memory the request waits for a running one's cache (with none running it fails: 503);
  2. runs one prefill chunk of one admitted sequence (chunked, so running replies keep streaming
     while a long prompt is read; a chunk never ends inside an image, engine.vision.tokens); a
     sequence whose prompt is done samples its first token from the prefill logits and joins the
     batch, and its prompt state goes into the prefix store;
  3. runs one decode step for all decoding sequences at once (Decoder.forward_batch: every weight
     row is read once for the whole batch) and samples each row with that sequence's own sampler,
     grammar mask (structured output), stop strings and limits. A model that picks on its own device
     (the CUDA decoder's pick_batch) picks the rows that need no grammar or logprobs there, so only
     their tokens come back; it draws with the same uniforms as the host, so a seed gives one reply.
Work that is no sequence (embeddings: engine.server.embeddings) comes as a call (Engine.call): the engine
thread runs it between two iterations, so it never races a prefill or decode step over the model's
buffers, and replies being decoded wait for one input's pass at most.
A request that arrives mid-reply of others is therefore decoding by the next step after its prefill,
without waiting for anything to finish. Cancellation (client gone) and deadlines are checked every
iteration. Results go back through each sequence's `emit` callback (called on the engine thread).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.generate import _StopMatcher
from engine.harmony import HarmonyDecoder, reply_decoder
from engine.kv_cache import KVCache
from engine.prefix_cache import PrefixCache
from engine.sampling import check_sampling, draw
from engine.server.constraints import Constraint
from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics
from engine.token_reuse import best_reuse
from engine.tokenizer import StreamDecoder, Tokenizer
from engine.vision.tokens import chunk_end, safe_prefix


@dataclass
class SeqParams:
    """What one request asks the engine for (validated by engine.server.protocol)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the k most likely
    grammar: str | None = None  # llguidance grammar (engine.server.constraints.grammar_for)
    text_start: bool = True  # the reply starts a new text (chat), not the prompt's continuation
    timeout_s: float = 600.0
    ignore_eos: bool = False  # end-of-turn tokens are never sampled (benchmarks: fixed reply lengths)
    # a chat prompt: a re-tokenized earlier reply may take the spelling a held cache has (engine.token_reuse)
    respell: bool = False
    # called once the prompt is prefilled or the request ends (engine.server.app: lets its images go)
    release: Callable[[], None] | None = None


@dataclass
class Delta:
    """One piece of a reply, as the engine hands it to the request's handler.

    `finish_reason` is set on the last one ("stop", "length", "cancelled"); `error` instead when the
    reply failed (timeout, engine failure).
    """

    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the request's stop string that ended the reply (finish_reason "stop")
    error: APIError | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_tps: float = 0.0


_ids = itertools.count(1)


class Job:
    """A request inside the engine: its cache, sampler, grammar and progress."""

    def __init__(self, params: SeqParams, emit: Callable[[Delta], None], arrived: float):
        self.id = next(_ids)
        self.params = params
        self.emit = emit
        self.arrived = arrived
        self.deadline = arrived + params.timeout_s
        self.cancelled = False
        self.cache: KVCache | None = None
        self.done = 0  # prompt positions the cache holds
        self.cached = 0
        self.pending: int | None = None  # sampled, not yet fed to the model
        self.generated = 0
        self.t_first = 0.0
        self.finished = False
        check_sampling(params.temperature, params.top_k, params.top_p, params.min_p)
        self.rng = np.random.default_rng(params.seed)  # one uniform a sampled token, host or device
        self.constraint: Constraint | None = None
        self.decoder: StreamDecoder | HarmonyDecoder | None = None  # set when the first token is sampled
        self.matcher: _StopMatcher | None = None

    def cancel(self) -> None:
        """Stop this request at the next engine iteration (safe from any thread)."""
        self.cancelled = True


class _Call:
    """A function to run on the engine thread, and the future its result goes to."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as e:  # noqa: BLE001 - the caller gets its own failure
            self.future.set_exception(e)


class Engine:
    """Owns a model and runs requests in continuous batches on its own thread.

    Args:
        model: an architecture instance (forward, forward_batch, new_cache, cfg).
        tokenizer: its tokenizer.
        n_ctx: context positions per sequence.
        max_seqs: sequences decoded together at most (more requests wait in the queue).
        prefill_chunk: prompt tokens per prefill pass.
        prefix_cache_bytes: budget of the shared prefix store (0: none).
        metrics: where figures are counted.
        compute_lock: held for each iteration's work (calls, admission, prefill and decode steps); engines
            of one server share one, so models never compute at once (they would share the CPU's cores
            anyway, and Numba's fallback threading layer, workqueue, aborts on concurrent parallel calls).
    """

    def __init__(
        self,
        model,
        tokenizer: Tokenizer,
        n_ctx: int = 4096,
        max_seqs: int = 16,
        prefill_chunk: int = 256,
        prefix_cache_bytes: int = 256 << 20,
        metrics: ServerMetrics | None = None,
        kv_dtype=np.float32,
        compute_lock=None,
    ):
        self.model = model
        self._compute = compute_lock or threading.Lock()
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.max_seqs = max_seqs
        self.prefill_chunk = prefill_chunk
        self.kv_dtype = kv_dtype
        self.store = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.metrics = metrics or ServerMetrics()
        self.n_vocab = int(model.cfg.vocab_size)
        self._inbox: queue.Queue[Job | _Call | None] = queue.Queue()
        self._calls: list[_Call] = []
        self._waiting: list[Job] = []
        self._prefilling: list[Job] = []
        self._decoding: list[Job] = []
        self._free: list[KVCache] = []
        self._memory_full = False  # a fresh cache did not fit while others ran
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0  # batched decode steps run (tests look at it)
        self.max_batch_seen = 0

    # --- public, any thread ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hearth-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and end the engine thread."""
        self._stop.set()
        self._inbox.put(None)  # wake it
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, params: SeqParams, emit: Callable[[Delta], None]) -> Job:
        """Queue a request; `emit` receives its Deltas on the engine thread. Returns its handle.

        Raises:
            APIError (400): the grammar cannot be compiled. (Built here, on the caller's thread.)
        """
        try:
            if self._stop.is_set():
                raise APIError(503, "the server is shutting down", "server_error")
            seq = Job(params, emit, time.monotonic())
            if params.grammar is not None:
                seq.constraint = Constraint(self.tokenizer, self.n_vocab, params.grammar)
        except BaseException:
            _release(params)
            raise
        self._inbox.put(seq)
        return seq

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run fn() on the engine thread between two steps (it owns the model: nothing else computes on
        it meanwhile); the future holds its result or exception. Safe from any thread."""
        item = _Call(fn)
        if self._stop.is_set():
            item.future.set_exception(APIError(503, "the server is shutting down", "server_error"))
        else:
            self._inbox.put(item)
        return item.future

    @property
    def running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- engine thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not (self._waiting or self._prefilling or self._decoding)
            self._drain_inbox(block=idle)
            if self._stop.is_set():  # stopping: not worth waiting for the compute lock
                break
            with self._compute:
                self._iterate()
            self.metrics.report_load(self, self.running, len(self._waiting) + self._inbox.qsize())
        for seq in self._waiting + self._prefilling + self._decoding:
            self._finish(seq, "cancelled")
        while True:  # calls queued while stopping: their callers must not wait forever
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Call):
                item.future.cancel()
        for call in self._calls:
            call.future.cancel()

    def _iterate(self) -> None:
        """One iteration's work: queued calls, admission, a prefill chunk, a decode step (under the compute
        lock)."""
        calls, self._calls = self._calls, []
        for call in calls:
            call.run()
        try:
            self._admit()
            self._reap()
            if self._prefilling:
                seq = self._prefilling[0]
                try:
                    self._prefill_step(seq)
                except Exception as e:  # noqa: BLE001 - one prompt's failure is its own (an image dropped)
                    self._finish(seq, error=_engine_failed(e))
            self._reap()
            if self._decoding:
                self._decode_step()
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
            error = _engine_failed(e)
            for seq in self._prefilling + self._decoding:
                self._finish(seq, error=error)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, _Call):
                    self._calls.append(item)
                elif item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self) -> None:
        while self._waiting and self.running < self.max_seqs:
            if self._memory_full and not self._free:
                return  # no room for a fresh cache: the next request waits for a running one's
            seq = self._waiting.pop(0)
            if seq.cancelled or time.monotonic() > seq.deadline:
                self._finish(seq, "cancelled" if seq.cancelled else None, error=_timeout(seq))
                continue
            ids = seq.params.prompt_ids
            try:
                seq.cache = self._take_cache(ids)
            except MemoryError as e:  # numpy's or CuPy's (a MemoryError): no room for another cache
                if self.running:  # wait for a running request to give its cache back
                    self._memory_full = True
                    self._waiting.insert(0, seq)
                else:
                    self._finish(seq, error=_no_cache_memory(e, self.n_ctx))
                return
            try:
                self._reuse(seq)
            except Exception as e:  # noqa: BLE001 - this request fails alone (and is answered)
                seq.cache = None  # its state may be half restored: not one to reuse
                self._finish(seq, error=_engine_failed(e))
                continue
            self._prefilling.append(seq)

    def _reuse(self, seq: Job) -> None:
        """Make seq's cache hold the longest prefix of its prompt at hand (its own, the prefix store's)."""
        ids = seq.params.prompt_ids
        if seq.params.respell:
            ids = self._respell(seq)
        if self.store is not None:
            live = seq.cache.common_prefix(ids)
            self.store.restore(ids, seq.cache, start=live)
        # recompute at least the last prompt token: its logits give the first reply token; an image is
        # prefilled whole (its rows attend to each other), so a reused prefix never ends inside one
        reused = safe_prefix(self.model, ids, min(seq.cache.common_prefix(ids), len(ids) - 1))
        seq.cache.trim(seq.cache.offset - reused)
        reused = seq.cache.offset  # a recurrent model's cache may step back further
        seq.done = seq.cached = reused
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.cached_tokens.inc(reused)

    def _respell(self, seq: Job) -> list[int]:
        """Spell seq's prompt as its cache or the prefix store holds an earlier reply, if it still fits."""
        p = seq.params
        held = [seq.cache.tokens]
        if self.store is not None:
            held.append(self.store.stored_sequence(p.prompt_ids))
        ids = best_reuse(self.tokenizer, p.prompt_ids, held)
        if len(ids) <= len(p.prompt_ids) or len(ids) + p.max_tokens <= self.n_ctx:
            p.prompt_ids = ids
        return p.prompt_ids

    def _take_cache(self, ids: Sequence[int]) -> KVCache:
        if self._free:
            def usable(i: int) -> int:
                return safe_prefix(self.model, ids, self._free[i].common_prefix(ids))

            return self._free.pop(max(range(len(self._free)), key=usable))
        return self.model.new_cache(self.n_ctx, self.kv_dtype)

    def _reap(self) -> None:
        now = time.monotonic()
        for seq in self._waiting + self._prefilling + self._decoding:
            if seq.cancelled:
                self._finish(seq, "cancelled")
            elif now > seq.deadline:
                self._finish(seq, error=_timeout(seq))

    def _prefill_step(self, seq: Job) -> None:
        ids = seq.params.prompt_ids
        # while others decode, keep passes short so their tokens keep flowing
        chunk = self.prefill_chunk if not self._decoding else max(16, self.prefill_chunk // 2)
        end = chunk_end(self.model, ids, seq.done, chunk)  # never inside an image
        logits = self.model.forward(ids[seq.done : end], seq.cache)
        seq.done = end
        if end < len(ids):
            return
        _release(seq.params)  # the cache holds the prompt's images now
        self._prefilling.remove(seq)
        if self.store is not None:
            self.store.insert(seq.cache)  # the prompt's state, for the next request sharing its prefix
        self._decoding.append(seq)
        self._sample(seq, logits[-1].copy())

    def _decode_step(self) -> None:
        batch = list(self._decoding)
        tokens = [s.pending for s in batch]
        caches = [s.cache for s in batch]
        pick = getattr(self.model, "pick_batch", None)
        if pick is not None:
            vocab = self.tokenizer.vocab_size
            picked, rows = pick(tokens, caches, [self._device_pick(s) for s in batch], vocab=vocab)
        else:
            logits = self.model.forward_batch(tokens, caches)
            picked, rows = [None] * len(batch), dict(enumerate(logits))
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        self.metrics.batch_size.observe(len(batch))
        for b, seq in enumerate(batch):
            if picked[b] is None:
                self._sample(seq, rows[b].copy())
            else:
                self._emit(seq, picked[b])

    def _device_pick(self, seq: Job) -> tuple | None:
        """What the model's device needs to pick seq's next token (pick_batch's row spec), or None when
        the host must see the logits (a grammar, logprobs)."""
        p = seq.params
        if seq.constraint is not None or p.logprobs is not None:
            return None
        u = seq.rng.random() if p.temperature > 0 else 0.0
        banned = tuple(self.tokenizer.eot_ids) if p.ignore_eos else ()
        return p.temperature, p.top_k, p.top_p, p.min_p, u, banned

    def _sample(self, seq: Job, logits: np.ndarray) -> None:
        """Pick seq's next token from its logits row (on the host) and emit it."""
        p = seq.params
        tok = self.tokenizer
        raw = logits
        logits = logits.copy() if p.logprobs is not None else logits
        if len(logits) > tok.vocab_size:
            logits[tok.vocab_size :] = -np.inf  # padded embedding rows stand for no text
        if p.ignore_eos:
            logits[list(tok.eot_ids)] = -np.inf
        if seq.constraint is not None:
            seq.constraint.apply(logits)
        if p.temperature == 0:
            token = int(np.argmax(logits))
        else:
            token = draw(logits, p.temperature, p.top_k, p.top_p, p.min_p, seq.rng.random())
        self._emit(seq, token, raw)

    def _emit(self, seq: Job, token: int, raw: np.ndarray | None = None) -> None:
        """Emit what seq's next token adds (raw: its logits row, for logprobs); finish seq if it ends."""
        p = seq.params
        tok = self.tokenizer
        if seq.generated == 0:
            seq.t_first = time.monotonic()
            seq.decoder = reply_decoder(tok, p.prompt_ids, text_start=p.text_start)
            seq.matcher = _StopMatcher(p.stop)
            self.metrics.ttft.observe(seq.t_first - seq.arrived)
        seq.generated += 1
        self.metrics.generated_tokens.inc()
        delta = Delta(token=token)
        if p.logprobs is not None:
            delta.logprob, delta.top_logprobs = _logprobs(raw, token, p.logprobs)
        finish = None
        if token in tok.eot_ids:
            finish = "stop"
        else:
            if seq.constraint is not None:
                seq.constraint.consume(token)
            text, stopped = seq.matcher.feed(seq.decoder.push(token))
            delta.text = text
            if stopped or seq.constraint is not None and seq.constraint.done:
                finish = "stop"
            elif seq.generated >= p.max_tokens or seq.cache.offset + 1 > seq.cache.n_ctx:
                finish = "length"
            if finish is not None and not stopped:
                tail, stopped = seq.matcher.feed(seq.decoder.flush())
                delta.text += tail if stopped else tail + seq.matcher.flush()
            delta.stop_sequence = seq.matcher.matched
        seq.pending = token
        if finish is None:
            self._send(seq, delta)
        else:
            self._finish(seq, finish, delta=delta)

    def _send(self, seq: Job, delta: Delta) -> None:
        elapsed = time.monotonic() - seq.t_first if seq.t_first else 0.0
        delta.prompt_tokens = len(seq.params.prompt_ids)
        delta.cached_tokens = seq.cached
        delta.generated_tokens = seq.generated
        delta.ttft_s = seq.t_first - seq.arrived if seq.t_first else 0.0
        delta.decode_tps = (seq.generated - 1) / elapsed if seq.generated > 1 and elapsed > 0 else 0.0
        try:
            seq.emit(delta)
        except Exception:  # noqa: BLE001 - a handler that is gone only loses its own reply
            seq.cancelled = True

    def _finish(
        self,
        seq: Job,
        reason: str | None = None,
        *,
        delta: Delta | None = None,
        error: APIError | None = None,
    ) -> None:
        if seq.finished:
            return
        seq.finished = True
        _release(seq.params)
        for group in (self._waiting, self._prefilling, self._decoding):
            if seq in group:
                group.remove(seq)
        delta = delta or Delta()
        delta.finish_reason, delta.error = (None, error) if error is not None else (reason, None)
        self.metrics.finished.inc(reason=reason or "error")
        self._send(seq, delta)
        if delta.decode_tps:
            self.metrics.decode_tps.observe(delta.decode_tps)
        if seq.cache is not None:
            self._memory_full = False  # a cache comes back (or is dropped): admitting may go on
            if len(self._free) < self.max_seqs:
                self._free.append(seq.cache)  # keeps its tokens: a follow-up turn reuses them
            seq.cache = None


def _release(params: SeqParams) -> None:
    """Call params.release once (it may be called from the request's thread or the engine's)."""
    release, params.release = params.release, None
    if release is not None:
        release()


def _engine_failed(e: Exception) -> APIError:
    return APIError(500, f"the engine failed: {type(e).__name__}: {e}", "server_error")


def _no_cache_memory(e: MemoryError, n_ctx: int) -> APIError:
    return APIError(
        503,
        f"no memory left for this request's KV cache of {n_ctx} positions ({type(e).__name__}: {e}); "
        "restart the server with a smaller --ctx or --max-seqs, or free memory on the device",
        "server_error",
        code="out_of_memory",
    )


def _timeout(seq: Job) -> APIError:
    return APIError(
        504,
        f"the request ran past the server's time limit of {seq.params.timeout_s:g} s "
        "(hearth serve --request-timeout); ask for fewer max_tokens",
        "timeout_error",
        code="timeout",
    )


def _logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """log-softmax of the model's own distribution: the chosen token's and the k most likely."""
    x = logits.astype(np.float64)
    finite = np.isfinite(x)
    m = x[finite].max()
    lse = m + np.log(np.exp(x[finite] - m).sum())
    top: list[tuple[int, float]] = []
    if k > 0:
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        top = [(int(i), float(x[i] - lse)) for i in ids]
    return float(x[token] - lse), top
