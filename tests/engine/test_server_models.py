"""`hearth serve` serves the library's models, loading each on its first request (engine.server.pool).

The pool's rules (one load per model however many requests wait for it, at most max_loaded models, the
least recently used idle one unloaded for room or memory, busy ones never, keep-alive expiry, Ollama's
keep_alive 0 unload) are checked on stand-in engines; then a real server with the two starter models
(SmolLM2 loaded at start, Gemma 3 on request, through `hearth serve`'s own loader) is driven with
OpenAI's and Ollama's clients.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics
from engine.server.pool import (
    CatalogEntry,
    ModelNotServedError,
    ModelPool,
    Served,
    library_catalog,
    parse_duration,
)
from tests.engine.server_harness import LiveServer

# --- the pool on stand-in engines ----------------------------------------------------------------


class FakeEngine:
    def __init__(self):
        self.running = 0
        self.alive = True
        self.n_ctx = 64
        self.stopped = False

    def stop(self):
        self.stopped = True
        self.alive = False


class Loader:
    """Loads catalog entries as stand-ins; `need` bytes each (InsufficientMemoryError beyond what the pool
    says is available), `delay` seconds each."""

    def __init__(self, need: int = 0, delay: float = 0.0):
        self.need = need
        self.delay = delay
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, entry: CatalogEntry, available: int) -> Served:
        from engine.memory_guard import InsufficientMemoryError, KVShape, estimate

        with self.lock:
            self.calls.append((entry.id, available))
        time.sleep(self.delay)
        if self.need > available:
            shape = KVShape(1, 1, 1, 1, 0)
            raise InsufficientMemoryError(estimate(self.need, shape, 16, 1, available))
        return Served(entry.id, [entry.id, *entry.aliases], entry.path, FakeEngine(), object(),
                      weights_bytes=self.need)


def catalog(*ids: str):
    entries = [CatalogEntry(i, Path(f"/models/{i}.gguf"), (f"repo/{i}:file",)) for i in ids]
    return lambda: entries


def test_a_model_is_loaded_once_however_many_requests_wait_for_it():
    load = Loader(delay=0.3)
    pool = ModelPool(load, catalog("a", "b"))
    got = []
    threads = [threading.Thread(target=lambda: got.append(pool.acquire("a"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [c[0] for c in load.calls] == ["a"] and pool.loads == 1
    served = {s for s, _ in got}
    assert len(served) == 1 and next(iter(served)).leases == 4
    assert sorted(round(s, 1) > 0 for _, s in got) == [False, False, False, True]  # one paid the load
    # names: the alias, and any case
    assert pool.acquire("REPO/a:FILE")[0] is next(iter(served))


def test_an_unknown_model_is_a_404_naming_where_to_look():
    pool = ModelPool(Loader(), catalog("a"))
    with pytest.raises(ModelNotServedError) as e:
        pool.acquire("llama3:8b")
    assert e.value.status == 404 and "GET /v1/models" in e.value.message and "hearth pull" in e.value.message


def test_the_least_recently_used_idle_model_makes_room():
    pool = ModelPool(Loader(), catalog("a", "b", "c"), max_loaded=2)
    a, _ = pool.acquire("a")
    b, _ = pool.acquire("b")
    pool.release(a)
    time.sleep(0.01)
    pool.release(b)
    c, _ = pool.acquire("c")
    assert [s.id for s in pool.loaded()] == ["b", "c"] and a.engine.stopped and not b.engine.stopped
    assert pool.metrics.loaded.value() == 2


def test_a_busy_model_is_never_unloaded_the_load_waits_for_it():
    pool = ModelPool(Loader(), catalog("a", "b"), max_loaded=1, wait_s=30)
    a, _ = pool.acquire("a")
    a.engine.running = 1  # a request still decodes on it
    pool.release(a)
    done = []
    t = threading.Thread(target=lambda: done.append(pool.acquire("b")))
    t.start()
    time.sleep(0.5)
    assert not done and not a.engine.stopped  # b waits
    a.engine.running = 0
    with pool._cv:
        pool._cv.notify_all()  # (an engine's request ending wakes the pool at the next check)
    t.join(5)
    assert done and done[0][0].id == "b" and a.engine.stopped


def test_no_room_while_every_model_stays_busy_is_a_503():
    pool = ModelPool(Loader(), catalog("a", "b"), max_loaded=1, wait_s=0.3)
    pool.acquire("a")  # never released
    with pytest.raises(APIError) as e:
        pool.acquire("b")
    assert e.value.status == 503 and e.value.code == "server_busy" and "(a)" in e.value.message


def test_memory_plans_without_the_loaded_models_weights_and_evicts_for_room():
    # 10 units available; each model needs 6: the second fits only once the first is unloaded
    load = Loader(need=6)
    pool = ModelPool(load, catalog("a", "b"), max_loaded=3, available=lambda: 10)
    a, _ = pool.acquire("a")
    pool.release(a)
    b, _ = pool.acquire("b")
    assert load.calls == [("a", 10), ("b", 4), ("b", 10)]  # planned with a's weights taken off
    assert [s.id for s in pool.loaded()] == ["b"] and a.engine.stopped


def test_a_failed_load_leaves_nothing_behind():
    from models.errors import ModelFormatError

    def fail(entry, available):
        raise ModelFormatError(entry.path, "not a model file")

    pool = ModelPool(fail, catalog("a"))
    for _ in range(2):
        with pytest.raises(ModelFormatError):
            pool.acquire("a")
    assert not pool.loaded() and not pool._loading


def test_a_model_that_does_not_fit_alone_gets_the_memory_error():
    from engine.memory_guard import InsufficientMemoryError

    pool = ModelPool(Loader(need=20), catalog("a"), available=lambda: 10)
    with pytest.raises(InsufficientMemoryError):
        pool.acquire("a")
    assert not pool.loaded()
    pool2 = ModelPool(Loader(need=20), catalog("a"), available=lambda: 10)
    with pytest.raises(InsufficientMemoryError):  # a second try loads again (nothing left half-done)
        pool2.acquire("a")


def test_keep_alive_unloads_idle_models_but_not_the_pinned_one():
    pool = ModelPool(Loader(), catalog("a", "b"), keep_alive_s=0.2)
    pinned = Served("m", ["m"], Path("/models/m.gguf"), FakeEngine(), object(), pinned=True)
    pool.add(pinned)
    m, _ = pool.acquire("m")
    a, _ = pool.acquire("a")
    pool.release(m)
    pool.release(a)
    deadline = time.monotonic() + 5
    while a in pool.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.loaded() == [pinned] and a.engine.stopped
    # a request's own keep-alive: 0 unloads at once, even the pinned model
    m, _ = pool.acquire("m")
    pool.release(m, 0.0)
    assert pool.loaded() == [] and pinned.engine.stopped


def test_a_request_keep_alive_of_forever_keeps_a_model():
    pool = ModelPool(Loader(), catalog("a"), keep_alive_s=0.1)
    a, _ = pool.acquire("a")
    pool.release(a, math.inf)
    time.sleep(0.8)
    assert pool.loaded() == [a]
    assert pool.unload("A") and pool.loaded() == []  # Ollama's unload idiom
    assert not pool.unload("a")


def test_a_busy_model_is_unloaded_only_once_idle():
    pool = ModelPool(Loader(), catalog("a"))
    a, _ = pool.acquire("a")
    assert pool.unload("a") and pool.loaded() == [a]  # still leased
    pool.release(a)
    deadline = time.monotonic() + 5
    while pool.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.loaded() == []


def test_the_metrics_gauges_sum_over_engines():
    m = ServerMetrics()
    e1, e2 = object(), object()
    m.report_load(e1, 2, 1)
    m.report_load(e2, 3, 0)
    assert m.running.value() == 5 and m.waiting.value() == 1
    m.forget(e1)
    assert m.running.value() == 3 and m.waiting.value() == 0


@pytest.mark.parametrize("value, seconds", [
    (None, None), (10, 10.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), ("45", 45.0),
    ("-1", math.inf), (-1, math.inf), ("-5m", math.inf), ("0", 0.0), (0, 0.0),
])
def test_keep_alive_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 m", "m5", "", True, [5], {"s": 1}, "1d"])
def test_bad_keep_alive_is_a_400(value):
    with pytest.raises(APIError) as e:
        parse_duration(value)
    assert e.value.status == 400 and e.value.param == "keep_alive"


def _tiny_gguf(path: Path) -> None:
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_library_catalog_names_models_uniquely(tmp_path):
    from models.library import Library
    from models.starter import starter_path

    lib = Library()
    first = tmp_path / "one" / "Model-Q4_0.gguf"
    second = tmp_path / "two" / "model-q4_0.gguf"  # the same stem, but for case
    split = tmp_path / "Big-Q8_0-00001-of-00002.gguf"
    gone = tmp_path / "gone.gguf"
    for p in (first, second, split, gone):
        _tiny_gguf(p)
    for p in (first, second, split):
        lib.add(p, repo="org/repo", file=p.name, source="download")
    lib.add(gone, source="import")
    gone.unlink()
    entries = {e.id: e for e in library_catalog()}
    ids = set(entries)
    assert "Model-Q4_0" in ids and "Big-Q8_0" in ids and "gone" not in ids
    other = next(i for i in ids if i.startswith("model-q4_0-"))
    assert entries[other].path == second
    assert entries["Model-Q4_0"].answers("org/repo:Model-Q4_0.gguf")
    if starter_path("smollm2-135m-instruct").is_file():  # the library folder of this test is empty
        assert "smollm2-135m-instruct" in ids


# --- a real server over two models -----------------------------------------------------------------


HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def pool(smollm2_path, gemma3_path, tmp_path_factory):
    from engine.cli import build_parser
    from engine.commands_server import _precheck, load_served

    args = build_parser().parse_args(["serve", "--ctx", "256", "--max-seqs", "2", "--prefix-cache-mb", "8"])
    metrics = ServerMetrics()
    broken = tmp_path_factory.mktemp("models") / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)  # a header cut short
    entries = [CatalogEntry("gemma-3-270m", gemma3_path, ("gemma",)),
               CatalogEntry("smollm2-135m-instruct", smollm2_path, (smollm2_path.stem,)),
               CatalogEntry("broken", broken)]
    pool = ModelPool(
        lambda e, available: load_served(str(e.path), args, metrics, available=available, name=e.id,
                                         aliases=e.aliases),
        lambda: entries, max_loaded=1, keep_alive_s=math.inf, metrics=metrics, precheck=_precheck,
    )
    pool.add(load_served(str(smollm2_path), args, metrics, pinned=True))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def server(pool):
    s = LiveServer(pool=pool)
    yield s
    s.close()


@pytest.fixture(scope="module")
def oai(server):
    return server.openai(300)


@pytest.fixture(scope="module")
def client(server):
    return server.ollama(300)


def _greedy(oai, model: str, n: int = 12) -> str:
    r = oai.chat.completions.create(model=model, messages=HI, max_tokens=n, temperature=0)
    return r.choices[0].message.content


@pytest.mark.slow
def test_models_are_listed_loaded_on_request_and_swapped(server, pool, oai, client, smollm2_path):
    smol = smollm2_path.stem
    # the -m model stands for its library entry
    assert [m.id for m in oai.models.list().data] == [smol, "gemma-3-270m", "broken"]
    tags = client.list().models
    assert [t.model for t in tags] == [smol, "gemma-3-270m", "broken"]
    assert tags[1].size == pool.catalog()[0].path.stat().st_size
    assert [m.model for m in client.ps().models] == [smol]
    loaded_show = client.show("smollm2-135m-instruct")
    before = _greedy(oai, "smollm2-135m-instruct")

    # Gemma on request: loaded, and SmolLM2 (idle) unloaded for it (one model at a time here)
    r = client.generate(model="gemma:latest", prompt="The capital of France is", options={"num_predict": 8,
                        "temperature": 0})
    assert r.done and r.response and r.load_duration > 0
    assert [m.model for m in client.ps().models] == ["gemma-3-270m"] and pool.loads == 1
    again = client.generate(model="gemma-3-270m", prompt="The capital of France is",
                            options={"num_predict": 8, "temperature": 0})
    assert again.response == r.response and again.load_duration == 0 and pool.loads == 1

    # SmolLM2 comes back through its library entry (under the id it was served by at start too), with the
    # same greedy reply as before its unload
    assert _greedy(oai, "smollm2-135m-instruct") == before
    assert _greedy(oai, smol) == before
    assert [m.model for m in client.ps().models] == ["smollm2-135m-instruct"] and pool.loads == 2

    # Ollama's unload idiom, then the model list is whole again
    r = httpx.post(f"http://127.0.0.1:{server.port}/api/generate",
                   json={"model": "smollm2-135m-instruct", "keep_alive": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    deadline = time.monotonic() + 10
    while client.ps().models and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.ps().models == []
    assert {m.id for m in oai.models.list().data} == {"gemma-3-270m", "smollm2-135m-instruct", "broken"}
    # /api/show of models not loaded reads their files: nothing loads
    loads = pool.loads
    shown = client.show("smollm2-135m-instruct:latest")
    assert shown.template == loaded_show.template and shown.capabilities == loaded_show.capabilities
    assert shown.details == loaded_show.details and shown.modelinfo == loaded_show.modelinfo
    gemma = client.show("gemma-3-270m")
    assert gemma.capabilities == ["completion"] and gemma.details.family == "gemma3"
    assert gemma.modelinfo["gemma3.context_length"] == 32768 and gemma.details.quantization_level == "Q4_K_M"
    with pytest.raises(ollama.ResponseError) as e:
        client.show("broken")
    assert e.value.status_code == 500 and "broken" in e.value.error
    assert pool.loads == loads and client.ps().models == []
    health = httpx.get(f"http://127.0.0.1:{server.port}/health").json()
    assert health["status"] == "ok" and health["loaded"] == []


@pytest.mark.slow
def test_a_load_waits_for_a_streaming_reply_on_the_other_model(server, pool, oai):
    # one model at a time: Gemma's request waits for SmolLM2's stream to end, which runs to its end
    _greedy(oai, "smollm2-135m-instruct", 2)  # loaded
    stream = oai.chat.completions.create(model="smollm2-135m-instruct", messages=HI, max_tokens=40,
                                         temperature=0, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    other = {}
    t = threading.Thread(target=lambda: other.update(text=_greedy(oai, "gemma-3-270m", 4)))
    t.start()
    time.sleep(1.0)
    assert "text" not in other  # waiting for the stream's lease
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    t.join(120)
    assert other.get("text") is not None
    assert [s.id for s in pool.loaded()] == ["gemma-3-270m"]


@pytest.mark.slow
def test_unknown_models_and_bad_keep_alive_are_errors_in_each_api(server, oai, client):
    with pytest.raises(openai.NotFoundError) as e:
        _greedy(oai, "llama3:8b")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(ollama.ResponseError) as e2:
        client.chat(model="llama3:8b", messages=HI)
    assert e2.value.status_code == 404 and "hearth pull" in e2.value.error
    r = httpx.post(f"http://127.0.0.1:{server.port}/api/chat",
                   json={"model": "gemma-3-270m", "messages": HI, "keep_alive": "soon"}, timeout=60)
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    r = httpx.post(f"{server.url}/chat/completions",
                   json={"model": "gemma-3-270m", "messages": HI, "ttl": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl"


@pytest.mark.slow
def test_a_model_that_fails_to_load_says_which_and_why(server, pool, oai):
    loaded = [s.id for s in pool.loaded()]
    for _ in range(2):  # a failed load leaves nothing behind: the second request tries again
        with pytest.raises(openai.InternalServerError) as e:
            _greedy(oai, "broken")
        body = e.value.body
        assert body["code"] == "model_load_failed" and "'broken'" in body["message"]
    assert [s.id for s in pool.loaded()] == loaded and not pool._loading


# --- Ollama's /api/pull and /api/delete against the loopback Hub ----------------------------------


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from tests.models.test_library_cli import tiny_gguf_hub

    s = tiny_gguf_hub(monkeypatch, tmp_path)
    yield s
    s.close()


@pytest.fixture
def library_server(hub, smollm2_path):
    from engine.cli import build_parser
    from engine.commands_server import load_served

    args = build_parser().parse_args(["serve", "--ctx", "128", "--max-seqs", "1", "--prefix-cache-mb", "0"])
    pool = ModelPool(lambda e, a: pytest.fail("no load expected"), library_catalog)
    pool.add(load_served(str(smollm2_path), args, pool.metrics, pinned=True))
    s = LiveServer(pool=pool)
    yield s, pool
    s.close()
    pool.close()


@pytest.mark.slow
def test_pull_and_delete_through_ollamas_client(library_server, hub):
    from models.paths import models_dir

    server, pool = library_server
    client = server.ollama(120)
    lines = list(client.pull("hf.co/org/Tiny-GGUF:Q8_0", stream=True))
    statuses = [p.status for p in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    file_lines = [p for p in lines if p.status == "pulling Tiny-Q8_0.gguf"]
    assert file_lines and file_lines[-1].completed == file_lines[-1].total > 0
    path = models_dir() / "hub" / "org" / "Tiny-GGUF" / "Tiny-Q8_0.gguf"
    assert path.is_file()
    assert "Tiny-Q8_0" in [m.model for m in client.list().models]
    entry = next(e for e in pool.catalog() if e.id == "Tiny-Q8_0")
    assert entry.answers("hf.co/org/Tiny-GGUF:Q8_0") and entry.answers("HF.CO/org/tiny-gguf:q8_0")

    cdn = len([e for e in hub.log if e["path"].startswith("/cdn/")])
    assert client.pull("hf.co/org/Tiny-GGUF:Q8_0").status == "success"  # pulled already: nothing fetched
    assert len([e for e in hub.log if e["path"].startswith("/cdn/")]) == cdn

    assert client.delete("hf.co/org/Tiny-GGUF:Q8_0").status == "success"
    assert not path.exists() and "Tiny-Q8_0" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("hf.co/org/Tiny-GGUF:Q8_0")
    assert e.value.status_code == 404


@pytest.mark.slow
def test_pull_errors_say_what_to_do(library_server, hub):
    server, _ = library_server
    url = f"http://127.0.0.1:{server.port}/api/pull"
    r = httpx.post(url, json={"model": "llama3.2", "stream": False}, timeout=60)
    assert r.status_code == 400 and "hf.co/ORG/REPO" in r.json()["error"]
    r = httpx.post(url, json={"model": "hf.co/org/Tiny-GGUF:Q2_K", "stream": False}, timeout=60)
    assert r.status_code == 404 and "offers: Q4_K_M, Q8_0" in r.json()["error"]
    r = httpx.post(url, json={"model": "hf.co/org/gated-GGUF", "stream": False}, timeout=60)
    assert r.status_code == 403 and "login" in r.json()["error"]
    # streamed: the error is the stream's last line, as Ollama writes it
    r = httpx.post(url, json={"model": "hf.co/org/Tiny-GGUF:Q2_K"}, timeout=60)
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"} and "offers" in lines[-1]["error"]
    r = httpx.post(url, json={"model": "hf.co/org/Tiny-GGUF", "stream": "yes"}, timeout=60)
    assert r.status_code == 400
    r = httpx.request("DELETE", f"http://127.0.0.1:{server.port}/api/delete", json={}, timeout=60)
    assert r.status_code == 400


def test_hub_names():
    from engine.server.manage import hub_spec

    assert hub_spec("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M") == (
        "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert hub_spec("huggingface.co/org/repo:latest") == "org/repo"
    assert hub_spec("org/repo:model.gguf") == "org/repo:model.gguf"
    assert hub_spec("smollm2-135m-instruct:latest") == "smollm2-135m-instruct"
    for bad in ("llama3.2", "qwen3:8b", "hf.co/justone", "hf.co//x"):
        with pytest.raises(APIError) as e:
            hub_spec(bad)
        assert e.value.status == 400


def test_a_busy_model_is_not_deleted_under_its_requests():
    pool = ModelPool(Loader(), catalog("a"))
    a, _ = pool.acquire("a")
    assert not pool.unload_now(a.path) and pool.loaded() == [a]
    pool.release(a)
    assert pool.unload_now(a.path) and pool.loaded() == []
    assert pool.unload_now(Path("/models/none.gguf"))


def test_engines_sharing_a_compute_lock_take_turns_and_never_overlap():
    # two models' engines in one server: their steps never run at once (Numba's workqueue layer would
    # abort), and neither starves the other
    from engine.loader import load_model
    from engine.server.pool import FairLock
    from engine.server.scheduler import Engine, SeqParams

    tiny = Path(__file__).parents[1] / "fixtures" / "tiny" / "llama"
    lock = FairLock()
    inside, overlaps, steps = [0], [0], {0: [], 1: []}
    engines = []
    for k in range(2):
        lm = load_model(tiny)
        real = lm.model.forward_batch

        def forward_batch(*a, _real=real, _k=k, **kw):
            inside[0] += 1
            overlaps[0] += inside[0] > 1
            steps[_k].append(time.monotonic())
            time.sleep(0.002)  # a step long enough that an overlap would be seen
            try:
                return _real(*a, **kw)
            finally:
                inside[0] -= 1

        lm.model.forward_batch = forward_batch
        engines.append(Engine(lm.model, lm.tokenizer, n_ctx=128, max_seqs=2, prefix_cache_bytes=0,
                              compute_lock=lock))
    for e in engines:
        e.start()
    done = []
    try:
        jobs = []
        for e in engines:
            for _ in range(2):
                params = SeqParams(prompt_ids=[1, 2, 3], max_tokens=40, temperature=0.0, ignore_eos=True)
                jobs.append(e.submit(params, lambda d: done.append(d) if d.finish_reason else None))
        deadline = time.monotonic() + 60
        while len(done) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for e in engines:
            e.stop()
    assert len(done) == 4 and all(d.error is None for d in done)
    assert overlaps[0] == 0 and len(steps[0]) >= 30 and len(steps[1]) >= 30
    # taking turns: while both decode, neither runs many steps in a row
    merged = sorted([(t, 0) for t in steps[0]] + [(t, 1) for t in steps[1]])
    both = [k for t, k in merged if max(steps[0][0], steps[1][0]) <= t <= min(steps[0][-1], steps[1][-1])]
    longest = max(len(list(g)) for _, g in __import__("itertools").groupby(both))
    assert longest <= 3
