"""engine.tools.ToolCallStream: a reply's text streams with its tool calls held back.

The property every format must keep: whatever the split of a reply into deltas, the text shown (every
feed's return and finish()'s) is parse_tool_calls' `rest` of the whole reply, and finish()'s calls are its
calls; and no shown piece ever holds call markup. The replies are those the families' own templates write
(tests/fixtures/chat_templates, as tests/engine/test_tools.py renders them) and test_tools.py's strings.
"""

from __future__ import annotations

import itertools
import random

import pytest

from engine import tools
from engine.chat_template import TemplateError
from engine.reasoning import ReasoningStream, split_reasoning
from tests.engine.test_tools import ADD, FAMILIES, USER, template

CALLS = [tools.ToolCall("add", {"a": 2, "b": 3.5}, "abc123XYZ"), tools.ToolCall("now", {}, "def456UVW")]
# what no shown text may contain: the markers and a call's JSON
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '"name": "add"')

STRINGS = [  # (reply, fmt): tests/engine/test_tools.py's and more
    ('Let me add both.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
     "<tool_call>\n{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 3, \\\"b\\\": 4}\"}\n</tool_call>",
     tools.HERMES),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>', tools.HERMES),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', tools.HERMES),
    ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_time[CALL_ID]X1y2Z3w4v[ARGS]{}', tools.MISTRAL),
    ('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}]',
     tools.MISTRAL),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}',
     tools.LLAMA3),
    ('{"name": "Bob", "age": 3}', tools.LLAMA3),
    ('The call would be {"name": "add", "parameters": {}}', tools.LLAMA3),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', tools.HARMONY),
    # text after a call, between calls, a broken block amid good ones, markers that are no calls
    ('A <tool_call>{"name": "add", "arguments": {}}</tool_call> then B\n\n'
     '<tool_call>{"name": "now", "arguments": {}}</tool_call>  ', tools.HERMES),
    ('Use <tool_ calls, not <tool_call> blocks.', tools.HERMES),
    ('I like [TOOL_ things and <tool_call> text', None),
    ('  \n<tool_call>{"name": "add", "arguments": {}}</tool_call>\n  and then', tools.HERMES),
    ('{"name": "add", "parameters": {}} and some text', tools.LLAMA3),
    ('{"name": "add", "parameters": {}} <tool_call>{"name": "now", "arguments": {}}</tool_call>', None),
    ('{this is not JSON', None),
    ('<tool_call>{"bad": 1 [TOOL_CALLS][{"name": "add", "arguments": {}}]</tool_call> tail', None),
    ('[TOOL_CALLS]add[ARGS]{"a": 1}', None),
    ('[TOOL_CALLS] not a call at all', tools.MISTRAL),
    ('Plain answer without any calls.\n\n', tools.HERMES),
]


def family_replies() -> list[tuple[str, str]]:
    """(reply, fmt) for each family: its template's assistant turn with one and two calls, with and without
    text before them (where the template takes it)."""
    out = []
    for name, bos, eos, end, fmt in FAMILIES:
        t = template(name, bos, eos)
        prompt = t.render(USER, add_generation_prompt=True, tools=[ADD])
        for calls, content in itertools.product((CALLS[:1], CALLS), ("", "Let me add.")):
            turn = {**tools.assistant_message(content, calls)}
            try:
                full = t.render([*USER, turn], add_generation_prompt=False, tools=[ADD])
            except TemplateError:  # Llama's templates take one call per turn
                continue
            reply = split_reasoning(full[len(prompt):].split(end)[0]).answer
            out.append((reply, fmt))
    return out


CASES = STRINGS + family_replies()


def stream(text: str, fmt: str | None, cuts) -> tuple[list[str], str, list[tools.ToolCall]]:
    gate = tools.ToolCallStream(fmt)
    pieces, start = [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(gate.feed(text[start:cut]))
        start = cut
    tail, calls = gate.finish()
    return pieces, tail, calls


def splits(text: str, seed: int):
    """Every single split point, every character alone, and random multi-way splits."""
    n = len(text)
    yield from ([k] for k in range(n + 1))
    yield list(range(1, n))
    rng = random.Random(seed)
    for _ in range(30):
        yield sorted(rng.sample(range(1, n), min(n - 1, rng.randint(2, 8)))) if n > 2 else []


def shown_ok(text: str, rest: str, shown: str) -> bool:
    # the documented exception: whitespace at the very start of a reply that goes on with text
    return shown == rest or (text[:1].isspace() and shown.lstrip() == rest)


@pytest.mark.parametrize(("text", "fmt"), CASES, ids=[f"{i}-{f}" for i, (_, f) in enumerate(CASES)])
@pytest.mark.parametrize("as_server", [False, True], ids=["fmt", "any"])
def test_shown_text_is_the_parsed_rest_at_every_split(text, fmt, as_server):
    fmt = None if as_server else fmt
    rest, calls = tools.parse_tool_calls(text, fmt)
    expected = [(c.name, c.arguments) for c in calls]
    for cuts in splits(text, len(text)):
        pieces, tail, got = stream(text, fmt, cuts)
        shown = "".join(pieces) + tail
        assert shown_ok(text, rest, shown), (cuts, pieces, tail, rest)
        assert [(c.name, c.arguments) for c in got] == expected
        if calls:  # while it streams no piece shows markup (the end may show a broken block, as parsed)
            streamed = "".join(pieces)
            assert not any(m in streamed for m in MARKUP if m not in rest), (cuts, pieces)


def test_every_family_reply_is_in_the_cases():
    assert len(family_replies()) >= 2 * len(FAMILIES)
    for reply, fmt in family_replies():
        assert tools.parse_tool_calls(reply, fmt)[1], reply


def test_a_partial_marker_is_held_and_released_when_it_is_no_marker():
    gate = tools.ToolCallStream(tools.HERMES)
    assert gate.feed("Use the <tool_") == "Use the"  # the space too: a reply with calls is stripped
    assert not gate.pending
    assert gate.feed("box here.") == " <tool_box here."
    assert gate.finish() == ("", [])


def test_a_call_is_held_from_its_marker_and_text_after_it_streams():
    gate = tools.ToolCallStream(tools.HERMES)
    assert gate.feed("Adding.\n<tool_call>\n{\"name\": \"add\", ") == "Adding."
    assert gate.pending
    assert gate.feed('"arguments": {"a": 1}}\n</tool') == ""
    assert gate.feed("_call>\nDone") == "\n\nDone"  # the line break held before the call, and the one after
    assert not gate.pending
    tail, calls = gate.finish()
    assert tail == "" and [c.arguments for c in calls] == [{"a": 1}]


def test_a_broken_block_is_shown_once_it_closes():
    gate = tools.ToolCallStream(tools.HARMONY)
    assert gate.feed('<tool_call>{"name": oops') == ""
    assert gate.pending
    assert gate.feed("}</tool_call> ok") == '<tool_call>{"name": oops}</tool_call> ok'
    assert gate.finish() == ("", [])


def test_mistral_holds_everything_after_its_marker():
    gate = tools.ToolCallStream(tools.MISTRAL)
    assert gate.feed("Sure. [TOOL_") == "Sure."
    assert gate.feed('CALLS]add[ARGS]{"a": 1}') == ""
    assert gate.pending
    tail, calls = gate.finish()
    assert tail == "" and calls[0].name == "add"
    gate = tools.ToolCallStream(tools.MISTRAL)  # a marker that makes no call: its text comes at the end
    assert gate.feed("[TOOL_CALLS] nothing") == ""
    assert gate.finish() == ("[TOOL_CALLS] nothing", [])


def test_a_reply_starting_with_a_brace_is_held_until_it_is_clear():
    gate = tools.ToolCallStream(tools.LLAMA3)
    assert gate.feed('{"name": "add", "parameters": {"a"') == ""
    assert gate.pending
    assert gate.feed(": 1}}") == ""  # a whole call: more calls (or text, which undoes it) may follow
    tail, calls = gate.finish()
    assert tail == "" and calls[0].arguments == {"a": 1}
    gate = tools.ToolCallStream(tools.LLAMA3)
    assert gate.feed('{"name": "Bob", "age"') == ""
    assert gate.feed(": 3} is JSON") == '{"name": "Bob", "age": 3} is JSON'  # no call: shown at once
    gate = tools.ToolCallStream(tools.LLAMA3)
    assert gate.feed("{this is") == "{this is"  # no JSON object goes on like that
    gate = tools.ToolCallStream(tools.LLAMA3)
    assert gate.feed("Hello <|python_tag|>") == "Hello <|python_tag|>"  # only the reply's start counts


def test_each_format_only_holds_its_own_markers():
    assert tools.ToolCallStream(tools.HERMES).feed("[TOOL_CALLS] {") == "[TOOL_CALLS] {"
    assert tools.ToolCallStream(tools.MISTRAL).feed("<tool_call> {") == "<tool_call> {"
    both = "a <tool_call> [TOOL_CALLS]"
    assert tools.ToolCallStream(tools.LLAMA3).feed(both) == both
    assert tools.ToolCallStream(None).feed(both) == "a"


def test_whitespace_at_the_start_of_a_reply_with_text_is_shown():
    text = '\n Sure. <tool_call>{"name": "add", "arguments": {}}</tool_call>'
    pieces, tail, calls = stream(text, tools.HERMES, [3, 9])
    assert "".join(pieces) + tail == "\n Sure." and tools.parse_tool_calls(text)[0] == "Sure." and calls


@pytest.mark.parametrize("opened", [False, True])
def test_thinking_streams_and_only_the_answer_is_gated(opened):
    """As the server and the app chain them: engine.reasoning splits the thinking off, the gate takes the
    answer; a marker inside the thinking is thinking."""
    reply = ("" if opened else "<think>") + "\nI could use <tool_call> here.\n</think>\n\nLet me add.\n" + (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    for cuts in splits(reply, 7):
        split, gate = ReasoningStream(opened), tools.ToolCallStream(tools.HERMES)
        thinking, shown, start = "", "", 0
        for cut in [*cuts, len(reply)]:
            t, a = split.feed(reply[start:cut])
            start = cut
            thinking += t
            shown += gate.feed(a)
        t, a = split.flush()
        thinking += t
        shown += gate.feed(a)
        tail, calls = gate.finish()
        assert thinking.strip() == "I could use <tool_call> here."
        assert shown + tail == "Let me add." and calls[0].arguments == {"a": 1}


def test_a_harmony_reply_streams_token_by_token_with_its_call_held():
    """gpt-oss: engine.harmony's decoder writes the analysis as a <think> block and a message to
    functions.NAME as a <tool_call> block, piece by piece as tokens come; the gate holds that block."""
    from engine.harmony import reply_decoder
    from engine.loader import load_model
    from tests.engine.test_gpt_oss import TINY

    tok = load_model(TINY / "gpt-oss").tokenizer
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    decoder = reply_decoder(tok, [], text_start=True)
    split, gate = ReasoningStream(), tools.ToolCallStream(tools.tool_format(template("gpt-oss").source))
    thinking, pieces = "", []
    for i in [*tok.encode(reply), None]:
        if i in tok.eot_ids:
            continue
        t, a = split.feed(decoder.push(i) if i is not None else decoder.flush())
        if i is None:
            t2, a2 = split.flush()
            t, a = t + t2, a + a2
        thinking += t
        pieces.append(gate.feed(a))
    tail, calls = gate.finish()
    assert thinking.strip() == "Need the weather."
    assert "".join(pieces) + tail == "Checking." and not any("{" in p for p in pieces)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_the_pending_calls_name_is_known_once_it_arrives():
    gate = tools.ToolCallStream(tools.HERMES)
    gate.feed('Hi <tool_call>\n{"na')
    assert gate.pending and gate.pending_name == ""
    gate.feed('me": "get_weather", "arguments": {')
    assert gate.pending_name == "get_weather"
    gate = tools.ToolCallStream(tools.MISTRAL)
    gate.feed("[TOOL_CALLS]add[CALL_ID]")
    assert gate.pending_name == "add"
    gate = tools.ToolCallStream(tools.LLAMA3)
    gate.feed('{"name": "now", "parameters"')
    assert gate.pending_name == "now"
    gate.feed(": 3} no")
    assert not gate.pending and gate.pending_name == ""
