"""`hearth serve` speaks Anthropic's Messages API (engine.server.anthropic), checked with Anthropic's own
Python client against the real SmolLM2 server: replies equal the OpenAI route's greedy ones, streams
assemble into the same message, token counts agree, tools round-trip (SmolLM2 never calls a tool by
itself, so the reply that calls one is scripted as in test_server_tool_stream), errors are Anthropic's.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from engine.chat_template import ChatTemplate
from engine.server.scheduler import Engine
from tests.engine.server_harness import LiveServer
from tests.engine.test_cli_tools import QWEN
from tests.engine.test_server_tool_stream import PIECES, Script

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hello in French."}]
ADD = {"name": "add", "description": "Add two numbers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}


@pytest.fixture(scope="module")
def lm(smollm2_path):
    from engine.loader import load_model

    lm = load_model(smollm2_path)
    lm.template = ChatTemplate(QWEN, eos_token=lm.tokenizer.eos_token)  # a template that takes tools
    return lm


@pytest.fixture(scope="module")
def engine(lm):
    e = Engine(lm.model, lm.tokenizer, n_ctx=512, max_seqs=4, prefill_chunk=128, prefix_cache_bytes=16 << 20)
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def script(engine):
    return Script(engine)


@pytest.fixture(scope="module")
def server(engine, lm, script):
    s = LiveServer(engine, lm)
    yield s
    s.close()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0,
                               timeout=120)


@pytest.fixture
def scripted(script):
    yield script
    script.pieces = []


def test_a_reply_equals_the_openai_routes(server, claude):
    msg = claude.messages.create(model="smol", max_tokens=16, extra_body={"temperature": 0}, messages=HI,
                                 system="You answer in one line.")
    oai = server.openai().chat.completions.create(
        model="smol", max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "You answer in one line."}, *HI])
    [block] = msg.content
    assert block.type == "text" and block.text == oai.choices[0].message.content
    assert msg.role == "assistant" and msg.model == "smol" and msg.id.startswith("msg")
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[oai.choices[0].finish_reason]
    usage = msg.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == oai.usage.prompt_tokens
    assert usage.output_tokens == oai.usage.completion_tokens
    counted = claude.messages.count_tokens(model="smol", messages=HI, system="You answer in one line.")
    assert counted.input_tokens == oai.usage.prompt_tokens


def test_a_stream_assembles_into_the_same_message(claude):
    whole = claude.messages.create(model="smol", max_tokens=12, extra_body={"temperature": 0}, messages=HI)
    events = []
    greedy = {"temperature": 0}
    with claude.messages.stream(model="smol", max_tokens=12, extra_body=greedy, messages=HI) as stream:
        for event in stream:
            events.append(event.type)
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "text" in events


def test_a_tool_call_comes_back_as_a_tool_use_block_and_its_result_goes_in(claude, scripted, lm):
    scripted.pieces = PIECES
    msg = claude.messages.create(model="smol", max_tokens=64, messages=[{"role": "user", "content": "2+3?"}],
                                 tools=[ADD])
    text, call = msg.content
    assert text.type == "text" and text.text == "Let me add that."
    assert (call.type, call.name, call.input) == ("tool_use", "add", {"a": 2, "b": 3})
    assert msg.stop_reason == "tool_use"

    scripted.pieces = PIECES
    with claude.messages.stream(model="smol", max_tokens=64, tools=[ADD],
                                messages=[{"role": "user", "content": "2+3?"}]) as stream:
        deltas = [e.text for e in stream if e.type == "text"]
        streamed = stream.get_final_message()
    assert "".join(deltas) == "Let me add that." and not any("<tool" in d or "{" in d for d in deltas)
    assert streamed.content[1].input == {"a": 2, "b": 3} and streamed.stop_reason == "tool_use"

    scripted.pieces = []  # the answer to the result is the model's own
    use = {"type": "tool_use", "id": call.id, "name": "add", "input": call.input}
    claude.messages.create(model="smol", max_tokens=4, tools=[ADD], messages=[
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me add that."}, use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]},
    ])
    prompt = lm.tokenizer.decode(scripted.prompts[-1])
    assert "<tool_response>\n5\n</tool_response>" in prompt and '"arguments": {"a": 2, "b": 3}' in prompt


def test_structured_output_follows_the_schema(claude):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 20}},
              "required": ["greeting"], "additionalProperties": False}
    msg = claude.messages.create(model="smol", max_tokens=40, messages=HI,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="smol", max_tokens=8, messages=HI, output_config={"format": "json"})


def test_errors_are_anthropics(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smol", max_tokens=0, messages=HI)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:  # a text model reads no images
        claude.messages.create(model="smol", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image",
             "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
            {"type": "text", "text": "What is this?"}]}])
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smol", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert "fetches no URLs" in e.value.body["error"]["message"]
    r = httpx.post(f"http://127.0.0.1:{server.port}/v1/messages", content=b"{", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(f"http://127.0.0.1:{server.port}/v1/messages", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_api_key_may_come_as_x_api_key(engine, lm):
    s = LiveServer(engine, lm, api_key="sekret")
    try:
        ok = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="sekret", max_retries=0)
        assert ok.messages.create(model="smol", max_tokens=2, messages=HI).content
        bad = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="smol", max_tokens=2, messages=HI)
        assert e.value.body["error"]["type"] == "authentication_error"
    finally:
        s.close()


def test_a_stop_sequence_is_named_in_the_reply(claude):
    greedy = {"temperature": 0}
    free = claude.messages.create(model="smol", max_tokens=16, extra_body=greedy, messages=HI)
    text = free.content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]  # a string the greedy reply holds: the reply ends before it, naming it
    stops = ["never said zq", stop]
    msg = claude.messages.create(model="smol", max_tokens=16, extra_body=greedy, messages=HI,
                                 stop_sequences=stops)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]
    with claude.messages.stream(model="smol", max_tokens=16, extra_body=greedy, messages=HI,
                                stop_sequences=stops) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
    assert streamed.content[0].text == msg.content[0].text
    assert free.stop_sequence is None and free.stop_reason in ("end_turn", "max_tokens")
