"""Serving and KV-cache memory: requests wait for a cache instead of being lost when memory runs out, a
request no cache can be made for fails with a clear error while the engine carries on, and
`hearth serve --kv-dtype f16` halves each request's cache."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.cli import main
from engine.loader import load_model
from engine.server.scheduler import Engine, SeqParams
from tests.engine.tiny_models import TinySpec, write_tiny_gguf


class TightMemory:
    """A model whose new_cache raises MemoryError (as numpy or CuPy do) once `limit` caches exist."""

    def __init__(self, model, limit: int):
        self.model, self.limit, self.made = model, limit, 0

    def new_cache(self, n_ctx, dtype):
        if self.made >= self.limit:
            raise MemoryError("Out of memory allocating 1,048,576 bytes")
        self.made += 1
        return self.model.new_cache(n_ctx, dtype)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture
def lm(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    return load_model(path)


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int = 6) -> list[list]:
    """Submit every prompt at once; the Deltas each one received, once all have finished."""
    replies: list[list] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def emitter(i):
        def emit(delta):
            replies[i].append(delta)
            if delta.finish_reason or delta.error:
                done[i].set()

        return emit

    for i, ids in enumerate(prompts):
        engine.submit(SeqParams(prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True), emitter(i))
    for ev in done:
        assert ev.wait(60), "a request never finished"
    return replies


def test_requests_wait_for_a_cache_when_memory_runs_out(lm):
    model = TightMemory(lm.model, limit=2)
    engine = Engine(model, lm.tokenizer, n_ctx=64, max_seqs=4, prefix_cache_bytes=0)
    engine.start()
    try:
        replies = _run(engine, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]])
    finally:
        engine.stop()
    for deltas in replies:
        assert deltas[-1].error is None and deltas[-1].finish_reason == "length"
        assert sum(d.token is not None for d in deltas) == 6
    assert model.made == 2 and engine.max_batch_seen == 2  # two at a time, the others reused their caches


def test_a_request_no_cache_fits_for_fails_clearly_and_the_engine_goes_on(lm):
    model = TightMemory(lm.model, limit=0)
    engine = Engine(model, lm.tokenizer, n_ctx=64, max_seqs=4, prefix_cache_bytes=0)
    engine.start()
    try:
        (deltas,) = _run(engine, [[5, 6, 7]])
        error = deltas[-1].error
        assert error is not None and error.status == 503 and error.code == "out_of_memory"
        assert "--ctx" in error.message and "MemoryError" in error.message
        model.limit = 1  # memory came back: the next request is served
        (deltas,) = _run(engine, [[8, 9]])
        assert deltas[-1].error is None and deltas[-1].finish_reason == "length"
        assert engine.alive
    finally:
        engine.stop()


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_serve_kv_dtype_reaches_the_engine_and_its_caches(lm, monkeypatch, capsys, kv_dtype):
    """`hearth serve --kv-dtype`: the engine's caches (and the warm-up ones) take that precision. The
    engine is stopped right after its warm-up, before the server would start."""
    from engine.server import scheduler
    from engine.server.errors import ServeError

    made = []

    class Recording(scheduler.Engine):
        def __init__(self, model, *args, **kw):
            super().__init__(model, *args, **kw)
            made.append(self)

    def stop_after_warm_up(*args):
        raise ServeError("stopped by the test after the warm-up")

    monkeypatch.setattr(scheduler, "Engine", Recording)
    monkeypatch.setattr("engine.server.constraints.ll_tokenizer", stop_after_warm_up)
    argv = ["serve", "-m", str(lm.path), "--port", "0", "--ctx", "64", "--kv-dtype", kv_dtype]
    assert main(argv) == 1
    assert "stopped by the test after the warm-up" in capsys.readouterr().err
    (engine,) = made
    want = np.float16 if kv_dtype == "f16" else np.float32
    assert engine.kv_dtype == want and engine._take_cache([1, 2]).k.dtype == want
