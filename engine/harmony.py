"""OpenAI's harmony reply format (gpt-oss), streamed as Hearth's reasoning convention.

A gpt-oss reply is a run of messages, each with a header and a channel:

    <|channel|>analysis<|message|>...chain of thought...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

(the prompt ends with "<|start|>assistant", so the reply starts at its first header). The special tokens
are control tokens, which a plain decode drops, leaving "analysis...assistantfinal..." run together.
`HarmonyDecoder` reads the structure instead and writes what the rest of Hearth reads everywhere
(engine.reasoning): the analysis channel as a <think>...</think> block, the final (and commentary)
channels as the answer. A stored reply is then rendered back by the model's template as its final
message, the thinking dropped, as gpt-oss's own template does with earlier turns.

<|end|> closes one message and the reply goes on, so for a harmony vocabulary it does not end a turn;
<|return|> (the answer is done) and <|call|> (a tool call, which Hearth does not run) do
(`harmony_stop_ids`). A message to a function (`to=functions.NAME`, gpt-oss's tool calls) becomes a
`<tool_call>` block, which the API server turns into OpenAI tool_calls as it does for Qwen's and Hermes'.

"Continue" (a reply that stopped part-way goes on): `continuation` spells the stored partial reply back in
harmony, its analysis and answer as the messages they were, left open; `reply_decoder` reads the prompt's
open message so the new text goes on inside the same <think> block or answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine.reasoning import CLOSE, OPEN

# the harmony special tokens the decoder acts on
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
THINKING_CHANNELS = ("analysis",)


def harmony_ids(controls: dict[str, int]) -> dict[str, int] | None:
    """{special text: id} when a vocabulary whose control tokens are `controls` (text -> id) speaks
    harmony, else None."""
    found = {t: controls[t] for t in (START, END, MESSAGE, CHANNEL, RETURN, CALL) if t in controls}
    return found if all(t in found for t in (START, END, MESSAGE, CHANNEL, RETURN)) else None


def harmony_stop_ids(eot_ids, ids: dict[str, int]) -> frozenset[int]:
    """A harmony vocabulary's end-of-turn ids: <|end|> out (a message ends, the reply goes on),
    <|return|> and <|call|> in."""
    stops = set(eot_ids) - {ids[END]}
    stops.update(ids[t] for t in (RETURN, CALL) if t in ids)
    return frozenset(stops)


def reply_decoder(tokenizer, prompt_ids: Sequence[int], text_start: bool | None = None):
    """The decoder for the tokens generated after `prompt_ids`: a HarmonyDecoder for a harmony model
    (gpt-oss; it starts inside the message the prompt leaves open, if any), otherwise a StreamDecoder
    that drops control tokens. text_start: the reply starts a new text (default: the prompt ends with a
    control token, a turn marker; a completion continues the prompt's text)."""
    from engine.tokenizer import StreamDecoder

    if text_start is None:
        text_start = bool(prompt_ids) and tokenizer.is_control(prompt_ids[-1])
    plain = StreamDecoder(tokenizer, skip_special=True, text_start=text_start)
    if tokenizer.harmony is None:
        return plain
    decoder = HarmonyDecoder(plain, tokenizer.harmony)
    decoder.resume(prompt_ids)
    return decoder


def continuation(partial: str) -> str:
    """The harmony text that follows the generation prompt ("<|start|>assistant") for a reply that goes on
    from `partial`, a stored reply in Hearth's convention: its <think> block as an analysis message (left
    open when the block is), then its answer as an open final message."""
    body = partial.lstrip()
    if not body.startswith(OPEN):
        return f"{CHANNEL}final{MESSAGE}{partial}"
    thinking, closed, answer = body[len(OPEN) :].partition(CLOSE)
    thinking = thinking.removeprefix("\n")  # the decoder's own line breaks around the block
    analysis = f"{CHANNEL}analysis{MESSAGE}"
    if not closed:
        return analysis + thinking
    final = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
    return analysis + thinking.removesuffix("\n") + final + answer.lstrip("\n")


class HarmonyDecoder:
    """StreamDecoder's interface (push, flush, reset) over a harmony reply: text in Hearth's reasoning
    convention (analysis as a <think> block, other channels as the answer) and tool calls as the
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks the server parses for every model.

    Args:
        decoder: a StreamDecoder (skip_special) for the messages' text.
        ids: harmony_ids of the tokenizer.

    A message's header (role, `<|channel|>` name, a recipient such as `to=functions.get_weather`) is read,
    not shown; a reply that never opens a message shows its text at the end (flush).
    """

    def __init__(self, decoder, ids: dict[str, int]):
        self._text = decoder
        self._ids = {i: t for t, i in ids.items()}
        self.reset()

    def reset(self) -> None:
        self._text.reset()
        self._in_message = False
        self._header = ""  # the current header's text; the channel name after a \0
        self._channel = ""
        self._thinking = False  # inside the <think> block written for an analysis message
        self._answered = False  # an answer message (or tool call) has begun
        self._dropping = False  # an analysis message after the answer: not shown
        self._tool = False  # inside a tool call's arguments

    def resume(self, prompt_ids: Sequence[int]) -> None:
        """Start inside the message `prompt_ids` leaves open (a continued reply, `continuation`): read its
        header and text as if generated, showing nothing, so what follows goes on in that channel."""
        tail = []  # the prompt's ids from its last <|start|> on (read backwards: a long prompt costs nothing)
        for t in reversed(prompt_ids):
            tail.append(int(t))
            if self._ids.get(tail[-1]) == START:
                break
        else:
            return
        kinds = [self._ids.get(t) for t in tail]
        if MESSAGE not in kinds or any(k in (END, RETURN, CALL) for k in kinds):
            return  # the prompt ends at a header or after a closed message: a reply starts afresh
        for t in reversed(tail):
            self.push(t)

    def push(self, token_id: int) -> str:
        special = self._ids.get(int(token_id))
        text = self._text.push(token_id) if special is None else self._text.flush()
        if not self._in_message:
            self._header += text
            text = ""
        elif self._dropping:
            text = ""
        if special == CHANNEL and not self._in_message:
            self._header += "\0"
        elif special == MESSAGE and not self._in_message:
            self._in_message = True
            text += self._open()
        elif special in (END, RETURN, CALL, START):
            if self._tool:
                text += "}</tool_call>"
                self._tool = False
            self._in_message = False
            self._header = ""
        return text

    def _open(self) -> str:
        """Text that starts a message, from its header."""
        before, _, channel = self._header.partition("\0")
        words = channel.split()
        if words:
            self._channel = words[0]
        recipient = next((w[3:] for w in (before + " " + channel).split() if w.startswith("to=")), "")
        self._header = ""
        self._dropping = False
        if self._channel in THINKING_CHANNELS and not recipient:
            if self._answered:  # thinking after the answer began: the block is closed, not shown
                self._dropping = True
                return ""
            if self._thinking:  # a further analysis message: the same block
                return "\n"
            self._thinking = True
            return OPEN + "\n"
        out = ""
        if self._thinking:
            self._thinking = False
            out = "\n" + CLOSE + "\n\n"
        elif self._answered:
            out = "\n\n"
        self._answered = True
        if recipient.startswith("functions."):
            self._tool = True
            name = json.dumps(recipient[len("functions.") :])
            out += f'<tool_call>{{"name": {name}, "arguments": '
        return out

    def flush(self) -> str:
        out = self._text.flush()
        if not self._in_message:
            # a reply that never opened a message (not harmony after all): its text is the answer
            header = (self._header + out).replace("\0", "")
            out = header if not (self._thinking or self._answered) else ""
        elif self._dropping:
            out = ""
        elif self._tool:  # the reply stopped at <|call|>, which ends a turn and so never reaches push
            out += "}</tool_call>"
        self.reset()
        return out
