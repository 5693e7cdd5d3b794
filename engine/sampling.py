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

    def sample(logits: np.ndarray) -> int:
        ids, probs = filtered_distribution(logits, temp, top_k, top_p, min_p)
        return int(ids[rng.choice(len(ids), p=probs)])

    return sample


def filtered_distribution(
    logits: np.ndarray, temp: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """The distribution a sampler draws from: (candidate ids, their probabilities summing to 1).

    Applied in the order llama.cpp and HF use: temperature, top-k, then top-p and min-p on the
    renormalised probabilities of the survivors.
    """
    ids = top_k_ids(logits, top_k)
    scaled = logits[ids].astype(np.float64) / temp
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    keep = len(ids)
    if top_p < 1.0:
        # smallest prefix whose mass reaches top_p (always at least one token)
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), top_p)) + 1)
    if min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= min_p * probs[0]))))
    ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


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
