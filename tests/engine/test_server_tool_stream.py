"""`hearth serve` streams a reply with tools: its text as it comes, its calls' markup never, the calls at the
end, through the official openai and ollama clients against a real server (SmolLM2-135M, module engine).

Scripted part: SmolLM2-135M never chooses to call a tool, so the text of a reply that calls one is scripted
(the Qwen2.5-format `<tool_call>` block a tool-using model writes, in pieces as tokens bring it); the model
gets Qwen2.5's (ChatML, tool-aware) template as in test_cli_tools.py. Everything else is the real thing: the
request, the template with the tools, the engine's tokens and timing (one scripted piece per real token),
the SSE / NDJSON streams and the clients that read them.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from engine.chat_template import ChatTemplate
from engine.server.scheduler import Engine
from tests.engine.server_harness import LiveServer
from tests.engine.test_cli_tools import QWEN

pytestmark = pytest.mark.slow

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
HI = [{"role": "user", "content": "What is 2+3?"}]
PIECES = ["Let me ", "add", " that.", "\n<tool_", 'call>\n{"name": "add", ', '"arguments": {"a": 2, ',
          '"b": 3}}\n</tool_call>']
STEP_S = 0.05  # each scripted piece comes this long after the last: a stream shows its text before the end


@pytest.fixture(scope="module")
def lm(smollm2_path):
    from engine.loader import load_model

    lm = load_model(smollm2_path)
    lm.template = ChatTemplate(QWEN, eos_token=lm.tokenizer.eos_token)
    return lm


class Script:
    """The engine's replies, scripted: with `pieces` set, a request's real tokens carry these texts (one per
    token, the rest on the last); `last_at` is when the last piece went out (time.monotonic())."""

    def __init__(self, engine: Engine):
        self.pieces: list[str] = []
        self.last_at = 0.0
        self.prompts: list[list[int]] = []
        real = engine.submit

        def submit(params, emit):
            self.prompts.append(list(params.prompt_ids))
            if not self.pieces:
                return real(params, emit)
            params.max_tokens, params.ignore_eos = len(self.pieces), True
            pieces = iter(self.pieces)

            def scripted(d):
                if d.error is None:
                    time.sleep(STEP_S)
                    last = d.finish_reason is not None
                    text = "".join(pieces) if last else next(pieces, "")
                    d = dataclasses.replace(d, text=text, finish_reason="stop" if last else None)
                    if last:
                        self.last_at = time.monotonic()
                emit(d)

            return real(params, scripted)

        engine.submit = submit


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


@pytest.fixture
def scripted(script):
    yield script
    script.pieces = []


def test_openai_stream_shows_the_text_at_once_and_the_call_at_the_end(server, scripted):
    scripted.pieces = PIECES
    client = server.openai(120)
    chunks, content_at = [], []
    stream = client.chat.completions.create(model="smol", messages=HI, tools=[ADD], stream=True)
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            content_at.append(time.monotonic())
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(contents) == "Let me add that."
    assert len(contents) >= 2 and content_at[0] < scripted.last_at - STEP_S  # streamed, not held to the end
    assert not any("<tool" in c or "{" in c for c in contents)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.type, tc.function.name) for tc in calls] == [(0, "function", "add")]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3} and len(calls[0].id) == 9
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tools were in the prompt, through the template
    assert '"name": "add"' in server.app.state.pool.default.handlers.api.tok.decode(scripted.prompts[-1])


def test_openai_client_assembles_the_streamed_call_like_the_whole_reply(server, scripted):
    scripted.pieces = PIECES
    client = server.openai(120)
    with client.chat.completions.stream(model="smol", messages=HI, tools=[ADD]) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    whole = client.chat.completions.create(model="smol", messages=HI, tools=[ADD]).choices[0]
    for choice in (streamed, whole):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me add that."
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}


def test_a_false_alarm_is_released_as_text(server, scripted):
    scripted.pieces = ["Use the <tool_", "box", " first."]
    client = server.openai(120)
    chunks = list(client.chat.completions.create(model="smol", messages=HI, tools=[ADD], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Use the <tool_box first."
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_a_real_reply_with_tools_streams_token_by_token(server):
    """No script: SmolLM2's own reply, tools offered, streams as without tools."""
    client = server.openai(120)
    kwargs = {"model": "smol", "messages": HI, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, tools=[ADD], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    assert plain  # (a different prompt, with the tools: the texts need not match)


def test_ollama_stream_shows_the_text_and_sends_the_calls_in_a_message(server, scripted):
    scripted.pieces = PIECES
    client = server.ollama(120)
    parts, at = [], []
    for part in client.chat(model="smol", messages=HI, tools=[ADD], stream=True):
        parts.append(part)
        at.append(time.monotonic())
    contents = [(p.message.content, t) for p, t in zip(parts, at, strict=True) if p.message.content]
    assert "".join(c for c, _ in contents) == "Let me add that."
    assert len(contents) >= 2 and contents[0][1] < scripted.last_at - STEP_S
    with_calls = [p for p in parts if p.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done and parts[-1].done
    [call] = with_calls[0].message.tool_calls
    assert call.function.name == "add" and dict(call.function.arguments) == {"a": 2, "b": 3}
    whole = client.chat(model="smol", messages=HI, tools=[ADD], stream=False)
    assert whole.message.content == "Let me add that."
    assert [(c.function.name, dict(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("add", {"a": 2, "b": 3})
    ]


def test_a_client_that_leaves_during_a_held_call_cancels_it(server, scripted):
    scripted.pieces = ["Ok.", "\n<tool_call>\n"] + ['{"name": "add", '] * 100  # 5 s of a call
    client = server.openai(120)
    stream = client.chat.completions.create(model="smol", messages=HI, tools=[ADD], stream=True)
    engine = server.app.state.pool.default.handlers.api.engine
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    deadline = time.monotonic() + 2.5
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.running  # stopped long before its 102 pieces
    assert len(scripted.prompts[-1]) + 102 < engine.n_ctx
