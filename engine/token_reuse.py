"""Keep a model's own tokens when a prompt re-tokenizes text it generated.

A chat's next prompt renders the previous reply as text, and the tokenizer does not always split
that text the way the model generated it (SmolLM2 wrote " compost" "er"; encoding the reply gives
" comp" "oster"). The KV cache holds the generated tokens, so from the first such difference on
the whole rest of the conversation would be prefilled again. `reuse_held_tokens` swaps the
re-tokenized stretch back to the held tokens where both spell exactly the same bytes, so the cache
is reused and the model sees what it wrote.

Only runs of ordinary tokens are compared: special tokens (`<|im_end|>`, `<start_of_turn>`) are cut
out of the text by the tokenizer, so literal text that happens to spell one never stands in for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.tokenizer import Tokenizer


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _text_run(tokenizer: Tokenizer, ids: Sequence[int], start: int) -> tuple[bytes, np.ndarray]:
    """Bytes of the ordinary tokens from `start` up to the next special token (or image id, past the
    vocabulary: engine.vision.tokens), and where each ends."""
    pieces = []
    for token in ids[start:]:
        if int(token) >= tokenizer.vocab_size or tokenizer.is_special(int(token)):
            break
        pieces.append(tokenizer.token_bytes(int(token)))
    ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
    return b"".join(pieces), ends


def reuse_held_tokens(tokenizer: Tokenizer, ids: Sequence[int], held: Sequence[int]) -> list[int]:
    """`ids` with the stretch after its common prefix with `held` spelled with held's tokens, if it can be.

    Where `ids` and `held` part, both go on as runs of ordinary tokens. The longest stretch of those
    runs that spells the same bytes and ends on a token boundary of both is taken from `held`; the
    rest of `ids` follows unchanged. Without such a stretch `ids` is returned as it is.

    Args:
        tokenizer: the model's tokenizer.
        ids: the prompt as encoded from text.
        held: the tokens whose keys and values are at hand (a KV cache's, a stored prefix's).
    """
    ids = [int(t) for t in ids]
    k = _common_prefix(held, ids)
    if k == len(held) or k == len(ids):
        return ids
    held_bytes, held_ends = _text_run(tokenizer, held, k)
    ids_bytes, ids_ends = _text_run(tokenizer, ids, k)
    n = min(len(held_bytes), len(ids_bytes))
    a = np.frombuffer(held_bytes[:n], np.uint8)
    b = np.frombuffer(ids_bytes[:n], np.uint8)
    diff = np.flatnonzero(a != b)
    same = int(diff[0]) if len(diff) else n
    boundaries = np.intersect1d(held_ends[held_ends <= same], ids_ends[ids_ends <= same])
    if not len(boundaries):
        return ids
    end = boundaries[-1]
    i = k + int(np.searchsorted(held_ends, end)) + 1
    j = k + int(np.searchsorted(ids_ends, end)) + 1
    return [int(t) for t in held[:i]] + ids[j:]


def best_reuse(tokenizer: Tokenizer, ids: Sequence[int], candidates: Sequence[Sequence[int]]) -> list[int]:
    """`ids` respelled against whichever held sequence then shares the longest prefix with it."""
    best, best_shared = [int(t) for t in ids], max((_common_prefix(c, ids) for c in candidates), default=0)
    for held in candidates:
        respelled = reuse_held_tokens(tokenizer, ids, held)
        shared = _common_prefix(held, respelled)
        if shared > best_shared:
            best, best_shared = respelled, shared
    return best
