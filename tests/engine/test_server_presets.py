"""Ollama's created models on `hearth serve`: /api/create (Modelfiles too), /api/copy, /api/show and
/api/delete of presets (engine.server.modelfile, models.library.Preset), driven with Ollama's own client
against a live server over the SmolLM2 starter. A preset runs on its base's engine: the pool here fails any
load, so every reply below comes from the one SmolLM2 loaded at start.
"""

from __future__ import annotations

import json
import math
import sqlite3

import httpx
import ollama
import pytest

from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics
from engine.server.modelfile import (
    apply_parameters,
    conversation,
    parameters,
    parameters_text,
    parse_modelfile,
    template,
)
from engine.server.pool import ModelPool, library_catalog
from models.library import Library, Preset
from tests.engine.server_harness import LiveServer

MODELFILE = '''# a terse pirate
FROM {base}
PARAMETER temperature 0
PARAMETER num_predict 6
PARAMETER stop "<|im_end|>"
SYSTEM """You are Captain Hook, a pirate.
Answer like a pirate."""
MESSAGE user Who are you?
MESSAGE assistant "Captain Hook, arr."
LICENSE MIT
'''

# --- Modelfiles and parameters, no server -------------------------------------------------------------


def test_a_modelfile_parses_as_ollamas_client_sends_it():
    fields = parse_modelfile(MODELFILE.format(base="smol"))
    assert fields["from"] == "smol"
    assert fields["parameters"] == {"temperature": 0.0, "num_predict": 6, "stop": ["<|im_end|>"]}
    assert fields["system"] == "You are Captain Hook, a pirate.\nAnswer like a pirate."
    assert fields["messages"] == [{"role": "user", "content": "Who are you?"},
                                  {"role": "assistant", "content": "Captain Hook, arr."}]
    assert fields["license"] == ["MIT"]
    two = parse_modelfile("from smol\nparameter stop A\nPARAMETER\tstop \"B C\"\nparameter top_k 5\n")
    assert two["parameters"] == {"stop": ["A", "B C"], "top_k": 5}


@pytest.mark.parametrize("text, says", [
    ("PARAMETER top_k 4", "no FROM line"),
    ("FROM smol\nFROB x", "unknown instruction 'FROB'"),
    ("FROM smol\nSYSTEM \"\"\"never closed", "never closed"),
    ("FROM smol\nPARAMETER temperature", "takes a name and a value"),
    ("FROM smol\nPARAMETER colour red", "unknown parameter 'colour'"),
    ("FROM smol\nPARAMETER temperature hot", "invalid float value 'hot'"),
    ("FROM smol\nPARAMETER num_predict 2.5", "invalid int value"),
    ("FROM smol\nMESSAGE narrator Once upon a time", "MESSAGE takes a role"),
])
def test_bad_modelfiles_are_400s_that_say_what_to_write(text, says):
    with pytest.raises(APIError) as e:
        parse_modelfile(text)
    assert e.value.status == 400 and says in e.value.message


def test_parameters_are_typed_and_held_to_a_requests_ranges():
    given = {"temperature": "0.5", "top_k": 3.0, "stop": "x", "use_mmap": "true", "seed": ["7"]}
    assert parameters(given) == {"temperature": 0.5, "top_k": 3, "stop": ["x"], "use_mmap": True, "seed": 7}
    for bad, says in (({"temperature": 9}, "[0.0, 2.0]"), ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
                      ({"num_predict": 0}, "num_predict"), ({"nope": 1}, "unknown parameter")):
        with pytest.raises(APIError) as e:
            parameters(bad)
        assert e.value.status == 400 and says in e.value.message
    assert parameters_text({"temperature": 0.0, "stop": ["a", "b"]}) == (
        f'{"temperature":<30} 0\n{"stop":<30} "a"\n{"stop":<30} "b"')


def test_go_templates_are_refused_jinja_ones_taken():
    with pytest.raises(APIError) as e:
        template("{{ if .System }}{{ .System }}{{ end }}{{ .Prompt }}")
    assert e.value.status == 400 and "Go template" in e.value.message
    assert "leave TEMPLATE out" in e.value.message
    jinja = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    assert template(jinja) == jinja


def test_a_preset_sets_the_conversation_and_the_requests_defaults():
    p = Preset("bot", "/m.gguf", system="S", messages=[{"role": "user", "content": "u0"}])
    chat = [{"role": "user", "content": "hi"}]
    assert conversation(p, chat) == [{"role": "system", "content": "S"}, {"role": "user", "content": "u0"},
                                     *chat]
    own = [{"role": "system", "content": "mine"}, *chat]
    assert conversation(p, own)[0]["content"] == "mine" and len(conversation(p, own)) == 3
    params = {"temperature": 0.0, "num_predict": 6, "stop": ["x"]}
    body = {"options": {"temperature": 0.7}}
    apply_parameters("/api/chat", body, params)
    assert body["options"] == {"temperature": 0.7, "num_predict": 6, "stop": ["x"]}
    body = {"max_tokens": 3}
    apply_parameters("/v1/chat/completions", body, params)
    assert body == {"max_tokens": 3, "temperature": 0.0, "stop": ["x"]}
    body = {"max_tokens": 3}
    apply_parameters("/v1/messages", body, params)
    assert body == {"max_tokens": 3, "temperature": 0.0, "stop_sequences": ["x"]}


def test_an_older_library_gets_the_presets_table(tmp_path):
    db = tmp_path / "library.sqlite3"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE models (id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE, repo TEXT, "
                  "revision TEXT, file TEXT, format TEXT NOT NULL, quant TEXT, size INTEGER NOT NULL, "
                  "architecture TEXT, params INTEGER, context_length INTEGER, sha256 TEXT, source TEXT NOT "
                  "NULL, added_at TEXT NOT NULL, used_at TEXT)")
    c.close()
    lib = Library(db_path=db, root=tmp_path)
    lib.save_preset(Preset("Bot", "/m.gguf", parameters={"stop": ["x"]}))
    lib.save_preset(Preset("bot", "/n.gguf", system="again"))  # the same name in another case: replaced
    (only,) = Library(db_path=db, root=tmp_path).presets()
    assert (only.name, only.base, only.system, only.parameters) == ("bot", "/n.gguf", "again", {})
    assert lib.remove_preset("BOT") and not lib.remove_preset("bot") and lib.presets() == []


def test_a_preset_runs_on_its_base_loaded_once():
    from pathlib import Path

    from engine.server.pool import CatalogEntry, Served

    path = Path("/models/a.gguf")
    bot = Preset("bot", str(path), system="S")
    entries = [CatalogEntry("a", path, ("repo/a:file",)), CatalogEntry("bot", path, preset=bot, base="a")]
    loads = []

    def load(entry, available):
        loads.append(entry.id)
        return Served(entry.id, [entry.id, *entry.aliases], entry.path, _Idle(), object())

    pool = ModelPool(load, lambda: entries)
    assert pool.preset("BOT:latest") is entries[1] and pool.preset("a") is None
    assert pool.base_of(entries[1]) is entries[0]
    s1, _ = pool.acquire("bot")
    s2, _ = pool.acquire("a")
    assert s1 is s2 and loads == ["a"] and not s1.answers("bot")
    assert [i for i, _, _ in pool.listing()] == ["a", "bot"]  # listed beside its loaded base


class _Idle:
    running = 0
    alive = True

    def stop(self):
        pass


# --- a live server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(smollm2_path):
    from engine.cli import build_parser
    from engine.commands_server import load_served

    args = build_parser().parse_args(["serve", "--ctx", "512", "--max-seqs", "1", "--prefix-cache-mb", "0"])
    s = load_served(str(smollm2_path), args, ServerMetrics(), pinned=True)
    yield s
    s.engine.stop()


class _Pool(ModelPool):
    def close(self) -> None:  # the module's one engine outlives each test's pool
        pass


def _no_load(entry, available):
    raise AssertionError(f"a preset loaded {entry.id} again instead of using the loaded engine")


@pytest.fixture
def live(served, smollm2_path):
    """A server over the loaded SmolLM2, serving this test's library (HEARTH_HOME) with SmolLM2 in it."""
    Library().add(smollm2_path, source="import")
    pool = _Pool(_no_load, library_catalog, keep_alive_s=math.inf)
    pool.add(served)
    s = LiveServer(pool=pool)
    yield s, pool
    s.close()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.port}{path}", json=body, timeout=120)


HI = [{"role": "user", "content": "Say hello."}]


@pytest.mark.slow
def test_create_from_a_modelfile_chat_show_copy_delete(live, served, smollm2_path):
    server, pool = live
    client = server.ollama(120)
    base = served.id
    assert base == smollm2_path.stem

    # the older API shape: the Modelfile's text, streamed status lines
    r = _post(server, "/api/create", {"model": "pirate", "modelfile": MODELFILE.format(base=base)})
    assert r.status_code == 200
    statuses = [json.loads(line)["status"] for line in r.text.splitlines()]
    assert statuses[0].startswith("using existing layer sha256:")
    assert statuses[-2:] == ["writing manifest", "success"]
    assert any(s.startswith("creating new layer") for s in statuses)

    # listed by both APIs, with the base named as its parent
    tags = {t.model: t for t in client.list().models}
    assert "pirate" in tags and base in tags and tags["pirate"].details.parent_model == base
    assert "pirate" in [m["id"] for m in httpx.get(f"{server.url}/models").json()["data"]]

    # served on the loaded engine: the system prompt and the MESSAGE lines open the prompt (the context
    # /api/generate returns is the prompt's tokens and the reply's), num_predict limits the reply
    g = client.generate(model="pirate", prompt="Where is the treasure?")
    prompt = served.lm.tokenizer.decode(g.context)
    assert "You are Captain Hook, a pirate." in prompt and "Captain Hook, arr." in prompt
    assert prompt.index("Captain Hook, a pirate") < prompt.index("Who are you?") < prompt.index("treasure")
    assert g.eval_count <= 6 and g.done_reason == "length"
    plain = client.generate(model=base, prompt="Where is the treasure?", options={"temperature": 0})
    assert "pirate" not in served.lm.tokenizer.decode(plain.context)
    # temperature 0 from the preset: the same reply twice; a request's own options override the preset's
    c1 = client.chat(model="pirate", messages=HI)
    c2 = client.chat(model="pirate:latest", messages=HI)
    assert c1.message.content == c2.message.content and c1.model == "pirate"
    bare = client.chat(model=base, messages=HI, options={"num_predict": 1})
    assert c1.prompt_eval_count > bare.prompt_eval_count
    short = client.chat(model="pirate", messages=HI, options={"num_predict": 2})
    assert short.eval_count <= 2
    # a request's own system prompt replaces the preset's
    mine = client.generate(model="pirate", prompt="Hi", system="You are a librarian.")
    assert "librarian" in served.lm.tokenizer.decode(mine.context)
    assert "Captain Hook, a pirate" not in served.lm.tokenizer.decode(mine.context)
    assert pool.loads == 0 and [s.id for s in pool.loaded()] == [base]

    # /api/show: what the Modelfile set, as Ollama shows it
    shown = client.show("pirate")
    assert shown.parameters.splitlines() == [f'{"temperature":<30} 0', f'{"num_predict":<30} 6',
                                            f'{"stop":<30} "<|im_end|>"']
    assert f"FROM {base}" in shown.modelfile and 'SYSTEM """You are Captain Hook' in shown.modelfile
    assert "PARAMETER stop <|im_end|>" in shown.modelfile and shown.license == "MIT"
    assert shown.template == client.show(base).template  # the base's own template
    raw = _post(server, "/api/show", {"model": "pirate"}).json()
    assert raw["system"].startswith("You are Captain Hook") and raw["messages"][1]["role"] == "assistant"

    # copy: a second name, the same preset
    assert client.copy("pirate", "pirate2").status == "success"
    g2 = client.generate(model="pirate2", prompt="Where is the treasure?")
    assert g2.response == g.response
    # /api/ps: the loaded model, and the presets served on it under their own names
    running = {m.model: m for m in client.ps().models}
    assert set(running) == {base, "pirate", "pirate2"}
    assert running["pirate2"].details.parent_model == base and running["pirate2"].context_length
    # a copy of the base model: its plain self under another name
    assert client.copy(base, "smol").status == "success"
    greedy = {"temperature": 0, "num_predict": 4}
    assert client.chat(model="smol", messages=HI, options=greedy).message.content == client.chat(
        model=base, messages=HI, options=greedy).message.content

    # delete: the preset goes, the base and its loaded engine stay
    assert client.delete("pirate").status == "success"
    names = [t.model for t in client.list().models]
    assert "pirate" not in names and "pirate2" in names and base in names
    assert {m.model for m in client.ps().models} == {base, "pirate2", "smol"}  # smol: the base's copy, used
    assert [s.id for s in pool.loaded()] == [base] and smollm2_path.is_file()
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="pirate", messages=HI)
    assert e.value.status_code == 404
    assert pool.loads == 0


@pytest.mark.slow
def test_create_with_ollamas_client_and_stop_strings(live, served):
    server, _ = live
    client = server.ollama(120)
    base = served.id
    full = client.chat(model=base, messages=HI, options={"temperature": 0, "num_predict": 24}).message.content
    word = next(w for w in full.split()[1:] if len(w) >= 3 and full.index(w) > 0)
    cut = full[:full.index(word)]
    # the client's own create (from, parameters, system, messages), streamed and not
    lines = list(client.create(model="cutter", from_=base, parameters={"temperature": 0, "num_predict": 24,
                                                                       "stop": [word]}, stream=True))
    assert lines[-1].status == "success"
    r = client.chat(model="cutter", messages=HI)
    assert r.message.content == cut and r.done_reason == "stop"
    assert client.create(model="echo", from_="cutter", system="Repeat the user's words.").status == "success"
    shown = client.show("echo")  # FROM a preset: its parameters carry over
    assert f'{"stop":<30} {json.dumps(word)}' in shown.parameters
    # re-creating a preset replaces it
    assert client.create(model="cutter", from_=base, parameters={"temperature": 0, "num_predict": 3}).status \
        == "success"
    assert client.chat(model="cutter", messages=HI).eval_count <= 3
    # a Jinja TEMPLATE renders the prompt in place of the model's
    jinja = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    client.create(model="plain", from_=base, template=jinja, system="Be brief.",
                  parameters={"num_predict": 2})
    prompt = served.lm.tokenizer.decode(client.generate(model="plain", prompt="Hi").context)
    assert "[system] Be brief.\n[user] Hi\n[assistant]" in prompt and "<|im_start|>" not in prompt
    assert client.show("plain").template == jinja
    # the OpenAI route takes the preset's parameters as defaults too
    oai = server.openai(120)
    reply = oai.chat.completions.create(model="cutter", messages=HI)
    assert reply.usage.completion_tokens <= 3 and reply.model == "cutter"


@pytest.mark.slow
def test_presets_persist_across_a_restart(live, served):
    server, _ = live
    client = server.ollama(120)
    client.create(model="keeper", from_=served.id, system="Keep it short.", parameters={"top_k": 5})
    # a new server over the same library (nothing loaded: the load would fail) sees the preset
    pool2 = _Pool(_no_load, library_catalog)
    s2 = LiveServer(pool=_with_default(pool2, served))
    try:
        c2 = s2.ollama(60)
        assert "keeper" in [t.model for t in c2.list().models]
        shown = c2.show("keeper:latest")
        assert "SYSTEM \"\"\"Keep it short.\"\"\"" in shown.modelfile and "top_k" in shown.parameters
    finally:
        s2.close()


def _with_default(pool, served):
    pool.add(served)
    return pool


@pytest.mark.slow
def test_create_and_copy_errors_say_what_to_do(live, served, tmp_path):
    server, _ = live
    base = served.id

    def create(body: dict) -> httpx.Response:
        return _post(server, "/api/create", {"stream": False, **body})

    cases = [
        ({"model": "x", "from": "llama3.2"}, 400, "GET /api/tags"),
        ({"model": "x", "modelfile": f"FROM {base}\nADAPTER ./lora.gguf"}, 400, "ADAPTER"),
        ({"model": "x", "modelfile": f"FROM {base}\nPARAMETER colour red"}, 400, "unknown parameter"),
        ({"model": "x", "modelfile": f"FROM {base}\nPARAMETER top_p lots"}, 400, "invalid float value"),
        ({"model": "x", "from": base, "parameters": {"temperature": 5}}, 400, "temperature"),
        ({"model": "x", "from": base, "template": "{{ .Prompt }}"}, 400, "Go template"),
        ({"model": "x", "from": base, "quantize": "q4_K_M"}, 400, "hearth convert"),
        ({"model": "x", "files": {"m.gguf": "sha256:" + "0" * 64}}, 400, "FROM"),
        ({"model": "x"}, 400, "'from' is required"),
        ({"model": "bad name!", "from": base}, 400, "is invalid"),
        ({"model": base, "from": base}, 400, "already exists"),
        ({"model": "x", "from": str(tmp_path / "none.gguf")}, 400, "nor a file"),
    ]
    for body, status, says in cases:
        r = create(body)
        assert r.status_code == status and says in r.json()["error"], (body, r.text)
    # the ollama client raises them as ResponseErrors, streamed or not
    with pytest.raises(ollama.ResponseError) as e:
        list(server.ollama(60).create(model="x", from_="llama3.2", stream=True))
    assert e.value.status_code == 400
    r = _post(server, "/api/blobs/sha256:" + "0" * 64, {})
    assert r.status_code == 501 and "FROM" in r.json()["error"]

    assert _post(server, "/api/copy", {"source": "nothing", "destination": "y"}).status_code == 404
    r = _post(server, "/api/copy", {"source": base, "destination": "no good"})
    assert r.status_code == 400 and "destination" in r.json()["error"]
    assert _post(server, "/api/copy", {"source": base, "destination": "y"}).status_code == 200
    r = _post(server, "/api/copy", {"source": base, "destination": "Y"})
    assert r.status_code == 400 and "already exists" in r.json()["error"]
    r = _post(server, "/api/push", {"model": "y"})
    assert r.status_code == 501


@pytest.mark.slow
def test_a_gguf_path_is_a_from(live, served, smollm2_path, tmp_path):
    server, pool = live
    client = server.ollama(60)
    assert client.create(model="bypath", from_=str(smollm2_path), parameters={"num_predict": 2}).status \
        == "success"
    r = client.chat(model="bypath", messages=HI)
    assert r.eval_count <= 2 and pool.loads == 0
    # a file that is no model
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    resp = _post(server, "/api/create", {"model": "junk", "from": str(junk), "stream": False})
    assert resp.status_code == 400 and "junk.gguf" in resp.json()["error"]
