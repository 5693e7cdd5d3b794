"""Reasoning ("thinking") blocks: a reply that starts with <think>...</think> before its answer.

Reasoning models (Qwen3, QwQ, DeepSeek-R1 and its distills, ...) write their chain of thought first,
between <think> and </think>, then the answer. Gemma 4 writes the same block as a channel,
"<|channel>thought\n...<channel|>" (its markers are text tokens, decoded into the reply); `MARKERS`
holds each (open, close) pair, and every function here treats them alike. Some chat templates open
the block themselves (the generation prompt ends with "<think>"), so the model's text starts inside
it; the worker then puts the opening marker in front of the reply, so a stored reply always spells
its block out (`opens_reasoning`, `stored_opening`).

- `split_reasoning` parses a whole reply (the app's display, the API's non-streamed answer);
- `ReasoningStream` splits a reply as it streams (the API's `reasoning_content` deltas);
- `strip_reasoning` drops earlier replies' thinking from a conversation before it is rendered again:
  the thinking is for the turn it was written in (Qwen3's and DeepSeek-R1's templates drop it too),
  and it would fill the context.

Only a block at the very start of a reply counts (after whitespace): a "<think>" or "<|channel>" later
in an answer is text the model wrote about tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# (open, close) markers of a thinking block; the first is Hearth's own (harmony's replies are stored in it).
# Gemma 4's newline after the channel name belongs to its marker.
MARKERS = (("<think>", "</think>"), ("<|channel>thought\n", "<channel|>"))
OPEN, CLOSE = MARKERS[0]


@dataclass(frozen=True)
class Reasoning:
    """A reply split into its thinking and its answer."""

    thinking: str | None  # None: the reply has no thinking block
    answer: str
    thinking_done: bool = True  # False: the block is still open (streaming, or cut off while thinking)


def split_reasoning(text: str) -> Reasoning:
    """Split a reply (as stored: a prompt-opened block has its opening tag) into thinking and answer."""
    body = text.lstrip()
    marker = _opening_marker(body)
    if marker is None:
        return Reasoning(None, text)
    opening, closing = marker
    body = body[len(opening) :]
    end = body.find(closing)
    if end < 0:
        return Reasoning(body.strip(), "", thinking_done=False)
    return Reasoning(body[:end].strip(), body[end + len(closing) :].lstrip())


def _opening_marker(body: str) -> tuple[str, str] | None:
    """The (open, close) pair whose opening marker `body` starts with."""
    return next((pair for pair in MARKERS if body.startswith(pair[0])), None)


def starts_opening(text: str) -> bool:
    """`text` (after leading whitespace) is a proper beginning of an opening marker: a thinking block may
    be arriving over tokens."""
    start = text.lstrip()
    return any(0 < len(start) < len(opening) and opening.startswith(start) for opening, _ in MARKERS)


def opens_reasoning(prompt_tail: str) -> str:
    """The opening marker of the thinking block a rendered prompt (its end is enough) leaves open for the
    reply, as in `MARKERS`; "" (false) when it leaves none."""
    tail = prompt_tail.rstrip()
    return next((opening for opening, _ in MARKERS if tail.endswith(opening.rstrip())), "")


def stored_opening(marker: str) -> str:
    """The text a stored reply starts with when the prompt opened its block with `marker`
    (`opens_reasoning`): the marker on a line of its own; "" for no marker."""
    return marker.rstrip() + "\n" if marker else ""


def strip_reasoning(messages: Sequence[dict], keep_last: bool = False) -> list[dict]:
    """The conversation with each assistant message's thinking block removed (its answer kept).

    Args:
        keep_last: leave the last message as it is (a reply being continued goes on from its raw text).
    """
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        last = i == len(messages) - 1
        if message.get("role") == "assistant" and isinstance(content, str) and not (keep_last and last):
            split = split_reasoning(content)
            if split.thinking is not None:
                message = {**message, "content": split.answer}
        out.append(message)
    return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back: the tag may
    be completing in the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Splits streamed reply text into thinking and answer pieces.

    `feed(text)` returns (thinking, answer) text that is now certain; a tag arriving in pieces is held
    back until it is complete or ruled out. `flush()` returns the rest when the reply ends.

    Args:
        opened: the opening marker the prompt left open (`opens_reasoning`; True for <think>): the text
            starts inside that block.
    """

    def __init__(self, opened: bool | str = False):
        marker = OPEN if opened is True else opened
        self._state = "thinking" if marker else "start"
        self._close = dict(MARKERS).get(marker, CLOSE)  # "start" sets it from the marker it finds
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        thinking = answer = ""
        while True:
            held = self._held
            if self._state == "start":  # before the reply's first text: is it a thinking block?
                body = held.lstrip()
                marker = _opening_marker(body)
                if marker is not None:
                    self._held, self._state, self._close = body[len(marker[0]) :], "thinking", marker[1]
                    continue
                if not body or starts_opening(body):
                    return thinking, answer  # undecided yet
                self._state = "answer"
                continue
            if self._state == "thinking":
                end = held.find(self._close)
                if end >= 0:
                    thinking += held[:end]
                    self._held, self._state = held[end + len(self._close) :], "after"
                    continue
                keep = _partial_suffix(held, self._close)
                thinking += held[: len(held) - keep]
                self._held = held[len(held) - keep :]
                return thinking, answer
            if self._state == "after":  # the whitespace between the block and the answer is dropped
                body = held.lstrip()
                if not body:
                    self._held = ""
                    return thinking, answer
                self._held, self._state = body, "answer"
                continue
            answer += held
            self._held = ""
            return thinking, answer

    def flush(self) -> tuple[str, str]:
        """The text still held back, as (thinking, answer); the stream is over."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return held, ""
        return "", held if self._state != "after" else held.lstrip()
