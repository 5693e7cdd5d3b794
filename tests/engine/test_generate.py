"""Generation loop logic (prefix reuse, stops, limits, events) on a scripted model with a real tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ContextOverflowError
from engine.generate import GenerationParams, _StopMatcher, generate, prefill
from engine.kv_cache import KVCache
from engine.tokenizer import Tokenizer
from models.formats.gguf import open_gguf


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    with open_gguf(smollm2_path) as f:
        return Tokenizer.from_gguf_metadata(f.metadata)


class ScriptedModel:
    """Emits a fixed token sequence greedily; records what it was asked to compute."""

    def __init__(self, script: list[int], vocab: int):
        self.script = script
        self.vocab = vocab
        self.calls: list[list[int]] = []

    def forward(self, tokens, cache: KVCache, all_logits=False):
        tokens = [int(t) for t in tokens]
        cache.check_room(len(tokens))
        self.calls.append(tokens)
        cache.advance(tokens)
        step = cache.offset - self.prompt_len
        logits = np.zeros((1, self.vocab), np.float32)
        logits[0, self.script[min(step, len(self.script) - 1)]] = 10.0
        return logits


def _run(model, tokenizer, prompt, cache, **kw):
    model.prompt_len = len(prompt)
    events = list(generate(model, tokenizer, prompt, cache, GenerationParams(temperature=0.0, **kw)))
    return events, "".join(e.text for e in events)


def test_stops_on_end_of_turn_and_reports(tokenizer):
    words = tokenizer.encode(" Paris is lovely")
    eot = tokenizer.encode("<|im_end|>")
    assert len(eot) == 1 and eot[0] in tokenizer.eot_ids
    model = ScriptedModel(words + eot, tokenizer.vocab_size)
    prompt = tokenizer.encode("Hello there")
    cache = KVCache(1, 1, 4, 64)
    events, text = _run(model, tokenizer, prompt, cache, max_tokens=50)
    assert text == " Paris is lovely"
    assert events[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in events[:-1])
    assert events[-1].generated_tokens == len(words) + 1
    assert events[-1].prompt_tokens == len(prompt) and events[-1].ttft_s > 0
    assert events[-1].peak_memory_mb > 0
    # the cache holds the prompt and the reply, without the end-of-turn token
    assert cache.tokens == prompt + words


def test_max_tokens_gives_length(tokenizer):
    words = tokenizer.encode(" one two three four five six")
    model = ScriptedModel(words, tokenizer.vocab_size)
    events, text = _run(model, tokenizer, tokenizer.encode("Count:"), KVCache(1, 1, 4, 64), max_tokens=3)
    assert events[-1].finish_reason == "length"
    assert text == tokenizer.decode(words[:3])


def test_stop_string_is_cut_and_not_emitted(tokenizer):
    words = tokenizer.encode(" alpha beta\n\nUser: gamma")
    model = ScriptedModel(words, tokenizer.vocab_size)
    events, text = _run(
        model, tokenizer, tokenizer.encode("x"), KVCache(1, 1, 4, 64), max_tokens=40, stop=["\nUser:"]
    )
    assert events[-1].finish_reason == "stop"
    assert text == " alpha beta\n"


def test_context_full_gives_context(tokenizer):
    words = tokenizer.encode(" a b c d e f g h i j k l")
    model = ScriptedModel(words, tokenizer.vocab_size)
    prompt = tokenizer.encode("ab")
    events, _ = _run(model, tokenizer, prompt, KVCache(1, 1, 4, len(prompt) + 3), max_tokens=40)
    assert events[-1].finish_reason == "context"


def test_prompt_longer_than_context_is_typed(tokenizer):
    model = ScriptedModel([1], tokenizer.vocab_size)
    with pytest.raises(ContextOverflowError, match="context holds 4"):
        _run(model, tokenizer, list(range(10, 20)), KVCache(1, 1, 4, 4))


def test_prefix_reuse_prefills_only_new_tokens(tokenizer):
    model = ScriptedModel([5], tokenizer.vocab_size)
    cache = KVCache(1, 1, 4, 64)
    model.prompt_len = 0
    _, reused = prefill(model, cache, [1, 2, 3, 4])
    assert reused == 0 and model.calls == [[1, 2, 3, 4]]
    _, reused = prefill(model, cache, [1, 2, 3, 4, 7, 8])
    assert reused == 4 and model.calls[-1] == [7, 8]
    _, reused = prefill(model, cache, [1, 2, 9])  # diverges: trim back, recompute the tail
    assert reused == 2 and model.calls[-1] == [9] and cache.tokens == [1, 2, 9]
    _, reused = prefill(model, cache, [1, 2, 9])  # identical: the last token is recomputed for its logits
    assert reused == 2 and model.calls[-1] == [9]


def test_stop_matcher_holds_back_partial_matches():
    m = _StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", False)
    assert m.feed("e") == ("", False)
    assert m.feed("x more") == ("</ex more", False)
    assert m.feed("done</end> trailing") == ("done", True)
    assert m.matched == "</end>"
    assert _StopMatcher([]).feed("abc") == ("abc", False)


def test_stop_matcher_names_the_stop_that_ended_the_text():
    m = _StopMatcher(["world", "lo w", "lo"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched == "lo", "the match starting first; of those, the shortest"
    m = _StopMatcher(["x"])
    assert m.feed("abc") == ("abc", False) and m.matched is None


def test_invalid_params():
    with pytest.raises(ValueError):
        GenerationParams(max_tokens=0)
