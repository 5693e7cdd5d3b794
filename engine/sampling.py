"""Sampling, built not configured: make_sampler returns a callable logits -> token id.

Penalties are logits processors: callables (tokens, logits) -> logits applied before sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Sampler = Callable[[np.ndarray], int]
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


def check_sampling(temp: float, top_k: int, top_p: float, min_p: float) -> None:
    """Raise ValueError for options no sampler can honour."""
    if temp < 0:
        raise ValueError("temperature must be >= 0")
    if top_k < 0 or not 0.0 < top_p <= 1.0 or not 0.0 <= min_p < 1.0:
        raise ValueError("need top_k >= 0, 0 < top_p <= 1 and 0 <= min_p < 1")


def make_sampler(
    temp: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None
) -> Sampler:
    """Build a sampler.

    Args:
        temp: temperature; 0 means greedy (argmax).
        top_k: keep the k most likely tokens (0: off).
        top_p: keep the smallest set whose probability reaches top_p (1: off).
        min_p: drop tokens whose probability is below min_p times the top token's (0: off).
        seed: makes the random choices reproducible.

    Returns:
        sampler(logits (vocab,) float32) -> token id.
    """
    check_sampling(temp, top_k, top_p, min_p)
    if temp == 0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(seed)
    return lambda logits: draw(logits, temp, top_k, top_p, min_p, rng.random())


def filtered_distribution(
    logits: np.ndarray, temp: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """The distribution a sampler draws from: (candidate ids, their probabilities summing to 1), most
    likely first (ties by lower id).

    Applied in the order llama.cpp and HF use: temperature, top-k, then top-p and min-p on the
    renormalised probabilities of the survivors. With top-k off this sorts the whole vocabulary; `draw`
    picks from the same distribution without doing so.
    """
    ids = top_k_ids(logits, top_k)
    probs = _softmax_head(logits, ids, temp, None)
    keep = _kept(probs, top_p, min_p, complete=True)
    ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


DRAW_FIRST = 256  # candidates draw looks at first with top-k off (x16 each time they do not settle it)


def draw(logits: np.ndarray, temp: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """The token filtered_distribution's inverse CDF gives the uniform u in [0, 1) (as
    Generator.choice with that distribution): the sampler's pick, and the GPU sampler's reference.

    With top-k off, the k = DRAW_FIRST most likely tokens come first, their probabilities normalised
    over the whole vocabulary: when the top-p and min-p cuts fall among them, or with no cut when u
    falls among them, the pick is the full sort's; otherwise 16 times as many (then all) are tried. A
    128k vocabulary costs a fraction of a millisecond instead of a full sort's ~15 ms."""
    if 0 < top_k < len(logits):
        ids, probs = filtered_distribution(logits, temp, top_k, top_p, min_p)
        return _pick(ids, probs, len(ids), u)
    for ids, probs, complete in _heads(logits, temp):
        keep = _kept(probs, top_p, min_p, complete)
        if keep is not None:
            return _pick(ids, probs, keep, u)
        if top_p >= 1.0 and min_p == 0.0:  # everything is kept: the draw settles once the CDF passes u
            cdf = np.cumsum(probs)
            if u < cdf[-1]:
                return int(ids[np.searchsorted(cdf, u, side="right")])
    raise AssertionError("the whole vocabulary settles every draw")


def dense_distribution(
    logits: np.ndarray, temp: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """filtered_distribution as a dense (vocab,) float64 array (speculative decoding's p and q),
    without sorting the vocabulary when top-k is off: no cut keeps the plain softmax, and the cuts are
    settled on the most likely tokens first, as draw does."""
    n = len(logits)
    if top_k <= 0 or top_k >= n:
        if top_p >= 1.0 and min_p == 0.0:
            p = np.exp((logits.astype(np.float64) - logits.max()) / temp)
            return p / p.sum()
        ids, probs = next((i[:k], p[:k] / p[:k].sum()) for i, p, c in _heads(logits, temp)
                          if (k := _kept(p, top_p, min_p, c)) is not None)
    else:
        ids, probs = filtered_distribution(logits, temp, top_k, top_p, min_p)
    dense = np.zeros(n, np.float64)
    dense[ids] = probs
    return dense


def _heads(logits: np.ndarray, temp: float):
    """Top-k off: (ids, probs, complete) for the DRAW_FIRST most likely tokens, then 16 times as many,
    then all (complete): ids most likely first, probs normalised over the whole vocabulary."""
    n = len(logits)
    total = None  # the whole vocabulary's mass relative to the top token's
    m = min(n, DRAW_FIRST)
    while True:
        ids = top_k_ids(logits, m if m < n else 0)
        if total is None and m < n:
            # float32 exponentials (a float64 pass costs ~2 ms on 262k logits), summed in float64
            scaled = (logits - logits[ids[0]]) * np.float32(1.0 / temp)
            total = float(np.exp(scaled, dtype=np.float32).sum(dtype=np.float64))
        yield ids, _softmax_head(logits, ids, temp, total if m < n else None), m == n
        if m == n:
            return
        m = n if m * 16 >= n else m * 16


def _softmax_head(logits: np.ndarray, ids: np.ndarray, temp: float, total: float | None) -> np.ndarray:
    """Probabilities (float64) of ids (most likely first) at temp, normalised over ids when total is
    None, else over a vocabulary whose mass relative to the top token's is total."""
    scaled = logits[ids].astype(np.float64) / temp
    probs = np.exp(scaled - scaled[0])
    return probs / (probs.sum() if total is None else total)


def _kept(probs: np.ndarray, top_p: float, min_p: float, complete: bool) -> int | None:
    """How many of probs (a prefix of the sorted distribution; the whole of it when complete) the top-p
    and min-p cuts keep; None when the cuts may reach past the prefix."""
    keep = len(probs) if complete else None
    if top_p < 1.0:
        cdf = np.cumsum(probs)
        if complete or cdf[-1] >= top_p:
            # smallest prefix whose mass reaches top_p (always at least one token)
            keep = min(len(probs), int(np.searchsorted(cdf, top_p)) + 1)
    if min_p > 0.0:
        above = int(np.count_nonzero(probs >= min_p * probs[0]))
        if complete or above < len(probs):
            keep = max(1, above) if keep is None else min(keep, max(1, above))
    return keep


def _pick(ids: np.ndarray, probs: np.ndarray, keep: int, u: float) -> int:
    """Inverse CDF over the first keep candidates, renormalised (Generator.choice's arithmetic)."""
    cdf = np.cumsum(probs[:keep])
    cdf /= cdf[-1]
    return int(ids[min(keep - 1, int(np.searchsorted(cdf, u, side="right")))])


TOP_K_BLOCK = 256


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits (all of them when k is 0 or >= the vocabulary), largest first, ties
    by lower id.

    A 128k vocabulary's argpartition costs milliseconds a token, more than a GPU decode step, so the
    candidates come from block maxima first: the k-th largest maximum of TOP_K_BLOCK-logit blocks is a
    value that at least k logits reach, so every one of the k largest is at or above it, and usually
    few others are. Non-finite floors (masked vocabularies, NaN) take the plain sort."""
    n = len(logits)
    cand = np.arange(n)
    blocks = n // TOP_K_BLOCK
    if 0 < k < n and blocks >= k:
        maxima = logits[: blocks * TOP_K_BLOCK].reshape(blocks, TOP_K_BLOCK).max(axis=1)
        floor = np.partition(maxima, blocks - k)[blocks - k]
        if np.isfinite(floor):
            cand = np.flatnonzero(logits >= floor)  # ascending ids: the stable sort breaks ties by id
    order = np.argsort(-logits[cand], kind="stable")
    return cand[order[:k]] if 0 < k < n else cand[order]


def repetition_penalty(penalty: float, last_n: int = 64) -> LogitsProcessor:
    """CTRL-style penalty (as llama.cpp and HF): logits of recent tokens divided by penalty if positive,
    multiplied if negative."""
    if penalty <= 0:
        raise ValueError("repetition penalty must be > 0")

    def process(tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        recent = np.unique(np.asarray(tokens[-last_n:], dtype=np.int64)) if last_n else np.empty(0, np.int64)
        if len(recent):
            values = logits[recent]
            logits[recent] = np.where(values > 0, values / penalty, values * penalty)
        return logits

    return process
