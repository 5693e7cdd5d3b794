"""A stand-in for `hearth serve` with the same command line and behaviour at its edges: it binds the port,
prints a ready line with the URL, answers GET /health, and exits cleanly on SIGTERM. `--fail` exits at once
with an error, like a server whose port is taken."""

from __future__ import annotations

import argparse
import http.server
import signal
import sys
import threading


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        body = b'{"status": "ok"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--fail", action="store_true")
    args = ap.parse_args()
    if args.fail:
        print(f"hearth: {args.host}:{args.port} is already in use; pick another --port", file=sys.stderr)
        return 1
    server = http.server.ThreadingHTTPServer((args.host, args.port), _Health)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"loading {args.model}", flush=True)
    print(f"Hearth is serving {args.model} at http://{args.host}:{server.server_port}/v1", flush=True)
    stop.wait()
    server.shutdown()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
