"""Draft-only fast path (engine.backends.cpu.draft): two-level int8 activations, repacked 16-row weights,
the fused Llama step; and that speculation with it stays exact and switches itself off when slow."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from engine.backends.cpu import draft as D
from engine.generate import GenerationParams, generate
from engine.loader import load_model
from engine.speculative import DraftModel, speculative_generate
from engine.weights import Weight
from tests.engine.tiny_models import TinySpec, write_tiny_gguf

T = gguf.GGMLQuantizationType


def _weight(rows: int, cols: int, qtype: int, seed: int = 0) -> tuple[Weight, np.ndarray]:
    w = np.random.default_rng(seed).normal(0, 0.2, (rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    return Weight(int(qtype), np.ascontiguousarray(raw), rows, cols), ref


def test_two_level_activations_are_int16_grade():
    x = np.random.default_rng(1).normal(0, 3, 256).astype(np.float32)
    x[40:64] = 0  # a block partly zero, and one all zero below
    x[224:256] = 0
    xq, xd, xs, xz = np.empty(512, np.int8), *(np.empty(8, np.float32) for _ in range(3))
    D.quantize_act8(x, xq, xd, xs, xz)
    q = xq.reshape(8, 2, 32).astype(np.int64)
    back = ((254 * q[:, 0] + q[:, 1]) * xd[:, None]).reshape(-1)
    amax = np.abs(x.reshape(8, 32)).max(axis=1).repeat(32)
    assert np.all(np.abs(back - x) <= amax / 64000 + 1e-12)
    np.testing.assert_allclose(xs, x.reshape(8, 32).sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xz, back.reshape(8, 32).sum(axis=1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("rows", [48, 37])  # 37: padded to 48 rows, the padding never read back
def test_repacked_matvec_matches_numpy(qtype, rows):
    cols = 96
    w, ref = _weight(rows, cols, qtype)
    x = np.random.default_rng(2).normal(0, 1, (3, cols)).astype(np.float32)
    wbuf, sbuf, bits = D.repack(w)
    assert bits == (8 if qtype == T.Q8_0 else 4)
    out = np.full((3, -(-rows // 16) * 16), np.nan, np.float32)
    D.matvec_i8(out, wbuf, sbuf, bits, rows, cols, x)
    want = x.astype(np.float64) @ ref.T
    # activations ~1.5e-5 of each block's max, scales rounded to float16 (Q4_0/Q8_0's are float16 already)
    tol = 2e-3 * np.abs(ref).sum(axis=1).max() * np.abs(x).max()
    np.testing.assert_allclose(out[:, :rows], want, atol=tol)
    assert np.all(out[:, rows:] == 0)


def test_q8_0_requantized_to_4_bits():
    w, ref = _weight(32, 64, T.Q8_0)
    x = np.random.default_rng(3).normal(0, 1, (1, 64)).astype(np.float32)
    wbuf, sbuf, bits = D.repack(w, 4)
    assert bits == 4 and wbuf.size == 2 * 2 * 256  # 2 groups of 16 rows x 2 blocks x 256 bytes
    out = np.empty((1, 32), np.float32)
    D.matvec_i8(out, wbuf, sbuf, bits, 32, 64, x)
    want = x.astype(np.float64) @ ref.T
    # 4-bit min/max grid over blocks of ~N(0, 0.2): each weight within (max - min) / 30 ~ 0.04
    assert np.abs(out - want).max() < 0.06 * np.abs(x).sum()
    assert np.corrcoef(out[0], want[0])[0, 1] > 0.99
    with pytest.raises(ValueError):
        D.repack(_weight(16, 32, T.Q4_1)[0], 8)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft-fast")
    write_tiny_gguf(d / "target.gguf", TinySpec(seed=0))
    write_tiny_gguf(d / "draft.gguf", TinySpec(seed=0, matrix_type=T.Q4_1))
    write_tiny_gguf(d / "draft_f32.gguf", TinySpec(seed=1, layers=1))
    return load_model(d / "target.gguf"), load_model(d / "draft.gguf"), load_model(d / "draft_f32.gguf")


def test_fused_step_follows_the_exact_forward(tiny_q4):
    _, lm, _ = tiny_q4
    m = lm.model
    fast = D.DraftForward.build(m)
    assert fast is not None
    prompt = lm.tokenizer.encode("once upon a time there")
    c_exact, c_fast = m.new_cache(64), m.new_cache(64)
    m.forward(prompt[:-1], c_exact)
    m.forward(prompt[:-1], c_fast)
    steps = [[prompt[-1]], [5], [70, 71], [9], [100, 101, 102, 103]]
    for tokens in steps:
        want = m.forward(tokens, c_exact, all_logits=True)
        got = fast.forward(tokens, c_fast)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
        assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
    assert c_fast.tokens == c_exact.tokens
    # rollback is the cache's trim, as for the exact forward
    c_fast.trim(3)
    c_exact.trim(3)
    np.testing.assert_allclose(fast.forward([7], c_fast), m.forward([7], c_exact), atol=2e-3 * 40)
    with pytest.raises(ValueError):
        fast.forward(list(range(D.MAX_TOKENS + 1)), c_fast)


def test_models_the_fast_path_does_not_cover(tiny_q4):
    _, _, f32 = tiny_q4
    assert D.DraftForward.build(f32.model) is None  # F32 matrices: the exact forward
    assert DraftModel(f32.model, f32.tokenizer, 32).fast is None
    _, q4, _ = tiny_q4
    assert DraftModel(q4.model, q4.tokenizer, 32, dtype=np.float16).fast is None  # float16 cache
    assert DraftModel(q4.model, q4.tokenizer, 32, fast=False).fast is None


def test_greedy_identical_with_the_fast_draft(tiny_q4):
    target, q4, _ = tiny_q4
    m, tok = target.model, target.tokenizer
    params = GenerationParams(max_tokens=40, temperature=0)
    prompt = tok.encode("once upon a time")
    plain = [e.token for e in generate(m, tok, prompt, m.new_cache(128), params)]
    drafter = DraftModel(q4.model, q4.tokenizer, 128)
    assert drafter.fast is not None
    spec = list(speculative_generate(m, tok, prompt, m.new_cache(128), params, drafter, k=4, adaptive=False))
    assert [e.token for e in spec] == plain
    # the draft is the target quantized: most drafts are accepted, so the fast path really drafted
    assert spec[-1].accepted_tokens > 0.5 * spec[-1].drafted_tokens > 0


class _SlowDraft(DraftModel):
    """A draft made artificially slow: every proposal sleeps, so speculation costs more than it gains."""

    def propose(self, *args, **kwargs):
        time.sleep(0.05)
        return super().propose(*args, **kwargs)


def test_adaptive_speculation_switches_itself_off_for_a_slow_draft(tiny_q4):
    target, q4, _ = tiny_q4
    m, tok = target.model, target.tokenizer
    params = GenerationParams(max_tokens=40, temperature=0)
    prompt = tok.encode("once upon a time")
    plain = [e.token for e in generate(m, tok, prompt, m.new_cache(128), params)]
    events = list(speculative_generate(m, tok, prompt, m.new_cache(128), params,
                                       _SlowDraft(q4.model, q4.tokenizer, 128), k=4, adaptive=True))
    assert [e.token for e in events] == plain
    assert len(events) > 12, "the reply must run past the first rounds for the test to mean anything"
    assert events[-1].draft_k == 0  # switched off
    # off after the first measured rounds, probed again only every 24 plain tokens: mostly plain decoding
    assert events[-1].drafted_tokens <= len(events) / 2
    assert events[-1].target_passes > len(events) / 2
