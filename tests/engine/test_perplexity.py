"""Perplexity: window bookkeeping on a model with known probabilities, and on a real model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.perplexity import (
    DEFAULT_TEXT,
    PerplexityError,
    llamacpp_perplexity,
    load_text,
    perplexity,
    perplexity_detail,
)


class _Cache:
    def __init__(self, n):
        self.n = n


class CountingModel:
    """Logits put probability p on token (prev + 1) % V and spread the rest uniformly."""

    def __init__(self, vocab=10, p=0.5):
        self.vocab, self.p = vocab, p
        self.calls = []

    def new_cache(self, n):
        return _Cache(n)

    def forward(self, tokens, cache, all_logits=False):
        tokens = np.asarray(tokens)
        assert len(tokens) <= cache.n
        self.calls.append(len(tokens))
        self.firsts = [*getattr(self, "firsts", []), int(tokens[0])]
        q = (1 - self.p) / (self.vocab - 1)
        logits = np.full((len(tokens), self.vocab), math.log(q), np.float32)
        logits[np.arange(len(tokens)), (tokens + 1) % self.vocab] = math.log(self.p)
        return logits


def test_every_token_scored_once_and_exact_value():
    model = CountingModel()
    tokens = np.arange(1000) % 10  # always the predicted successor: nll = -log p
    res = perplexity_detail(model, tokens, ctx=128, stride=32)
    assert res.n_scored == 999
    assert res.ppl == pytest.approx(2.0, rel=1e-5)
    assert max(model.calls) == 128


def test_unpredicted_tokens_give_uniform_rest():
    model = CountingModel(vocab=10, p=0.5)
    tokens = np.zeros(300, np.int64)  # successor never right: prob (1-p)/(V-1) each
    assert perplexity(model, tokens, 64, 16) == pytest.approx(18.0, rel=1e-5)


def test_llamacpp_mode_scores_second_half_of_disjoint_chunks():
    model = CountingModel()
    res = llamacpp_perplexity(model, np.arange(1000) % 10, ctx=100)
    assert res.n_scored == 10 * (100 - 50 - 1)
    assert model.calls == [100] * 10


def test_bad_parameters():
    model = CountingModel()
    with pytest.raises(PerplexityError):
        perplexity(model, [1], 16, 8)
    with pytest.raises(PerplexityError):
        perplexity(model, np.arange(100), 16, 16)
    with pytest.raises(PerplexityError):
        llamacpp_perplexity(model, np.arange(10), 16)
    with pytest.raises(PerplexityError, match="no such text"):
        load_text("/nonexistent/file.txt")


def test_default_text_ships_and_real_model_ppl_is_sane(smollm2_path):
    from engine.loader import load_model

    text = load_text(None)
    assert DEFAULT_TEXT.is_file() and len(text.split()) > 2000
    m = load_model(smollm2_path)
    tokens = m.tokenizer.encode(text, add_special=True)[:700]
    ppl = perplexity(m.model, tokens, 256, 128)
    assert 5 < ppl < 100  # SmolLM2-135M on plain English prose


def test_windows_start_with_bos_when_the_model_adds_one():
    model = CountingModel(vocab=10)
    tokens = np.arange(600) % 9 + 1  # token 0 never occurs in the text
    tokens[0] = 0  # the text's own BOS
    with_bos = perplexity_detail(model, tokens, ctx=128, stride=64, bos_id=0)
    assert model.firsts and all(f == 0 for f in model.firsts)
    assert with_bos.n_scored == 599  # the replaced first tokens are context only, never scored
