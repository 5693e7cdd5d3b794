"""Tool calls out of replies, per template family, from the replies the families' own templates write.

The templates in tests/fixtures/chat_templates are the models' chat templates as published (see the README
there). A reply "as the model writes it" is what the template renders for an assistant turn with
tool_calls: the text between the generation prompt and the end-of-turn marker.
"""

from pathlib import Path

import pytest

from engine import tools
from engine.chat_template import ChatTemplate
from engine.reasoning import split_reasoning
from engine.server.protocol import parse_tool_calls as server_parse

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
ADD = tools.tool_schema(
    "add",
    "Add two numbers",
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a"]},
)
# template file, BOS, EOS, end-of-turn marker of an assistant turn, expected format
FAMILIES = [
    ("qwen2.5", "", "", "<|im_end|>", tools.HERMES),
    ("qwen3", "", "", "<|im_end|>", tools.HERMES),
    ("hermes3", "<|begin_of_text|>", "<|eot_id|>", "<|im_end|>", tools.HERMES),
    ("llama3.2", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", tools.LLAMA3),
    ("llama3.3", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", tools.LLAMA3),
    ("mistral-nemo", "<s>", "</s>", "</s>", tools.MISTRAL),
    ("mistral-small-3.2", "<s>", "</s>", "</s>", tools.MISTRAL),
]
USER = [{"role": "user", "content": "What is 2+3?"}]


def template(name: str, bos: str = "", eos: str = "") -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), bos, eos)


def written_reply(t: ChatTemplate, calls: list[tools.ToolCall], end: str) -> str:
    """The text a model trained on `t` writes for an assistant turn making `calls`."""
    prompt = t.render(USER, add_generation_prompt=True, tools=[ADD])
    full = t.render([*USER, tools.assistant_message("", calls)], add_generation_prompt=False, tools=[ADD])
    assert full.startswith(prompt)
    return split_reasoning(full[len(prompt) :].split(end)[0]).answer  # Qwen3 writes an empty <think> block


@pytest.mark.parametrize(("name", "bos", "eos", "end", "fmt"), FAMILIES)
def test_the_reply_each_template_teaches_parses_into_its_call(name, bos, eos, end, fmt):
    t = template(name, bos, eos)
    assert tools.tool_format(t.source) == fmt
    call = tools.ToolCall("add", {"a": 2, "b": 3.5}, "abc123XYZ")
    reply = written_reply(t, [call], end)
    rest, calls = tools.parse_tool_calls(reply, fmt)
    assert rest == ""
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 2, "b": 3.5})]
    # the API server, which tries each format, finds it as well
    assert server_parse(reply)[1][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3.5}'}


@pytest.mark.parametrize(("name", "bos", "eos", "end", "fmt"), FAMILIES)
def test_a_reply_with_broken_json_stays_text(name, bos, eos, end, fmt):
    t = template(name, bos, eos)
    reply = written_reply(t, [tools.ToolCall("add", {"a": 2, "b": 3}, "abc123XYZ")], end)
    broken = reply.replace('"b": 3}', '"b": 3')  # the object's closing brace lost
    assert broken != reply
    assert tools.parse_tool_calls(broken, fmt) == (broken, [])


@pytest.mark.parametrize(("name", "bos", "eos", "end", "fmt"), FAMILIES)
def test_results_go_back_through_each_template(name, bos, eos, end, fmt):
    t = template(name, bos, eos)
    call = tools.ToolCall("add", {"a": 2, "b": 3}, "abc123XYZ")
    conv = [*USER, tools.assistant_message("", [call]), tools.tool_message(call, "the sum is 5")]
    prompt = t.render(conv, add_generation_prompt=True, tools=[ADD])
    assert prompt.index('"add"') < prompt.rindex("the sum is 5")


def test_hermes_calls_amid_text_and_several():
    reply = (
        'Let me add both.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        "<tool_call>\n{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 3, \\\"b\\\": 4}\"}\n</tool_call>"
    )
    rest, calls = tools.parse_tool_calls(reply, tools.HERMES)
    assert rest == "Let me add both."
    assert [c.arguments for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert len({c.id for c in calls}) == 2 and all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_hermes_keeps_a_broken_block_and_takes_the_good_one():
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
    good = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    rest, calls = tools.parse_tool_calls(bad + "\n" + good, tools.HERMES)
    assert rest == bad and [c.name for c in calls] == ["add"]


def test_hermes_block_cut_off_at_the_end_of_the_reply():
    rest, calls = tools.parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', tools.HERMES)
    assert rest == "" and calls[0].arguments == {"a": 1}


def test_mistral_new_form_several_calls_with_and_without_ids():
    reply = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_time[CALL_ID]X1y2Z3w4v[ARGS]{}'
    rest, calls = tools.parse_tool_calls(reply, tools.MISTRAL)
    assert rest == ""
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("get_time", {})]
    assert calls[1].id == "X1y2Z3w4v"


def test_mistral_list_form_keeps_the_text_before():
    reply = 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}]'
    rest, calls = tools.parse_tool_calls(reply, tools.MISTRAL)
    assert rest == "Sure." and [c.name for c in calls] == ["add", "now"]


def test_llama3_python_tag_and_semicolon_separated_calls():
    reply = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}'
    rest, calls = tools.parse_tool_calls(reply, tools.LLAMA3)
    assert rest == "" and [c.name for c in calls] == ["add", "now"]


def test_llama3_plain_json_answer_is_not_a_call():
    for text in ('{"name": "Bob", "age": 3}', 'The call would be {"name": "add", "parameters": {}}'):
        assert tools.parse_tool_calls(text, tools.LLAMA3) == (text, [])


def test_gpt_oss_template_is_harmony_and_its_decoded_calls_parse():
    t = template("gpt-oss")
    assert tools.tool_format(t.source) == tools.HARMONY
    # engine.harmony's decoder writes a message to functions.add as this block (tests/engine/test_gpt_oss.py)
    block = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    rest, calls = tools.parse_tool_calls(block, tools.HARMONY)
    assert rest == "" and calls[0].arguments == {"a": 1}


def test_templates_without_tools_have_no_format():
    for name in ("chatml", "gemma"):
        source = (TEMPLATES.parents[2] / "resources" / "templates" / f"{name}.jinja").read_text()
        assert tools.tool_format(source) is None


def test_clip_result_says_how_much_was_cut():
    assert tools.clip_result("abc", 5) == "abc"
    clipped = tools.clip_result("x" * 100, 10)
    assert clipped.startswith("x" * 10) and "90 more characters" in clipped
