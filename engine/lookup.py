"""Prompt lookup: draft tokens by n-gram matching in the conversation itself (no draft model).

For rewrite, quote and code-edit replies most of the output already occurs in the prompt. The last n
tokens of the history (n from `max_ngram` down to `min_ngram`) are searched for at an earlier place
in the history; the tokens that followed that occurrence are proposed. The most recent occurrence
wins (it is the likeliest to continue as it did). The proposal is deterministic: the accept rule
treats its distribution as one-hot (engine.speculative.accept_or_resample with q = None).
"""

from __future__ import annotations

from engine.generate import GenerationParams


class PromptLookup:
    """n-gram drafting over the token history.

    Args:
        max_ngram: longest suffix tried as the lookup key.
        min_ngram: shortest suffix tried (1 matches single tokens: more proposals, fewer accepted).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of history's last n-gram."""
        n_hist = len(history)
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            key = history[n_hist - n :]
            first = key[0]
            # scan backwards from the latest possible start (the suffix itself excluded)
            for start in range(n_hist - n - 1, -1, -1):
                if history[start] == first and history[start : start + n] == key:
                    follow = history[start + n : start + n + k]
                    if follow:
                        return list(follow)
        return []

    def propose(self, history: list[int], k: int, params: GenerationParams, processors, rng, sample: bool):
        """speculative_generate's proposer interface: (tokens, per-token draft distributions = None)."""
        tokens = self.lookup(history, k)
        return tokens, [None] * len(tokens)
