"""Malformed requests for `hearth serve`: each one must get a 4xx with an error body (OpenAI's, or Ollama's
under /api/), never a crash.

Used by the tests (a few hundred) and scripts/bench_serve.py (a thousand). Every case is invalid by
construction (a valid request would start a generation and answer 200): a valid body with one to three
fields replaced by values the server must reject, raw bytes that are not a JSON object, wrong
methods, paths, Host headers or sizes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
from dataclasses import dataclass

from engine.server.protocol import MAX_BODY_BYTES

# field -> values every one of which is invalid for it
_BAD_CHAT = {
    "model": [None, 5, "", ["m"], {"id": "m"}, "no-such-model", True],
    "messages": [
        None,
        "hi",
        [],
        {},
        [None],
        ["hi"],
        [{"role": "robot", "content": "x"}],
        [{"content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"x": 1}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a.example/b.png"}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,%%%"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "data:text/plain;base64,aGk="}]}],
        [{"role": "system", "content": [{"type": "image_url", "image_url": "data:image/png;base64,aGk="}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}],
        [{"role": 7, "content": "x"}],
    ],
    "max_tokens": [0, -1, -(10**12), 10**9, "10", 1.5, True, [], {}],
    "max_completion_tokens": [0, -3, 10**12, "x"],
    "temperature": [-0.1, 2.5, 1e308, "hot", [], True],
    "top_p": [0, -1, 1.01, "1", {}],
    "n": [0, 2, 100, "1", 1.0],
    "seed": ["s", 1.5, [], 2**70],
    "stop": [5, [1], ["a", "b", "c", "d", "e"], ["x" * 300], {"s": 1}],
    "stream": ["yes", 1, [], {}],
    "stream_options": ["x", 5, []],
    "logprobs": ["yes", 1, []],
    "top_logprobs": [-1, 21, "3", 1.5],
    "response_format": [
        "json",
        5,
        [],
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": 5}},
        {"type": "json_schema", "json_schema": "s"},
    ],
    "tools": [
        "t",
        5,
        [{"type": "function"}],
        [{"type": "other", "function": {"name": "f"}}],
        [5],
        [{"type": "function", "function": {"name": ""}}],
    ],
    "tool_choice": ["sometimes", 5, []],
    "presence_penalty": [3, -3, "x"],
    "frequency_penalty": [9, "x", []],
    "ignore_eos": ["no", 0],
}
_BAD_COMPLETION = {
    "model": [None, 5, "", "no-such-model"],
    "prompt": [None, "", [], 5, {}, [-1], [10**9], [1.5], ["a", "b"], [[1, 2]], True],
    "max_tokens": [0, -1, 10**9, "5", 2.5],
    "temperature": [-1, 9, "x"],
    "top_p": [0, 2],
    "logprobs": [-1, 6, "x", True],
    "echo": [True, "x"],
    "best_of": [2, "x"],
    "suffix": ["tail", 5],
    "stop": [[None], 3],
    "n": [3],
}
_OPTIONS = [
    "x", 5, [], {"num_predict": 0}, {"num_predict": -3}, {"num_predict": 10**9}, {"temperature": "hot"},
    {"top_k": -2}, {"top_p": 0}, {"min_p": 1}, {"seed": "s"}, {"stop": 5},
]
_OLLAMA_COMMON = {
    "model": [None, 5, "", ["m"], "no-such-model"],
    "options": _OPTIONS,
    "format": ["yaml", 5, []],
    "think": ["very", 5, []],
    "stream": ["yes", 1, []],
}
_BAD_OLLAMA_CHAT = {
    **_OLLAMA_COMMON,
    "messages": [
        "hi",
        {},
        [None],
        ["hi"],
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": "x", "images": "abc"}],
        [{"role": "user", "content": "x", "images": ["%%%"]}],
        [{"role": "user", "content": "x", "images": [5]}],
        [{"role": "assistant", "content": "x", "images": ["aGk="]}],
        [{"role": "user", "content": "x", "tool_calls": "t"}],
    ],
    "tools": ["t", 5, [{"type": "function"}]],
}
_BAD_GENERATE = {
    **_OLLAMA_COMMON,
    "prompt": [5, [], {}],
    "suffix": ["tail"],
    "template": ["{{ .Prompt }}"],
    "raw": ["yes", 1],
    "context": ["c", [1.5], [-1], [10**9]],
    "system": [5, []],
    "images": ["abc", [5], ["%%%"]],
}
_BAD_EMBEDDINGS = {
    "model": [None, 5, "", ["m"], "no-such-model"],
    "input": [None, [], 5, {}, True, [None], [1.5], [[1], "a"], [[]], [-1], [10**9], [[2], [-3]], ["a", 5]],
    "encoding_format": ["hex", 5, [], True],
    "dimensions": [0, -1, "8", 1.5, 10**6, True, []],
}
_BAD_OLLAMA_EMBED = {
    "model": [None, 5, "", "no-such-model"],
    "input": [None, [], 5, {}, [5], [None], [["a"]]],
    "truncate": ["yes", 1, []],
    "options": ["x", 5, []],
    "dimensions": [0, "8", 10**6, -2],
}
_BAD_OLLAMA_EMBEDDINGS = {
    "model": [None, 5, "", "no-such-model"],
    "prompt": [None, 5, [], {}, ["a"]],
    "options": ["x", 5, []],
}
_BAD_MESSAGES = {
    "model": [None, 5, "", "no-such-model"],
    "max_tokens": [None, 0, -1, "4", 1.5, 10**9],
    "messages": [
        "hi", [], [{}], [None], [{"role": "system", "content": "x"}], [{"role": "user", "content": 5}],
        [{"role": "user", "content": [5]}], [{"role": "user", "content": [{"type": "document"}]}],
        [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
        [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": 5}}]}],
        [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}],
        [{"role": "assistant", "content": [{"type": "tool_use", "name": 5}]}],
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [5]}]}],
    ],
    "system": [5, [5], [{"type": "image"}]],
    "stop_sequences": ["x", [5]],
    "tools": ["t", [5], [{"description": "no name"}], [{"type": "web_search_20250305", "name": "web"}]],
    "tool_choice": ["auto", {"type": "sometimes"}],
    "thinking": ["on", {"type": "maybe"}],
    "output_config": [{"format": "json"}, {"format": {"type": "json_schema"}}],
    "stream": ["yes", 1],
}
_RAW = [
    b"",
    b"{",
    b"[]",
    b"null",
    b"42",
    b'"text"',
    b"\xff\xfe\x00",
    b'{"model": }',
    b"[" * 5000 + b"]" * 5000,
    b'{"a": ' * 3000 + b"1" + b"}" * 3000,
    b"\x00" * 64,
    b"true",
]


@dataclass
class Case:
    """One malformed request."""

    method: str
    path: str
    body: bytes | None
    headers: dict


def cases(n: int, model: str, seed: int = 0, port: int = 0) -> list[Case]:
    """n malformed requests for a server serving `model` on 127.0.0.1:port."""
    rng = random.Random(seed)
    host = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json"}
    big = b'{"model": "' + b"x" * (MAX_BODY_BYTES + (1 << 20)) + b'"}'  # one object, shared by its cases
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.04:  # the embedding routes, OpenAI's and Ollama's
            path = rng.choice(["/v1/embeddings", "/api/embed", "/api/embeddings"])
            if path == "/api/embeddings":
                body, bad = {"model": model, "prompt": "hi"}, _BAD_OLLAMA_EMBEDDINGS
            else:
                body = {"model": model, "input": ["hi", "there"]}
                bad = _BAD_EMBEDDINGS if path == "/v1/embeddings" else _BAD_OLLAMA_EMBED
            _mutate(rng, body, bad)
            out.append(Case("POST", path, json.dumps(body).encode(), host))
        elif kind < 0.12:  # Ollama's routes
            chat = rng.random() < 0.5
            body = {"model": model, "options": {"num_predict": 4}, "stream": False}
            body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
            _mutate(rng, body, _BAD_OLLAMA_CHAT if chat else _BAD_GENERATE)
            path = "/api/chat" if chat else "/api/generate"
            out.append(Case("POST", path, json.dumps(body).encode(), host))
        elif kind < 0.18:  # Anthropic's Messages API
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            _mutate(rng, body, _BAD_MESSAGES)
            out.append(Case("POST", "/v1/messages", json.dumps(body).encode(), host))
        elif kind < 0.45:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            _mutate(rng, body, _BAD_CHAT)
            out.append(Case("POST", "/v1/chat/completions", json.dumps(body).encode(), host))
        elif kind < 0.65:
            body = {"model": model, "prompt": "Once", "max_tokens": 4}
            _mutate(rng, body, _BAD_COMPLETION)
            out.append(Case("POST", "/v1/completions", json.dumps(body).encode(), host))
        elif kind < 0.8:
            path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/embed",
                               "/v1/messages"])
            out.append(Case("POST", path, rng.choice(_RAW), host))
        elif kind < 0.86:
            path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/models", "/health"])
            # the POST routes refuse GET; every route refuses PUT/DELETE/PATCH
            methods = ["GET", "PUT", "DELETE"] if "completions" in path else ["PUT", "DELETE", "PATCH"]
            out.append(Case(rng.choice(methods), path, None, host))
        elif kind < 0.91:
            path = rng.choice(
                ["/api", "/api/unknown", "/v1", "/v2/chat/completions", "/v1/embeddings", "/api/embed",
                 "/../etc/passwd", "/%00"]
            )
            out.append(Case(rng.choice(["GET", "POST"]), path, b"{}", host))
        elif kind < 0.96:
            bad_host = rng.choice(["evil.example", "127.0.0.1.nip.io", "localhost.attacker.com", ""])
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            out.append(
                Case("POST", "/v1/chat/completions", json.dumps(body).encode(), {**host, "Host": bad_host})
            )
        else:
            out.append(Case("POST", "/v1/chat/completions", big, host))
    return out


def _mutate(rng: random.Random, body: dict, bad: dict) -> None:
    for name in rng.sample(sorted(bad), rng.randint(1, 3)):
        body[name] = rng.choice(bad[name])


def send(case: Case, port: int, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send one case; returns (status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(case.method, case.path, skip_host=True, skip_accept_encoding=True)
        for k, v in case.headers.items():
            conn.putheader(k, v)
        if case.body is not None:
            conn.putheader("Content-Length", str(len(case.body)))
        conn.endheaders()
        if case.body:
            # the server may answer (413) before reading it all
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.send(case.body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def check(status: int, body: bytes) -> str | None:
    """Why an answer to a malformed request is wrong, or None when it is a 4xx with an error body (OpenAI's
    {"error": {"message": ...}} or Ollama's {"error": "..."})."""
    if not 400 <= status < 500:
        return f"status {status}: {body[:200]!r}"
    try:
        err = json.loads(body)["error"]
        message = err if isinstance(err, str) else err["message"]
        assert isinstance(message, str) and message
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"status {status} without an error body: {body[:200]!r}"
    return None
