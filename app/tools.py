"""The app's MCP tool servers: started from mcp.json when tools are on, off the GUI thread.

`ToolManager` owns an engine.mcp_client.ToolHost (its servers run on the host's own asyncio thread); it
starts, restarts (settings or mcp.json changed) and stops it on a plain thread so the window never waits,
and relays call results to the GUI thread as signals. The consent rules live in the controller.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading

from app.qt import QObject, Signal
from app.settings import Settings
from engine.mcp_client import (
    MCPConfigError,
    ServerConfig,
    ToolCallError,
    ToolHost,
    ToolInfo,
    ToolServerError,
    config_path,
    load_config,
)
from engine.tool_loop import CallOutcome


def disabled_servers(settings: Settings) -> set[str]:
    """The mcp.json servers the user switched off (settings' mcp_disabled)."""
    try:
        names = json.loads(settings.get("mcp_disabled") or "[]")
    except ValueError:
        return set()
    return {str(n) for n in names} if isinstance(names, list) else set()


class ToolManager(QObject):
    """The running tool servers of the app.

    Signals:
        stateChanged(): servers started or stopped (tools(), errors() changed).
        callDone(outcome: CallOutcome, result: str, is_error: bool): a call ended with this result (or
            error text), on the GUI thread; the receiver writes it into the outcome there (the call's
            thread never touches an outcome the GUI thread reads).
    """

    stateChanged = Signal()
    callDone = Signal(object, str, bool)

    def __init__(self, settings: Settings, parent: QObject | None = None):
        super().__init__(parent)
        self.settings = settings
        self.host: ToolHost | None = None
        self.config_error = ""
        self.servers: dict[str, ServerConfig] = {}
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._generation = 0  # which start's results are current (a restart outdates an earlier one)
        self.always: set[str] = set()  # tools the user allowed always (this run of the app)
        self.starting = False

    @property
    def active(self) -> bool:
        """Tools are on and at least one server is up with tools."""
        return bool(self.settings.get("tools_enabled")) and bool(self.tools())

    def tools(self) -> list[ToolInfo]:
        host = self.host
        return host.tools() if host is not None else []

    def errors(self) -> dict[str, str]:
        """Server name -> why it is not running (failed start, died, bad mcp.json under "mcp.json")."""
        out = dict(self._errors)
        if self.host is not None:
            out.update({name: str(e) for name, e in self.host.errors().items()})
        if self.config_error:
            out["mcp.json"] = self.config_error
        return out

    def read_config(self) -> dict[str, ServerConfig]:
        """mcp.json's servers (config_error says why when it cannot be read)."""
        try:
            self.servers = load_config(config_path())
            self.config_error = ""
        except MCPConfigError as e:
            self.servers, self.config_error = {}, str(e)
        return self.servers

    def restart(self, wait: bool = False) -> None:
        """Stop the servers and start the enabled ones again (none when tools are off); in the background
        unless wait."""
        with self._lock:
            self._generation += 1
            generation = self._generation
            old, self.host = self.host, None
            self._errors = {}
        self.read_config()
        off = disabled_servers(self.settings)
        chosen = [c for c in self.servers.values() if c.name not in off and not c.disabled]
        if not self.settings.get("tools_enabled"):
            chosen = []
        self.starting = bool(chosen)
        thread = threading.Thread(
            target=self._start, args=(old, chosen, generation), daemon=True, name="hearth-mcp-start"
        )
        thread.start()
        if wait:
            thread.join()

    def _start(self, old: ToolHost | None, chosen: list[ServerConfig], generation: int) -> None:
        if old is not None:
            old.close()
        host = None
        if chosen:
            limit = float(self.settings.get("tool_timeout_s"))
            host = ToolHost(chosen, call_timeout=limit, on_change=self._changed)  # a server died
            host.start()
        with self._lock:
            if generation != self._generation:  # a later restart won: this host is not wanted
                stale = host
                host = None
            else:
                stale = None
                self.host = host
                self.starting = False
        if stale is not None:
            stale.close()
            return
        self._changed()

    def _changed(self) -> None:
        """stateChanged, from any thread; nothing when the manager is gone (the window closed while the
        servers were starting: Qt deleted the signal's source)."""
        with contextlib.suppress(RuntimeError):
            self.stateChanged.emit()

    def call(self, outcome: CallOutcome) -> concurrent.futures.Future:
        """Run an allowed call; callDone(outcome, result, is_error) follows on the GUI thread. Cancel the
        future to stop it."""
        host = self.host
        if host is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(ToolCallError("the tool servers are not running (Settings > Tools)"))
        else:
            limit = float(self.settings.get("tool_timeout_s"))
            future = host.call(outcome.call.name, outcome.call.arguments, limit)
        future.add_done_callback(lambda f, o=outcome: self._finished(f, o))
        return future

    def _finished(self, future: concurrent.futures.Future, outcome: CallOutcome) -> None:
        if future.cancelled():
            return  # Stop: the controller has marked the call already
        try:
            result = future.result()
            text, is_error = result.text, result.is_error
        except (ToolCallError, ToolServerError) as e:
            text, is_error = f"Error: {e}", True
        except Exception as e:  # noqa: BLE001 - the model and the user read what went wrong
            text, is_error = f"Error: {type(e).__name__}: {e}", True
        # from the loop's thread: queued to the receivers' (GUI) thread, which writes the outcome
        self.callDone.emit(outcome, text, is_error)

    def shutdown(self) -> None:
        """Stop every server (on quit); waits a few seconds at most."""
        with self._lock:
            self._generation += 1
            host, self.host = self.host, None
        if host is not None:
            host.close(timeout=5)
