"""`hearth serve` through the official openai client against a real server on 127.0.0.1 (SmolLM2-135M).

One engine (the continuous-batching thread) serves the whole module; replies are kept short.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import jsonschema
import openai
import pytest

from engine.server.fuzz import cases, check, send
from engine.server.scheduler import Engine
from tests.engine.server_harness import LiveServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lm(smollm2_path):
    from engine.loader import load_model
    from engine.templates import ensure_chat_template

    lm = load_model(smollm2_path)
    ensure_chat_template(lm)
    return lm


@pytest.fixture(scope="module")
def engine(lm):
    e = Engine(lm.model, lm.tokenizer, n_ctx=512, max_seqs=8, prefill_chunk=128, prefix_cache_bytes=32 << 20)
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def server(engine, lm):
    s = LiveServer(engine, lm)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai(120)


HI = [{"role": "user", "content": "Name three colours."}]


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list()] == ["smol"]
    status, body = _get(server.port, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    client.chat.completions.create(model="smol", messages=HI, max_tokens=2)
    status, body = _get(server.port, "/metrics")
    text = body.decode()
    assert status == 200
    for series in (
        "hearth_requests_total{",
        "hearth_time_to_first_token_seconds_bucket",
        "hearth_generated_tokens_total",
        "hearth_decode_batch_size_count",
    ):
        assert series in text, series
    assert 'endpoint="/v1/chat/completions",status="200"' in text


def test_chat_streamed_equals_non_streamed(client):
    kw = dict(model="smol", messages=HI, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content and reasons == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the template's default system prompt and the user turn were prefilled once:
    # the second request reused them
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens - 1


def test_a_reply_that_re_tokenizes_differently_keeps_its_cached_tokens(client, engine, lm):
    from engine.generate import prefill
    from tests.engine.test_token_reuse import REPLY, odd_spelling

    question = [{"role": "user", "content": "How do I keep compost from smelling?"}]
    held = lm.tokenizer.encode(lm.template.render(question, add_generation_prompt=True))
    held += odd_spelling(lm.tokenizer, REPLY)
    cache = lm.model.new_cache(512)
    prefill(lm.model, cache, held)
    engine.store.insert(cache)  # as the request that generated those tokens left them
    follow_up = question + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "Why?"}]
    reply = client.chat.completions.create(model="smol", messages=follow_up, max_tokens=2, temperature=0)
    # the canonical encoding parts from `held` inside the reply; the server kept the held spelling
    assert reply.usage.prompt_tokens_details.cached_tokens == len(held)


@pytest.mark.parametrize("opening", ["think", "gemma"])
def test_thinking_goes_to_reasoning_content(client, server, engine, lm, monkeypatch, opening):
    from engine.chat_template import ChatTemplate
    from tests.engine.test_reasoning import GEMMA_OPENING_TEMPLATE, OPENING_TEMPLATE

    # the template opens a thinking block (as DeepSeek-R1's does, or a Gemma 4 thought channel):
    # SmolLM2's short reply is all thinking
    template = OPENING_TEMPLATE if opening == "think" else GEMMA_OPENING_TEMPLATE
    monkeypatch.setattr(lm, "template", ChatTemplate(template))
    kw = dict(model="smol", messages=HI, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kw)
    message = full.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking.strip() and message.content == ""
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == ""
    # --reasoning-format none: the reply's text, as the model wrote it, in content
    raw = LiveServer(engine, lm, reasoning_format="none")
    try:
        plain = raw.openai(120)
        message = plain.chat.completions.create(**kw).choices[0].message
        assert message.content == thinking and "reasoning_content" not in (message.model_extra or {})
    finally:
        raw.close()


def test_chat_template_kwargs_reach_the_template(client, lm, monkeypatch):
    from engine.chat_template import ChatTemplate
    from tests.engine.test_reasoning import QWEN_STYLE_TEMPLATE

    monkeypatch.setattr(lm, "template", ChatTemplate(QWEN_STYLE_TEMPLATE))
    ask = client.chat.completions.create
    plain = ask(model="smol", messages=HI, max_tokens=1).usage.prompt_tokens
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    closed = ask(model="smol", messages=HI, max_tokens=1, extra_body=off).usage.prompt_tokens
    assert closed == plain + len(lm.tokenizer.encode("<think>\n\n</think>\n\n"))
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        ask(model="smol", messages=HI, max_tokens=1, extra_body={"chat_template_kwargs": {"messages": []}})


def test_reasoning_effort_reaches_the_template(client, lm, monkeypatch):
    # OpenAI's reasoning_effort parameter, as gpt-oss's template reads it
    from engine.chat_template import ChatTemplate

    template = (
        "{{ 'Reasoning: ' + reasoning_effort | default('medium') }}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    monkeypatch.setattr(lm, "template", ChatTemplate(template))
    ask = client.chat.completions.create
    medium = ask(model="smol", messages=HI, max_tokens=1).usage.prompt_tokens
    low = ask(model="smol", messages=HI, max_tokens=1, reasoning_effort="low").usage.prompt_tokens
    encode = lm.tokenizer.encode
    assert low == medium + len(encode("Reasoning: low")) - len(encode("Reasoning: medium"))
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        ask(model="smol", messages=HI, max_tokens=1, extra_body={"reasoning_effort": "extreme"})


def test_earlier_thinking_is_left_out_of_the_prompt(client):
    answer = "Red, green and blue."
    turns = [*HI, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    thought = [*HI, {"role": "assistant", "content": f"<think>\nThey want colours.\n</think>\n\n{answer}"},
               turns[-1]]
    ask = client.chat.completions.create
    usage = [ask(model="smol", messages=m, max_tokens=1).usage for m in (turns, thought)]
    assert usage[0].prompt_tokens == usage[1].prompt_tokens


def test_completion_streamed_equals_non_streamed(client):
    kw = dict(model="smol", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_stop_seed_and_logprobs(client):
    r = client.completions.create(
        model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"], logprobs=2
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text.startswith(" 5, 6,") and "7" not in c.text
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == r.usage.completion_tokens
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(len(alts) == 2 for alts in c.logprobs.top_logprobs)
    a, b, other = (
        client.completions.create(
            model="smol", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=s
        )
        .choices[0]
        .text
        for s in (7, 7, 8)
    )
    assert a == b and a != other
    chat = client.chat.completions.create(
        model="smol", messages=HI, max_tokens=3, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].logprob - 1e-9


def test_concurrent_clients_share_decode_steps(client, engine):
    prompts = ["a poem about rain", "a list of fruits", "the alphabet", "a recipe", "numbers", "a story"]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": f"Write {prompts[i]}."}],
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    seen = engine.max_batch_seen = 0
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    seen = engine.max_batch_seen
    assert not errors and len(results) == len(prompts) and all(results.values())
    assert seen >= 3, f"at most {seen} sequences shared a decode step"
    # each reply matches the same request run alone (batched rows agree with single decode)
    alone = (
        client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": f"Write {prompts[0]}."}],
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    assert alone[:20] == results[0][:20]


def test_a_new_request_joins_without_waiting_for_a_running_one(client, engine):
    done: dict[str, float] = {}

    def long() -> None:
        client.completions.create(
            model="smol", prompt="Count: 1, 2,", max_tokens=200, temperature=0,
            extra_body={"ignore_eos": True},
        )
        done["long"] = time.monotonic()

    t = threading.Thread(target=long)
    t.start()
    start = engine.steps
    deadline = time.monotonic() + 30
    while engine.steps < start + 3 and time.monotonic() < deadline:  # the long one is decoding
        time.sleep(0.01)
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
    done["short"] = time.monotonic()
    t.join(120)
    assert r.usage.completion_tokens == 3 and done["short"] < done["long"]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colours"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_json_schema_output_parses_and_validates(client, temperature, seed):
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=120,
        temperature=temperature,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_object_streamed(client):
    stream = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give a JSON object with a key 'a'."}],
        max_tokens=120,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "kwargs,error,param",
    [
        ({"messages": []}, openai.BadRequestError, "messages"),
        ({"max_tokens": -5}, openai.BadRequestError, "max_tokens"),
        ({"max_tokens": 10**7}, openai.BadRequestError, "max_tokens"),
        ({"model": "gpt-9"}, openai.NotFoundError, "model"),
        ({"temperature": 7}, openai.BadRequestError, "temperature"),
        ({"n": 3}, openai.BadRequestError, "n"),
        ({"messages": [{"role": "user", "content": "x" * 4000}]}, openai.BadRequestError, "messages"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            openai.BadRequestError,
            "response_format",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            openai.BadRequestError,
            "tools",
        ),
    ],
)
def test_errors_are_openai_style(client, kwargs, error, param):
    args = {"model": "smol", "messages": HI, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as info:
        client.chat.completions.create(**args)
    body = info.value.body
    assert body["param"] == param and body["message"] and body["type"]


def test_malformed_requests_all_get_4xx_and_the_server_lives(client, server):
    bad = []
    for case in cases(200, "smol", seed=11, port=server.port):
        status, body = send(case, server.port)
        why = check(status, body)
        if why:
            bad.append((case.method, case.path, (case.body or b"")[:120], why))
    assert not bad, bad[:5]
    assert client.chat.completions.create(model="smol", messages=HI, max_tokens=2).choices[0].message.content


def test_client_disconnect_cancels_generation(server, engine):
    before = engine.metrics.finished.value(reason="cancelled")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps(
        {"model": "smol", "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    )
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()  # the first event arrived: it is generating
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    while engine.metrics.finished.value(reason="cancelled") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.metrics.finished.value(reason="cancelled") == before + 1
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.running == 0


def test_api_key_host_allowlist_and_timeout(engine, lm):
    s = LiveServer(engine, lm, api_key="sekret", request_timeout_s=0.3)
    try:
        status, body = _get(s.port, "/v1/models")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert _get(s.port, "/health")[0] == 200  # the app polls it without the key
        ok = openai.OpenAI(base_url=s.url, api_key="sekret", max_retries=0)
        assert [m.id for m in ok.models.list()] == ["smol"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0).models.list()
        status, body = _get(
            s.port, "/v1/models", {"Host": "attacker.example", "Authorization": "Bearer sekret"}
        )
        assert status == 403 and json.loads(body)["error"]["code"] == "host_not_allowed"
        with pytest.raises(openai.APIStatusError) as info:
            ok.completions.create(
                model="smol", prompt="Once", max_tokens=400, extra_body={"ignore_eos": True}
            )
        assert info.value.status_code == 504 and info.value.body["code"] == "timeout"
    finally:
        s.close()


def test_non_loopback_needs_an_api_key():
    from engine.server.app import ServerConfig
    from engine.server.errors import ServeError

    with pytest.raises(ServeError, match="--api-key"):
        ServerConfig(model_name="m", host="0.0.0.0")
    ServerConfig(model_name="m", host="0.0.0.0", api_key="k")
    ServerConfig(model_name="m", host="::1")
