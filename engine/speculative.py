"""Speculative decoding: a draft proposes k tokens, the target scores all k+1 positions in one pass.

`speculative_generate` is a sibling of engine.generate.generate with the same events (plus speculation
stats). The draft is a small model sharing the target's vocabulary (`DraftModel`) or n-gram lookup in
the conversation itself (engine.lookup.PromptLookup). The target's verify pass runs
`model.forward(tokens, cache, all_logits=True)` over k+1 tokens; its linears use the small-batch
kernels (engine.backends.cpu.smalln), which read every weight row once for all k+1 tokens, so a pass
costs about one decode step. Rejected positions are rolled back with `KVCache.trim` on both caches.

Exactness: every drafted token is accepted or replaced by `accept_or_resample`, the standard rule on
the target's and draft's *processed* distributions (temperature, top-k, top-p, min-p, penalties), so
the output follows the target's distribution; at temperature 0 it is the target's greedy output.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from engine.backends.cpu.draft import MAX_TOKENS as MAX_FAST_TOKENS
from engine.backends.cpu.draft import DraftForward
from engine.errors import ContextOverflowError, HearthError
from engine.generate import GenerationEvent, GenerationParams, _StopMatcher, generate, prefill
from engine.harmony import reply_decoder
from engine.kv_cache import KVCache
from engine.memory import peak_rss_mb
from engine.sampling import dense_distribution, repetition_penalty
from engine.tokenizer import Tokenizer


class IncompatibleDraftError(HearthError):
    """The draft model cannot propose tokens for the target: a different vocabulary or special tokens."""


class DraftLoadError(HearthError):
    """The draft model asked for could not be found or loaded (the reason is in the message).

    Attributes:
        draft: the draft model spec (path or starter name) as given.
        reason_kind: the class name of the underlying error (ModelNotFoundError, ModelFormatError, ...).
    """

    def __init__(self, draft: str, reason: BaseException):
        self.draft = str(draft)
        self.reason_kind = type(reason).__name__
        super().__init__(f"the draft model {draft!r} could not be loaded: {reason}; pick another draft "
                         "model (same tokenizer as the chat model) or turn speculation off")


@dataclass
class SpeculativeEvent(GenerationEvent):
    """A GenerationEvent plus the reply's running speculation stats (for the status bar).

    from_draft: this token was proposed by the draft (or lookup) and accepted by the target.
    acceptance_rate: accepted / drafted tokens so far. tokens_per_pass: tokens emitted per target
    forward pass. speedup_estimate: modelled tokens/s with speculation over plain decoding, from the
    measured pass times. draft_k: the draft length now in use (0: speculation switched off).
    """

    from_draft: bool = False
    acceptance_rate: float = 0.0
    tokens_per_pass: float = 0.0
    speedup_estimate: float = 1.0
    draft_k: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0


def _probs(logits: np.ndarray, params: GenerationParams) -> np.ndarray:
    """Dense (vocab,) float64 distribution the sampler would draw from after temperature/top-k/top-p/min-p."""
    return dense_distribution(logits, params.temperature, params.top_k, params.top_p, params.min_p)


def accept_or_resample(
    p: np.ndarray | None, q: np.ndarray | None, token: int, target_argmax: int, rng: np.random.Generator
) -> tuple[bool, int]:
    """The speculative sampling rule for one drafted token.

    Greedy (p is None): accept iff the draft token is the target's argmax, else emit the argmax.
    Sampling: accept with probability min(1, p[t] / q[t]); on rejection draw from the residual
    max(0, p - q) renormalised, which makes the emitted token distributed exactly as p. q is the
    draft's processed distribution; None means a deterministic proposal (prompt lookup: q = one-hot).

    Returns:
        (accepted, the token to emit at this position).
    """
    if p is None:
        return token == target_argmax, target_argmax
    q_t = 1.0 if q is None else q[token]
    if q_t > 0 and rng.random() * q_t < p[token]:  # u < p/q without dividing
        return True, token
    residual = p.copy()
    if q is None:
        residual[token] = 0.0
    else:
        np.subtract(residual, q, out=residual)
        np.maximum(residual, 0.0, out=residual)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: the rejection had probability ~0; p itself is exact
        residual, total = p, p.sum()
    return False, int(rng.choice(len(residual), p=residual / total))


_FAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fast_forward(model):
    """The model's engine.backends.cpu.draft.DraftForward (built once per model: it repacks the weights),
    or None when that path does not cover the model."""
    if model not in _FAST:
        _FAST[model] = DraftForward.build(model)
    return _FAST[model]


class DraftModel:
    """A small model proposing tokens for a target (same vocabulary and special tokens).

    Args:
        model: the draft architecture instance (forward, new_cache, cfg).
        tokenizer: the draft's tokenizer, checked against the target's.
        n_ctx: draft KV cache size; when the conversation outgrows it, speculation switches off.
        dtype: the draft cache's element type (float32 or float16).
        fast: decode steps through engine.backends.cpu.draft (weights repacked for VNNI, int16-grade
            activations in two int8 levels, one fused call a step: ~1.6x the exact forward's speed,
            proposals as good) when the model and a float32 cache allow it; False (or a model it
            does not cover) runs the model's exact forward. Either way the output is the target's:
            it verifies every drafted token.
    """

    def __init__(self, model, tokenizer: Tokenizer, n_ctx: int, dtype=np.float32, fast: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.cache: KVCache = model.new_cache(min(n_ctx, int(model.cfg.max_position_embeddings)), dtype)
        self.fast = fast_forward(model) if fast else None
        if self.fast is not None and not self.fast.supports(self.cache):
            self.fast = None

    def check_compatible(self, target_model, target_tokenizer: Tokenizer) -> None:
        from engine.draft_pairing import compatibility_problem

        problem = compatibility_problem(target_tokenizer, self.tokenizer, target_model.cfg.vocab_size,
                                        self.model.cfg.vocab_size)
        if not self.cache.partial_states:
            problem = "its recurrent layers (Qwen3.5's) cannot step back over rejected drafts"
        if problem:
            raise IncompatibleDraftError(f"the draft model cannot be used with this target: {problem}; "
                                         "pick a draft with the same tokenizer "
                                         "(`hearth ls --drafts-for MODEL` lists them)")

    def room(self, history_len: int) -> int:
        """How many tokens the draft can still propose after a history of this length."""
        return self.cache.n_ctx - history_len

    def _catch_up(self, history: list[int]) -> np.ndarray:
        """Bring the draft cache to hold `history`; the logits (vocab,) after its last token (a view)."""
        if self.fast is None:
            return prefill(self.model, self.cache, history, 64)[0]
        reused = min(self.cache.common_prefix(history), len(history) - 1)
        self.cache.trim(self.cache.offset - reused)
        missing = history[reused:]
        if len(missing) > MAX_FAST_TOKENS:  # a long gap (a new prompt): the exact prefill path
            for start in range(0, len(missing) - 1, 64):
                self.model.forward(missing[start : min(start + 64, len(missing) - 1)], self.cache)
            missing = missing[-1:]
        return self.fast.forward(missing, self.cache)[-1]

    def _step(self, token: int) -> np.ndarray:
        if self.fast is not None:
            return self.fast.forward([token], self.cache)[-1]
        return self.model.forward([token], self.cache)[-1]

    def propose(self, history: list[int], k: int, params: GenerationParams, processors, rng, sample: bool):
        """k tokens continuing history, with the draft's processed distributions (None when greedy)."""
        logits = self._catch_up(history)
        tokens, dists = [], []
        for i in range(k):
            if not sample and not processors:
                # greedy fast path: the argmax of the logits buffer itself, no copy, no distribution
                tokens.append(int(np.argmax(logits)))  # as the plain sampler picks
                dists.append(None)
                if i + 1 < k:
                    logits = self._step(tokens[-1])
                continue
            row = logits.copy()
            for process in processors:
                row = process(history + tokens, row)
            if sample:
                q = _probs(row, params)
                tokens.append(int(rng.choice(len(q), p=q)))
                dists.append(q)
            else:
                tokens.append(int(np.argmax(row)))
                dists.append(None)
            if i + 1 < k:
                logits = self._step(tokens[-1])
        return tokens, dists

    def prime(self, history: list[int], chunk: int = 512) -> Iterator[int]:
        """Prefill all of the prompt but its last token into the draft cache, `chunk` tokens a pass.

        (The first `propose` feeds the last token and takes its logits.) Yields the number of
        positions the cache holds after each pass, so a caller can check for cancel in between; a
        prompt the draft's context cannot hold is skipped (speculation then stays off).
        """
        if not 1 < len(history) < self.cache.n_ctx:
            return
        done = min(self.cache.common_prefix(history), len(history) - 1)
        self.cache.trim(self.cache.offset - done)
        for start in range(done, len(history) - 1, chunk):
            stop = min(start + chunk, len(history) - 1)
            self.model.forward(history[start:stop], self.cache)
            yield stop


class _Adaptive:
    """Chooses k from the running acceptance rate and measured pass times; k = 0 switches speculation off.

    With acceptance rate a, a round of k drafts emits E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs
    k * t_draft + t_verify(k + 1); plain decoding costs t_plain per token. t_verify(n) is modelled as
    t_plain + (n - 1) * t_extra, t_extra fitted to the verify passes seen. The k maximising
    E(k) / cost is used while it beats plain decoding; otherwise speculation stays off and is probed
    again every `probe_every` plain tokens: a probe is a real round at the last good k, so it measures
    the rate and timings as they are now (the context, and with it every pass, grows).

    The timings must hold up for that to work:
    - a draft's first round is slow (its weights are repacked and its kernels loaded on first use), and a
      shared machine has slow moments: a time under half the running estimate replaces it outright;
    - t_plain is measured by plain passes, never taken from a verify pass: while speculation runs, one
      round in `plain_every` is a plain pass (about 1/30 of the rounds at plain speed).
    """

    def __init__(self, k_max: int, k_start: int, adaptive: bool, probe_every: int = 24,
                 plain_every: int = 32):
        self.k_max, self.k, self.adaptive = k_max, k_start, adaptive
        self.probe_every, self.plain_every = probe_every, plain_every
        self.probe_k = k_start  # the k a probe runs
        self.accepted = 0.0  # decayed counts: the rate follows the reply's recent rounds
        self.drafted = 0.0
        self.t_draft = None  # seconds per drafted token
        self.t_plain = None  # seconds per plain (1-token) target pass
        self.t_extra = None  # extra seconds per additional token in a verify pass
        self.off_for = 0
        self.since_plain = 0  # speculative rounds since the last plain pass

    @staticmethod
    def _ema(old, new, w=0.3):
        return new if old is None or new < 0.5 * old else (1 - w) * old + w * new

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.drafted + 1.25)  # a mild prior of 0.8 before any round

    def note_round(self, k: int, accepted: int, t_draft: float, t_verify: float) -> None:
        if k == 0:
            self.t_plain = self._ema(self.t_plain, t_verify)
            self.since_plain = 0
            return
        self.since_plain += 1
        self.accepted = 0.9 * self.accepted + accepted
        self.drafted = 0.9 * self.drafted + k
        self.t_draft = self._ema(self.t_draft, t_draft / k)
        if self.t_plain is not None:
            self.t_extra = self._ema(self.t_extra, max(0.0, t_verify - self.t_plain) / k)

    def expected_tokens(self, k: int) -> float:
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def speedup(self, k: int) -> float:
        """Modelled speed with k drafts over plain decoding (1.0 while the timings are unknown)."""
        if not k or self.t_draft is None or self.t_plain is None or self.t_extra is None:
            return 1.0
        cost = k * self.t_draft + self.t_plain + k * self.t_extra
        return self.expected_tokens(k) * self.t_plain / cost

    def next_k(self, limit: int) -> int:
        if not self.adaptive:
            return min(self.k, limit)
        if self.off_for > 0:
            self.off_for -= 1
            if self.off_for == 0:  # probe: one real round, whatever the stale figures say
                self.k = self.probe_k
                return min(self.k, limit)
            return 0
        if self.t_draft is not None and (self.t_plain is None or self.since_plain >= self.plain_every):
            return 0  # a plain pass to time
        if self.t_extra is not None:
            best = max(range(1, self.k_max + 1), key=self.speedup)
            if self.speedup(best) < 1.0:
                self.off_for = self.probe_every
                self.k = 0
                return 0
            self.k = self.probe_k = best
        return min(max(self.k, 1), limit)


def speculative_generate(
    model,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    cache: KVCache,
    params: GenerationParams,
    proposer,
    k: int = 4,
    k_max: int = 8,
    adaptive: bool = True,
) -> Iterator[GenerationEvent]:
    """Stream a reply like engine.generate.generate, drafting with `proposer` and verifying in batches.

    Args:
        proposer: a DraftModel or an engine.lookup.PromptLookup.
        k: draft length to start with (the fixed length when adaptive is False).
        k_max: the largest draft length adaptation may choose (verify passes stay within the
            backend's small-batch kernels: k_max + 1 <= engine.backends.cpu.SMALL_BATCH_MAX).
        adaptive: adapt k to the acceptance rate and switch speculation off when it would be slower.

    The target cache ends up holding the prompt and the generated tokens but the last, as generate's.

    Raises:
        IncompatibleDraftError: the draft model's vocabulary or special tokens differ from the target's.
        ContextOverflowError: the prompt does not fit the target's context.
    """
    if not 1 <= k <= k_max:
        raise ValueError(f"need 1 <= k <= k_max, got k={k}, k_max={k_max}")
    if not cache.partial_states:
        # a recurrent model (Qwen3.5) keeps its state for the cache's end only: rejected drafts could not be
        # taken back, so the reply is decoded plainly (its events carry no speculation figures)
        yield from generate(model, tokenizer, prompt_ids, cache, params)
        return
    if hasattr(proposer, "check_compatible"):
        proposer.check_compatible(model, tokenizer)
    prompt_ids = [int(t) for t in prompt_ids]
    if len(prompt_ids) >= cache.n_ctx:
        raise ContextOverflowError(len(prompt_ids) + 1, cache.n_ctx)
    greedy = params.temperature == 0
    rng = np.random.default_rng(params.seed)
    processors = []
    if params.repetition_penalty != 1.0:
        processors.append(repetition_penalty(params.repetition_penalty, params.repeat_last_n))
    vocab = tokenizer.vocab_size
    decoder = reply_decoder(tokenizer, prompt_ids)
    matcher = _StopMatcher(params.stop)
    policy = _Adaptive(k_max, k, adaptive)

    t0 = time.perf_counter()
    logits, reused = prefill(model, cache, prompt_ids, params.prefill_chunk)
    if hasattr(proposer, "prime"):
        for _ in proposer.prime(prompt_ids, params.prefill_chunk):
            pass
    t_prefill = time.perf_counter() - t0
    ev = SpeculativeEvent(text="", token=None, prompt_tokens=len(prompt_ids), cached_tokens=reused,
                          ttft_s=t_prefill,
                          prompt_tps=(len(prompt_ids) - reused) / t_prefill if t_prefill > 0 else 0.0)
    history = list(prompt_ids)
    t_decode = time.perf_counter()
    pending = [logits]  # target logits rows for the positions still to be decided, in order

    def decide(row: np.ndarray, seen: list[int], drafted: int | None, q) -> tuple[bool, int]:
        if greedy and not processors:
            # greedy fast path: the target's argmax over the real vocabulary, read in place
            best = int(np.argmax(row[:vocab]))  # as the plain greedy sampler picks
            return (drafted == best, best) if drafted is not None else (False, best)
        row = row.copy()
        if len(row) > vocab:
            row[vocab:] = -np.inf  # padded embedding rows stand for no text
        for process in processors:
            row = process(seen, row)
        if drafted is None:  # no draft here: sample the target's own distribution
            if greedy:
                return False, int(np.argmax(row))
            p = _probs(row, params)
            return False, int(rng.choice(len(p), p=p))
        return accept_or_resample(None if greedy else _probs(row, params), q, drafted,
                                  int(np.argmax(row)), rng)

    finish = None
    drafts: list[int] = []
    dists: list = []
    times = None  # (draft seconds, verify seconds) of the pass that produced `pending`
    while True:
        # Decide the tokens of this round: each drafted token in turn, then a bonus or a correction.
        emitted: list[tuple[int, bool]] = []
        for i, row in enumerate(pending):
            drafted = drafts[i] if i < len(drafts) else None
            seen = history + [t for t, _ in emitted]
            accepted, token = decide(row, seen, drafted, dists[i] if i < len(dists) else None)
            emitted.append((token, accepted))
            if not accepted:
                break
        n_acc = sum(1 for _, a in emitted if a)
        ev.drafted_tokens += len(drafts)
        ev.accepted_tokens += n_acc
        if times is not None:
            policy.note_round(len(drafts), n_acc, *times)
        for token, accepted in emitted:
            ev.generated_tokens += 1
            if token in tokenizer.eot_ids:
                finish, text = "stop", ""
            else:
                history.append(token)
                text = decoder.push(token)
            text, stopped = matcher.feed(text)
            if stopped:
                finish = "stop"
            elif finish is None and ev.generated_tokens >= params.max_tokens:
                finish = "length"
            elif finish is None and len(history) >= cache.n_ctx:
                finish = "context"
            if finish is not None and not stopped:
                tail, stopped = matcher.feed(decoder.flush())
                text += tail if stopped else tail + matcher.flush()
            elapsed = time.perf_counter() - t_decode
            passes = max(ev.target_passes, 1)
            yield SpeculativeEvent(
                text=text, token=token, finish_reason=finish, prompt_tokens=ev.prompt_tokens,
                cached_tokens=ev.cached_tokens, generated_tokens=ev.generated_tokens, ttft_s=ev.ttft_s,
                prompt_tps=ev.prompt_tps,
                generation_tps=(ev.generated_tokens - 1) / elapsed if ev.generated_tokens > 1 and elapsed
                else 0.0,
                peak_memory_mb=peak_rss_mb() if finish else 0.0, from_draft=accepted,
                acceptance_rate=ev.accepted_tokens / ev.drafted_tokens if ev.drafted_tokens else 0.0,
                tokens_per_pass=(ev.generated_tokens - 1) / passes if ev.target_passes else 0.0,
                speedup_estimate=policy.speedup(policy.k) if policy.k else 1.0, draft_k=policy.k,
                drafted_tokens=ev.drafted_tokens, accepted_tokens=ev.accepted_tokens,
                target_passes=ev.target_passes,
            )
            if finish is not None:
                break
        if finish is not None:
            cache.trim(cache.offset - cache.common_prefix(history))  # rejected drafts out
            return
        # The target cache holds history[:-1] plus the drafts fed last round: keep history[:-1].
        cache.trim(cache.offset - (len(history) - 1))
        # Next round: draft, then verify [last token, d1..dk] in one target pass.
        room = min(cache.n_ctx - len(history), params.max_tokens - ev.generated_tokens)
        k_now = policy.next_k(max(0, min(k_max, room - 1)))
        t1 = time.perf_counter()
        drafts, dists = [], []
        if k_now and (not hasattr(proposer, "room") or proposer.room(len(history)) > k_now):
            drafts, dists = proposer.propose(history, k_now, params, processors, rng, not greedy)
        elif k_now:
            policy.adaptive, policy.k = False, 0  # the draft's context is full: plain decoding from here
        t2 = time.perf_counter()
        out = model.forward([history[-1]] + drafts, cache, all_logits=bool(drafts))
        pending = list(out) if drafts else [out[-1]]
        ev.target_passes += 1
        times = (t2 - t1, time.perf_counter() - t2)
