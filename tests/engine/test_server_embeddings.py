"""The embedding routes of `hearth serve` through the official clients, on real servers on 127.0.0.1.

The tiny bert-embed fixture (an encoder: embeddings only) and qwen3-embed (a decoder embedding model that
still chats) are served; vectors are compared with their transformers goldens (tests/engine/
test_embeddings.py checks the engine itself).
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest

from engine.loader import load_model
from engine.server.fuzz import cases, check, send
from engine.server.scheduler import Engine
from tests.engine.server_harness import LiveServer

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"
TOL = 2e-5


def golden(name: str) -> dict:
    return json.loads((TINY / name / "embedding_golden.json").read_text())


def unit(rows) -> np.ndarray:
    x = np.asarray(rows, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def serve(folder: Path):
    lm = load_model(folder)
    engine = Engine(lm.model, lm.tokenizer, n_ctx=128, max_seqs=4, prefill_chunk=64, prefix_cache_bytes=0)
    engine.start()
    return lm, engine, LiveServer(engine, lm)


@pytest.fixture(scope="module")
def bert_server():
    lm, engine, server = serve(TINY / "bert-embed")
    yield server
    server.close()
    engine.stop()


@pytest.fixture(scope="module")
def oai(bert_server):
    return bert_server.openai(60)


@pytest.fixture(scope="module")
def oll(bert_server):
    return bert_server.ollama(60)


def post(server, path: str, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_openai_client_embeddings(oai):
    g = golden("bert-embed")
    # the openai client asks for base64 by default and decodes it: the route's base64 is what it reads
    reply = oai.embeddings.create(model="smol", input=g["texts"])
    vectors = np.array([d.embedding for d in reply.data])
    assert [d.index for d in reply.data] == [0, 1, 2, 3]
    assert np.abs(vectors - unit(g["cls"])).max() < TOL
    assert reply.usage.prompt_tokens == sum(map(len, g["ids"])) == reply.usage.total_tokens
    floats = oai.embeddings.create(model="smol", input=g["texts"][0], encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - vectors[0]).max() < 1e-6
    short = oai.embeddings.create(model="smol", input=g["texts"][:2], dimensions=8)
    expected = unit(np.asarray(g["cls"])[:2, :8])
    assert np.abs(np.array([d.embedding for d in short.data]) - expected).max() < TOL
    by_ids = oai.embeddings.create(model="smol", input=g["ids"][1])
    assert np.abs(np.array(by_ids.data[0].embedding) - vectors[1]).max() < 1e-6
    two = oai.embeddings.create(model="smol", input=g["ids"][:2])
    assert len(two.data) == 2 and two.usage.prompt_tokens == len(g["ids"][0]) + len(g["ids"][1])


def test_base64_is_little_endian_float32(bert_server):
    g = golden("bert-embed")
    status, body = post(bert_server, "/v1/embeddings",
                        {"model": "smol", "input": "Hello, world!", "encoding_format": "base64"})
    assert status == 200
    v = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    assert np.abs(v - unit(g["cls"][1])).max() < TOL


def test_ollama_client_embed_and_legacy_embeddings(oll):
    g = golden("bert-embed")
    reply = oll.embed(model="smol", input=g["texts"])
    assert np.abs(np.array(reply.embeddings) - unit(g["cls"])).max() < TOL
    assert reply.prompt_eval_count == sum(map(len, g["ids"])) and reply.total_duration > 0
    one = oll.embed(model="smol:latest", input=g["texts"][0], keep_alive="5m", options={"num_ctx": 64})
    assert np.abs(np.array(one.embeddings[0]) - unit(g["cls"][0])).max() < TOL
    long = " ".join(["hello world"] * 20)  # past max_seq_length (24): Ollama truncates by default
    assert len(oll.embed(model="smol", input=long).embeddings[0]) == 32
    with pytest.raises(ollama.ResponseError) as e:
        oll.embed(model="smol", input=long, truncate=False)
    assert e.value.status_code == 400 and "24" in e.value.error
    legacy = oll.embeddings(model="smol", prompt=g["texts"][1])  # as Ollama's: not normalised
    assert np.abs(np.array(legacy.embedding) - np.asarray(g["cls"][1])).max() < TOL


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/embeddings", {"model": "smol", "input": []}, "input"),
        ("/v1/embeddings", {"model": "smol", "input": 5}, "input"),
        ("/v1/embeddings", {"model": "smol", "input": ["a", 5]}, "input"),
        ("/v1/embeddings", {"model": "smol", "input": [[2, 3], []]}, "input"),
        ("/v1/embeddings", {"model": "smol", "input": [10**6]}, "input"),
        ("/v1/embeddings", {"model": "smol", "input": " ".join(["hello"] * 40)}, "input"),
        ("/v1/embeddings", {"model": "smol", "input": "a", "dimensions": 33}, "dimensions"),
        ("/v1/embeddings", {"model": "smol", "input": "a", "dimensions": "8"}, "dimensions"),
        ("/v1/embeddings", {"model": "smol", "input": "a", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a"}, "model"),
        ("/api/embed", {"model": "smol", "input": []}, "input"),
        ("/api/embed", {"model": "smol", "input": [1, 2]}, "input"),
        ("/api/embed", {"model": "smol", "input": "a", "truncate": "yes"}, "truncate"),
        ("/api/embeddings", {"model": "smol", "prompt": ["a"]}, "prompt"),
    ],
)
def test_bad_inputs_are_400s_naming_the_field(bert_server, path, body, field):
    status, reply = post(bert_server, path, body)
    assert status == 400
    if path.startswith("/v1/"):
        assert reply["error"]["param"] == field, reply
    else:
        assert f"'{field}'" in reply["error"] or field in reply["error"], reply


def test_an_encoder_answers_chat_with_a_clear_error(oai, oll, bert_server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "embedding model" in str(e.value) and e.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="smol", prompt="hi", max_tokens=4)
    with pytest.raises(ollama.ResponseError) as e:
        oll.generate(model="smol", prompt="hi")
    assert e.value.status_code == 400 and "embedding model" in e.value.error
    assert oai.models.list().data[0].capabilities == ["embedding"]  # llama.cpp's extra field
    assert oll.show("smol").capabilities == ["embedding"]


def test_fuzzed_requests_get_4xx(bert_server):
    for case in cases(150, "smol", seed=5, port=bert_server.port):
        status, body = send(case, bert_server.port)
        assert check(status, body) is None, (case.method, case.path, case.body[:200] if case.body else None)
    assert post(bert_server, "/v1/embeddings", {"model": "smol", "input": "a"})[0] == 200


def test_a_decoder_embedding_model_embeds_while_it_chats():
    g = golden("qwen3-embed")
    lm, engine, server = serve(TINY / "qwen3-embed")
    try:
        oai = server.openai(120)
        oll = server.ollama(120)
        assert set(oai.models.list().data[0].capabilities) == {"completion", "embedding"}
        assert "embedding" in oll.show("smol").capabilities
        replies = []

        def chat():
            stream = oai.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=40, stream=True,
                extra_body={"ignore_eos": True},
            )
            replies.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

        talker = threading.Thread(target=chat)
        talker.start()
        vectors = []
        for _ in range(3):  # while the reply decodes: engine calls between its steps
            reply = oai.embeddings.create(model="smol", input=g["texts"], encoding_format="float")
            vectors.append(np.array([d.embedding for d in reply.data]))
        talker.join(120)
        assert replies and replies[0]
        for v in vectors:
            assert np.abs(v - unit(g["last"])).max() < TOL
        by_ollama = np.array(oll.embed(model="smol", input=g["texts"]).embeddings)
        assert np.abs(by_ollama - unit(g["last"])).max() < TOL
    finally:
        server.close()
        engine.stop()


def test_hearth_serve_starts_with_a_bert_gguf(tmp_path, monkeypatch, capsys):
    from engine.cli import main
    from engine.server import app
    from engine.server.errors import ServeError

    gguf = tmp_path / "bert-embed.gguf"
    assert main(["convert", str(TINY / "bert-embed"), "--to", "Q8_0", "-o", str(gguf)]) == 0
    seen = []

    def record(config, engine=None, lm=None, pool=None):
        seen.append((config, pool.loaded()[0].lm))
        raise ServeError("stopped by the test before serving")

    monkeypatch.setattr(app, "create_app", record)
    assert main(["serve", "-m", str(gguf), "--port", "0", "--ctx", "64"]) == 1
    assert "stopped by the test" in capsys.readouterr().err
    [(config, lm)] = seen
    assert lm.embedding.encoder_only and config.model_name == "bert-embed"


def test_engine_calls_run_on_the_engine_thread():
    from engine.server.errors import APIError

    lm = load_model(TINY / "bert-embed")
    engine = Engine(lm.model, lm.tokenizer, n_ctx=64, prefix_cache_bytes=0)
    engine.start()
    try:
        assert engine.call(lambda: threading.current_thread().name).result(30) == "hearth-engine"
        with pytest.raises(ZeroDivisionError):  # the caller gets the call's own failure
            engine.call(lambda: 1 / 0).result(30)
    finally:
        engine.stop()
    with pytest.raises(APIError):  # after stop: refused at once, never left waiting
        engine.call(lambda: 1).result(1)
