"""Speculative decoding in the chat runtime: per-reply options -> a proposer, the worker's draft model.

engine.worker.ChatRunner keeps one DraftSlot. The draft model a reply asks for
(engine.client.SpeculationOptions) is loaded on first use (resolved, mapped, checked against the
target's tokenizer, kernels warmed) and kept with its own KV cache for later replies, so the next
turn of a chat only prefills the draft with what is new. Asking for another draft replaces it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from engine.client import SpeculationOptions
from engine.errors import HearthError
from engine.lookup import PromptLookup
from engine.speculative import DraftLoadError, DraftModel, SpeculativeEvent


class DraftSlot:
    """The draft model one target keeps loaded (at most one at a time).

    Args:
        target_lm: the target's LoadedModel (the draft must share its tokenizer).
        n_ctx: the target's context; the draft cache gets as many positions (or its trained limit).
        kv_dtype: element type of the draft's KV cache.
    """

    def __init__(self, target_lm, n_ctx: int, kv_dtype=np.float32):
        self.target_lm = target_lm
        self.n_ctx = n_ctx
        self.kv_dtype = kv_dtype
        self.spec: str | None = None
        self.draft: DraftModel | None = None

    def get(self, spec: str) -> DraftModel:
        """The draft for `spec` (a path or starter name), loading it when it is not the one held.

        Raises:
            DraftLoadError: the draft cannot be resolved, read or built.
            IncompatibleDraftError: its vocabulary or special tokens differ from the target's.
        """
        if self.draft is not None and self.spec == spec:
            return self.draft
        from engine.loader import load_model
        from models.resolve import resolve_model

        self.draft, self.spec = None, None  # a failed load leaves no stale draft behind
        try:
            path = resolve_model(str(spec))
            if Path(path).resolve() == Path(self.target_lm.path).resolve():
                raise HearthError("it is the chat model itself; a draft must be a smaller model")
            lm = load_model(path)
        except HearthError as e:
            raise DraftLoadError(spec, e) from e
        draft = DraftModel(lm.model, lm.tokenizer, self.n_ctx, self.kv_dtype)
        draft.check_compatible(self.target_lm.model, self.target_lm.tokenizer)
        # the first call of each kernel loads it from the JIT cache: not inside the first reply
        warm = lm.model.new_cache(8, self.kv_dtype)
        lm.model.forward([0, 0], warm)
        lm.model.forward([0], warm)
        if draft.fast is not None:  # and the draft's own fused step (float32 cache)
            warm32 = lm.model.new_cache(8)
            draft.fast.forward([0, 0], warm32)
            draft.fast.forward([0], warm32)
        self.draft, self.spec = draft, spec
        return draft


def proposer_for(options: SpeculationOptions | None, slot: DraftSlot):
    """The proposer a reply's options ask for: None (plain decoding), a PromptLookup or a DraftModel."""
    if options is None or options.mode == "off":
        return None
    if options.mode == "prompt-lookup":
        return PromptLookup()
    return slot.get(options.draft_model)


def prime(proposer, ids: list[int], chunk: int) -> Iterator[int]:
    """Prefill a draft model's cache with the prompt, one chunk a step (nothing for prompt lookup)."""
    if isinstance(proposer, DraftModel):
        yield from proposer.prime(ids, chunk)


def spec_fields(mode: str, event) -> dict:
    """engine.client.ChatEvent's speculation fields for one generation event."""
    if not isinstance(event, SpeculativeEvent):
        return {}
    return {
        "speculation": mode,
        "from_draft": event.from_draft,
        "drafted_tokens": event.drafted_tokens,
        "accepted_tokens": event.accepted_tokens,
        "acceptance_rate": event.acceptance_rate,
        "tokens_per_pass": event.tokens_per_pass,
        "speedup_estimate": event.speedup_estimate,
        "draft_k": event.draft_k,
        "target_passes": event.target_passes,
    }
