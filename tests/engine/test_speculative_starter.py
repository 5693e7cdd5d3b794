"""Speculation on the real SmolLM2 starter: an F16 target (the Q4_1 starter dequantized) drafted by the
Q4_1 starter and by prompt lookup must give exactly the plain greedy output."""

from __future__ import annotations

import pytest

from engine.generate import GenerationParams, generate
from engine.loader import load_model
from engine.lookup import PromptLookup
from engine.speculative import DraftModel, speculative_generate
from tests.conftest import TEST_MODELS
from tests.engine.spec_models import float_copy

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
)


@pytest.fixture(scope="module")
def pair(smollm2_path):
    target = load_model(float_copy(smollm2_path, "F16", TEST_MODELS / "spec"))
    return target, load_model(smollm2_path)


def _ids(lm, text):
    rendered = lm.template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return lm.tokenizer.encode(rendered, add_special=False)


def test_float_copy_keeps_metadata_and_types(pair):
    target, draft = pair
    assert target.tokenizer.vocab_size == draft.tokenizer.vocab_size
    assert target.template is not None
    assert target.model.layers[0].wq.ggml_type == 1  # F16
    assert target.model.cfg == draft.model.cfg


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-k"])
def test_draft_greedy_identical(pair, adaptive):
    target, draft = pair
    params = GenerationParams(max_tokens=40, temperature=0)
    for text in PROMPTS:
        ids = _ids(target, text)
        m, tok = target.model, target.tokenizer
        plain = [e.token for e in generate(m, tok, ids, m.new_cache(256), params)]
        events = list(speculative_generate(m, tok, ids, m.new_cache(256), params,
                                           DraftModel(draft.model, draft.tokenizer, 256), k=4,
                                           adaptive=adaptive))
        assert [e.token for e in events] == plain, text
        last = events[-1]
        assert last.drafted_tokens > 0 and 0 < last.acceptance_rate <= 1
        assert last.tokens_per_pass >= 1.0


def test_lookup_greedy_identical_and_accepts_copied_text(pair):
    target, _ = pair
    text = ("Repeat this sentence exactly, changing 'red' to 'blue': The red fox jumped over the sleeping "
            "dog and ran into the quiet forest before sunrise.")
    ids = _ids(target, text)
    params = GenerationParams(max_tokens=40, temperature=0)
    m, tok = target.model, target.tokenizer
    plain = [e.token for e in generate(m, tok, ids, m.new_cache(256), params)]
    events = list(speculative_generate(m, tok, ids, m.new_cache(256), params, PromptLookup(), k=4,
                                       adaptive=False))
    assert [e.token for e in events] == plain
    assert events[-1].accepted_tokens > 10  # the copied sentence comes from the prompt
    assert any(e.from_draft for e in events)


def test_cache_holds_the_reply_after_speculation(pair):
    # the next chat turn reuses the cache: it must hold prompt + reply (no rejected drafts)
    target, draft = pair
    ids = _ids(target, PROMPTS[0])
    cache = target.model.new_cache(256)
    events = list(speculative_generate(target.model, target.tokenizer, ids, cache,
                                       GenerationParams(max_tokens=12, temperature=0),
                                       DraftModel(draft.model, draft.tokenizer, 256), k=4))
    reply = [e.token for e in events if e.token not in target.tokenizer.eot_ids]
    assert cache.tokens == (ids + reply)[: cache.offset]
    assert cache.offset >= len(ids) + len(reply) - 1
