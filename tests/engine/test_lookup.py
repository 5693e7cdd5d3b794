"""Prompt lookup drafting (engine.lookup)."""

from __future__ import annotations

import pytest

from engine.lookup import PromptLookup


def test_proposes_what_followed_the_latest_match():
    lk = PromptLookup(max_ngram=3)
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert lk.lookup(history, 2) == [7, 8]  # the later of the two occurrences of (1, 2, 3)


def test_longest_ngram_first_then_shorter():
    lk = PromptLookup(max_ngram=3)
    # (4, 2, 3) never occurred before; (2, 3) did, followed by 5
    assert lk.lookup([2, 3, 5, 6, 4, 2, 3], 3) == [5, 6, 4]


def test_no_match_and_k_limits():
    lk = PromptLookup(max_ngram=2, min_ngram=2)
    assert lk.lookup([1, 2, 3, 4], 4) == []
    assert lk.lookup([1, 2, 9, 1, 2], 1) == [9]
    assert lk.lookup([5], 3) == []


def test_propose_interface():
    tokens, dists = PromptLookup().propose([1, 2, 3, 1, 2], 2, None, [], None, False)
    assert tokens == [3, 1] and dists == [None, None]


def test_bad_ngram_sizes():
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)
