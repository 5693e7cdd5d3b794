"""`hearth serve`'s Ollama routes (/api/*) through Ollama's own Python client, on 127.0.0.1.

SmolLM2-135M serves the text tests (one engine for the module, as tests/engine/test_server.py); the tiny
Gemma 3 vision fixture serves the image test. Replies are checked against the OpenAI routes of the same
server: one request, two wire formats, the same tokens.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
from pathlib import Path

import jsonschema
import ollama
import pytest

from engine.server import ollama as api
from engine.server.errors import APIError
from engine.server.scheduler import Delta, Engine
from tests.engine.server_harness import LiveServer
from tests.engine.test_server_images import png

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"
HI = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 12}


# --- parsing (no model) ------------------------------------------------------------------------


def test_ollama_defaults_and_options_become_the_engines_sampling():
    req = api.parse_chat({"model": "m", "messages": HI}, 512)
    assert req.stream is True and req.think is None
    chat = req.chat
    assert (chat.temperature, chat.top_k, chat.top_p, chat.min_p) == (0.8, 40, 0.9, 0.0)  # Ollama's defaults
    assert chat.max_tokens is None  # no num_predict: up to the context
    options = {"temperature": 0.2, "top_k": 5, "top_p": 0.5, "min_p": 0.05, "seed": 3, "stop": ["\n"],
               "num_predict": 7, "repeat_penalty": 1.3, "num_ctx": 99999}  # the last two are ignored
    chat = api.parse_chat({"model": "m", "messages": HI, "options": options, "stream": False}, 512).chat
    assert (chat.temperature, chat.top_k, chat.top_p, chat.min_p, chat.seed) == (0.2, 5, 0.5, 0.05, 3)
    assert chat.stop == ["\n"] and chat.max_tokens == 7
    for unlimited in (-1, -2):
        assert api.parse_chat({"model": "m", "messages": HI, "options": {"num_predict": unlimited}},
                              512).chat.max_tokens is None


@pytest.mark.parametrize(
    "body,says",
    [
        ({"options": {"num_predict": 0}}, "num_predict"),
        ({"options": {"temperature": "hot"}}, "temperature"),
        ({"options": {"top_k": -1}}, "top_k"),
        ({"options": "fast"}, "options"),
        ({"format": "yaml"}, "format"),
        ({"think": "very"}, "think"),
        ({"stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["%%%"]}]}, "messages[0].images[0]"),
        ({"messages": [{"role": "user", "content": "hi", "images": "abc"}]}, "messages[0].images"),
        ({"messages": [{"role": "assistant", "content": "hi", "images": [base64.b64encode(png()).decode()]}]},
         "user messages only"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ],
)
def test_bad_ollama_chat_bodies_are_400s_that_name_the_field(body, says):
    with pytest.raises(APIError) as e:
        api.parse_chat({"model": "m", "messages": HI, **body}, 512)
    assert e.value.status == 400 and says in e.value.message
    assert api.error_body(e.value) == {"error": e.value.message}


def test_generate_bodies():
    plain = api.parse_generate({"model": "m", "prompt": "hi", "system": "Be brief."}, 512)
    assert [m["role"] for m in plain.chat.messages] == ["system", "user"] and plain.raw_prompt is None
    raw = api.parse_generate({"model": "m", "prompt": "1, 2,", "raw": True, "context": [1, 2]}, 512)
    assert raw.raw_prompt == "1, 2," and raw.context == [1, 2] and raw.chat.messages == []
    assert api.parse_generate({"model": "m"}, 512).chat.messages == []  # only loads the model
    for body, says in (({"suffix": "x"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"),
                       ({"raw": True, "system": "s"}, "raw"), ({"context": ["a"]}, "context")):
        with pytest.raises(APIError, match=says):
            api.parse_generate({"model": "m", "prompt": "hi", **body}, 512)


class _Tok:
    eot_ids = {0}


def _reply(tools: bool, split: bool = True) -> api._Reply:
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    parsed = api.parse_chat({"model": "m", "messages": HI, **({"tools": [tool]} if tools else {})}, 512)
    params = type("P", (), {"prompt_ids": [5, 6]})()
    server = type("A", (), {"tok": _Tok(), "tool_format": None})()
    return api._Reply(server, parsed, params, split, False, "message", {"model": "m"}, 0.0, context=False)


DELTAS = [
    Delta(text="<think>cold?</think>", token=1),
    Delta(text='<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>', token=2),
    Delta(text="", token=0, finish_reason="stop", prompt_tokens=9, generated_tokens=3, ttft_s=0.5,
          decode_tps=4.0),
]


def test_tool_calls_and_thinking_in_a_whole_reply():
    body = _reply(tools=True).whole(DELTAS)
    message = body["message"]
    assert message["thinking"] == "cold?" and message["content"] == ""
    assert message["tool_calls"] == [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    assert body["done"] and body["done_reason"] == "stop" and body["eval_count"] == 3
    assert body["prompt_eval_count"] == 9 and body["prompt_eval_duration"] == 500_000_000
    assert body["eval_duration"] == 500_000_000  # 2 tokens after the first at 4 tok/s


def test_tool_calls_and_thinking_in_a_stream():
    async def lines():
        q: asyncio.Queue = asyncio.Queue()
        for d in DELTAS:
            q.put_nowait(d)
        job = type("J", (), {"cancel": lambda self: None})()
        return [json.loads(line) async for line in _reply(tools=True).stream(job, q)]

    out = asyncio.run(lines())
    assert [o["done"] for o in out] == [False, False, True]
    assert out[0]["message"]["thinking"] == "cold?" and out[0]["message"]["content"] == ""
    assert out[1]["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert "<tool_call>" not in "".join(o["message"]["content"] for o in out)


# --- a real server, Ollama's client -----------------------------------------------------------


@pytest.fixture(scope="module")
def lm(smollm2_path):
    from engine.loader import load_model
    from engine.templates import ensure_chat_template

    lm = load_model(smollm2_path)
    ensure_chat_template(lm)
    return lm


@pytest.fixture(scope="module")
def server(lm):
    engine = Engine(lm.model, lm.tokenizer, n_ctx=512, max_seqs=4, prefill_chunk=128,
                    prefix_cache_bytes=8 << 20)
    engine.start()
    s = LiveServer(engine, lm)
    yield s
    s.close()
    engine.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.ollama(120)


@pytest.fixture(scope="module")
def oai(server):
    return server.openai(120)


@pytest.mark.slow
def test_model_information(client, server, lm):
    [entry] = client.list().models
    assert entry.model == "smol" and entry.size == lm.path.stat().st_size
    assert entry.details.format == "gguf" and entry.details.family == "llama"
    assert entry.details.quantization_level == "Q4_1" and entry.details.parameter_size
    shown = client.show("smol:latest")  # clients add the default tag
    assert shown.capabilities == ["completion"] and shown.template == lm.template.source
    assert shown.modelinfo["llama.context_length"] == lm.context_length
    assert client.ps().models[0].model == "smol"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/api/version")
    assert json.loads(conn.getresponse().read())["version"] == api.API_VERSION
    conn.request("GET", "/")
    assert b"Hearth is running" in conn.getresponse().read()
    conn.close()


@pytest.mark.slow
def test_chat_streamed_equals_whole_and_the_openai_route(client, oai):
    whole = client.chat(model="smol", messages=HI, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.content
    assert whole.eval_count <= 12 and whole.prompt_eval_count > 5 and whole.total_duration > 0
    parts = list(client.chat(model="smol", messages=HI, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count == whole.eval_count
    openai_reply = oai.chat.completions.create(model="smol", messages=HI, max_tokens=12, temperature=0)
    assert openai_reply.choices[0].message.content == whole.message.content
    # top_k 1 leaves only the most likely token: sampling at temperature 1 is greedy decoding
    top1 = client.chat(model="smol", messages=HI, options={"temperature": 1.0, "top_k": 1, "num_predict": 12})
    assert top1.message.content == whole.message.content
    via_openai = oai.chat.completions.create(model="smol", messages=HI, max_tokens=12, temperature=1.0,
                                             extra_body={"top_k": 1})
    assert via_openai.choices[0].message.content == whole.message.content


@pytest.mark.slow
def test_generate_with_context_and_raw(client, oai):
    first = client.generate(model="smol", prompt="Name a colour.", options=GREEDY)
    assert first.response and first.context and first.done
    assert len(first.context) == first.prompt_eval_count + first.eval_count - (first.done_reason == "stop")
    follow = client.generate(model="smol", prompt="Another one.", context=first.context, options=GREEDY)
    assert follow.prompt_eval_count > len(first.context)  # the earlier turn's tokens come first
    raw = client.generate(model="smol", prompt="1, 2, 3, 4,", raw=True, options=GREEDY)
    completion = oai.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert raw.response == completion.choices[0].text
    loaded = client.generate(model="smol")  # no prompt: Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
          "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["json", COLOUR])
def test_format_constrains_the_reply(client, fmt):
    ask = "Give a JSON object with a key 'a'." if fmt == "json" else "Give a colour as JSON."
    reply = client.chat(model="smol", messages=[{"role": "user", "content": ask}], format=fmt,
                        options={"temperature": 0, "num_predict": 120})
    assert reply.done_reason == "stop"
    value = json.loads(reply.message.content)
    if isinstance(fmt, dict):
        jsonschema.validate(value, fmt)
    else:
        assert isinstance(value, dict)


@pytest.mark.slow
def test_thinking_goes_to_the_thinking_field(client, lm, monkeypatch):
    from engine.chat_template import ChatTemplate
    from tests.engine.test_reasoning import OPENING_TEMPLATE

    monkeypatch.setattr(lm, "template", ChatTemplate(OPENING_TEMPLATE))  # the reply is all thinking
    reply = client.chat(model="smol", messages=HI, options={"temperature": 0, "num_predict": 8})
    assert reply.message.thinking.strip() and reply.message.content == ""
    options = {"temperature": 0, "num_predict": 8}
    parts = list(client.chat(model="smol", messages=HI, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking


@pytest.mark.slow
def test_errors_are_ollama_style(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3:8b", messages=HI)
    assert e.value.status_code == 404 and "does not exist" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smol", messages=HI, options={"num_predict": 100000})
    assert e.value.status_code == 400 and "context" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 501 and "hearth pull" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smol", messages=[{"role": "user", "content": "hi", "images": [png()]}])
    assert e.value.status_code == 400 and "image" in e.value.error
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/api/tags", headers={"Host": "evil.example"})  # DNS rebinding guard
    r = conn.getresponse()
    assert r.status == 403 and "not allowed" in json.loads(r.read())["error"]
    conn.close()


def test_images_through_ollamas_client(tmp_path):
    from engine.loader import load_model

    lm = load_model(TINY / "gemma3-vision")
    engine = Engine(lm.model, lm.tokenizer, n_ctx=600, max_seqs=2, prefill_chunk=512)
    engine.start()
    server = LiveServer(engine, lm)
    try:
        client = server.ollama(120)
        assert "vision" in client.show("smol").capabilities
        picture = tmp_path / "photo.png"
        picture.write_bytes(png(seed=5))
        reply = client.chat(model="smol", options={"temperature": 0, "num_predict": 4},
                            messages=[{"role": "user", "content": "What is this?", "images": [picture]}])
        oai = server.openai(120)
        url = "data:image/png;base64," + base64.b64encode(png(seed=5)).decode()
        same = oai.chat.completions.create(model="smol", max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}])
        assert reply.prompt_eval_count == same.usage.prompt_tokens > lm.vision.shape.tokens  # its rows are in
        assert reply.message.content == same.choices[0].message.content
    finally:
        server.close()
        engine.stop()


@pytest.mark.slow
def test_the_name_a_model_was_served_by_is_accepted(smollm2_path, monkeypatch, capsys):
    # `hearth serve -m smollm2-135m-instruct`: clients may ask for the model by that name (as `ollama run
    # NAME` users do), besides the file's stem and the model's own name
    from engine.cli import main
    from engine.server import app
    from engine.server.errors import ServeError

    seen = []

    def record(config, engine=None, lm=None, pool=None):
        seen.append((config, pool.loaded()))
        raise ServeError("stopped by the test before serving")

    monkeypatch.setattr(app, "create_app", record)
    assert main(["serve", "-m", "smollm2-135m-instruct", "--port", "0", "--ctx", "64"]) == 1
    assert "stopped by the test" in capsys.readouterr().err
    ((config, [served]),) = seen
    assert served.answers("smollm2-135m-instruct") and served.answers(smollm2_path.stem)
    assert not served.engine.alive  # the failed start stopped the model's engine
    assert config.model_name == smollm2_path.stem and "smollm2-135m-instruct" in config.aliases
