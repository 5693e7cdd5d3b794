"""A re-tokenized reply is spelled with the tokens the model generated, so the KV cache is reused."""

from __future__ import annotations

import threading

import pytest

from engine.client import LoadOptions
from engine.generate import GenerationParams, generate, prefill
from engine.token_reuse import best_reuse, reuse_held_tokens
from engine.tokenizer import Tokenizer
from models.formats.gguf import open_gguf

REPLY = "Keep a small worm composter on the balcony. It turns kitchen scraps into rich soil."


def _tokenizer(path) -> Tokenizer:
    with open_gguf(path) as f:
        return Tokenizer.from_gguf_metadata(f.metadata)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return _tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma3_path):
    return _tokenizer(gemma3_path)


def odd_spelling(tok: Tokenizer, text: str) -> list[int]:
    """Tokens for `text` that spell its bytes but differ from encode(text): text cut in two, each
    half encoded alone (what a model does when it writes "compost" + "er")."""
    canonical = tok.encode(text)
    for cut in range(1, len(text)):
        ids = tok.encode(text[:cut]) + tok.encode(text[cut:])
        if ids != canonical and b"".join(tok.token_bytes(t) for t in ids) == b"".join(
            tok.token_bytes(t) for t in canonical
        ):
            return ids
    raise AssertionError(f"every cut of {text!r} re-tokenizes the same way")


def _turns(tok: Tokenizer, open_turn: str, close_turn: str):
    """(prompt ids, generated ids, the next prompt's ids) for a two-turn chat in a template's markers."""
    first = f"{open_turn}user\nHow do I compost in a flat?{close_turn}\n{open_turn}assistant\n"
    prompt = tok.encode(first)
    generated = odd_spelling(tok, REPLY)
    following = tok.encode(
        f"{first}{REPLY}{close_turn}\n{open_turn}user\nAnd in winter?{close_turn}\n{open_turn}assistant\n"
    )
    return prompt, generated, following


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
def test_a_re_tokenized_reply_takes_the_generated_tokens(model, smollm2_tokenizer, gemma_tokenizer):
    if model == "smollm2":
        tok, markers = smollm2_tokenizer, ("<|im_start|>", "<|im_end|>")
    else:
        tok, markers = gemma_tokenizer, ("<start_of_turn>", "<end_of_turn>")
    prompt, generated, following = _turns(tok, *markers)
    held = prompt + generated
    assert following[: len(held)] != held  # the case this is about: the reply re-tokenizes differently
    respelled = reuse_held_tokens(tok, following, held)
    assert respelled[: len(held)] == held
    assert tok.decode(respelled) == tok.decode(following)
    # what follows the reply (end of turn, the new user message) keeps its encoded tokens
    tail = following[-len(respelled) + len(held) :]
    assert respelled[len(held) :] == tail and tok.is_special(tail[0])


def test_nothing_changes_where_the_held_text_differs(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt, generated, following = _turns(tok, "<|im_start|>", "<|im_end|>")
    # the user edited the reply: past the common prefix no stretch spells the same bytes
    edited = tok.encode(
        "<|im_start|>user\nHow do I compost in a flat?<|im_end|>\n<|im_start|>assistant\n"
        "Buy a bokashi bin.<|im_end|>\n"
    )
    assert reuse_held_tokens(tok, edited, prompt + generated) == edited
    # a held sequence that is all prefix, or a prompt that is all prefix, is left alone
    assert reuse_held_tokens(tok, following, following[:10]) == following
    assert reuse_held_tokens(tok, following[:10], following) == following[:10]
    assert reuse_held_tokens(tok, following, []) == following


def test_the_held_stretch_ends_where_both_spellings_share_a_boundary(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt, generated, _ = _turns(tok, "<|im_start|>", "<|im_end|>")
    # the template stored the reply cut short inside its second sentence
    cut = REPLY.index(" into")
    text = "<|im_start|>user\nHow do I compost in a flat?<|im_end|>\n<|im_start|>assistant\n" + REPLY[:cut]
    ids = tok.encode(text + " compost, you said?<|im_end|>\n")
    respelled = reuse_held_tokens(tok, ids, prompt + generated)
    assert tok.decode(respelled) == tok.decode(ids)
    shared = next(i for i, (a, b) in enumerate(zip(respelled, prompt + generated)) if a != b)
    assert shared > len(tok.encode(text[: text.index("Keep")]))  # the generated "compost" "er" are kept
    assert respelled != ids


def test_literal_text_never_stands_in_for_a_special_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    end = tok.encode("<|im_end|>")
    assert len(end) == 1 and tok.is_special(end[0])
    # the model wrote the marker's text with ordinary tokens; the next prompt has the real marker
    literal = tok.encode("<|im_") + tok.encode("end|>")
    assert not any(tok.is_special(t) for t in literal)
    prompt = tok.encode("<|im_start|>assistant\nSure")
    following = prompt + end + tok.encode("\n<|im_start|>user\nok<|im_end|>")
    respelled = reuse_held_tokens(tok, following, prompt + literal)
    assert respelled == following


def test_best_reuse_picks_the_held_sequence_that_covers_most(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt, generated, following = _turns(tok, "<|im_start|>", "<|im_end|>")
    other_chat = tok.encode("<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n")
    picked = best_reuse(tok, following, [other_chat, prompt + generated])
    assert picked[: len(prompt + generated)] == prompt + generated
    assert best_reuse(tok, following, [other_chat]) == following
    assert best_reuse(tok, following, []) == following


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from engine.worker import ChatRunner

    return ChatRunner.load(smollm2_path, LoadOptions(n_ctx=512, batch_size=64, prefix_cache_mb=64))


def _chat(runner, messages, max_tokens=8):
    tokens, events = [], list(runner.chat(messages, GenerationParams(max_tokens=max_tokens, temperature=0.0)))
    tokens = [e.token for e in events if e.token is not None]
    return tokens, events[-1]


def test_a_chat_turn_reuses_a_reply_that_re_tokenizes_differently(runner):
    tok, model = runner.lm.tokenizer, runner.lm.model
    messages = [{"role": "user", "content": "How do I compost in a flat?"}]
    held = runner.encode(messages) + odd_spelling(tok, REPLY)
    runner.cache.trim(runner.cache.offset)
    prefill(model, runner.cache, held)  # the cache as a turn that generated those tokens leaves it
    messages += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "And in winter?"}]
    canonical = runner.encode(messages)
    assert canonical[: len(held)] != held

    tokens, last = _chat(runner, messages)
    assert last.cached_tokens == len(held)
    assert last.to_prefill == last.prompt_tokens - len(held) < len(canonical) - len(held) + 4
    # the reply is the one the respelled prompt gives from an empty cache
    respelled = reuse_held_tokens(tok, canonical, held)
    assert last.prompt_tokens == len(respelled)
    cold = model.new_cache(512, runner.cache.dtype)
    greedy = GenerationParams(max_tokens=8, temperature=0.0)
    expected = [e.token for e in generate(model, tok, respelled, cold, greedy)]
    assert tokens == expected

    # another chat takes the live cache; coming back, the prefix store gives the held spelling back
    _chat(runner, [{"role": "user", "content": "What is the boiling point of water?"}])
    _, back = _chat(runner, messages)
    assert back.restored_tokens > 0 and back.cached_tokens >= len(held)


def test_the_server_reuses_a_reply_that_re_tokenizes_differently(runner):
    from engine.server.scheduler import Engine, SeqParams

    tok, model = runner.lm.tokenizer, runner.lm.model
    messages = [{"role": "user", "content": "How do I compost in a flat?"}]
    held = runner.encode(messages) + odd_spelling(tok, REPLY)
    messages += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "And in winter?"}]
    canonical = runner.encode(messages)
    engine = Engine(model, tok, n_ctx=512, max_seqs=2, prefill_chunk=64, prefix_cache_bytes=32 << 20)
    cache = model.new_cache(512)
    prefill(model, cache, held)
    engine.store.insert(cache)  # what an earlier request of this conversation left

    def ask(respell: bool):
        deltas, done = [], threading.Event()

        def emit(delta):
            deltas.append(delta)
            if delta.finish_reason or delta.error:
                done.set()

        params = SeqParams(prompt_ids=list(canonical), max_tokens=4, temperature=0.0, respell=respell)
        engine.submit(params, emit)
        assert done.wait(120) and deltas[-1].error is None
        return deltas[-1]

    engine.start()
    try:
        respelled = ask(True)  # first: a request leaves its cache to the next
        plain = ask(False)
    finally:
        engine.stop()
    parted = next(i for i, (a, b) in enumerate(zip(held, canonical)) if a != b)
    assert plain.cached_tokens == parted and plain.prompt_tokens == len(canonical)
    assert respelled.cached_tokens == len(held)
    assert respelled.prompt_tokens == len(reuse_held_tokens(tok, canonical, held))
