"""The engine worker process: owns the loaded models and runs chat turns for engine.client.

Generation runs in the worker's main thread; a listener thread reads the pipe so that `cancel`
(a flag checked between prefill batches and between tokens) and `status` are served while a reply
is being computed, and `embed` requests go to a thread of their own (engine.embedder: the one embedding
model, beside the chat models), so a document search does not wait behind a reply nor touch its model.
See engine.client for the message protocol.

ChatRunner is the per-model chat engine (also used in process by `hearth bench --chat`): it fits
the conversation to the context (engine.context_policy), spells a re-tokenized earlier reply as the
cache holds it (engine.token_reuse), reuses the longest prefix the live KV cache holds, restores a
longer one from the prefix store (engine.prefix_cache) when the user switched chats, prefills the
rest in batches, and streams the reply.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from engine import memory_guard
from engine.backends import cpu
from engine.client import (
    ChatEvent,
    EngineStatus,
    LoadOptions,
    LoadProgress,
    ModelInfo,
    NoModelLoadedError,
    SpeculationOptions,
    error_payload,
)
from engine.context_policy import DEFAULT_POLICY, ChatContext, fit_conversation
from engine.embedder import Embedder
from engine.generate import GenerationParams, generate, prefill
from engine.harmony import continuation
from engine.loader import LoadedModel, load_model
from engine.memory import peak_rss_mb, rss_mb
from engine.prefix_cache import PrefixCache
from engine.reasoning import opens_reasoning, stored_opening, strip_reasoning
from engine.spec_chat import DraftSlot, prime, proposer_for, spec_fields
from engine.speculative import speculative_generate
from engine.templates import ensure_chat_template
from engine.token_reuse import best_reuse
from engine.tools import tool_format
from engine.vision import encode_with_images, message_images, prepare_messages
from engine.vision.tokens import chunk_end, safe_prefix
from models.formats.gguf import open_gguf
from models.resolve import resolve_model

MAX_CHAT_STATES = 512  # per-chat context-policy states kept (LRU)


class ChatRunner:
    """One loaded model with its live KV cache, its prefix store and per-chat context state.

    Args:
        lm: the loaded model.
        key: the name clients address it by.
        options: the load options.
        prefix_cache_bytes: budget of the prefix store (0: none).
        estimate: the memory estimate made before loading (None when not checked).
    """

    def __init__(
        self,
        lm: LoadedModel,
        key: str,
        options: LoadOptions,
        prefix_cache_bytes: int = 0,
        estimate: memory_guard.MemoryEstimate | None = None,
    ):
        self.lm = lm
        self.key = key
        self.options = options
        self.estimate = estimate
        self.cache = lm.model.new_cache(options.n_ctx, options.kv_numpy_dtype)
        self.store = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.contexts: OrderedDict[str, ChatContext] = OrderedDict()
        # speculation's draft model; its cache stays float32, which its fused step needs (a draft's cache
        # is small next to its target's)
        self.drafts = DraftSlot(lm, options.n_ctx)
        self.load_s = 0.0

    @classmethod
    def load(
        cls,
        spec: str | Path,
        options: LoadOptions,
        progress: Callable[[LoadProgress], None] = lambda p: None,
        available: int | None = None,
    ) -> ChatRunner:
        """Resolve, check memory, map and warm up a model.

        Args:
            spec: a model file path or a starter model's name.
            options: context, batch, threads, prefix store budget.
            progress: receives LoadProgress steps (warnings come as stage "warning").
            available: bytes of RAM to plan with (default: what the OS reports).

        Raises:
            ModelNotFoundError, ModelFormatError, InsufficientMemoryError, UnsupportedArchitectureError.
        """
        t0 = time.perf_counter()
        progress(LoadProgress("resolve", 0.0, str(spec)))

        def download(stage: str, done: int, total: int) -> None:
            if total:
                progress(LoadProgress("download", 0.5 * done / total, stage))

        path = resolve_model(str(spec), progress=download)
        progress(LoadProgress("check", 0.5, "estimating memory"))
        weights_bytes, shape = _model_shape(path)
        available = memory_guard.available_bytes() if available is None else available

        def plan(gpu_layers: int) -> tuple[memory_guard.MemoryEstimate, int]:
            """The memory check with gpu_layers on a GPU, and the prefix store's budget: it is a cache,
            so it gets at most half of what the load leaves free."""
            est = memory_guard.check(
                weights_bytes, shape, options.n_ctx, options.batch_size, available,
                options.kv_numpy_dtype.itemsize, gpu_layers,
            )
            spare = int(available * memory_guard.HEADROOM) - est.total_bytes
            return est, max(0, min(options.prefix_cache_mb << 20, spare // 2))

        planned = gpu_layers_planned(options, shape.n_layers)
        estimate, store_bytes = plan(planned)
        for warning in estimate.warnings:
            progress(LoadProgress("warning", 0.5, warning))
        progress(LoadProgress("map", 0.6, "mapping weights"))
        lm = load_model(path)
        encoder = bool(getattr(lm.model, "encoder_only", False))  # a BERT: embeddings only, no template
        notice = None if encoder else ensure_chat_template(lm)
        if notice:
            progress(LoadProgress("warning", 0.6, notice))
        if lm.vision_notice:
            progress(LoadProgress("warning", 0.6, lm.vision_notice))
        if options.threads:
            cpu.set_threads(options.threads)
        if options.device != "cpu":
            choice = _place(lm, options, progress)
            if lm.vision is not None and getattr(lm.model, "images", None) is None:
                lm.vision = None  # the GPU decoder embeds no image ids
                lm.vision_notice = ("images are read on the CPU only; on the GPU this model reads text (load "
                                    "it with device CPU for images)")
                progress(LoadProgress("warning", 0.6, lm.vision_notice))
            if choice.device.kind == "cpu" and planned:
                # planned with layers on the GPU, but the model stays on the CPU (no kernels for it):
                # it must fit in RAM after all
                estimate, store_bytes = plan(0)
        progress(LoadProgress("warmup", 0.8, "loading compiled kernels"))
        compiled = cpu.kernels_compiled()
        if encoder:  # its one path: a pass over a short input
            lm.model.hidden_states([lm.tokenizer.bos_id or 0] * 2)
            runner = cls(lm, options.name or path.stem, options, store_bytes, estimate)
            runner.load_s = time.perf_counter() - t0
            return runner
        warm = lm.model.new_cache(8, options.kv_numpy_dtype)  # loads the kernels this dtype uses
        lm.model.forward([lm.tokenizer.bos_id or 0] * 2, warm)  # small-batch path
        lm.model.forward([0], warm)  # decode path
        if cpu.kernels_compiled() > compiled:
            # a cold Numba cache: compile the prefill path (past the small-batch limit) now too, not at
            # the first message (Gemma's first 44-token prompt waited 1.0 s instead of 0.12)
            long = getattr(lm.model, "small_batch_max", cpu.SMALL_BATCH_MAX) + 1
            warm = lm.model.new_cache(long, options.kv_numpy_dtype)
            lm.model.forward([lm.tokenizer.bos_id or 0] * long, warm)
        runner = cls(lm, options.name or path.stem, options, store_bytes, estimate)
        runner.load_s = time.perf_counter() - t0
        return runner

    @property
    def info(self) -> ModelInfo:
        est = self.estimate
        return ModelInfo(
            key=self.key,
            name=self.lm.name,
            path=str(self.lm.path),
            n_ctx=self.cache.n_ctx,
            trained_ctx=self.lm.context_length,
            file_size=self.lm.file_size,
            load_s=self.load_s,
            prefix_cache_bytes=self.store.max_bytes if self.store else 0,
            estimated_bytes=est.total_bytes if est else 0,
            warnings=list(est.warnings) if est else [],
            device=getattr(self.lm.model, "placement", "cpu"),
            vision=self.lm.vision is not None,
            tool_format=tool_format(self.lm.template.source if self.lm.template is not None else None) or "",
        )

    def status(self) -> dict:
        """Context use and prefix store figures of this model."""
        return {
            "key": self.key,
            "name": self.lm.name,
            "n_ctx": self.cache.n_ctx,
            "context_used": self.cache.offset,
            "prefix_cache_bytes": self.store.nbytes if self.store else 0,
            "prefix_cache_budget": self.store.max_bytes if self.store else 0,
        }

    def encode(self, messages: Sequence[dict], template_vars: dict | None = None) -> list[int]:
        """Render a conversation with the model's template (generation prompt added) into token ids.

        Args:
            template_vars: further template variables (enable_thinking: False asks Qwen3-style
                templates for a reply without a thinking block; other templates ignore it).
        """
        ensure_chat_template(self.lm)  # normally done at load, where its notice is reported
        messages = strip_reasoning(messages, keep_last=_continues(messages))  # earlier replies' thinking
        partial = ""
        if _continues(messages):
            # "continue": the reply goes on from the last assistant message's text, rendered unclosed
            partial = messages.pop()["content"]
        messages, images = prepare_messages(self.lm, messages)
        text = self.lm.template.render(messages, add_generation_prompt=True, **(template_vars or {}))
        if partial and self.lm.tokenizer.harmony is not None:
            partial = continuation(partial)  # gpt-oss: the reply's analysis and answer as harmony messages
        elif (marker := opens_reasoning(text)) and partial.lstrip().startswith(marker):
            partial = partial.lstrip()[len(marker) :]  # the template opened the block the reply spells out
        text += partial
        # the template writes BOS itself when the model wants it
        return encode_with_images(self.lm, text, images)

    def _opens_reasoning(self, messages: Sequence[dict], ids: Sequence[int]) -> str:
        """The opening marker of the thinking block the prompt `ids` leaves open ("" for none): the
        reply's text starts inside it."""
        return "" if _continues(messages) else opens_reasoning(self.lm.tokenizer.decode(ids[-8:]))

    def _context_state(self, chat_id: str | None) -> ChatContext | None:
        if chat_id is None:
            return None
        state = self.contexts.pop(chat_id, None) or ChatContext()
        self.contexts[chat_id] = state
        while len(self.contexts) > MAX_CHAT_STATES:
            self.contexts.popitem(last=False)
        return state

    def _respell(self, ids: list[int], limit: int) -> list[int]:
        """ids with a re-tokenized earlier reply spelled as the live cache or the prefix store holds
        it (engine.token_reuse), unless that would no longer fit the `limit` the prompt was fitted to."""
        held = [self.cache.tokens]
        if self.store is not None:
            held.append(self.store.stored_sequence(ids))
        respelled = best_reuse(self.lm.tokenizer, ids, held)
        return respelled if len(respelled) <= max(len(ids), limit) else ids

    def chat(
        self,
        messages: Sequence[dict],
        params: GenerationParams,
        *,
        chat_id: str | None = None,
        policy: str = DEFAULT_POLICY,
        reuse: bool = True,
        should_stop: Callable[[], bool] = lambda: False,
        speculation: SpeculationOptions | None = None,
        template_vars: dict | None = None,
    ) -> Iterator[ChatEvent]:
        """Stream the reply to `messages` (see ChatEvent).

        Args:
            reuse: False prefills the whole prompt from scratch (benchmarks, cold-run checks).
            speculation: draft model or prompt lookup for this reply (engine.spec_chat); the
                draft is loaded (and checked) before anything is prefilled.
            should_stop: polled between prefill batches and between tokens; True ends the reply
                with finish_reason "cancelled".
            template_vars: further chat template variables (see encode).
        """
        t0 = time.perf_counter()
        model, cache, n_ctx = self.lm.model, self.cache, self.cache.n_ctx
        if self.options.threads:
            cpu.set_threads(self.options.threads)
        proposer = proposer_for(speculation, self.drafts)
        reserve = min(params.max_tokens, n_ctx // 4)

        def encode(conversation: Sequence[dict]) -> list[int]:
            return self.encode(conversation, template_vars)

        # new images first (the vision tower's work), reported and cancellable between its layers
        tower = self.lm.vision
        pending = [] if tower is None else [d for d in _new_images(messages) if not tower.holds(d)]
        for n, data in enumerate(pending):
            for done in tower.read(data):
                step = ChatEvent(images_to_read=len(pending), images_read=n + done, context_size=n_ctx,
                                 context_after=cache.offset)
                if should_stop():
                    yield replace(step, finish_reason="cancelled")
                    return
                yield step

        fitted = fit_conversation(messages, encode, n_ctx, reserve, policy, self._context_state(chat_id))
        ids = fitted.ids
        if proposer is not None and max(ids) >= self.lm.tokenizer.vocab_size:
            proposer = None  # a draft model cannot read image ids, nor prompt lookup match them
        restored = 0
        if not reuse:
            cache.trim(cache.offset)
        else:
            ids = self._respell(ids, n_ctx - reserve)
        if reuse and self.store is not None:
            live = cache.common_prefix(ids)
            restored = max(0, self.store.restore(ids, cache, start=live) - live)
        cached = safe_prefix(model, ids, min(cache.common_prefix(ids), len(ids) - 1))
        cache.trim(cache.offset - cached)  # as prefill() would; a recurrent cache may step back further
        cached = cache.offset
        chunk = self.options.batch_size
        base = ChatEvent(
            prompt_tokens=len(ids),
            cached_tokens=cached,
            restored_tokens=min(restored, cached),
            to_prefill=len(ids) - cached,
            context_size=n_ctx,
            context_before=len(ids),
            dropped_messages=fitted.dropped,
        )

        def cancelled(**counts) -> ChatEvent:
            return replace(base, finish_reason="cancelled", context_after=cache.offset, **counts)

        try:
            done = cached
            while len(ids) - done > chunk:  # the last piece is prefilled by generate()
                if should_stop():
                    yield cancelled(prefilled=done - cached)
                    return
                end = chunk_end(model, ids, done, chunk)  # never inside an image
                if end >= len(ids):
                    break
                prefill(model, cache, ids[:end], end - done)
                done = end
                yield replace(base, prefilled=done - cached, context_after=cache.offset)
            for _ in prime(proposer, ids, chunk):  # the draft's own prefill, cancellable between chunks
                if should_stop():
                    yield cancelled(prefilled=done - cached)
                    return
            if should_stop():
                yield cancelled(prefilled=done - cached)
                return
            ttft = 0.0
            # a reply inside a block the template opened is stored with the opening tag (engine.reasoning)
            opening = stored_opening(self._opens_reasoning(messages, ids))
            gen_params = replace(params, prefill_chunk=chunk)
            if proposer is None:
                stream = generate(model, self.lm.tokenizer, ids, cache, gen_params)
            else:
                stream = speculative_generate(model, self.lm.tokenizer, ids, cache, gen_params, proposer,
                                              k=speculation.k, k_max=max(8, speculation.k),
                                              adaptive=speculation.adaptive)
            for event in stream:
                if not ttft:
                    ttft = time.perf_counter() - t0
                out = replace(
                    base,
                    text=opening + event.text,
                    token=event.token,
                    finish_reason=event.finish_reason,
                    prefilled=base.to_prefill,
                    generated_tokens=event.generated_tokens,
                    ttft_s=ttft,
                    prompt_tps=base.to_prefill / ttft,
                    generation_tps=event.generation_tps,
                    context_after=cache.offset,
                    peak_memory_mb=event.peak_memory_mb,
                    **spec_fields(speculation.mode if speculation else "", event),
                )
                opening = ""
                yield out
                if event.finish_reason:
                    return
                if should_stop():
                    stream.close()
                    yield replace(
                        out, text="", token=None, finish_reason="cancelled", peak_memory_mb=peak_rss_mb()
                    )
                    return
        finally:
            if reuse and self.store is not None and cache.offset:
                self.store.insert(cache)


def _model_shape(path: Path) -> tuple[int, memory_guard.KVShape]:
    """(bytes of weights, KV shape) of a GGUF file or a Hugging Face folder, for the memory check."""
    from engine.hf_repo import config_from_hf, is_hf_repo, read_json

    if is_hf_repo(path):
        config = read_json(path / "config.json")
        cfg = config_from_hf(path, config)
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        if (config.get("quantization_config") or {}).get("weight_block_size"):
            weights += weights // 32  # block-wise FP8 keeps a float32 scale per row and 128 columns
        return weights, memory_guard.kv_shape_from_config(cfg)
    with open_gguf(path) as gguf:
        weights = path.stat().st_size
        from engine.vision.load import find_mmproj  # its vision tower, when one is beside it

        mmproj = find_mmproj(path)
        weights += mmproj.stat().st_size if mmproj is not None else 0
        return weights, memory_guard.kv_shape_from_gguf(gguf.metadata, str(path))


def _new_images(messages: Sequence[dict]) -> list[bytes]:
    """The distinct images of a conversation, in order."""
    seen, out = set(), []
    for m in messages:
        for data in message_images(m.get("content")):
            if data not in seen:
                seen.add(data)
                out.append(data)
    return out


def _continues(messages: Sequence[dict]) -> bool:
    """The request continues the last assistant message (its "continue" flag) instead of replying."""
    return bool(messages) and messages[-1].get("role") == "assistant" and bool(messages[-1].get("continue"))


def gpu_layers_planned(options: LoadOptions, n_layers: int) -> int:
    """How many layers the load will put on a GPU: 0 on the CPU or when CUDA is not usable (the load
    then falls back to the CPU, so RAM must hold everything), else options.gpu_layers (None: all)."""
    if options.device == "cpu":
        return 0
    from engine.backends.cuda.device import choose_device

    if choose_device(options.device).device.kind != "cuda":
        return 0
    return n_layers if options.gpu_layers is None else min(options.gpu_layers, n_layers)


def _place(lm: LoadedModel, options: LoadOptions, progress: Callable[[LoadProgress], None]):
    """Move the model to the GPU the options ask for; a CUDA fallback is reported as a warning. Returns
    the DeviceChoice made."""
    from engine.backends.cuda.placement import place_model

    def uploaded(done: int, total: int) -> None:
        progress(LoadProgress("upload", 0.6 + 0.2 * done / max(total, 1), "uploading weights to the GPU"))

    return place_model(
        lm,
        options.device,
        n_ctx=options.n_ctx,
        notify=lambda text: progress(LoadProgress("warning", 0.6, text)),
        progress=uploaded,
        gpu_layers=options.gpu_layers,
    )


def serve(conn) -> None:
    """Worker main loop: run requests from `conn` until shutdown or until the client goes away."""
    send_lock = threading.Lock()
    inbox: queue.Queue = queue.Queue()
    cancelled: set[int] = set()
    stopping = threading.Event()
    loading = threading.Event()  # a load request is running
    busy = threading.Event()
    runners: dict[str, ChatRunner] = {}
    embedder = Embedder()
    embeds: queue.Queue = queue.Queue()
    kernels_lock = threading.Lock()  # held by a request's compute when Numba's kernels must not overlap

    def kernels():
        return kernels_lock if cpu.kernels_exclusive() else nullcontext()

    def send(kind: str, req_id: int, payload) -> None:
        with send_lock:
            conn.send((kind, req_id, payload))

    def send_error(req_id: int, e: Exception) -> bool:
        """Send a request's failure back as a typed error; False when the client is gone."""
        try:
            send("error", req_id, error_payload(e))
            return True
        except (OSError, BrokenPipeError):
            return False

    def status() -> EngineStatus:
        return EngineStatus(
            pid=os.getpid(),
            rss_mb=rss_mb(),
            busy=busy.is_set(),
            models=[r.status() for r in list(runners.values())],
            embedding_model=embedder.status(),
        )

    def run_embeds() -> None:
        while (item := embeds.get()) is not None:
            req_id, payload = item
            try:
                with kernels():
                    vectors = embedder.embed(
                        payload["model"], payload["texts"], prompt_name=payload.get("prompt_name"),
                        task=payload.get("task"), truncate=payload.get("truncate", False),
                    )
                send("embedded", req_id, vectors)
            except (EOFError, OSError, BrokenPipeError):
                return  # the client is gone
            except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a typed error
                if not send_error(req_id, e):
                    return

    def listen() -> None:
        while True:
            try:
                op, req_id, payload = conn.recv()
            except (EOFError, OSError):
                op, req_id, payload = "shutdown", 0, None
            if op == "cancel":
                cancelled.update(payload)
            elif op == "embed":
                embeds.put((req_id, payload))
            elif op == "status":
                try:
                    send("status", req_id, status())
                except Exception as e:  # noqa: BLE001 - report, keep listening
                    send("error", req_id, error_payload(e))
            else:
                inbox.put((op, req_id, payload))
            if op == "shutdown":
                stopping.set()
                if loading.is_set():
                    # a model load cannot stop half-way and has nothing to keep: leave at once
                    # instead of holding the app's exit until the load is over
                    os._exit(0)
                return

    threading.Thread(target=listen, name="hearth-listener", daemon=True).start()
    threading.Thread(target=run_embeds, name="hearth-embedder", daemon=True).start()
    while True:
        op, req_id, payload = inbox.get()
        if op == "shutdown":
            break
        busy.set()
        try:
            if op == "load":
                loading.set()
                try:
                    with kernels():
                        # the embedding model's memory is taken (its weights may not be resident yet)
                        available = memory_guard.available_bytes() - embedder.nbytes
                        runner = ChatRunner.load(
                            payload["model"], payload["options"], lambda p, r=req_id: send("progress", r, p),
                            available=max(available, 0),
                        )
                finally:
                    loading.clear()
                old = runners.pop(runner.key, None)
                runners[runner.key] = runner  # the newest model is the default one
                del old
                gc.collect()
                send("loaded", req_id, runner.info)
            elif op == "generate":
                runner = _pick(runners, payload["model"])
                stream = runner.chat(
                    payload["messages"],
                    payload["params"],
                    chat_id=payload["chat_id"],
                    policy=payload["policy"],
                    reuse=payload["reuse"],
                    should_stop=lambda r=req_id: r in cancelled or stopping.is_set(),
                    speculation=payload.get("speculation"),
                    template_vars=payload.get("template_vars"),
                )
                with kernels():
                    for event in stream:
                        send("event", req_id, event)
            elif op == "unload":
                if payload is None:
                    runners.clear()
                    embedder.drop()
                elif runners.pop(payload, None) is None:
                    raise NoModelLoadedError(f"no model named {payload!r} is loaded")
                gc.collect()
                send("done", req_id, None)
        except (EOFError, OSError, BrokenPipeError):
            break  # the client is gone
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a typed error
            if not send_error(req_id, e):
                break
        finally:
            cancelled.discard(req_id)
            busy.clear()
    embeds.put(None)
    conn.close()


def _pick(runners: dict[str, ChatRunner], key: str | None) -> ChatRunner:
    if not runners:
        raise NoModelLoadedError("no model is loaded; load one first")
    if key is None:
        return next(reversed(runners.values()))
    if key not in runners:
        raise NoModelLoadedError(f"no model named {key!r} is loaded (loaded: {', '.join(runners)})")
    return runners[key]
