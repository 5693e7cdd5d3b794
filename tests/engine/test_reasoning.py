"""Thinking blocks: splitting whole replies and streams, stripping old thinking, prompt-opened blocks."""

from __future__ import annotations

import pytest

from engine.reasoning import (
    ReasoningStream,
    opens_reasoning,
    split_reasoning,
    stored_opening,
    strip_reasoning,
)

REPLY = "<think>\nThe user wants a capital.\nIt is Paris.\n</think>\n\nParis is the capital of France."


def test_split_a_finished_reply():
    r = split_reasoning(REPLY)
    assert r.thinking == "The user wants a capital.\nIt is Paris."
    assert r.answer == "Paris is the capital of France." and r.thinking_done


def test_split_a_reply_still_thinking_and_one_without_a_block():
    r = split_reasoning("  <think>\nLet me see")
    assert (r.thinking, r.answer, r.thinking_done) == ("Let me see", "", False)
    plain = "Use <think> tags like this: <think>x</think>."
    assert split_reasoning(plain).thinking is None and split_reasoning(plain).answer == plain
    assert split_reasoning("").thinking is None


def test_prompt_opened_blocks():
    assert opens_reasoning("<｜Assistant｜><think>\n")
    # Qwen3 with thinking switched off: the template writes an empty, closed block
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


def test_strip_keeps_answers_and_other_messages():
    messages = [
        {"role": "user", "content": "<think>not a reply</think>hi"},
        {"role": "assistant", "content": REPLY},
        {"role": "assistant", "content": "<think>cut off while thinking"},
        {"role": "user", "content": "and Spain?"},
    ]
    out = strip_reasoning(messages)
    assert [m["content"] for m in out] == [
        "<think>not a reply</think>hi", "Paris is the capital of France.", "", "and Spain?"
    ]
    assert messages[1]["content"] == REPLY  # the input is left alone
    partial = [*messages[:2], {"role": "assistant", "content": "<think>going on"}]
    assert strip_reasoning(partial, keep_last=True)[-1]["content"] == "<think>going on"
    assert strip_reasoning(partial, keep_last=True)[1]["content"] == "Paris is the capital of France."


# Gemma 4: the block is a "thought" channel; its markers are text tokens, decoded into the reply
GEMMA_REPLY = (
    "<|channel>thought\nThe user wants a capital.\nIt is Paris.<channel|>Paris is the capital of France."
)
GEMMA_TOKENS = ["<|channel>", "thought", "\n", "The", " user", " wants", " a", " capital", ".\n", "It", " is",
                " Paris", ".", "<channel|>", "Paris", " is", " the", " capital", " of", " France", "."]


def test_gemma_split_a_finished_reply_and_one_cut_off():
    r = split_reasoning(GEMMA_REPLY)
    assert (r.thinking, r.answer, r.thinking_done) == (
        "The user wants a capital.\nIt is Paris.", "Paris is the capital of France.", True
    )
    r = split_reasoning("\n<|channel>thought\nLet me see <chan")
    assert (r.thinking, r.answer, r.thinking_done) == ("Let me see <chan", "", False)
    # the pairs do not mix: a <think> block is not closed by <channel|>
    assert split_reasoning("<think>a<channel|>b").thinking_done is False


def test_gemma_channel_later_in_an_answer_is_text():
    plain = "Gemma opens with <|channel>thought\n and closes with <channel|>."
    assert split_reasoning(plain).thinking is None and split_reasoning(plain).answer == plain
    assert _stream([plain[:17], plain[17:30], plain[30:]]) == ("", plain)
    assert _stream(["<|chan", "nel>final\nHi"]) == ("", "<|channel>final\nHi")  # not the thought channel
    assert split_reasoning("<|channel>thought").thinking is None  # the marker ends with its newline


def test_gemma_prompt_opened_blocks():
    assert opens_reasoning("<|turn>model\n<|channel>thought\n") == "<|channel>thought\n"
    assert opens_reasoning("<｜Assistant｜><think>\n") == "<think>"
    assert stored_opening("<|channel>thought\n") == "<|channel>thought\n"
    assert stored_opening("<think>") == "<think>\n" and stored_opening("") == ""
    # thinking off: the template writes an empty, closed channel
    assert not opens_reasoning("<|turn>model\n<|channel>thought\n<channel|>")
    assert not opens_reasoning("<|turn>model\n")


def test_gemma_strip_from_history():
    messages = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": GEMMA_REPLY},
        {"role": "assistant", "content": "<|channel>thought\ncut off"},
        {"role": "assistant", "content": "See <|channel>thought\nx<channel|> here"},
    ]
    out = strip_reasoning(messages)
    assert [m["content"] for m in out] == [
        "Capital of France?", "Paris is the capital of France.", "", messages[3]["content"]
    ]


def _stream(pieces, opened=False):
    s = ReasoningStream(opened)
    thinking = answer = ""
    for piece in pieces:
        t, a = s.feed(piece)
        thinking, answer = thinking + t, answer + a
    t, a = s.flush()
    return thinking + t, answer + a


def test_gemma_stream_token_by_token():
    thinking, answer = _stream(GEMMA_TOKENS)
    assert thinking == "The user wants a capital.\nIt is Paris."
    assert answer == "Paris is the capital of France."


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 100])
def test_gemma_stream_in_pieces_of_any_size(size):
    pieces = [GEMMA_REPLY[i : i + size] for i in range(0, len(GEMMA_REPLY), size)]
    assert _stream(pieces) == ("The user wants a capital.\nIt is Paris.", "Paris is the capital of France.")


def test_gemma_stream_holds_back_only_what_may_be_a_marker():
    s = ReasoningStream()
    assert s.feed("<|chan") == ("", "")  # may be <|channel>thought
    assert s.feed("nel>thought") == ("", "")  # the marker's newline is still to come
    assert s.feed("\nplan <chan") == ("plan ", "")  # "<chan" may be <channel|>
    assert s.feed("nel is fine </think>") == ("<channel is fine </think>", "")  # </think> is not this close
    assert s.feed("<channel") == ("", "")
    assert s.feed("|>\nDone.") == ("", "Done.")
    assert s.flush() == ("", "")
    # prompt-opened, and cut off while thinking
    opened = opens_reasoning("<|turn>model\n<|channel>thought\n")
    assert _stream(["plan", "<channel|>", "Yes."], opened=opened) == ("plan", "Yes.")
    assert _stream(["still thinking <channel"], opened=opened) == ("still thinking <channel", "")
    assert _stream(["<|channel>thought\nstill <chan"]) == ("still <chan", "")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 100])
def test_stream_in_pieces_of_any_size(size):
    pieces = [REPLY[i : i + size] for i in range(0, len(REPLY), size)]
    thinking, answer = _stream(pieces)
    assert thinking == "\nThe user wants a capital.\nIt is Paris.\n"
    assert answer == "Paris is the capital of France."


def test_stream_holds_back_only_what_may_be_a_tag():
    s = ReasoningStream()
    assert s.feed("<th") == ("", "")  # may be <think>
    assert s.feed("ink>plan </th") == ("plan ", "")  # "</th" may be </think>
    assert s.feed("is is fine") == ("</this is fine", "")
    assert s.feed("</think>\n") == ("", "")
    assert s.feed("\nDone.") == ("", "Done.")
    assert s.flush() == ("", "")


def test_stream_without_a_block_and_prompt_opened():
    assert _stream(["Hel", "lo <think> there"]) == ("", "Hello <think> there")
    assert _stream(["  <", "b>bold</b>"]) == ("", "  <b>bold</b>")
    assert _stream(["plan", "</think>", "Yes."], opened=True) == ("plan", "Yes.")
    # cut off while thinking: what was held back is thinking too
    assert _stream(["still thinking </thi"], opened=True) == ("still thinking </thi", "")
    assert _stream(["<thi"]) == ("", "<thi")


# ChatML whose generation prompt opens a thinking block, as DeepSeek-R1's and QwQ's templates do
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Gemma 4's turns, with a generation prompt that opens the thought channel
GEMMA_OPENING_TEMPLATE = (
    "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n<|channel>thought\n{% endif %}"
)


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from engine.client import LoadOptions
    from engine.worker import ChatRunner

    return ChatRunner.load(smollm2_path, LoadOptions(n_ctx=512, prefix_cache_mb=0))


def _reply(runner, messages, max_tokens=6):
    from engine.generate import GenerationParams

    events = list(runner.chat(messages, GenerationParams(max_tokens=max_tokens, temperature=0.0)))
    return "".join(e.text for e in events), events


def test_earlier_replies_reach_the_template_without_their_thinking(runner):
    history = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "And of Spain?"},
    ]
    stripped = [history[0], {"role": "assistant", "content": "Paris is the capital of France."}, history[2]]
    assert runner.encode(history) == runner.encode(stripped)
    assert "It is Paris" not in runner.lm.tokenizer.decode(runner.encode(history))


def test_a_reply_inside_a_template_opened_block_is_stored_with_its_tag(runner, monkeypatch):
    from engine.chat_template import ChatTemplate

    monkeypatch.setattr(runner.lm, "template", ChatTemplate(OPENING_TEMPLATE))
    messages = [{"role": "user", "content": "Capital of France?"}]
    text, events = _reply(runner, messages)
    assert text.startswith("<think>\n") and text.count("<think>") == 1
    assert events[0].text.startswith("<think>\n")  # with the first piece, so the app shows it at once
    assert split_reasoning(text).thinking is not None

    # continuing that reply: the template's own <think> opens the block; the stored tag is not repeated
    partial = {"role": "assistant", "content": text, "continue": True}
    prompt = runner.lm.tokenizer.decode(runner.encode([*messages, partial]))
    assert prompt.count("<think>") == 1 and prompt.endswith(text[len("<think>") :])
    more, events = _reply(runner, [*messages, partial])
    assert not more.startswith("<think>")  # a continuation adds text, never a second tag


def test_a_reply_inside_a_gemma_channel_is_stored_with_its_marker(runner, monkeypatch):
    from engine.chat_template import ChatTemplate

    monkeypatch.setattr(runner.lm, "template", ChatTemplate(GEMMA_OPENING_TEMPLATE))
    messages = [{"role": "user", "content": "Capital of France?"}]
    text, events = _reply(runner, messages)
    assert events[0].text.startswith("<|channel>thought\n")  # with the first piece, as <think> is
    assert split_reasoning(text).thinking is not None
    # continuing it: the template's marker opens the block, the stored one is not repeated
    partial = {"role": "assistant", "content": text, "continue": True}
    prompt = runner.lm.tokenizer.decode(runner.encode([*messages, partial]))
    assert prompt.endswith("<|turn>model\n" + text)
    more, _ = _reply(runner, [*messages, partial])
    assert not more.startswith("<|channel>")
    reply = {"role": "assistant", "content": GEMMA_REPLY}
    history = [*messages, reply, {"role": "user", "content": "Spain?"}]
    assert "It is Paris" not in runner.lm.tokenizer.decode(runner.encode(history))


def test_without_an_opened_block_replies_are_left_as_written(runner):
    text, _ = _reply(runner, [{"role": "user", "content": "Capital of France?"}])
    assert not text.startswith("<think>")


# Qwen3's switch: with enable_thinking false the generation prompt holds an empty, closed block
QWEN_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def test_template_variables_reach_the_template(runner, monkeypatch):
    from engine.chat_template import ChatTemplate

    monkeypatch.setattr(runner.lm, "template", ChatTemplate(QWEN_STYLE_TEMPLATE))
    messages = [{"role": "user", "content": "Capital of France?"}]
    decode = runner.lm.tokenizer.decode
    assert decode(runner.encode(messages)).endswith("<|im_start|>assistant\n")
    off = {"enable_thinking": False}
    assert decode(runner.encode(messages, off)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    from engine.generate import GenerationParams

    params = GenerationParams(max_tokens=2, temperature=0.0)
    events = list(runner.chat(messages, params, template_vars=off))
    assert events[-1].prompt_tokens == len(runner.encode(messages, off)) > len(runner.encode(messages))
    assert not "".join(e.text for e in events).startswith("<think>")  # the block is closed: no tag added
