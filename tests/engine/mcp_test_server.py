"""An MCP server for the tests, written with the SDK's own server (MCPServer, mcp 2's FastMCP).

    python tests/engine/mcp_test_server.py            stdio
    python tests/engine/mcp_test_server.py http PORT  streamable HTTP on 127.0.0.1:PORT/mcp
    python tests/engine/mcp_test_server.py broken     writes to stderr and exits before speaking
"""

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("hearth-test")


@server.tool()
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@server.tool()
def fail(reason: str = "it broke") -> str:
    """Always raise an error."""
    raise RuntimeError(reason)


@server.tool()
def sleep(seconds: float) -> str:
    """Wait `seconds`, then answer."""
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def big(n: int) -> str:
    """A result of n characters."""
    return "x" * n


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def crash() -> str:
    """The server process dies."""
    print("crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "stdio"
    if mode == "broken":
        print("fatal: missing API key HEARTH_TEST_KEY", file=sys.stderr, flush=True)
        sys.exit(2)
    if mode == "http":
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
