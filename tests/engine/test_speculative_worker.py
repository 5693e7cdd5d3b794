"""Speculation through the engine worker (EngineClient): per-reply options, stats in the events, typed
errors for a draft that cannot be loaded or does not fit the target.

One spawned worker serves the module: target = the F16 copy of the SmolLM2 starter, draft = the
Q4_1 starter itself (self-speculation).
"""

from __future__ import annotations

import pytest

from engine.client import ChatEvent, EngineClient, LoadOptions, SpeculationOptions
from engine.generate import GenerationParams
from engine.speculative import DraftLoadError, IncompatibleDraftError
from tests.conftest import TEST_MODELS
from tests.engine.spec_models import float_copy

GREEDY = GenerationParams(max_tokens=32, temperature=0.0)
ASK = [{"role": "user", "content": "Write two sentences about the sea."}]
REPEAT = [{"role": "user", "content": "Repeat exactly, changing 'cat' to 'dog': The cat sat on the warm "
           "mat by the door, and the cat watched the rain fall on the quiet street all afternoon."}]


@pytest.fixture(scope="module")
def client(smollm2_path, tmp_path_factory):
    target = float_copy(smollm2_path, "F16", TEST_MODELS / "spec")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEARTH_HOME", str(tmp_path_factory.mktemp("spec-worker-home")))
        engine = EngineClient()
    engine.load_and_wait(target, LoadOptions(n_ctx=512, batch_size=128, prefix_cache_mb=0, name="f16"))
    yield engine
    engine.close()


def _run(client, messages, **kw) -> tuple[list[int], str, ChatEvent]:
    tokens, text, last = [], "", None
    for event in client.generate(messages, GREEDY, reuse=False, **kw):
        if event.token is not None:
            tokens.append(event.token)
        text += event.text
        last = event
    return tokens, text, last


def test_draft_reply_is_the_plain_reply_with_stats(client, smollm2_path):
    plain_ids, plain_text, plain = _run(client, ASK)
    assert plain.speculation == "" and plain.drafted_tokens == 0 and plain.speedup_estimate == 0.0
    # fixed k: with adaptation a loaded machine's timings may switch speculation off mid-reply, and the
    # tokens-per-pass check below is about the stats, not the policy (tested in test_speculative.py)
    options = SpeculationOptions(mode="draft", draft_model=str(smollm2_path), k=4, adaptive=False)
    for _ in range(2):  # the second reply reuses the loaded draft
        ids, text, last = _run(client, ASK, speculation=options)
        assert (ids, text) == (plain_ids, plain_text)
        assert last.finish_reason == plain.finish_reason
        assert last.speculation == "draft"
        assert last.drafted_tokens > 0 and 0 < last.accepted_tokens <= last.drafted_tokens
        assert last.acceptance_rate == pytest.approx(last.accepted_tokens / last.drafted_tokens)
        # self-speculation: most drafts are accepted, so a target pass yields several tokens
        assert last.acceptance_rate > 0.5 and last.tokens_per_pass > 1.5
        assert 0 < last.target_passes < last.generated_tokens
        assert last.speedup_estimate > 0 and last.draft_k >= 0


def test_prompt_lookup_reply_is_the_plain_reply(client):
    plain_ids, _, _ = _run(client, REPEAT)
    ids, _, last = _run(client, REPEAT, speculation=SpeculationOptions(mode="lookup", adaptive=False))
    assert ids == plain_ids
    assert last.speculation == "prompt-lookup" and last.drafted_tokens > 0 and last.accepted_tokens > 0


def test_missing_draft_is_a_typed_error_and_the_runner_stays_usable(client, tmp_path):
    with pytest.raises(DraftLoadError, match="could not be loaded"):
        _run(client, ASK, speculation=SpeculationOptions(mode="draft", draft_model=str(tmp_path / "no.gguf")))
    _, text, last = _run(client, ASK)
    assert text and last.finish_reason


def test_draft_with_another_tokenizer_is_rejected(client, gemma3_path):
    with pytest.raises(IncompatibleDraftError, match="vocabulary"):
        _run(client, ASK, speculation=SpeculationOptions(mode="draft", draft_model=str(gemma3_path)))


def test_options_are_validated():
    with pytest.raises(ValueError, match="draft_model"):
        SpeculationOptions(mode="draft")
    with pytest.raises(ValueError, match="mode"):
        SpeculationOptions(mode="medusa")
    with pytest.raises(ValueError, match="k"):
        SpeculationOptions(mode="prompt-lookup", k=0)
    assert SpeculationOptions(mode="lookup").mode == "prompt-lookup"
