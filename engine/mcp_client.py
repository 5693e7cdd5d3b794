"""Tool servers over the Model Context Protocol (MCP), for chats that use tools.

Servers are configured in `mcp.json` in Hearth's config dir, in the format Claude Desktop and LM Studio use:

    {"mcpServers": {"files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem"],
                              "env": {"KEY": "value"}},
                    "web": {"url": "http://127.0.0.1:8000/mcp"}}}

A server with "command" is started as a subprocess and spoken to over its stdin/stdout; one with "url" is
reached over streamable HTTP. The protocol is the official `mcp` SDK's.

`ToolHost` runs every server of a session on one asyncio loop in its own daemon thread, so neither the GUI's
event loop nor the terminal chat waits on a server except where it asks to (`start`, `call(...).result()`).
Each server lives in one task that holds its transport and session open until `close`; a server that fails
to start, or dies, is reported as a ToolServerError with the tail of its stderr, never a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine import tools
from models.errors import HearthError
from models.paths import config_dir

START_TIMEOUT_S = 30.0
WATCH_S = 5.0  # an idle server is pinged this often, so one that died is reported without waiting for a call
CALL_TIMEOUT_S = 120.0
CONNECTION_CLOSED = -32000  # JSON-RPC code the SDK gives pending requests when the server's stream ends
STDERR_TAIL = 2000  # characters of a failed server's stderr shown with its error


class MCPConfigError(HearthError):
    """mcp.json cannot be read or does not have the expected shape."""


class ToolServerError(HearthError):
    """A tool server failed to start, stopped answering, or died."""

    def __init__(self, server: str, message: str, stderr: str = ""):
        self.server = server
        self.stderr = stderr
        tail = f"\nIts last output on stderr:\n{stderr}" if stderr.strip() else ""
        super().__init__(f"Tool server '{server}': {message}{tail}")


class ToolCallError(HearthError):
    """A tool call could not be made: unknown tool, timed out, or its server is gone."""


def config_path() -> Path:
    """Where mcp.json lives: next to settings.json in the user config dir (HEARTH_HOME redirects it)."""
    return config_dir() / "mcp.json"


@dataclass
class ServerConfig:
    """One entry of mcp.json's "mcpServers"."""

    name: str
    command: str = ""
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    url: str = ""
    cwd: str | None = None
    disabled: bool = False  # "disabled": true in mcp.json (as Cline writes it): listed, not started

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"


def load_config(path: Path | None = None) -> dict[str, ServerConfig]:
    """The servers of mcp.json (none when the file does not exist), by name, in the file's order.

    Raises:
        MCPConfigError: the file is not JSON or an entry lacks "command"/"url"; the message names the file.
    """
    path = Path(path) if path is not None else config_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError) as e:
        raise MCPConfigError(f"{path} is not valid JSON ({e}); fix it or remove it") from e
    servers = data.get("mcpServers", {}) if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise MCPConfigError(f'{path} must hold {{"mcpServers": {{"name": {{"command": ...}}}}}}')
    out = {}
    for name, entry in servers.items():
        where = f"{path}: server '{name}'"
        if not isinstance(entry, dict):
            raise MCPConfigError(f"{where} must be an object with a \"command\" or a \"url\"")
        command, url = entry.get("command"), entry.get("url") or entry.get("serverUrl")
        if not (isinstance(command, str) and command) and not (isinstance(url, str) and url):
            raise MCPConfigError(f"{where} needs a \"command\" (a program to start) or a \"url\" (http://...)")
        args, env = entry.get("args", []), entry.get("env", {})
        if not isinstance(args, list) or not isinstance(env, dict):
            raise MCPConfigError(f'{where}: "args" must be a list and "env" an object')
        out[name] = ServerConfig(
            name=name,
            command=command or "",
            args=[str(a) for a in args],
            env={str(k): str(v) for k, v in env.items()},
            url=url or "",
            cwd=entry.get("cwd") if isinstance(entry.get("cwd"), str) else None,
            disabled=entry.get("disabled") is True,
        )
    return out


def write_default_config(path: Path | None = None) -> Path:
    """Create an empty mcp.json (for the user to edit) unless one exists; returns its path."""
    path = Path(path) if path is not None else config_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"mcpServers": {}}, indent=2) + "\n", encoding="utf-8")
    return path


@dataclass
class ToolInfo:
    """A tool a server offers."""

    server: str
    name: str
    description: str = ""
    input_schema: dict = field(default_factory=dict)

    def schema(self) -> dict:
        """The tool as the chat template's `tools` variable lists it."""
        return tools.tool_schema(self.name, self.description, self.input_schema)


@dataclass
class ToolResult:
    """What a call gave back: its text (text parts joined; other parts described), and whether the tool
    reported an error."""

    text: str
    is_error: bool = False


def _result_text(result) -> str:
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(getattr(block, "resource", None), "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind or 'unknown'} content, {getattr(block, 'mime_type', '') or 'no type'}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _unwrap(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, as anyio task groups raise them."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # an ExceptionGroup
        exc = exc.exceptions[0]
    return exc


class _Server:
    """One running server: its task, session and stderr file (the task owns the transport's contexts)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.session = None
        self.tools: list[ToolInfo] = []
        self.ready: asyncio.Future | None = None
        self.stopping: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.error: ToolServerError | None = None
        # the server's stderr goes to a real file (a subprocess needs a descriptor); closed by ToolHost.close
        self.stderr_file = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115

    def stderr_tail(self) -> str:
        try:
            self.stderr_file.flush()
            self.stderr_file.seek(0, os.SEEK_END)
            size = self.stderr_file.tell()
            self.stderr_file.seek(max(0, size - STDERR_TAIL * 4))
            return self.stderr_file.read()[-STDERR_TAIL:].strip()
        except (OSError, ValueError):
            return ""

    def failed(self, message: str) -> ToolServerError:
        return ToolServerError(self.config.name, message, self.stderr_tail())


class ToolHost:
    """MCP servers of a chat session, on a private asyncio loop in a daemon thread.

    The public methods may be called from any thread. `start` and `list` wait (with a time limit); `call`
    returns a concurrent.futures.Future whose cancel() cancels the call.

    Args:
        servers: the configs to run (load_config's values, filtered to the enabled ones).
        start_timeout: seconds a server may take to start and list its tools.
        call_timeout: default seconds a tool call may take.
        on_change: told (on the host's thread) when a server that was running dies.
        watch_s: how often an idle server is pinged to notice that.
    """

    def __init__(
        self,
        servers: Iterable[ServerConfig],
        start_timeout: float = START_TIMEOUT_S,
        call_timeout: float = CALL_TIMEOUT_S,
        on_change: Callable[[], None] = lambda: None,
        watch_s: float = WATCH_S,
    ):
        self._servers = {c.name: _Server(c) for c in servers}
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.on_change = on_change  # called (on the host's thread) when a running server dies
        self.watch_s = watch_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hearth-mcp", daemon=True)
        self._thread.start()
        self._closed = False

    # --- public, from any thread ---------------------------------------------------------------------

    def start(self) -> dict[str, ToolServerError | None]:
        """Start every server (at once) and list its tools. Returns {name: None, or the error it gave}."""
        fut = asyncio.run_coroutine_threadsafe(self._start_all(), self._loop)
        return fut.result(timeout=self.start_timeout + 10)

    def tools(self) -> list[ToolInfo]:
        """The tools of the servers that are up, server order; a name a second server repeats is left out
        (the first server's tool answers to it)."""
        seen, out = set(), []
        for server in self._servers.values():
            if server.session is None or server.error is not None:
                continue
            for t in server.tools:
                if t.name not in seen:
                    seen.add(t.name)
                    out.append(t)
        return out

    def errors(self) -> dict[str, ToolServerError]:
        return {name: s.error for name, s in self._servers.items() if s.error is not None}

    def call(self, name: str, arguments: dict, timeout: float | None = None) -> concurrent.futures.Future:
        """Call tool `name`. The future gives a ToolResult, or raises ToolCallError / ToolServerError;
        cancelling it cancels the call."""
        return asyncio.run_coroutine_threadsafe(self._call(name, arguments, timeout), self._loop)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every server (their subprocesses end) and the loop's thread."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(self._stop_all(), self._loop).result(timeout=timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout)
        for s in self._servers.values():
            s.stderr_file.close()

    def __enter__(self) -> ToolHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- on the loop ------------------------------------------------------------------------------------

    async def _start_all(self) -> dict[str, ToolServerError | None]:
        waits = []
        for server in self._servers.values():
            if server.task is None:
                server.ready = self._loop.create_future()
                server.stopping = asyncio.Event()
                server.task = self._loop.create_task(self._serve(server))
            waits.append(self._wait_ready(server))
        await asyncio.gather(*waits)
        return {name: s.error for name, s in self._servers.items()}

    async def _wait_ready(self, server: _Server) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(server.ready), self.start_timeout)
        except asyncio.TimeoutError:
            server.error = server.failed(
                f"did not start within {self.start_timeout:.0f} s (check its command in mcp.json)"
            )
            server.task.cancel()

    async def _serve(self, server: _Server) -> None:
        from mcp import ClientSession

        c = server.config
        try:
            async with self._transport(server) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                listed = await session.list_tools()
                server.tools = [
                    ToolInfo(c.name, t.name, t.description or "", dict(t.input_schema or {}))
                    for t in listed.tools
                ]
                server.session = session
                if not server.ready.done():
                    server.ready.set_result(None)
                await self._watch(server, session)
        except asyncio.CancelledError:
            if server.error is None:
                server.error = server.failed("was stopped")
        except BaseException as e:  # noqa: BLE001 - whatever ends a server is reported, typed
            e = _unwrap(e)
            what = "failed to start" if not server.ready.done() else "stopped answering"
            if isinstance(e, FileNotFoundError):
                detail = f"its command '{c.command}' was not found (install it or fix mcp.json)"
                server.error = server.failed(detail)
            else:
                server.error = server.failed(f"{what}: {type(e).__name__}: {e}".rstrip(": "))
        finally:
            if server.error is None and not server.stopping.is_set():
                server.error = server.failed("exited")
            server.session = None
            if not server.ready.done():
                server.ready.set_result(None)

    async def _watch(self, server: _Server, session) -> None:
        """Wait for close; meanwhile ping the server every watch_s so one that died while idle is reported
        (on_change) before anyone calls it."""
        while not server.stopping.is_set():
            try:
                await asyncio.wait_for(server.stopping.wait(), self.watch_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await asyncio.wait_for(session.send_ping(), self.watch_s)
            except asyncio.TimeoutError:
                continue  # busy, not dead: a call in flight may hold it
            except Exception:  # noqa: BLE001 - whatever the transport says, the server is gone
                await asyncio.sleep(0.2)  # its last stderr lines
                server.error = server.failed("exited")
                self.on_change()
                return

    def _transport(self, server: _Server):
        c = server.config
        if c.url:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(c.url)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(command=c.command, args=c.args, env=c.env or None, cwd=c.cwd)
        return stdio_client(params, errlog=server.stderr_file)

    def _server_of(self, name: str) -> _Server:
        for server in self._servers.values():
            up = server.session is not None and server.error is None
            if up and any(t.name == name for t in server.tools):
                return server
        for server in self._servers.values():
            if any(t.name == name for t in server.tools):
                raise server.error or server.failed("is not running")
        raise ToolCallError(f"no running tool server offers a tool named '{name}'")

    async def _call(self, name: str, arguments: dict, timeout: float | None) -> ToolResult:
        server = self._server_of(name)
        limit = self.call_timeout if timeout is None else timeout
        call = asyncio.ensure_future(server.session.call_tool(name, arguments))
        ended = asyncio.ensure_future(server.task)  # the server dying ends the wait at once
        try:
            done, _ = await asyncio.wait({call, ended}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if call not in done:
            call.cancel()
            if ended in done:
                raise server.error or server.failed("stopped during the call")
            raise ToolCallError(f"the tool '{name}' did not answer within {limit:g} s")
        try:
            result = call.result()
        except Exception as e:  # noqa: BLE001 - a protocol error of this call becomes a typed one
            if getattr(e, "code", None) == CONNECTION_CLOSED or server.task.done():
                await asyncio.sleep(0.2)  # the dying process's last stderr lines
                if server.error is None:
                    server.error = server.failed(f"died during a call to '{name}'")
                    self.on_change()
                server.stopping.set()  # its task closes the transport and reaps the process
                raise server.error from e
            raise ToolCallError(f"the tool '{name}' failed: {e}") from e
        return ToolResult(_result_text(result), bool(getattr(result, "is_error", False)))

    async def _stop_all(self) -> None:
        for server in self._servers.values():
            if server.stopping is not None:
                server.stopping.set()
        tasks = [s.task for s in self._servers.values() if s.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=8)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2)
