"""Speculative decoding: the accept/reject rule, distribution exactness, greedy identity, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ContextOverflowError
from engine.generate import GenerationParams, generate
from engine.loader import load_model
from engine.lookup import PromptLookup
from engine.sampling import filtered_distribution
from engine.speculative import (
    DraftModel,
    IncompatibleDraftError,
    SpeculativeEvent,
    accept_or_resample,
    speculative_generate,
)
from tests.engine.tiny_models import TinySpec, write_tiny_gguf

# chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 8: 26.12, 11: 31.26, 15: 37.70}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_accept_rule_emits_the_target_distribution():
    # Draft token ~ q, then the rule: the emitted token must be distributed as p (not q).
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q = np.array([0.1, 0.4, 0.1, 0.1, 0.1, 0.2])  # q puts mass where p has none
    counts = np.zeros(6)
    for _ in range(20000):
        d = int(rng.choice(6, p=q))
        _, token = accept_or_resample(p, q, d, int(np.argmax(p)), rng)
        counts[token] += 1
    assert chi_square(counts, p) < CHI2_999[5 - 1]


def test_accept_rule_with_a_deterministic_proposal():
    # prompt lookup: q is one-hot on the proposed token
    rng = np.random.default_rng(1)
    p = np.array([0.3, 0.6, 0.1])
    counts = np.zeros(3)
    for _ in range(12000):
        _, token = accept_or_resample(p, None, 1, 1, rng)
        counts[token] += 1
    assert chi_square(counts, p) < CHI2_999[2]


def test_accept_rule_greedy():
    rng = np.random.default_rng(0)
    assert accept_or_resample(None, None, 5, 5, rng) == (True, 5)
    assert accept_or_resample(None, None, 4, 5, rng) == (False, 5)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random target and a draft of the same vocabulary with different weights."""
    d = tmp_path_factory.mktemp("spec-tiny")
    write_tiny_gguf(d / "target.gguf", TinySpec(seed=0))
    write_tiny_gguf(d / "draft.gguf", TinySpec(seed=1, layers=1))
    return load_model(d / "target.gguf"), load_model(d / "draft.gguf")


def test_sampled_tokens_follow_the_target_distribution(tiny_pair):
    # The first two reply tokens: the first from the prefill, the second decided by the accept rule
    # over a draft proposal. Their joint distribution must be the target's own processed one.
    target, draft = tiny_pair
    params = GenerationParams(max_tokens=3, temperature=0.8, top_k=3, top_p=0.97, min_p=0.0, seed=7)
    prompt = target.tokenizer.encode("the cat")
    m = target.model
    cache = m.new_cache(64)
    first = m.forward(prompt, cache)[-1].copy()
    ids1, p1 = filtered_distribution(first, 0.8, 3, 0.97, 0.0)
    joint = {}
    for a, pa in zip(ids1, p1):
        cache.trim(cache.offset - len(prompt))
        row = m.forward([int(a)], cache)[-1].copy()
        ids2, p2 = filtered_distribution(row, 0.8, 3, 0.97, 0.0)
        for b, pb in zip(ids2, p2):
            joint[(int(a), int(b))] = pa * pb
    cells = sorted(joint)
    counts = np.zeros(len(cells))
    tcache = m.new_cache(64)
    proposer = DraftModel(draft.model, draft.tokenizer, 64)
    n_drafted = n_rejected = 0
    for i in range(1500):
        params.seed = i
        events = list(speculative_generate(m, target.tokenizer, prompt, tcache, params, proposer, k=2,
                                           adaptive=False))
        pair = (events[0].token, events[1].token)
        assert pair in joint, f"sampled {pair}, outside the target's top-k/top-p support"
        counts[cells.index(pair)] += 1
        n_drafted += events[-1].drafted_tokens
        n_rejected += events[-1].drafted_tokens - events[-1].accepted_tokens
    assert n_drafted and n_rejected > 50, "the draft must disagree often for the test to mean anything"
    df = len(cells) - 1
    critical = CHI2_999.get(df) or (df + 3.1 * np.sqrt(2 * df))
    assert chi_square(counts, np.array([joint[c] for c in cells])) < critical


def test_greedy_identical_on_tiny_models_with_small_draft_context(tiny_pair):
    # The draft's context (24) runs out mid-reply: speculation switches off, output unchanged.
    target, draft = tiny_pair
    params = GenerationParams(max_tokens=40, temperature=0)
    prompt = target.tokenizer.encode("once upon a time")
    m, tok = target.model, target.tokenizer
    plain = [e.token for e in generate(m, tok, prompt, m.new_cache(128), params)]
    spec = list(speculative_generate(m, tok, prompt, m.new_cache(128), params,
                                     DraftModel(draft.model, draft.tokenizer, 24), k=3))
    assert [e.token for e in spec] == plain
    assert isinstance(spec[-1], SpeculativeEvent) and spec[-1].drafted_tokens > 0


def test_incompatible_draft_is_a_typed_error(tiny_pair, smollm2_path):
    target, _ = tiny_pair
    other = load_model(smollm2_path)  # 49152 tokens vs the tiny 258
    prompt = target.tokenizer.encode("hi")
    with pytest.raises(IncompatibleDraftError, match="vocabulary"):
        next(speculative_generate(target.model, target.tokenizer, prompt, target.model.new_cache(32),
                                  GenerationParams(temperature=0),
                                  DraftModel(other.model, other.tokenizer, 32)))


def test_prompt_longer_than_context(tiny_pair):
    target, draft = tiny_pair
    prompt = target.tokenizer.encode("x" * 40)
    with pytest.raises(ContextOverflowError):
        next(speculative_generate(target.model, target.tokenizer, prompt, target.model.new_cache(16),
                                  GenerationParams(temperature=0), PromptLookup()))


def test_rejects_bad_k(tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(ValueError):
        next(speculative_generate(target.model, target.tokenizer, [1, 2], target.model.new_cache(16),
                                  GenerationParams(temperature=0), PromptLookup(), k=0))


def _rounds(policy, n: int, t_draft: float, t_plain: float, t_extra: float, accept: float = 1.0) -> list[int]:
    """Run n rounds of the adaptive policy against a machine with these per-token timings; the ks chosen."""
    ks = []
    for _ in range(n):
        k = policy.next_k(8)
        ks.append(k)
        if k:
            policy.note_round(k, round(accept * k), k * t_draft, t_plain + k * t_extra)
        else:
            policy.note_round(0, 0, 0.0, t_plain)
    return ks


def test_adaptive_k_recovers_from_a_cold_first_round():
    from engine.speculative import _Adaptive

    policy = _Adaptive(k_max=8, k_start=4, adaptive=True)
    # the first round pays the draft's warm-up: 30 ms a drafted token against a 12 ms plain pass
    policy.note_round(policy.next_k(8), 4, 4 * 0.030, 0.019)
    assert policy.t_plain is None  # a verify pass is no plain pass
    ks = _rounds(policy, 12, t_draft=0.0045, t_plain=0.012, t_extra=0.0013)
    assert ks[0] == 0  # the plain pass that times t_plain
    assert ks[-4:] == [8, 8, 8, 8]
    assert policy.speedup(8) > 1.5
    assert policy.t_draft < 0.005  # the warm-up time is gone, not averaged in


def test_adaptive_k_times_a_plain_pass_now_and_then():
    from engine.speculative import _Adaptive

    policy = _Adaptive(k_max=8, k_start=4, adaptive=True, plain_every=10)
    ks = _rounds(policy, 60, t_draft=0.0045, t_plain=0.012, t_extra=0.0013)
    plain = [i for i, k in enumerate(ks) if k == 0]
    assert plain[0] == 1 and 4 <= len(plain) <= 6
    assert all(b - a == 11 for a, b in zip(plain, plain[1:]))


def test_adaptive_k_probes_with_real_rounds_while_off():
    from engine.speculative import _Adaptive

    policy = _Adaptive(k_max=8, k_start=4, adaptive=True, probe_every=5)
    ks = _rounds(policy, 10, t_draft=0.050, t_plain=0.012, t_extra=0.0013)  # a draft slower than the target
    assert ks[-1] == 0 and policy.k == 0
    # the machine changes (the draft got its cores back): the next probe measures it and speculation resumes
    ks = _rounds(policy, 14, t_draft=0.0045, t_plain=0.012, t_extra=0.0013)
    assert 0 < ks.index(next(k for k in ks if k)) <= 5
    assert ks[-3:] == [8, 8, 8]
