import numpy as np
import pytest

from engine.sampling import filtered_distribution, make_sampler, repetition_penalty


def _logits():
    return np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))


def test_greedy_is_argmax():
    sample = make_sampler(0.0)
    logits = np.array([0.1, 3.0, -1.0, 2.9], dtype=np.float32)
    assert sample(logits) == 1


def test_seed_reproducible_and_varies():
    logits = np.zeros(1000, dtype=np.float32)
    a = [make_sampler(1.0, seed=7)(logits) for _ in range(1)]
    s1, s2 = make_sampler(1.0, seed=7), make_sampler(1.0, seed=7)
    draws1 = [s1(logits) for _ in range(50)]
    draws2 = [s2(logits) for _ in range(50)]
    assert draws1 == draws2
    assert len(set(draws1)) > 20
    assert a[0] == draws1[0]


def test_top_k_top_p_min_p():
    ids, p = filtered_distribution(_logits(), 1.0, top_k=2)
    assert list(ids) == [0, 1]
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7], rtol=1e-6)
    ids, p = filtered_distribution(_logits(), 1.0, top_p=0.8)
    assert list(ids) == [0, 1, 2]  # 0.5 + 0.2 < 0.8 <= 0.85
    ids, p = filtered_distribution(_logits(), 1.0, min_p=0.25)
    assert list(ids) == [0, 1, 2]  # 0.1 < 0.25 * 0.5
    ids, _ = filtered_distribution(_logits(), 1.0, top_p=0.01)
    assert list(ids) == [0]


def test_temperature_sharpens_and_flattens():
    _, cold = filtered_distribution(_logits(), 0.5)
    _, hot = filtered_distribution(_logits(), 2.0)
    assert cold[0] > 0.5 > hot[0]
    np.testing.assert_allclose(cold.sum(), 1.0)


def test_sampling_frequencies_follow_distribution():
    sample = make_sampler(1.0, seed=1)
    draws = np.bincount([sample(_logits()) for _ in range(20000)], minlength=5) / 20000
    np.testing.assert_allclose(draws, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.015)


def test_repetition_penalty():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = repetition_penalty(2.0)([0, 1, 1], logits.copy())
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])


@pytest.mark.parametrize("kwargs", [{"temp": -1}, {"top_p": 0}, {"top_k": -1}, {"min_p": 1.0}])
def test_invalid_options(kwargs):
    with pytest.raises(ValueError):
        make_sampler(**kwargs)


def _top_k_reference(logits, k):
    order = np.lexsort((np.arange(len(logits)), -logits.astype(np.float64)))  # value desc, then id
    return order[:k] if 0 < k < len(logits) else order


@pytest.mark.parametrize("n", [5, 300, 1000, 128256])
@pytest.mark.parametrize("k", [0, 1, 3, 40, 256])
def test_top_k_ids_match_a_full_sort(n, k):
    """The block-maxima shortcut picks what a full sort picks: random logits, ties (quantized values, so
    many logits share the k-th value), a masked vocabulary (-inf), peaked and flat distributions."""
    from engine.sampling import top_k_ids

    rng = np.random.default_rng(n + k)
    cases = [
        rng.standard_normal(n).astype(np.float32) * 3,
        np.round(rng.standard_normal(n) * 2).astype(np.float32),  # heavy ties
        np.zeros(n, np.float32),
        np.where(rng.random(n) < 0.9, -np.inf, rng.standard_normal(n)).astype(np.float32),  # masked
        np.concatenate([np.full(n - n // 3, -5.0), rng.standard_normal(n // 3) + 10]).astype(np.float32),
    ]
    for logits in cases:
        np.testing.assert_array_equal(top_k_ids(logits, k), _top_k_reference(logits, k))


def test_sampling_a_large_vocabulary_follows_its_top_k():
    """With a 128k vocabulary (the shortcut's case) the draws stay within the k most likely tokens and
    follow their probabilities."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(128256).astype(np.float32)
    best = np.argsort(-logits)[:4]
    logits[best] = [12.0, 11.0, 10.5, 10.0]
    sample = make_sampler(1.0, top_k=4, seed=2)
    draws = np.array([sample(logits) for _ in range(4000)])
    assert set(draws.tolist()) <= set(best.tolist())
    p = np.exp([12.0, 11.0, 10.5, 10.0] - np.float64(12.0))
    want = p / p.sum()
    got = np.array([(draws == b).mean() for b in best])
    np.testing.assert_allclose(got, want, atol=0.03)


@pytest.mark.parametrize("n", [7, 300, 5000, 128256])
def test_draw_picks_what_the_full_distribution_picks(n):
    """engine.sampling.draw (top-k off: the 256 most likely first, more only when a cut or the draw
    reaches past them) picks, for each uniform u, the token the inverse CDF of filtered_distribution
    (a full sort) gives u: peaked, flat and heavily tied logits, every cut alone and together, and
    distributions whose kept set is far past the first candidates."""
    from engine.sampling import draw

    rng = np.random.default_rng(n)
    for scale in (0.3, 3.0, 8.0):
        logits = (rng.standard_normal(n) * scale).astype(np.float32)
        logits[: n // 4] = np.round(logits[: n // 4])  # ties
        for temp, k, top_p, min_p in [
            (0.8, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.05), (1.5, 0, 0.5, 0.0),
            (0.8, 40, 0.9, 0.05), (1.0, 0, 0.999, 0.01), (3.0, 0, 1.0, 0.0),
        ]:
            ids, probs = filtered_distribution(logits, temp, k, top_p, min_p)
            cdf = np.cumsum(probs)
            for u in rng.random(12):
                want = int(ids[np.searchsorted(cdf / cdf[-1], u, side="right")])
                got = draw(logits, temp, k, top_p, min_p, float(u))
                assert got == want, (scale, temp, k, top_p, min_p, u)


def test_sampler_draws_with_one_uniform_a_token():
    """make_sampler's picks are draw's with the seeded generator's uniforms, one a token (the server and
    the GPU sampler draw with the same stream)."""
    from engine.sampling import draw

    logits = np.random.default_rng(5).standard_normal(1000).astype(np.float32) * 2
    sample, rng = make_sampler(0.9, 0, 0.95, 0.0, seed=4), np.random.default_rng(4)
    want = [draw(logits, 0.9, 0, 0.95, 0.0, rng.random()) for _ in range(20)]
    assert [sample(logits) for _ in range(20)] == want


@pytest.mark.parametrize("n", [7, 5000, 128256])
def test_dense_distribution_is_the_filtered_one_scattered(n):
    """dense_distribution (speculative decoding's p and q; no vocabulary sort with top-k off) holds
    filtered_distribution's probabilities at its ids and zeros elsewhere."""
    from engine.sampling import dense_distribution

    rng = np.random.default_rng(n)
    for scale in (0.3, 3.0, 8.0):
        logits = (rng.standard_normal(n) * scale).astype(np.float32)
        logits[: n // 4] = np.round(logits[: n // 4])  # ties
        for args in [(0.8, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.05), (0.8, 40, 0.9, 0.05)]:
            ids, probs = filtered_distribution(logits, *args)
            want = np.zeros(n)
            want[ids] = probs
            got = dense_distribution(logits, *args)
            assert np.array_equal(np.flatnonzero(got), np.flatnonzero(want)), (scale, args)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
