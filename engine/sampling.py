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
    scaled = logits.astype(np.float64) / temp
    # top-k first: sorting 40 candidates is cheap, sorting a 50k vocabulary per token is not
    ids = np.argpartition(-scaled, top_k - 1)[:top_k] if 0 < top_k < len(scaled) else np.arange(len(scaled))
    ids = ids[np.argsort(-scaled[ids], kind="stable")]
    probs = np.exp(scaled[ids] - scaled[ids[0]])
    probs /= probs.sum()
    keep = len(ids)
    if top_p < 1.0:
        # smallest prefix whose mass reaches top_p (always at least one token)
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), top_p)) + 1)
    if min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= min_p * probs[0]))))
    ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


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
