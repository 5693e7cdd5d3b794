"""Implementations of the `hearth` subcommands (parsing lives in engine.cli)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engine.backends import cpu
from engine.document_context import cached_embed, document_budget, sources_text, with_documents
from engine.documents import Document, read_document
from engine.errors import HearthError, ImageInputError
from engine.generate import GenerationParams, generate, prefill
from engine.loader import LoadedModel, load_model
from engine.memory import peak_rss_mb
from engine.reasoning import opens_reasoning, stored_opening, strip_reasoning
from engine.templates import ensure_chat_template
from engine.token_reuse import reuse_held_tokens
from engine.vision import encode_with_images, prepare_messages
from models.resolve import resolve_model

EMBED_BATCH = 32  # document chunks embedded at a time (`hearth chat --doc`'s progress steps)

_shown: dict[str, int] = {}


def _download_progress(stage: str, done: int, total: int) -> None:
    if not total:
        return
    percent = done * 100 // total
    if _shown.get(stage) == percent:
        return  # redraw once per percent, not once per chunk
    _shown[stage] = percent
    end = "\n" if done >= total else ""
    print(f"\rfetching {stage}: {percent:3d}%", end=end, file=sys.stderr, flush=True)


def _preset(spec: str):
    """The library preset (Ollama's created model, `hearth ls` lists them) that `spec` names, else None: a
    file, folder or starter of that name comes first."""
    from models.library import Library
    from models.starter import STARTERS

    if spec in STARTERS or Path(spec).expanduser().exists():
        return None
    try:
        return Library().find_preset(spec)
    except (HearthError, OSError):
        return None


def _load(args) -> LoadedModel:
    """The model -m names (a preset: its base model, with the preset's template; `args.preset` is set)."""
    preset = args.preset = _preset(args.model)
    path = resolve_model(preset.base if preset else args.model, progress=_download_progress)
    if getattr(args, "threads", None):
        cpu.set_threads(args.threads)
    lm = load_model(path)
    if getattr(args, "device", "cpu") != "cpu":
        from engine.backends.cuda.placement import place_model, upload_progress

        place_model(
            lm, args.device, n_ctx=getattr(args, "ctx", 4096), progress=upload_progress,
            gpu_layers=getattr(args, "gpu_layers", None),
        )
    if preset is not None and preset.template:
        from engine.chat_template import ChatTemplate

        base = lm.template
        lm.template = ChatTemplate(preset.template, getattr(base, "bos_token", None),
                                   getattr(base, "eos_token", None))
    return lm


def _params(args) -> GenerationParams:
    """The sampling options given, else the preset's (-m PRESET: Ollama's parameter names), else the
    defaults (engine.cli.SAMPLING_DEFAULTS)."""
    from engine.cli import SAMPLING_DEFAULTS
    from models.library import preset_sampling

    preset = getattr(args, "preset", None)
    given = preset_sampling(preset.parameters) if preset is not None else {}

    def pick(name: str, key: str | None = None):
        value = getattr(args, name)
        return value if value is not None else given.get(key or name, SAMPLING_DEFAULTS.get(name))

    max_tokens = args.max_tokens
    if max_tokens is None:
        max_tokens = given.get("max_tokens", args.max_tokens_default)
    try:
        return GenerationParams(
            max_tokens=max_tokens,
            temperature=pick("temperature"),
            top_k=pick("top_k"),
            top_p=pick("top_p"),
            min_p=pick("min_p"),
            repetition_penalty=pick("repeat_penalty", "repetition_penalty"),
            seed=pick("seed"),
            stop=tuple(args.stop if args.stop is not None else given.get("stop", ())),
        )
    except ValueError as e:
        raise HearthError(f"invalid sampling option: {e}") from e


def _opening(args) -> list[dict]:
    """A chat's first messages: --system (else a preset's system prompt), then a preset's messages."""
    preset = getattr(args, "preset", None)
    system = args.system or (preset.system if preset is not None else None)
    opening = [{"role": "system", "content": system}] if system else []
    return opening + ([dict(m) for m in preset.messages] if preset is not None else [])


def _context(lm: LoadedModel, requested: int) -> int:
    if requested < 16:
        raise HearthError("--ctx must be at least 16 tokens")
    return min(requested, lm.context_length)


def _chat_prompt(lm: LoadedModel, messages: list[dict], template_vars: dict | None = None) -> list[int]:
    """Prompt ids for a conversation, in the model's chat template.

    A model without a template (a base checkpoint) gets its family's fallback template from
    resources/templates/, announced once on stderr; lm.template keeps it for later turns.
    """
    notice = ensure_chat_template(lm)
    if notice:
        print(f"hearth: {notice}", file=sys.stderr)
    # earlier replies' thinking blocks stay out of the context (engine.reasoning)
    template_messages, images = prepare_messages(lm, strip_reasoning(messages))
    pending = [data for data in dict.fromkeys(images) if not lm.vision.holds(data)] if images else []
    for n, data in enumerate(pending):  # the vision tower's work, with progress on stderr
        for done in lm.vision.read(data):
            print(f"\rreading image {n + 1}/{len(pending)}: {done:4.0%}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    text = lm.template.render(template_messages, add_generation_prompt=True, **(template_vars or {}))
    # the template writes BOS itself when the model wants it; encode its special tokens as such
    return encode_with_images(lm, text, images)


def _read_image(path: str) -> bytes:
    """An image file's bytes for a message, or a typed error that names the file."""
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ImageInputError(f"{path}: cannot read the image ({e.strerror or e})") from e


def _user_message(text: str, images: list[bytes]) -> dict:
    """A user message: the text, after its images as parts when there are any."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image", "image": b} for b in images]
            + [{"type": "text", "text": text}]}


def cmd_run(args) -> int:
    lm = _load(args)
    params = _params(args)
    if args.chat or args.image:
        images = [_read_image(path) for path in args.image]
        messages = _opening(args) + [_user_message(args.prompt, images)]
        ids = _chat_prompt(lm, messages)
    else:
        ids = lm.tokenizer.encode(args.prompt, add_special=True)
    cache = lm.model.new_cache(_context(lm, args.ctx))
    pieces, tokens, last = [], [], None
    for event in generate(lm.model, lm.tokenizer, ids, cache, params):
        pieces.append(event.text)
        if event.token is not None and event.token not in lm.tokenizer.eot_ids:
            tokens.append(event.token)
        if not args.json and event.text:
            print(event.text, end="", flush=True)
        last = event
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(pieces),
                    "ids": tokens,
                    "prompt_ids": ids,
                    "finish_reason": last.finish_reason,
                    "ttft_s": round(last.ttft_s, 4),
                    "prefill_tps": round(last.prompt_tps, 2),
                    "decode_tps": round(last.generation_tps, 2),
                },
                ensure_ascii=False,
            )
        )
    else:
        print()
        print(
            f"[{last.generated_tokens} tokens, {last.finish_reason}; TTFT {last.ttft_s:.2f}s, "
            f"prefill {last.prompt_tps:.1f} tok/s, decode {last.generation_tps:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def _ask_tool(call) -> str:
    """The terminal's consent for a tool call: y (once), a (always, this tool), n (deny)."""
    from engine.tool_loop import ALLOW_ALWAYS, ALLOW_ONCE, DENY, describe

    print(f"\n[tool call] {describe(call)}", file=sys.stderr)
    while True:
        try:
            answer = input("Run it? [y]es / [n]o / [a]lways for this tool: ").strip().lower()
        except EOFError:
            return DENY
        if answer in ("y", "yes"):
            return ALLOW_ONCE
        if answer in ("a", "always"):
            return ALLOW_ALWAYS
        if answer in ("n", "no"):
            return DENY


def _show_result(outcome) -> None:
    text = outcome.result
    if len(text) > 800:
        text = text[:800] + f" ... ({len(outcome.result)} characters)"
    label = "declined" if outcome.decision == "deny" else ("error" if outcome.is_error else "result")
    print(f"[tool {label}] {text}", file=sys.stderr)


def _tool_session(args, lm: LoadedModel):
    """The chat's ToolSession when --mcp asks for one: mcp.json's servers started, their errors and tools
    told on stderr. None without --mcp."""
    from engine import tools
    from engine.mcp_client import ToolHost, config_path, load_config
    from engine.tool_loop import ToolSession

    if not (args.mcp or args.mcp_config):
        return None
    path = Path(args.mcp_config) if args.mcp_config else config_path()
    servers = [c for c in load_config(path).values() if not c.disabled]
    if not servers:
        print(f"hearth: no MCP servers in {path} (add some under \"mcpServers\"); chatting without tools",
              file=sys.stderr)
    host = ToolHost(servers)
    for error in host.start().values():
        if error is not None:
            print(f"hearth: {error}", file=sys.stderr)
    fmt = tools.tool_format(lm.template.source if lm.template is not None else None)
    if fmt is None and servers:
        print(f"hearth: {lm.name}'s chat template takes no tools; chatting without them", file=sys.stderr)
    elif host.tools():
        print(f"tools: {', '.join(t.name for t in host.tools())}", file=sys.stderr)
    return ToolSession(host, fmt)


def cmd_chat(args) -> int:
    lm = _load(args)
    params = _params(args)
    n_ctx = _context(lm, args.ctx)
    cache = lm.model.new_cache(n_ctx)
    system = _opening(args)  # what /reset goes back to
    messages = list(system)
    pending: list[bytes] = []  # images for the next message (/image)
    docs = [_read_doc(path) for path in getattr(args, "doc", None) or []]  # for the first message (--doc)
    if lm.template is None:
        _chat_prompt(lm, messages)  # pick the fallback template now, so its notice precedes the prompt
    session = _tool_session(args, lm)
    try:
        return _chat_loop(lm, params, n_ctx, cache, system, messages, pending, session, docs,
                          getattr(args, "embed_model", None))
    finally:
        if session is not None:
            session.host.close()



def _queue_file(line: str, command: str, read, queue: list, what: str, error: type,
                refusal: str | None = None) -> None:
    """`/doc PATH` or `/image PATH` in `hearth chat`: read the file into `queue` (it goes with the next
    message) and say how many wait, or print why not (refusal: the command cannot be used at all)."""
    path = line.strip()[len(command):].strip()
    try:
        if refusal:
            raise error(refusal)
        if not path:
            raise error(f"give a file: {command} PATH")
        queue.append(read(path))
        print(f"({len(queue)} {what} go with your next message)", file=sys.stderr)
    except HearthError as e:
        print(f"hearth: {e}", file=sys.stderr)

def _read_doc(path: str) -> Document:
    """A document for the chat (--doc, /doc), said on stderr; DocumentError says what is wrong."""
    doc = read_document(Path(path).expanduser())
    pages = f", {doc.pages} pages" if doc.pages else ""
    print(f"(document {doc.name}: {len(doc.text):,} characters{pages})", file=sys.stderr)
    if doc.notice:
        print(f"hearth: {doc.notice}", file=sys.stderr)
    return doc


def _document_search(choice: str | None):
    """(embed, name) for ranking document chunks (engine.document_context.select) with --embed-model: a
    model's path or name, "none" for keywords only, or (None) the library's first embedding model, as the
    app's Automatic. (None, "") for keywords."""
    if choice in ("none", "keywords"):
        return None, ""
    if not choice:
        from models.library import Library

        try:
            found = Library().embedding_models()
        except Exception:  # noqa: BLE001 - an unreadable library only means keywords
            found = []
        if not found:
            return None, ""
        choice = found[0].path
    from engine.embedder import Embedder

    embedder = Embedder()  # loaded on the first question that needs it, kept for the chat

    def embed(texts, task):
        return embedder.embed(choice, texts, task=task, truncate=True)

    def report(done: int, total: int) -> None:  # a long document's first question takes a while
        if total > EMBED_BATCH:
            end = "\n" if done == total else ""
            print(f"\rreading the document for the search: {done}/{total} parts", end=end, file=sys.stderr,
                  flush=True)

    name = Path(choice).name.removesuffix(".gguf")
    return cached_embed(embed, str(choice), batch=EMBED_BATCH, report=report), name


def _chat_loop(lm, params, n_ctx, cache, system, messages, pending, session, docs=None,
               embed_model: str | None = None) -> int:
    from engine.tool_loop import run_tool_loop

    print(
        f"{lm.name} ready (context {n_ctx}, on {getattr(lm.model, 'placement', 'cpu')}). "
        "/reset clears the chat, /exit or Ctrl-D quits. /doc FILE adds a document to your next message."
        + (" /image FILE adds an image to your next message." if lm.vision is not None else ""),
        file=sys.stderr,
    )
    last = None
    docs = list(docs or [])  # documents for the next message
    attached: dict[int, list[Document]] = {}  # index in messages of a user message -> its documents

    search: list = []  # (embed, name), found when documents first need ranking

    def count(text: str) -> int:
        return len(lm.tokenizer.encode(text))

    def with_docs(conversation: list[dict], template_vars: dict) -> list[dict]:
        """The conversation with the chat's documents written in (as the app does: whole when they fit,
        else the chunks that best match the latest message); says on stderr what went in."""
        if not attached:
            return conversation
        per = [attached.get(i, []) for i in range(len(conversation))]
        other = len(_chat_prompt(lm, conversation, template_vars))
        if not search:
            search.extend(_document_search(embed_model))
        out, selection = with_documents(conversation, per, document_budget(n_ctx, params.max_tokens, other),
                                        count, *search)
        if selection.notice:
            print(f"hearth: {selection.notice}", file=sys.stderr)
        print(f"[sources: {sources_text(selection.sources())}]", file=sys.stderr)
        return out

    def reply(conversation: list[dict], template_vars: dict) -> str:
        nonlocal last
        ids = _chat_prompt(lm, with_docs(conversation, template_vars), template_vars)
        respelled = reuse_held_tokens(lm.tokenizer, ids, cache.tokens)  # the cache's own tokens
        ids = respelled if len(respelled) < n_ctx else ids
        # a reply inside a thinking block the template opened shows (and keeps) its opening tag
        text = [stored_opening(opens_reasoning(lm.tokenizer.decode(ids[-8:])))]
        print("".join(text), end="", flush=True)
        try:
            for event in generate(lm.model, lm.tokenizer, ids, cache, params):
                text.append(event.text)
                print(event.text, end="", flush=True)
                last = event
        except KeyboardInterrupt:
            conversation.append({"role": "assistant", "content": "".join(text)})
            raise
        print()
        return "".join(text)

    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit", "/bye"):
            return 0
        if line.strip() == "/reset":
            messages[:] = list(system)
            pending.clear()
            docs.clear()
            attached.clear()
            print("(chat cleared)", file=sys.stderr)
            continue
        if line.strip().startswith("/doc"):
            _queue_file(line, "/doc", _read_doc, docs, "document(s)", HearthError)
            continue
        if line.strip().startswith("/image"):
            refusal = f"{lm.name} does not read images" if lm.vision is None else None
            _queue_file(line, "/image", _read_image, pending, "image(s)", ImageInputError, refusal)
            continue
        if docs:
            attached[len(messages)] = list(docs)
            docs.clear()
        messages.append(_user_message(line, pending))
        pending.clear()
        mark = len(messages)
        try:
            if session is not None and session.active:
                _, notice = run_tool_loop(messages, reply, session, _ask_tool, _show_result)
                if notice:
                    print(f"hearth: {notice}", file=sys.stderr)
            else:
                messages.append({"role": "assistant", "content": reply(messages, {})})
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
            continue
        except HearthError as e:
            del messages[mark - 1 :]
            docs[:0] = attached.pop(mark - 1, [])  # they go with the next message instead
            print(f"\nhearth: {e}", file=sys.stderr)
            continue
        print(
            f"[{last.generated_tokens} tokens; {last.cached_tokens}/{last.prompt_tokens} prompt reused; "
            f"TTFT {last.ttft_s:.2f}s; {last.generation_tps:.1f} tok/s; context {cache.offset}/{n_ctx}]",
            file=sys.stderr,
        )


def cmd_tokenize(args) -> int:
    from engine.hf_repo import folder_tokenizer, is_hf_repo
    from engine.tokenizer import Tokenizer
    from models.formats.gguf import open_gguf

    path = resolve_model(args.model, progress=_download_progress)
    if is_hf_repo(path):  # the folder's own tokenizer files, no weights mapped
        tokenizer, _ = folder_tokenizer(path)
    else:
        with open_gguf(path) as gguf:
            tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    ids = tokenizer.encode(args.text, add_special=args.special)
    if args.json:
        print(json.dumps({"ids": ids}))
    else:
        print(" ".join(map(str, ids)))
    return 0


BENCH_TEXT = (
    "The history of computing is a story of people, machines and ideas. Early mechanical calculators "
    "gave way to electronic computers, which filled rooms and consumed enormous power. def fib(n):\n"
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)\nToday, a phone holds more memory than those "
    "machines ever did, and language models run on laptops. Numbers like 3.14159 and 2718281828 appear. "
)


def bench_prompt(lm: LoadedModel, n_tokens: int) -> list[int]:
    """A deterministic prompt of exactly n_tokens real tokens."""
    ids = lm.tokenizer.encode(BENCH_TEXT, add_special=False)
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def run_bench(lm: LoadedModel, n_prompt: int, n_gen: int, n_ctx: int, repetitions: int = 1) -> dict:
    """Measure prefill (n_prompt tokens from an empty cache) and greedy decode (n_gen tokens).

    Returns:
        dict with prefill_tps, decode_tps, ttft_s (prefill plus sampling the first token), kv_cache_mb.
    """
    import numpy as np

    model = lm.model
    if n_prompt + n_gen > n_ctx:
        raise HearthError(f"bench needs {n_prompt + n_gen} tokens of context; raise --ctx")
    prompt = bench_prompt(lm, n_prompt)
    best = {"prefill_tps": 0.0, "decode_tps": 0.0, "ttft_s": float("inf")}
    for _ in range(repetitions):
        cache = model.new_cache(n_ctx)
        t0 = time.perf_counter()
        logits = model.forward(prompt, cache)
        token = int(np.argmax(logits[-1]))
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(n_gen):
            token = int(np.argmax(model.forward([token], cache)[-1]))
        decode_s = time.perf_counter() - t1
        best["prefill_tps"] = max(best["prefill_tps"], n_prompt / ttft)
        best["ttft_s"] = min(best["ttft_s"], ttft)
        best["decode_tps"] = max(best["decode_tps"], n_gen / decode_s)
    kv_bytes_per_token = cache.nbytes / cache.n_ctx
    best["kv_cache_mb"] = kv_bytes_per_token * (n_prompt + n_gen) / 2**20
    return best


def cmd_bench(args) -> int:
    from engine.commands_spec import wants_speculative_bench

    if wants_speculative_bench(args):
        from engine.bench_spec import cmd_bench_spec

        return cmd_bench_spec(args)
    if getattr(args, "chat", False):
        from engine.bench_chat import cmd_bench_chat

        return cmd_bench_chat(args)
    t0 = time.perf_counter()
    lm = _load(args)
    if getattr(lm.model, "greedy_step", None) is not None:  # placed on the GPU (--device cuda)
        from engine.backends.cuda.bench import cmd_bench_cuda

        _print_bench(cmd_bench_cuda(args, lm, time.perf_counter() - t0), args.json)
        return 0
    # "ready" includes the first forward pass, which loads the cached Numba kernels
    warm = lm.model.new_cache(8)
    lm.model.forward(bench_prompt(lm, 4), warm)
    lm.model.forward([1], warm)
    load_s = time.perf_counter() - t0
    del warm
    result = run_bench(lm, args.prompt_tokens, args.gen_tokens, _context(lm, args.ctx), args.repetitions)
    out = {
        "model": lm.name,
        "file": str(lm.path),
        "file_mb": round(lm.file_size / 2**20, 1),
        "device": getattr(lm.model, "placement", "cpu"),
        "threads": cpu.get_threads(),
        "load_s": round(load_s, 3),
        "prefill_tokens": args.prompt_tokens,
        "prefill_tps": round(result["prefill_tps"], 2),
        "decode_tokens": args.gen_tokens,
        "decode_tps": round(result["decode_tps"], 2),
        "ttft_s": round(result["ttft_s"], 4),
        "kv_cache_mb": round(result["kv_cache_mb"], 1),
    }
    if getattr(args, "image", None):
        out |= bench_image(lm, _read_image(args.image), _context(lm, args.ctx))
    out["peak_rss_mb"] = round(peak_rss_mb(), 1)
    _print_bench(out, args.json)
    return 0


def bench_image(lm: LoadedModel, data: bytes, n_ctx: int) -> dict:
    """Time a one-message chat prompt with an image from an empty cache: the vision tower's reading of the
    image, then the prompt's prefill (its image rows included) and the first token.

    Raises:
        ImageInputError: the model reads no images, or the file is no image.
    """
    messages = [_user_message("Describe this picture.", [data])]
    prepare_messages(lm, messages)  # the typed error for a model without a tower
    t0 = time.perf_counter()
    for _ in lm.vision.read(data):
        pass
    image_s = time.perf_counter() - t0
    ids = _chat_prompt(lm, messages)
    cache = lm.model.new_cache(n_ctx)
    t1 = time.perf_counter()
    logits, _ = prefill(lm.model, cache, ids)
    int(logits.argmax())  # the first token, as a reply would pick it greedily
    prefill_s = time.perf_counter() - t1
    return {
        "image_s": round(image_s, 3),
        "image_rows": sum(t >= lm.model.images.base for t in ids),
        "image_prompt_tokens": len(ids),
        "image_prefill_s": round(prefill_s, 3),
        "image_ttft_s": round(image_s + prefill_s, 3),
    }


def _print_bench(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>15}: {value}")
