"""Runs `hearth serve`'s application in process, on a free 127.0.0.1 port, in a uvicorn thread."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from engine.server.app import ServerConfig, create_app


class LiveServer:
    """One uvicorn server over an existing engine (or a pool of models); `url` is its /v1 base."""

    def __init__(self, engine=None, lm=None, pool=None, **config):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        if pool is None:
            self.config = ServerConfig(model_name="smol", port=self.port, aliases=[lm.name], **config)
        else:  # a pool of models (engine.server.pool): its first model names the server
            self.config = ServerConfig(model_name=pool.default.id, port=self.port, **config)
        self.app = create_app(self.config, engine, lm, pool=pool)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def openai(self, timeout: float = 120):
        """An official OpenAI client for this server (no retries)."""
        import openai

        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=timeout)

    def ollama(self, timeout: float = 120):
        """Ollama's official client for this server."""
        import ollama

        return ollama.Client(host=f"http://127.0.0.1:{self.port}", timeout=timeout)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
