"""The engine worker process through EngineClient: streaming, reuse, cancel, bad loads, a killed worker.

One client (one spawned worker with SmolLM2 loaded) serves the whole module; the kill test runs last.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine.client import (
    ChatEvent,
    EngineClient,
    LoadOptions,
    LoadProgress,
    ModelInfo,
    NoModelLoadedError,
    WorkerDiedError,
)
from engine.generate import GenerationParams
from engine.memory_guard import InsufficientMemoryError
from models.errors import ModelFormatError, ModelNotFoundError

GREEDY = GenerationParams(max_tokens=16, temperature=0.0)
LONG = GenerationParams(max_tokens=400, temperature=0.0)


@pytest.fixture(scope="module")
def client(smollm2_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEARTH_HOME", str(tmp_path_factory.mktemp("worker-home")))
        engine = EngineClient()
    events = list(engine.load(smollm2_path, LoadOptions(n_ctx=2048, batch_size=64, name="smol")))
    engine.load_events = events
    yield engine
    engine.close()


def _run(client, messages, params=GREEDY, **kw) -> tuple[str, ChatEvent]:
    pieces, last = [], None
    for event in client.generate(messages, params, **kw):
        pieces.append(event.text)
        last = event
    return "".join(pieces), last


def test_client_imports_no_compute_stack():
    # the GUI process imports the client; numba and the kernels must stay in the worker
    code = "import sys, engine.client; assert not {'numba', 'engine.worker'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_options_are_validated():
    with pytest.raises(ValueError):
        LoadOptions(n_ctx=8)
    with pytest.raises(ValueError):
        LoadOptions(batch_size=0)


def test_load_reports_progress_then_info(client):
    stages = [e.stage for e in client.load_events if isinstance(e, LoadProgress)]
    assert stages[0] == "resolve" and "check" in stages and stages[-1] == "warmup"
    info = client.load_events[-1]
    assert isinstance(info, ModelInfo) and info.key == "smol" and info.n_ctx == 2048
    assert info.trained_ctx == 8192 and not info.warnings and info.prefix_cache_bytes > 0


def test_two_turns_prefill_only_the_new_tokens(client):
    msgs = [{"role": "user", "content": "Give me a word that rhymes with cat."}]
    reply, first = _run(client, msgs, chat_id="rhyme")
    assert first.finish_reason in ("stop", "length") and first.cached_tokens == 0
    assert first.context_before == first.prompt_tokens and first.context_after > first.context_before
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And one with dog?"}]
    _, second = _run(client, msgs, chat_id="rhyme")
    new = second.prompt_tokens - first.context_after
    print(f"\nturn 2: {second.to_prefill} prefilled for {new} new tokens")
    assert second.cached_tokens == first.context_after
    assert second.to_prefill == new
    status = client.status()
    assert status.models[0]["key"] == "smol" and status.models[0]["context_used"] == second.context_after
    assert status.rss_mb > 50 and status.models[0]["prefix_cache_bytes"] > 0
    deadline = time.perf_counter() + 5
    while client.status().busy:  # the worker files the turn in its prefix store after the last event
        assert time.perf_counter() < deadline
        time.sleep(0.01)


def test_cancel_during_decode_returns_control_fast(client):
    stream = client.generate([{"role": "user", "content": "Write a long story about a dragon."}], LONG)
    events = []
    for event in stream:
        events.append(event)
        if event.generated_tokens == 3:
            t0 = time.perf_counter()
            client.cancel()
    returned = time.perf_counter() - t0
    print(f"\ncancel during decode: control back in {returned * 1000:.1f} ms")
    assert events[-1].finish_reason == "cancelled" and events[-1].text == ""
    assert all(e.generated_tokens <= 3 for e in events[:-1])  # no text after stop
    assert returned < 0.5  # target 100 ms; generous for a loaded machine
    t1 = time.perf_counter()
    while client.status().busy:
        time.sleep(0.005)
    print(f"worker idle {(time.perf_counter() - t1) * 1000:.1f} ms after the stream ended")
    _, after = _run(client, [{"role": "user", "content": "Hi"}])
    assert after.finish_reason in ("stop", "length")


def test_cancel_during_prefill_from_another_thread(client):
    long_text = "The quick brown fox jumps over the lazy dog. " * 120  # ~1200 tokens: many batches of 64
    msgs = [{"role": "user", "content": long_text}]
    events, marks = [], {}

    def cancel_later():
        marks["t"] = time.perf_counter()
        client.cancel()

    stream = client.generate(msgs, GREEDY, chat_id="long")
    for event in stream:
        events.append(event)
        if event.prefilled and "timer" not in marks:
            marks["timer"] = threading.Timer(0.05, cancel_later)
            marks["timer"].start()
    returned = time.perf_counter() - marks["t"]
    last = events[-1]
    print(f"\ncancel during prefill: control back in {returned * 1000:.1f} ms ({last.prefilled} prefilled)")
    assert last.finish_reason == "cancelled" and last.generated_tokens == 0
    assert last.prefilled < last.to_prefill
    assert returned < 0.5
    # what was prefilled before the cancel is kept and reused by the next attempt
    _, done = _run(client, msgs, chat_id="long")
    assert done.finish_reason in ("stop", "length") and done.cached_tokens >= 64


def test_bad_loads_leave_the_loaded_model_working(client, tmp_path):
    with pytest.raises(ModelNotFoundError):
        client.load_and_wait(tmp_path / "nope.gguf")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelFormatError) as info:
        client.load_and_wait(corrupt)
    assert str(corrupt) in str(info.value)
    with pytest.raises(InsufficientMemoryError, match="at most") as info:
        client.load_and_wait(client.load_events[-1].path, LoadOptions(n_ctx=50_000_000, name="huge"))
    assert info.value.estimate.max_fitting_ctx < 50_000_000
    assert [m["key"] for m in client.status().models] == ["smol"]
    with pytest.raises(NoModelLoadedError, match="smol"):
        _run(client, [{"role": "user", "content": "Hi"}], model="other")
    _, last = _run(client, [{"role": "user", "content": "Say hello."}], model="smol")
    assert last.finish_reason in ("stop", "length") and last.generated_tokens > 0


def test_context_above_trained_length_warns(client):
    warnings = []
    info = client.load_and_wait(
        client.load_events[-1].path,
        LoadOptions(n_ctx=16384, name="smol-long", prefix_cache_mb=0),
        on_progress=lambda p: warnings.append(p.message) if p.stage == "warning" else None,
    )
    assert info.warnings and "8192" in info.warnings[0] and warnings == info.warnings
    client.unload("smol-long")
    assert [m["key"] for m in client.status().models] == ["smol"]


def test_killed_worker_raises_then_restarts(client):
    received = []
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        for event in client.generate([{"role": "user", "content": "Count to one hundred."}], LONG):
            received.append(event)
            if len(received) == 2:
                os.kill(client.pid, signal.SIGKILL)
    assert len(received) >= 2 and received[0].generated_tokens == 1  # what arrived stays with us
    old_pid = client.pid
    t0 = time.perf_counter()
    _, last = _run(client, [{"role": "user", "content": "Hi"}], model="smol")  # restarts and reloads
    print(f"\nrestart + reload + reply: {time.perf_counter() - t0:.1f} s")
    assert client.pid != old_pid and last.finish_reason in ("stop", "length")


def test_close_during_a_load_ends_the_worker_at_once(smollm2_path, tmp_path, monkeypatch):
    # closing the app while a model loads: the worker leaves (exit code 0) instead of finishing the load
    monkeypatch.setenv("HEARTH_HOME", str(tmp_path))
    engine = EngineClient()
    events = engine.load(smollm2_path, LoadOptions(n_ctx=512, name="smol"))
    first = next(events)
    assert isinstance(first, LoadProgress) and first.stage == "resolve"
    proc = engine._proc
    engine.close()
    assert proc.exitcode == 0, "the worker should have left by itself, not been killed"
    rest = []
    with pytest.raises(WorkerDiedError):
        for event in events:
            rest.append(event)
    assert not any(isinstance(e, ModelInfo) for e in rest), "the load was not cut short"
