"""`hearth bench --chat`: a scripted 8-turn conversation, with KV reuse and again without.

Per turn it reports the tokens the turn added to the conversation (user message, the template's
glue and the previous reply's end-of-turn marker), the tokens actually prefilled, time to first
token and decode speed. Both passes run in this process through the same ChatRunner the worker
uses, one after the other, on the same conversation (the replies of the first pass are replayed
in the second), greedy.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from engine.client import LoadOptions
from engine.generate import GenerationParams
from engine.worker import ChatRunner

SYSTEM = "You are a concise, knowledgeable assistant. Answer in a few clear sentences."
SCRIPT = (
    "I am planning a vegetable garden on a small sunny balcony. Which vegetables grow well in pots?",
    "How deep should the pots be for tomatoes, and how often should I water them in summer?",
    "What is a good way to make compost in a flat without it smelling bad?",
    "Some leaves on my tomato plants are turning yellow from the bottom up. What could cause that?",
    "Can I grow herbs like basil and parsley next to the tomatoes, or do they compete for water?",
    "Explain companion planting in simple terms and give two examples for a balcony garden.",
    "How do I protect the plants from strong wind on the eighth floor without blocking the sun?",
    "Please summarise our whole conversation as a short checklist I can print and stick on the door.",
)


def _turn(
    runner: ChatRunner, messages: list[dict], params: GenerationParams, reuse: bool
) -> tuple[str, dict]:
    pieces, last = [], None
    for event in runner.chat(messages, params, reuse=reuse):
        pieces.append(event.text)
        last = event
    return "".join(pieces), {
        "prompt_tokens": last.prompt_tokens,
        "prefilled": last.to_prefill,
        "ttft_s": round(last.ttft_s, 4),
        "decode_tps": round(last.generation_tps, 2),
        "generated": last.generated_tokens,
        "context_after": last.context_after,
    }


def _measure(
    runner: ChatRunner,
    messages: list[dict],
    params: GenerationParams,
    reuse: bool,
    repetitions: int,
    before: int,
) -> tuple[str, dict]:
    """One turn, run `repetitions` times from the same cache state; the best TTFT is reported.

    The extra runs stop after the first token (they only time the prefill); the full reply runs
    last, so the cache ends holding it for the next turn.
    """
    first_token = replace(params, max_tokens=1)
    ttfts = []
    for _ in range(max(1, repetitions) - 1):
        runner.cache.trim(runner.cache.offset - before)  # back to the state the previous turn left
        ttfts.append(_turn(runner, messages, first_token, reuse)[1]["ttft_s"])
    runner.cache.trim(runner.cache.offset - before)
    reply, figures = _turn(runner, messages, params, reuse)
    figures["ttft_s"] = min([figures["ttft_s"], *ttfts])  # a shared machine makes single timings noisy
    return reply, figures


def run_chat_bench(runner: ChatRunner, gen_tokens: int = 64, repetitions: int = 1) -> dict:
    """Run SCRIPT with reuse, then replay the same conversation without reuse; greedy.

    Args:
        repetitions: time every turn's TTFT this many times (with reuse: from the same cached
            state) and report the best.

    Returns:
        {"turns": [per-turn figures of both passes], "ttft_speedup_last_turn": float}
    """
    params = GenerationParams(max_tokens=gen_tokens, temperature=0.0)
    runner.cache.trim(runner.cache.offset)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    turns, prompts = [], []
    before = 0  # tokens in the cache when the turn starts
    for n, user in enumerate(SCRIPT, 1):
        messages.append({"role": "user", "content": user})
        prompts.append(list(messages))
        reply, figures = _measure(runner, messages, params, True, repetitions, before)
        messages.append({"role": "assistant", "content": reply})
        turns.append({"turn": n, "new_tokens": figures["prompt_tokens"] - before, **figures})
        before = figures["context_after"]
    for turn, prompt in zip(turns, prompts):
        cold = _measure(runner, prompt, params, False, repetitions, 0)[1]
        turn["prefilled_no_reuse"] = cold["prefilled"]
        turn["ttft_s_no_reuse"] = cold["ttft_s"]
        turn["decode_tps_no_reuse"] = cold["decode_tps"]
    last = turns[-1]
    speedup = last["ttft_s_no_reuse"] / last["ttft_s"] if last["ttft_s"] else 0.0
    return {"turns": turns, "ttft_speedup_last_turn": round(speedup, 2)}


def cmd_bench_chat(args) -> int:
    """`hearth bench --chat` (args from engine.cli's bench parser)."""
    from engine.commands import _download_progress
    from models.resolve import resolve_model

    path = resolve_model(args.model, progress=_download_progress)
    t0 = time.perf_counter()
    runner = ChatRunner.load(path, LoadOptions(n_ctx=args.ctx, threads=args.threads, prefix_cache_mb=0))
    load_s = time.perf_counter() - t0
    result = run_chat_bench(runner, args.gen_tokens, args.repetitions)
    out = {
        "model": runner.lm.name,
        "n_ctx": args.ctx,
        "gen_tokens": args.gen_tokens,
        "repetitions": args.repetitions,
        "load_s": round(load_s, 3),
        **result,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}: 8-turn chat, replies up to {args.gen_tokens} tokens, greedy")
    print(
        f"{'turn':>4} {'new':>5} {'prefilled':>9} {'TTFT s':>8} {'tok/s':>7} | "
        f"{'prefilled':>9} {'TTFT s':>8} {'tok/s':>7}  (without reuse)"
    )
    for t in out["turns"]:
        print(
            f"{t['turn']:>4} {t['new_tokens']:>5} {t['prefilled']:>9} {t['ttft_s']:>8.3f} "
            f"{t['decode_tps']:>7.1f} | {t['prefilled_no_reuse']:>9} {t['ttft_s_no_reuse']:>8.3f} "
            f"{t['decode_tps_no_reuse']:>7.1f}"
        )
    print(f"last turn TTFT {out['ttft_speedup_last_turn']}x lower with reuse")
    return 0
