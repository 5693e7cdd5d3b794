"""SmolLM2-135M-Instruct Q4_1 against golden outputs of Hugging Face transformers (tests/goldens/).

transformers dequantizes the GGUF to float32 and runs its own Llama implementation; these files
are made by scripts/make_goldens.py (see tests/goldens/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.generate import GenerationParams, generate
from engine.loader import load_model

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
# Logits are ~20-40 in magnitude. Prefill runs in float32 on dequantized weights, like the
# reference, so the only differences are summation order and float32 rounding.
LOGIT_ATOL = 0.02


@pytest.fixture(scope="module")
def lm(smollm2_path):
    return load_model(smollm2_path)


def _golden(name: str) -> dict:
    return json.loads((GOLDENS / name).read_text())


@pytest.mark.parametrize("index", [0, 1])
def test_logits_at_every_position(lm, index):
    record = _golden("smollm2_logits.json")["prompts"][index]
    ids = record["ids"]
    logits = lm.model.forward(ids, lm.model.new_cache(len(ids)), all_logits=True).astype(np.float64)
    top_ids = np.array(record["top_ids"])
    top_logits = np.array(record["top_logits"])
    ours_at_ref_top = np.take_along_axis(logits, top_ids, axis=1)
    err = np.abs(ours_at_ref_top - top_logits)
    assert err.max() < LOGIT_ATOL, f"max |logit diff| {err.max():.4f} at position {err.max(1).argmax()}"
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.testing.assert_allclose(lse, record["logsumexp"], atol=LOGIT_ATOL)
    assert np.array_equal(logits.argmax(1), top_ids[:, 0]), "top-1 differs"


def test_chat_template_and_tokens_match(lm):
    record = _golden("smollm2_greedy.json")
    text = lm.template.render([{"role": "user", "content": "What is the capital of France?"}])
    assert text == record["prompt_text"]
    assert lm.tokenizer.encode(text) == record["prompt_ids"]


def test_greedy_reply(lm):
    record = _golden("smollm2_greedy.json")
    cache = lm.model.new_cache(256)
    events = list(
        generate(
            lm.model,
            lm.tokenizer,
            record["prompt_ids"],
            cache,
            GenerationParams(max_tokens=32, temperature=0),
        )
    )
    assert [e.token for e in events] == record["new_ids"]
    assert "".join(e.text for e in events) == record["text_skip_special"]
    assert events[-1].finish_reason == "stop"


def test_greedy_32_tokens_through_the_decode_path(lm):
    """32 tokens past EOS, one decode step (quantized-activation matvec kernels) at a time."""
    record = _golden("smollm2_greedy.json")
    cache = lm.model.new_cache(256)
    logits = lm.model.forward(record["prompt_ids"], cache)
    got = []
    for _ in range(32):
        token = int(np.argmax(logits[-1]))
        got.append(token)
        logits = lm.model.forward([token], cache)
    assert got == record["new_ids_ignore_eos"]
