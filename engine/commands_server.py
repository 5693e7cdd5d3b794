"""`hearth serve`: the local OpenAI- and Ollama-compatible HTTP server (engine.server).

Loads the -m model the way the chat runtime does (engine.worker.ChatRunner.load: resolve, memory check,
chat template, kernel warm-up), starts its engine thread, binds the port, and prints its ready line
(`Hearth is serving MODEL at http://HOST:PORT/v1`) once connections are accepted; the app's Serve
toggle waits for that line. The library's other models are served too, each loaded the same way on its
first request and unloaded after --keep-alive idle (engine.server.pool); --no-library serves only -m.
SIGTERM or Ctrl+C stops it cleanly ("stopped" is its last line).
"""

from __future__ import annotations

import errno
import os
import socket
import sys

DEFAULT_PORT = 8080


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the library's models over OpenAI's (/v1) and Ollama's (/api) HTTP APIs, loading each "
        "on its first request",
    )
    p.add_argument(
        "-m", "--model", default="smollm2-135m-instruct",
        help="the model loaded at start and kept loaded: a file path or starter model name",
    )
    p.add_argument(
        "--no-library", action="store_true",
        help="serve only the -m model (by default every model in Hearth's library is served too)",
    )
    p.add_argument(
        "--max-models", type=int, default=3,
        help="models loaded at once at most (default 3); the least recently used idle one makes room",
    )
    p.add_argument(
        "--keep-alive", default="5m",
        help="how long a model loaded on demand stays after its last request (default 5m; seconds or a "
        "duration such as 30s, 1h; -1: until the server stops); requests may set their own (Ollama's "
        "keep_alive, LM Studio's ttl)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("HEARTH_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default $HEARTH_API_KEY); needed unless --host is "
        "a loopback address",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a further name the Host header may carry (repeatable)",
    )
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument(
        "--ctx", type=int, default=4096, help="context length per request in tokens (default 4096)"
    )
    p.add_argument("--max-seqs", type=int, default=16, help="requests decoded together at most (default 16)")
    p.add_argument(
        "--prefill-chunk", type=int, default=256, help="prompt tokens per prefill pass (default 256)"
    )
    p.add_argument(
        "--kv-dtype",
        choices=("f32", "f16"),
        default="f16",
        help="KV cache precision per request (default f16; f32 takes twice the memory per token of context)",
    )
    p.add_argument(
        "--prefix-cache-mb", type=int, default=256, help="RAM for shared prompt prefixes (default 256)"
    )
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds a request may run (default 600)"
    )
    p.add_argument("--name", default=None, help="model id clients use (default: the file name without .gguf)")
    p.add_argument(
        "--reasoning-format",
        choices=("deepseek", "none"),
        default="deepseek",
        help="deepseek (default): a reply's <think> block goes to the message's reasoning_content; "
        "none: it stays in content",
    )
    from engine.cli import add_device_args

    add_device_args(p)


def _bind(host: str, port: int) -> socket.socket:
    from engine.server.errors import ServeError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"{host}:{port} is already in use; pick another --port") from e
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}); check --host and --port") from e
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> int:
    import uvicorn

    from engine.server.app import ServerConfig, create_app, ready_line
    from engine.server.errors import ServeError
    from engine.server.metrics import ServerMetrics
    from engine.server.pool import ModelPool, library_catalog

    for name, value, low in (
        ("--max-seqs", args.max_seqs, 1),
        ("--prefill-chunk", args.prefill_chunk, 1),
        ("--ctx", args.ctx, 16),
        ("--prefix-cache-mb", args.prefix_cache_mb, 0),
    ):
        if value < low:
            raise ServeError(f"{name} must be at least {low}")
    if not 0 <= args.port <= 65535:
        raise ServeError("--port must be in 0..65535")
    if args.request_timeout <= 0:
        raise ServeError("--request-timeout must be > 0")
    if args.gpu_layers is not None and args.gpu_layers < 0:
        raise ServeError("--gpu-layers must be at least 0")
    if args.max_models < 1:
        raise ServeError("--max-models must be at least 1")
    keep_alive = _keep_alive(args.keep_alive)
    from engine.backends.cuda.device import parse_device

    parse_device(args.device)  # DeviceSpecError says what a device name looks like
    # checked before the (slow) load: an unsafe binding fails at once
    ServerConfig(model_name="-", host=args.host, port=args.port, api_key=args.api_key)
    sock = _bind(args.host, args.port)

    print(f"loading {args.model}", flush=True)
    metrics = ServerMetrics()
    pool = ModelPool(
        load=lambda entry, available: load_served(
            str(entry.path), args, metrics, available=available, name=entry.id, aliases=entry.aliases,
            compute_lock=pool.compute_lock,
        ),
        catalog=None if args.no_library else library_catalog,
        max_loaded=args.max_models,
        keep_alive_s=keep_alive,
        wait_s=args.request_timeout,
        metrics=metrics,
        precheck=_precheck,
    )
    pool.log = lambda line: print(line, flush=True)
    try:
        first = load_served(args.model, args, metrics, pinned=True, compute_lock=pool.compute_lock)
        pool.add(first)
        lm = first.lm
        config = ServerConfig(
            model_name=first.id,
            host=args.host,
            port=sock.getsockname()[1],
            api_key=args.api_key,
            allowed_hosts=list(args.allow_host),
            aliases=first.names[1:],
            request_timeout_s=args.request_timeout,
            reasoning_format=args.reasoning_format,
        )
        app = create_app(config, pool=pool)
    except BaseException:
        pool.close()
        sock.close()
        raise
    if not args.no_library:
        here = lm.path.resolve()
        others = [e.id for e in pool.catalog() if e.preset is not None or e.path.resolve() != here]
        if others:
            print(f"also serving on request: {', '.join(others)}", flush=True)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                print(ready_line(config, config.port), flush=True)

        def handle_exit(self, sig, frame):
            # uvicorn re-raises a caught signal after shutting down (the process then dies of it);
            # a SIGTERM here means "stop cleanly", so only the shutdown is kept (twice: at once)
            self.force_exit = self.should_exit
            self.should_exit = True

    server = _Server(
        uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=3, access_log=False
        )
    )
    try:
        server.run(sockets=[sock])
    finally:
        pool.close()
        sock.close()
        print("stopped", flush=True)
    return 0 if server.started else 1


def _keep_alive(text: str) -> float:
    from engine.server.errors import APIError, ServeError
    from engine.server.pool import parse_duration

    try:
        value = parse_duration(text, "--keep-alive")
    except APIError as e:
        raise ServeError(e.message) from e
    return value if value is not None else 300.0


def _precheck(entry) -> None:
    """Read a library model's header (GGUF) or config (folder) before a loaded model makes room for it."""
    from engine.worker import _model_shape

    _model_shape(entry.path)


def load_served(spec: str, args, metrics, available: int | None = None, name: str | None = None,
                aliases: tuple[str, ...] = (), pinned: bool = False, compute_lock=None):
    """Load `spec` for serving (ChatRunner.load, planning with `available` bytes of RAM), with its engine
    warmed up and started: an engine.server.pool.Served.

    compute_lock: the server's lock its engines take turns at (engine.server.pool.ModelPool.compute_lock).

    Raises:
        The load's errors (ModelNotFoundError, InsufficientMemoryError, ...), ServeError (no GPU room).
    """
    import time

    from engine.client import KV_DTYPES, LoadOptions
    from engine.server.constraints import ll_tokenizer
    from engine.server.pool import Served
    from engine.server.scheduler import Engine
    from engine.worker import ChatRunner

    t0 = time.monotonic()
    runner = ChatRunner.load(
        spec,
        LoadOptions(
            n_ctx=args.ctx,
            threads=args.threads,
            prefix_cache_mb=args.prefix_cache_mb,
            batch_size=args.prefill_chunk,
            device=args.device,
            gpu_layers=args.gpu_layers,
            kv_dtype=args.kv_dtype,
        ),
        progress=lambda p: print(f"warning: {p.message}", flush=True) if p.stage == "warning" else None,
        available=available,
    )
    lm = runner.lm
    engine = Engine(
        lm.model,
        lm.tokenizer,
        n_ctx=args.ctx,
        max_seqs=args.max_seqs,
        prefill_chunk=args.prefill_chunk,
        prefix_cache_bytes=runner.store.max_bytes if runner.store else 0,
        kv_dtype=KV_DTYPES[args.kv_dtype],
        metrics=metrics,
        compute_lock=compute_lock,
    )
    del runner  # its live cache and prefix store are not used: the engine has its own
    # compile/warm the batched decode path and build the grammar vocabulary before serving
    if not getattr(lm.model, "encoder_only", False):  # an encoder has no decode path (ChatRunner warmed it)
        warm = [lm.model.new_cache(8, engine.kv_dtype) for _ in range(2)]
        for c in warm:
            lm.model.forward([0], c)
        lm.model.forward_batch([0, 0], warm)
        ll_tokenizer(lm.tokenizer, engine.n_vocab)
        del warm
    _check_gpu_room(lm.model, args, engine.kv_dtype)
    model_id = name or args.name or lm.path.stem
    names = [model_id]
    if name is None:  # the -m model: the name it was asked for (a starter name) is accepted too
        names += [lm.name, lm.path.name, *([spec] if "/" not in spec else [])]
    names += list(aliases)
    names = list(dict.fromkeys(n for n in names if n))
    engine.start()
    return Served(model_id, names, lm.path, engine, lm, weights_bytes=lm.file_size, pinned=pinned,
                  load_s=time.monotonic() - t0)


def _check_gpu_room(model, args, kv_dtype) -> None:
    """Say how many concurrent requests' KV caches the GPU holds (each request gets a cache of --ctx
    positions); warn when that is fewer than --max-seqs (the others wait for a running one's cache),
    and refuse to start when not even one fits. A CPU model: nothing to say."""
    from engine.server.errors import ServeError

    fit = getattr(model, "caches_that_fit", None)
    if fit is None:
        return
    n = fit(args.ctx, kv_dtype)
    what = f"{args.ctx}-token KV caches of {model.cache_bytes(args.ctx, kv_dtype) / 2**20:.0f} MiB"
    advice = "a smaller --ctx, --kv-dtype f16, fewer --gpu-layers or a smaller quantization"
    if n == 0:
        raise ServeError(f"the GPU has no room left for one request's KV cache ({what}); use {advice}")
    print(f"GPU memory: room for {n} concurrent requests' {what} (--max-seqs {args.max_seqs})", flush=True)
    if n < args.max_seqs:
        print(
            f"warning: only {n} requests can run at once on the GPU (the others wait for a running one's "
            f"cache); for {args.max_seqs} use {advice}",
            flush=True,
        )


def main() -> int:  # pragma: no cover - `python -m engine.commands_server` for debugging
    from engine.cli import main as cli_main

    return cli_main(["serve", *sys.argv[1:]])
