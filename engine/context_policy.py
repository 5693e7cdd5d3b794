"""What to do when a conversation outgrows the context window, chosen per chat.

- "stop": refuse the turn with a clear message.
- "truncate-middle" (default): keep the system prompt and the first exchange (what the chat is
  about), drop the oldest turns after it, keep the latest.
- "rolling-window": keep the system prompt and as many of the latest turns as fit.

Whole messages are dropped, so that the remaining conversation still alternates user/assistant
(templates such as Gemma's reject anything else), and the kept part always starts with a user turn.
When something must go, enough is dropped to bring the prompt down to LOW_WATER of the room left
after the reply reserve, and the number dropped is remembered per chat: the next turns render the
same prefix, so they keep reusing the KV cache instead of re-prefilling after every turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models.errors import HearthError

POLICIES = ("stop", "truncate-middle", "rolling-window")
DEFAULT_POLICY = "truncate-middle"
LOW_WATER = 0.75


class ContextFullError(HearthError):
    """A conversation does not fit the context window and the chat's policy says stop (or nothing can go)."""

    def __init__(self, needed: int, n_ctx: int, reason: str):
        self.needed = needed
        self.n_ctx = n_ctx
        super().__init__(
            f"the conversation needs {needed} tokens (with room for the reply) but the context holds "
            f"{n_ctx}; {reason}"
        )


@dataclass
class ChatContext:
    """Per-chat memory of the policy: how many messages after the kept head are dropped."""

    dropped: int = 0


@dataclass
class FittedPrompt:
    """A conversation brought within the context: its token ids and what was left out."""

    ids: list[int]
    messages: list[dict]
    dropped: int  # messages left out (0: the whole conversation is in context)


def check_policy(policy: str) -> str:
    """Return `policy` if it is known, else raise ValueError naming the choices."""
    if policy not in POLICIES:
        raise ValueError(f"unknown context policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return policy


def _head_length(messages: Sequence[dict], policy: str) -> int:
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    # truncate-middle also keeps the first exchange: the first user message and the reply to it
    if policy == "truncate-middle" and n < len(messages) and messages[n].get("role") == "user":
        n += 1
        if n < len(messages) - 1 and messages[n].get("role") == "assistant":
            n += 1
    return n


def fit_conversation(
    messages: Sequence[dict],
    encode: Callable[[list[dict]], list[int]],
    n_ctx: int,
    reserve: int,
    policy: str = DEFAULT_POLICY,
    state: ChatContext | None = None,
) -> FittedPrompt:
    """Render `messages` into at most n_ctx - reserve tokens following `policy`.

    Args:
        messages: the whole conversation, oldest first; the last one is the message to answer.
        encode: messages -> prompt token ids (template + tokenizer, generation prompt included).
        n_ctx: context window.
        reserve: tokens kept free for the reply.
        policy: one of POLICIES.
        state: this chat's ChatContext (updated in place), or None for a one-off fit.

    Raises:
        ContextFullError: policy "stop" and it does not fit, or even the kept minimum does not fit.
        ValueError: unknown policy.
    """
    check_policy(policy)
    messages = [dict(m) for m in messages]
    state = state if state is not None else ChatContext()
    limit = n_ctx - reserve
    head = _head_length(messages, policy) if policy != "stop" else 0
    body = messages[head:]
    # drop counts that leave the body starting with a user message (and never the last message)
    cuts = [k for k in range(len(body)) if body[k].get("role") == "user"] or [0]
    if state.dropped > cuts[-1]:
        state.dropped = 0  # the conversation was shortened or edited: start over
    start = min((k for k in cuts if k >= state.dropped), default=cuts[-1])

    def render(k: int) -> list[int]:
        return encode(messages[:head] + body[k:])

    ids = render(start)
    if len(ids) <= limit:
        state.dropped = start
        return FittedPrompt(ids, messages[:head] + body[start:], start)
    if policy == "stop":
        raise ContextFullError(
            len(ids) + reserve,
            n_ctx,
            "start a new chat, load the model with a larger context, or switch this chat's context "
            "policy to truncate-middle or rolling-window",
        )
    target = int(limit * LOW_WATER)
    options = [k for k in cuts if k > start]
    best = None
    lo, hi = 0, len(options) - 1
    while lo <= hi:  # smallest drop that reaches the low-water mark (length falls as k grows)
        mid = (lo + hi) // 2
        mid_ids = render(options[mid])
        if len(mid_ids) <= target:
            best, hi = (options[mid], mid_ids), mid - 1
        else:
            lo = mid + 1
    if best is None:
        last = options[-1] if options else start
        last_ids = render(last) if options else ids
        if len(last_ids) > limit:
            raise ContextFullError(
                len(last_ids) + reserve,
                n_ctx,
                "even the system prompt and the latest message alone do not fit; shorten the message "
                "or load the model with a larger context",
            )
        best = (last, last_ids)
    state.dropped = best[0]
    return FittedPrompt(best[1], messages[:head] + body[best[0] :], best[0])
