"""Images in chat requests to `hearth serve`, over real HTTP on 127.0.0.1 (tiny Gemma 3 fixtures).

OpenAI's `image_url` content parts (a data URL, as an object or a plain string) are validated by
engine.server.protocol, each refusal a 400 naming the field; the images reach the model through
engine.vision (a model without a vision tower answers 400 too). The full path runs the tiny Gemma 3
vision fixture (gemma3-vision) with prefill chunks one token shorter than an image, so passes must
move around its images.
"""

from __future__ import annotations

import base64
import http.client
import json
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from engine.server import protocol
from engine.server.scheduler import Engine
from tests.engine.server_harness import LiveServer

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"


def png(width: int = 28, height: int = 28, seed: int = 0) -> bytes:
    """An RGB PNG file of random pixels (written by hand: no imaging library needed)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)  # filter 0 on every scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def ask(*parts: dict, role: str = "user") -> list[dict]:
    return [{"role": role, "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def image(url: str, as_object: bool = True) -> dict:
    return {"type": "image_url", "image_url": {"url": url} if as_object else url}


def post(port: int, messages: list[dict], **extra) -> tuple[int, dict]:
    body = json.dumps({"model": "smol", "messages": messages, "max_tokens": 2, "temperature": 0, **extra})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def get(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _serve(lm, **engine_args):
    engine = Engine(lm.model, lm.tokenizer, n_ctx=256, max_seqs=4, prefix_cache_bytes=8 << 20, **engine_args)
    engine.start()
    return engine, LiveServer(engine, lm)


@pytest.fixture(scope="module")
def text_lm():
    from engine.loader import load_model

    lm = load_model(TINY / "gemma3")
    assert getattr(lm, "vision", None) is None  # the model without a vision tower these tests need
    return lm


@pytest.fixture(scope="module")
def text_server(text_lm):
    engine, server = _serve(text_lm)
    yield server
    server.close()
    engine.stop()


PIXELS = data_url(png())


@pytest.mark.parametrize(
    "part,role,param,code,says",
    [
        (image("https://example.com/cat.png"), "user", "messages[0].content[1].image_url.url",
         "invalid_image_url", "does not fetch images"),
        (image("http://example.com/cat.png", as_object=False), "user", "messages[0].content[1].image_url",
         "invalid_image_url", "send the image itself as a data URL"),
        (image("data:image/png,iVBORw0KGgo="), "user", "messages[0].content[1].image_url.url",
         "invalid_image_url", "must be a base64 data URL of an image"),
        (image("data:text/plain;base64,aGVsbG8="), "user", "messages[0].content[1].image_url.url",
         "invalid_image_url", "'data:text/plain;base64'"),
        (image("data:image/png;base64"), "user", "messages[0].content[1].image_url.url",
         "invalid_image_url", "must be a base64 data URL of an image"),
        (image("file:///etc/passwd"), "user", "messages[0].content[1].image_url.url",
         "invalid_image_url", "must be a base64 data URL"),
        (image("data:image/png;base64,iVBO*w0KGgo="), "user", "messages[0].content[1].image_url.url",
         "invalid_image_url", "is not valid base64"),
        (image("data:image/png;base64,"), "user", "messages[0].content[1].image_url.url",
         "invalid_image_url", "holds no image data"),
        ({"type": "image_url", "image_url": {"detail": "high"}}, "user",
         "messages[0].content[1].image_url.url", "invalid_image_url", "must be a data URL"),
        (image(PIXELS), "system", "messages", None, "images go in user messages only, not in system"),
        (image(PIXELS), "assistant", "messages", None, "not in assistant messages"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "user", "messages", None,
         "messages[0].content[1] must be {'type': 'text'"),
    ],
    ids=["https-url", "http-string", "not-base64", "not-an-image-type", "no-comma", "file-url",
         "bad-base64", "empty", "no-url", "system", "assistant", "audio"],
)
def test_bad_image_parts_are_400s_naming_the_field(text_server, part, role, param, code, says):
    status, body = post(text_server.port, ask(part, role=role))
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert says in error["message"]
    assert param in error["message"] or param == "messages"


def test_images_over_the_size_limit_are_refused(text_server, monkeypatch):
    monkeypatch.setattr(protocol, "MAX_IMAGE_BYTES", 1 << 20)
    # one byte over: the base64 is as long as the limit's, so the decoded size is what refuses it
    for size in (1 << 20) + 1, 3 << 20:
        status, body = post(text_server.port, ask(image(data_url(b"\x89PNG" + b"\0" * (size - 4)))))
        assert status == 400, (size, body)
        error = body["error"]
        assert error["code"] == "image_too_large" and error["param"] == "messages[0].content[1].image_url.url"
        assert "over the limit of 1 MiB" in error["message"]


def test_an_image_of_the_largest_size_fits_the_default_body_limit(text_server):
    # 20 MiB as base64 is 26.7 MiB of JSON: the body limit lets it through, and the size check does too
    # (it is the model that refuses it here: it reads no images)
    big = data_url(b"\0" * protocol.MAX_IMAGE_BYTES)
    status, body = post(text_server.port, ask(image(big, as_object=False)))
    assert status == 400 and body["error"]["code"] == "images_not_supported", body


def test_too_many_images_are_refused(text_server):
    tiny = image(data_url(b"GIF89a"))
    messages = ask(*[tiny] * (protocol.MAX_IMAGES // 2)) + ask(*[tiny] * (protocol.MAX_IMAGES // 2 + 1))
    status, body = post(text_server.port, messages)
    assert status == 400 and body["error"]["code"] == "too_many_images", body
    assert f"at most {protocol.MAX_IMAGES} images per request" in body["error"]["message"]


def test_an_image_to_a_model_without_vision_is_a_400(text_server, text_lm):
    status, body = post(text_server.port, ask(image(PIXELS)))
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "images_not_supported" and error["param"] == "messages"
    assert f"{text_lm.name} does not read images" in error["message"]
    caps = get(text_server.port, "/v1/models")["data"][0]["capabilities"]
    assert caps == ["completion"]


def test_text_parts_still_read_as_text(text_server):
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    status, joined = post(text_server.port, [{"role": "user", "content": parts}])
    assert status == 200, joined
    status, plain = post(text_server.port, [{"role": "user", "content": "Name three colours."}])
    assert status == 200
    assert joined["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert joined["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


# --- a model that reads images ---------------------------------------------------------------------


class _Passes:
    """The model, with every prefill pass's token ids recorded (what the scheduler gave forward)."""

    def __init__(self, model):
        self._model = model
        self.passes: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, tokens, cache, *args, **kwargs):
        self.passes.append([int(t) for t in tokens])
        return self._model.forward(tokens, cache, *args, **kwargs)


@pytest.fixture(scope="module")
def vision_lm():
    from engine.loader import load_model

    return load_model(TINY / "gemma3-vision")


def test_a_model_with_vision_reads_images_through_the_server(vision_lm):
    from engine.vision import encode_with_images, prepare_messages

    lm = vision_lm
    assert getattr(lm, "vision", None) is not None, f"{lm.path} loads without its vision tower"
    table = lm.model.images
    span = lm.vision.shape.tokens  # rows per image (Gemma 3: the same for every image)
    model = _Passes(lm.model)
    engine = Engine(model, lm.tokenizer, n_ctx=256, max_seqs=4, prefill_chunk=span - 1)
    engine.start()
    server = LiveServer(engine, lm)
    try:
        assert "multimodal" in get(server.port, "/v1/models")["data"][0]["capabilities"]
        messages = ask(image(PIXELS), image(data_url(png(seed=1)), as_object=False))
        status, first = post(server.port, messages)
        assert status == 200, first
        parsed = protocol.parse_chat({"model": "smol", "messages": messages}, 256)
        template_messages, images = prepare_messages(lm, parsed.messages)
        text = lm.template.render(template_messages, add_generation_prompt=True)
        ids = encode_with_images(lm, text, images)
        assert len(table.runs(np.array(ids))) == 2
        assert first["usage"]["prompt_tokens"] == len(ids)  # image ids count as prompt tokens
        # every pass held whole images (chunk_end), and one image started a pass and outgrew the chunk
        for p in model.passes:
            table.key_ends(np.array(p), 0)  # raises ValueError for a pass holding part of an image
        assert max(len(p) for p in model.passes) >= span
        # the same images again: their keys and values are reused
        status, again = post(server.port, messages)
        assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) - 1
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        # bytes that are no image: the engine's ImageInputError, as a 400
        status, body = post(server.port, ask(image(data_url(b"not an image at all"))))
        assert status == 400 and body["error"]["code"] == "invalid_image", body
        assert "could not be read" in body["error"]["message"]
    finally:
        server.close()
        engine.stop()


class _Gated(_Passes):
    """The model, with prefill passes that wait for `gate` (a request whose prompt is not yet read)."""

    def __init__(self, model):
        super().__init__(model)
        self.gate = threading.Event()
        self.reading = threading.Event()  # a pass waits at the gate

    def forward(self, tokens, cache, *args, **kwargs):
        self.reading.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return super().forward(tokens, cache, *args, **kwargs)


def test_images_of_a_waiting_request_are_not_dropped_by_another_requests_images(vision_lm, monkeypatch):
    # request A's images are encoded when it is parsed and read when its prompt is prefilled; request B,
    # parsed meanwhile, must not drop them from the model's image table (A would fail with a 500)
    lm = vision_lm
    table = lm.model.images
    model = _Gated(lm.model)
    engine = Engine(model, lm.tokenizer, n_ctx=600, max_seqs=4, prefill_chunk=512)
    engine.start()
    server = LiveServer(engine, lm)
    first = {}
    try:
        monkeypatch.setattr(table, "capacity", 2)
        a = ask(image(data_url(png(seed=11))), image(data_url(png(seed=12))))
        waiting = threading.Thread(target=lambda: first.update(zip(("status", "body"), post(server.port, a))))
        waiting.start()
        assert model.reading.wait(60), first  # A is parsed (its images encoded) and waits to be read
        status, busy = post(server.port, ask(image(data_url(png(seed=13)))))
        assert status == 503 and busy["error"]["code"] == "server_busy", busy
        assert "retry when they finish" in busy["error"]["message"]
        model.gate.set()
        waiting.join(120)
        assert first["status"] == 200, first  # A's images were still there when its prompt was read
        assert not table._held  # released once A's prompt was prefilled
        status, later = post(server.port, ask(image(data_url(png(seed=13)))))
        assert status == 200, later  # B fits now: A's images may go
    finally:
        model.gate.set()
        server.close()
        engine.stop()
