"""Gemma-3-270M Q4_K_M (base) against golden outputs of Hugging Face transformers (tests/goldens/).

transformers dequantizes the GGUF to float32 and runs its own Gemma 3 implementation; these files
are made by scripts/make_goldens.py (see tests/goldens/README.md). The prompts are short (< 512
tokens), so the sliding window is checked by tests/engine/test_gemma3.py, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.loader import load_model

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
# Logits reach ~32. Prefill runs in float32 on dequantized weights, like the reference, so only
# summation order and float32 rounding differ (measured 3e-5 with gguf's own dequantizer).
LOGIT_ATOL = 0.02
# Decode quantizes activations for the matvec kernels; a greedy step may pick differently from the
# reference only where the reference's own top-1/top-2 margin is below this.
GREEDY_TIE = 0.01


@pytest.fixture(scope="module")
def lm(gemma3_path):
    return load_model(gemma3_path)


def _golden(name: str) -> dict:
    return json.loads((GOLDENS / name).read_text())


def test_is_a_base_model_with_its_own_tokens(lm):
    assert lm.template is None  # no chat template in the file: `run --chat` uses the fallback
    record = _golden("gemma3_logits.json")["prompts"][0]
    assert lm.tokenizer.encode(record["text"], add_special=True) == record["ids"]
    greedy = _golden("gemma3_greedy.json")
    assert lm.tokenizer.encode(greedy["prompt_text"], add_special=True) == greedy["prompt_ids"]


def test_logits_at_every_position(lm):
    record = _golden("gemma3_logits.json")["prompts"][0]
    ids = record["ids"]
    logits = lm.model.forward(ids, lm.model.new_cache(len(ids)), all_logits=True).astype(np.float64)
    top_ids = np.array(record["top_ids"])
    top_logits = np.array(record["top_logits"])
    err = np.abs(np.take_along_axis(logits, top_ids, axis=1) - top_logits)
    assert err.max() < LOGIT_ATOL, f"max |logit diff| {err.max():.4f} at position {err.max(1).argmax()}"
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.testing.assert_allclose(lse, record["logsumexp"], atol=LOGIT_ATOL)
    # top-1 must agree wherever the reference is not itself a near-tie
    clear = top_logits[:, 0] - top_logits[:, 1] > LOGIT_ATOL
    assert clear.sum() > len(ids) * 0.9
    assert np.array_equal(logits.argmax(1)[clear], top_ids[clear, 0]), "top-1 differs"


def test_greedy_32_tokens_through_the_decode_path(lm):
    """32 greedy tokens, one decode step at a time, identical up to the first reference near-tie."""
    record = _golden("gemma3_greedy.json")
    expected = record["new_ids_ignore_eos"]
    margins = record["top1_top2_margin_ignore_eos"]
    cache = lm.model.new_cache(128)
    logits = lm.model.forward(record["prompt_ids"], cache)
    got = []
    for _ in range(len(expected)):
        token = int(np.argmax(logits[-1]))
        got.append(token)
        logits = lm.model.forward([token], cache)
    first_diff = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if first_diff is not None:
        assert margins[first_diff] < GREEDY_TIE, (
            f"greedy diverges at step {first_diff} where the reference margin is {margins[first_diff]}: "
            f"got {got}, expected {expected}"
        )
    assert len(got) == 32


def test_fallback_chat_prompt_uses_gemma_turn_tokens(lm):
    from engine.templates import fallback_template

    template = fallback_template("gemma3", bos_token=lm.tokenizer.bos_token)
    text = template.render([{"role": "user", "content": "Hello"}])
    ids = lm.tokenizer.encode(text, add_special=False)
    start, end = lm.tokenizer.encode("<start_of_turn>"), lm.tokenizer.encode("<end_of_turn>")
    assert len(start) == 1 and len(end) == 1  # control tokens, matched whole
    assert ids[0] == lm.tokenizer.bos_id and ids[1] == start[0] and end[0] in ids
    assert end[0] in lm.tokenizer.eot_ids  # a chat reply stops at <end_of_turn>
