"""The MCP client against real servers: tests/engine/mcp_test_server.py, written with the SDK's MCPServer,
started over stdio (and streamable HTTP) as a user's servers are."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.mcp_client import (
    MCPConfigError,
    ServerConfig,
    ToolCallError,
    ToolHost,
    ToolServerError,
    config_path,
    load_config,
    write_default_config,
)

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))


def stdio(name: str = "test", *args: str) -> ServerConfig:
    return ServerConfig(name, command=sys.executable, args=[SERVER, *args])


@pytest.fixture(scope="module")
def host():
    with ToolHost([stdio()], start_timeout=30, call_timeout=20) as h:
        assert h.start() == {"test": None}
        yield h


def test_config_in_claude_desktop_format(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server-filesystem", "/tmp"], "env": {"K": "v"}},
        "web": {"url": "http://127.0.0.1:8000/mcp"},
    }}))
    servers = load_config(path)
    assert list(servers) == ["files", "web"]
    assert servers["files"].args == ["-y", "server-filesystem", "/tmp"] and servers["files"].env == {"K": "v"}
    assert servers["files"].transport == "stdio" and servers["web"].transport == "http"


def test_config_errors_name_the_file(tmp_path):
    path = tmp_path / "mcp.json"
    assert load_config(path) == {}  # none yet: no servers
    path.write_text("{not json")
    with pytest.raises(MCPConfigError, match="mcp.json is not valid JSON"):
        load_config(path)
    path.write_text(json.dumps({"mcpServers": {"x": {"args": []}}}))
    with pytest.raises(MCPConfigError, match="server 'x' needs a \"command\""):
        load_config(path)


def test_default_config_lives_in_the_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_HOME", str(tmp_path))
    path = write_default_config()
    assert path == config_path() == tmp_path / "config" / "mcp.json"
    assert json.loads(path.read_text()) == {"mcpServers": {}}


def test_lists_and_calls_tools(host):
    by_name = {t.name: t for t in host.tools()}
    assert {"add", "fail", "sleep", "big", "crash", "pid"} <= set(by_name)
    schema = by_name["add"].schema()
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    assert schema["function"]["description"] == "Add two numbers."
    result = host.call("add", {"a": 2, "b": 3}).result(timeout=20)
    assert (result.text, result.is_error) == ("5.0", False)


def test_a_tool_that_raises_is_an_error_result(host):
    result = host.call("fail", {"reason": "no"}).result(timeout=20)
    assert result.is_error and "fail" in result.text


def test_unknown_tool(host):
    with pytest.raises(ToolCallError, match="no running tool server offers a tool named 'nope'"):
        host.call("nope", {}).result(timeout=20)


def test_a_call_that_takes_too_long_times_out(host):
    t0 = time.monotonic()
    with pytest.raises(ToolCallError, match="did not answer within 0.5 s"):
        host.call("sleep", {"seconds": 30}, timeout=0.5).result(timeout=20)
    assert time.monotonic() - t0 < 5
    assert host.call("add", {"a": 1, "b": 1}).result(timeout=20).text == "2.0"  # the server goes on


def test_cancelling_a_call(host):
    future = host.call("sleep", {"seconds": 30})
    time.sleep(0.3)
    assert future.cancel()
    assert host.call("add", {"a": 1, "b": 2}).result(timeout=20).text == "3.0"


def test_a_huge_result_comes_back_whole(host):
    assert len(host.call("big", {"n": 300_000}).result(timeout=20).text) == 300_000


def test_a_server_that_cannot_start_reports_its_stderr():
    with ToolHost([stdio("broken", "broken"), ServerConfig("gone", command="no-such-program-hearth")]) as h:
        t0 = time.monotonic()
        errors = h.start()
        assert time.monotonic() - t0 < 20
    assert isinstance(errors["broken"], ToolServerError)
    broken = str(errors["broken"])
    assert "failed to start" in broken and "missing API key HEARTH_TEST_KEY" in broken
    assert "command 'no-such-program-hearth' was not found" in str(errors["gone"])


def test_a_server_that_hangs_at_start_times_out():
    hang = ServerConfig("hang", command=sys.executable, args=["-c", "import time; time.sleep(60)"])
    with ToolHost([hang], start_timeout=1.0) as h:
        t0 = time.monotonic()
        errors = h.start()
        assert time.monotonic() - t0 < 8
    assert "did not start within 1 s" in str(errors["hang"])


def test_a_server_that_dies_mid_call_is_a_typed_error_with_its_stderr():
    with ToolHost([stdio()]) as h:
        assert h.start() == {"test": None}
        with pytest.raises(ToolServerError, match="died during a call to 'crash'") as info:
            h.call("crash", {}).result(timeout=20)
        assert "crashing on purpose" in info.value.stderr
        with pytest.raises(ToolServerError):  # later calls say the same, at once
            h.call("add", {"a": 1, "b": 1}).result(timeout=5)


def test_close_stops_the_server_process():
    h = ToolHost([stdio()])
    h.start()
    pid = int(float(h.call("pid", {}).result(timeout=20).text))
    h.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the server process {pid} still runs after close()")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/mcp"
        down = ServerConfig("down", url="http://127.0.0.1:9/mcp")
        with ToolHost([ServerConfig("web", url=url), down]) as h:
            errors = h.start()
            assert errors["web"] is None and "failed to start" in str(errors["down"])
            assert h.call("add", {"a": 4, "b": 5}).result(timeout=20).text == "9.0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_server_that_dies_while_idle_is_reported_without_a_call():
    import signal
    import threading

    died = threading.Event()
    with ToolHost([stdio()], watch_s=0.3, on_change=died.set) as h:
        assert h.start() == {"test": None}
        pid = int(float(h.call("pid", {}).result(timeout=20).text))
        os.kill(pid, signal.SIGKILL)
        assert died.wait(10), "on_change was not called"
        assert "Tool server 'test': exited" in str(h.errors()["test"])
        assert h.tools() == []
        with pytest.raises(ToolServerError, match="exited"):
            h.call("add", {"a": 1, "b": 1}).result(timeout=5)


def test_a_long_call_is_not_taken_for_a_dead_server():
    with ToolHost([stdio()], watch_s=0.2) as h:
        assert h.start() == {"test": None}
        assert h.call("sleep", {"seconds": 1.5}).result(timeout=20).text == "slept 1.5"
        assert h.errors() == {}
