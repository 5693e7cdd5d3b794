"""ChatRunner (the worker's per-model chat engine) in process, and `hearth bench --chat`."""

from __future__ import annotations

import json

import pytest

from engine.cli import main
from engine.client import LoadOptions
from engine.context_policy import ContextFullError
from engine.generate import GenerationParams

GREEDY = GenerationParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from engine.worker import ChatRunner

    return ChatRunner.load(smollm2_path, LoadOptions(n_ctx=256, batch_size=128, prefix_cache_mb=32))


def _reply(runner, messages, **kw):
    pieces, last = [], None
    for event in runner.chat(messages, GREEDY, **kw):
        pieces.append(event.text)
        last = event
    return "".join(pieces), last


def test_long_chat_is_truncated_in_the_middle_and_keeps_reusing(runner):
    msgs = [{"role": "system", "content": "You answer in one sentence."}]
    lasts = []
    for i in range(9):
        msgs.append({"role": "user", "content": f"Tell me fact number {i} about the ocean, briefly please."})
        reply, last = _reply(runner, msgs, chat_id="ocean")
        msgs.append({"role": "assistant", "content": reply})
        lasts.append(last)
        assert last.context_before + GREEDY.max_tokens <= last.context_size + 1
        assert last.context_after <= last.context_size
    dropped = [e.dropped_messages for e in lasts]
    assert dropped[0] == 0 and dropped[-1] > 0 and dropped == sorted(dropped)
    # after a truncation, the following turn reuses the truncated prefix again
    first_cut = dropped.index(next(d for d in dropped if d))
    after = lasts[first_cut + 1]
    if after.dropped_messages == lasts[first_cut].dropped_messages:
        assert after.cached_tokens >= lasts[first_cut].context_after - 2


def test_stop_policy_refuses_when_full(runner):
    msgs = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(ContextFullError):
        list(runner.chat(msgs, GREEDY, policy="stop"))


def test_model_without_template_chats_in_its_family_fallback(runner, monkeypatch):
    monkeypatch.setattr(runner.lm, "template", None)
    events = list(runner.chat([{"role": "user", "content": "hi"}], GREEDY))
    assert events and events[-1].finish_reason is not None
    # SmolLM2 is a llama-family model: the fallback is ChatML, which its vocabulary has tokens for
    assert "<|im_start|>user\nhi<|im_end|>" in runner.lm.template.render([{"role": "user", "content": "hi"}])


def test_bench_chat_json(capsys, smollm2_path):
    argv = ["bench", "--chat", "-m", str(smollm2_path), "-g", "32", "-r", "2", "--ctx", "1024", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    turns = out["turns"]
    assert len(turns) == 8
    for t in turns:
        print(t)
        # with reuse only what the turn added is prefilled (user message, template glue, end of reply)
        assert abs(t["prefilled"] - t["new_tokens"]) <= 2
        assert t["prefilled_no_reuse"] == t["prompt_tokens"]
    assert turns[0]["prefilled"] == turns[0]["prompt_tokens"]
    print(f"TTFT speedup on turn 8: {out['ttft_speedup_last_turn']}x")
    # the target is 5x (measured with the CLI on a quiet machine: see the report); timings on a
    # machine shared by several jobs are noisy, so the test asks for a margin that noise cannot erase
    assert out["ttft_speedup_last_turn"] >= 2.0


@pytest.mark.parametrize("cold", [True, False], ids=["cold-cache", "warm-cache"])
def test_load_compiles_the_prefill_path_only_for_a_cold_kernel_cache(smollm2_path, monkeypatch, cold):
    from engine import worker

    passes = []
    load_model = worker.load_model

    def counting_load(path):
        lm = load_model(path)
        forward = lm.model.forward

        def counted(tokens, cache, **kw):
            passes.append(len(tokens))
            return forward(tokens, cache, **kw)

        monkeypatch.setattr(lm.model, "forward", counted)
        return lm

    monkeypatch.setattr(worker, "load_model", counting_load)
    # kernels_compiled is read before and after the short warm-up passes
    counts = iter([4, 9] if cold else [4, 4])
    monkeypatch.setattr(worker.cpu, "kernels_compiled", lambda: next(counts))
    runner = worker.ChatRunner.load(smollm2_path, LoadOptions(n_ctx=256, prefix_cache_mb=0))
    # a warm cache keeps the load short; a cold one compiles what a long first prompt needs, at load
    assert passes == ([2, 1, runner.lm.model.small_batch_max + 1] if cold else [2, 1])


def test_a_hugging_face_folder_loads_and_chats_like_a_gguf(tmp_path):
    """The app and `hearth serve` load through ChatRunner.load: a safetensors folder (here the tiny
    Qwen3-MoE checkpoint) gets its memory check from config.json and the safetensors sizes, then chats
    with KV reuse; too little memory is refused before anything is mapped."""
    from pathlib import Path

    from engine.memory_guard import InsufficientMemoryError
    from engine.worker import ChatRunner

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3moe"
    options = LoadOptions(n_ctx=128, batch_size=32, prefix_cache_mb=0)
    with pytest.raises(InsufficientMemoryError):
        ChatRunner.load(folder, options, available=1 << 20)
    runner = ChatRunner.load(folder, options)
    assert runner.lm.model.layers[0].moe is not None
    params = GenerationParams(max_tokens=5, temperature=0.0)
    messages = [{"role": "user", "content": "the"}]
    first = list(runner.chat(messages, params))[-1]
    assert first.generated_tokens == 5 and first.cached_tokens == 0
    reply = "".join(e.text for e in runner.chat(messages, params))
    turn2 = [*messages, {"role": "assistant", "content": reply}, *messages]
    again = list(runner.chat(turn2, params))[-1]
    assert again.cached_tokens > 0 and again.generated_tokens == 5
