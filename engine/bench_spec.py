"""`hearth bench -m TARGET --draft DRAFT` / `--lookup`: speculative decoding against plain decoding.

On a fixed prompt set, each prompt is decoded greedily twice back to back, plainly (engine.generate)
and speculatively (engine.speculative), for -g tokens (a reply that ends earlier counts what it
produced). Decode speed is tokens after the first over the time from the first token to the last, so
prefill is excluded from both. With -r N the set is run N times and the median run is reported.
"""

from __future__ import annotations

import json
import time

from engine.backends import cpu
from engine.errors import HearthError
from engine.generate import GenerationParams, generate
from engine.lookup import PromptLookup
from engine.speculative import DraftModel, speculative_generate

# Open-ended chat prompts (draft-model speculation).
DRAFT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works, step by step, for a curious ten-year-old.",
    "Give me five tips for keeping a vegetable garden healthy in a dry summer.",
)

# "Repeat this text with one change" prompts (prompt lookup): most of the reply is in the prompt.
_PASSAGES = (
    "The old mill stood at the edge of the village, where the river bent towards the hills. Every "
    "morning the miller opened the heavy doors, greeted the baker's boy, and started the great wheel. "
    "By noon the air was white with flour, and the sound of the stones could be heard in the square.",
    "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')\n"
    "    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n",
    "Dear team, thank you all for your hard work this quarter. Our sales grew by twelve percent, the new "
    "office opened on time, and customer complaints fell to their lowest level in three years. Please "
    "join us on Friday afternoon for a small celebration in the main hall.",
)
_CHANGES = ("the miller", "width", "Friday")
_REPLACEMENTS = ("the miller's daughter", "w", "Thursday")
LOOKUP_PROMPTS = tuple(
    f"Repeat the following text exactly, but replace \"{a}\" with \"{b}\" everywhere. Output only the "
    f"text.\n\n{text}"
    for text, a, b in zip(_PASSAGES, _CHANGES, _REPLACEMENTS)
)


def with_notes(prompts: tuple[str, ...], tokenizer, n_tokens: int) -> tuple[str, ...]:
    """The prompts, each after about n_tokens of notes (the passages repeated); unchanged for 0."""
    if n_tokens <= 0:
        return prompts
    pieces, count = [], 0
    while count < n_tokens:
        passage = _PASSAGES[len(pieces) % len(_PASSAGES)]
        pieces.append(passage)
        count += len(tokenizer.encode(passage + "\n\n"))
    notes = "\n\n".join(pieces)
    return tuple(f"Here are some notes:\n\n{notes}\n\nWith those in mind: {p}" for p in prompts)


def _prompt_ids(lm, text: str) -> list[int]:
    from engine.templates import ensure_chat_template

    ensure_chat_template(lm)
    rendered = lm.template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return lm.tokenizer.encode(rendered, add_special=False)


def _timed(events) -> tuple[list[int], float, object]:
    """(tokens, seconds from the first token to the last, last event) of one reply."""
    tokens, t_first, last = [], None, None
    for ev in events:
        if t_first is None:
            t_first = time.perf_counter()
        tokens.append(ev.token)
        last = ev
    return tokens, time.perf_counter() - t_first, last


def run_spec_bench(target, proposer_factory, prompts, n_gen: int, n_ctx: int, repetitions: int, k: int,
                   adaptive: bool) -> dict:
    """Plain vs speculative greedy decode over prompts; the median of `repetitions` runs of the set.

    Args:
        target: the LoadedModel to decode with.
        proposer_factory: () -> a fresh DraftModel or PromptLookup (a fresh draft cache per reply).
    """
    params = GenerationParams(max_tokens=n_gen, temperature=0.0)
    ids = [_prompt_ids(target, p) for p in prompts]
    if max(len(i) for i in ids) + n_gen > n_ctx:
        raise HearthError(f"the bench prompts need {max(len(i) for i in ids) + n_gen} tokens of context")
    model, tok = target.model, target.tokenizer
    runs = []
    identical = True
    for _ in range(repetitions):
        base_tok = base_s = spec_tok = spec_s = 0.0
        drafted = accepted = passes = 0
        for prompt in ids:
            plain, s_plain, _ = _timed(generate(model, tok, prompt, model.new_cache(n_ctx), params))
            replies = speculative_generate(model, tok, prompt, model.new_cache(n_ctx), params,
                                           proposer_factory(), k=k, adaptive=adaptive)
            spec, s_spec, last = _timed(replies)
            identical &= plain == spec
            base_tok, base_s = base_tok + len(plain) - 1, base_s + s_plain
            spec_tok, spec_s = spec_tok + len(spec) - 1, spec_s + s_spec
            drafted, accepted, passes = (drafted + last.drafted_tokens, accepted + last.accepted_tokens,
                                         passes + last.target_passes)
        runs.append({
            "baseline_decode_tps": base_tok / base_s, "decode_tps": spec_tok / spec_s,
            "speedup": (spec_tok / spec_s) / (base_tok / base_s),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_pass": spec_tok / passes if passes else 0.0,
            "decode_tokens": int(spec_tok),
        })
    runs.sort(key=lambda r: r["speedup"])
    out = dict(runs[len(runs) // 2])
    out["identical_greedy"] = bool(identical)
    out["prompt_tokens"] = [len(i) for i in ids]
    out["speedups"] = [round(r["speedup"], 3) for r in runs]
    return out


def cmd_bench_spec(args) -> int:
    from engine.commands import _context, _download_progress
    from engine.loader import load_model
    from models.resolve import resolve_model

    if args.draft and args.lookup:
        raise HearthError("choose one of --draft and --lookup")
    if not 1 <= args.spec_k <= cpu.SMALL_BATCH_MAX - 1:
        raise HearthError(f"-k/--spec-k must be between 1 and {cpu.SMALL_BATCH_MAX - 1}")
    if args.threads:
        cpu.set_threads(args.threads)
    target = load_model(resolve_model(args.model, progress=_download_progress))
    n_ctx = _context(target, args.ctx)
    if args.draft:
        draft = load_model(resolve_model(args.draft, progress=_download_progress))

        def factory():
            return DraftModel(draft.model, draft.tokenizer, n_ctx)

        prompts, mode = DRAFT_PROMPTS, "draft"
    else:
        draft = None

        def factory():
            return PromptLookup()

        prompts, mode = LOOKUP_PROMPTS, "lookup"
    prompts = with_notes(prompts, target.tokenizer, args.notes)
    # warm both models' kernels (the first call of a Numba kernel loads it from the cache)
    for lm in (target, draft):
        if lm is not None:
            warm = lm.model.new_cache(32)
            lm.model.forward([1, 2, 3, 4, 5], warm, all_logits=True)
            lm.model.forward([1], warm)
    if draft is not None:  # the draft's fused step too (engine.backends.cpu.draft), when it has one
        fast = factory().fast
        if fast is not None:
            warm = draft.model.new_cache(32)
            fast.forward([1, 2], warm)
            fast.forward([3], warm)
    result = run_spec_bench(target, factory, prompts, args.gen_tokens, n_ctx, max(1, args.repetitions),
                            args.spec_k, not args.fixed_k)
    out = {
        "model": target.name, "file": str(target.path), "mode": mode,
        "draft": str(draft.path) if draft is not None else None, "threads": cpu.get_threads(),
        "prompts": len(prompts), "gen_tokens": args.gen_tokens, "repetitions": max(1, args.repetitions),
        "k_start": args.spec_k, "adaptive": not args.fixed_k, "notes_tokens": args.notes,
    }
    out.update({key: round(v, 3) if isinstance(v, float) else v for key, v in result.items()})
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>20}: {value}")
    return 0
