"""Embedding through the worker (EngineClient.embed): the same vectors as engine.embed in process, one
embedder kept beside the chat model (replaced, dropped on unload), typed errors for a missing or broken
model, and a reply that goes on untouched while a question is embedded."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.client import EngineClient, LoadOptions
from engine.errors import EmbeddingModelError
from engine.generate import GenerationParams

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
BERT = TINY / "bert-embed"
NOMIC = TINY / "nomic-embed"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEARTH_HOME", str(tmp_path_factory.mktemp("embed-home")))
        engine = EngineClient(threads=2)
    yield engine
    engine.close()


def _in_process(path: Path, texts: list[str], **kw) -> np.ndarray:
    from engine.embed import embed_texts
    from engine.loader import load_model

    return embed_texts(load_model(path), texts, **kw)[0]


def test_embed_through_the_worker_matches_in_process(client):
    texts = ["the cat sat on the mat", "a dog", "hello world"]
    got = client.embed(BERT, texts)
    assert got.shape == (3, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, _in_process(BERT, texts), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert client.status().embedding_model["name"] == "bert-embed"

    # another model replaces it; a search task applies the family's prompt (nomic-bert: "search_query: ")
    query = client.embed(NOMIC, ["what is a hearth?"], task="query")
    np.testing.assert_allclose(query, _in_process(NOMIC, ["search_query: what is a hearth?"]), rtol=1e-5,
                               atol=1e-6)
    assert client.status().embedding_model["name"] == "nomic-embed"
    # a text longer than the tiny BERT's 24 tokens: refused, or cut when asked
    long = " ".join(["word"] * 80)
    from engine.errors import EmbeddingInputError

    with pytest.raises(EmbeddingInputError):
        client.embed(BERT, [long])
    cut = client.embed(BERT, [long], truncate=True)
    np.testing.assert_allclose(cut, _in_process(BERT, [long], truncate=True), rtol=1e-5, atol=1e-6)

    client.unload()
    assert client.status().embedding_model is None


def test_a_missing_or_broken_embedding_model_is_a_typed_error(client, tmp_path):
    with pytest.raises(EmbeddingModelError, match="cannot be used") as missing:
        client.embed(tmp_path / "nowhere.gguf", ["x"])
    assert missing.value.path.endswith("nowhere.gguf")
    broken = tmp_path / "broken-embed"
    shutil.copytree(BERT, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(EmbeddingModelError, match="could not be loaded"):
        client.embed(broken, ["x"])
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(EmbeddingModelError, match="bad.gguf"):
        client.embed(bad_gguf, ["x"])
    # the worker is fine after all that
    assert client.embed(BERT, ["still here"]).shape == (1, 32)


@pytest.mark.slow
def test_a_reply_goes_on_untouched_while_a_question_is_embedded(client, smollm2_path):
    client.load_and_wait(smollm2_path, LoadOptions(n_ctx=512, batch_size=64, prefix_cache_mb=0, name="smol"))
    params = GenerationParams(max_tokens=48, temperature=0.0)
    conv = [{"role": "user", "content": "Count from one to twenty in words."}]
    alone = "".join(e.text for e in client.generate(conv, params, reuse=False))
    vectors: list[np.ndarray] = []
    texts: list[str] = []
    first = threading.Event()
    for event in client.generate(conv, params, reuse=False):
        texts.append(event.text)
        if event.token is not None and not first.is_set():
            first.set()
            vectors.append(client.embed(BERT, ["during a reply"]))  # answered while the reply streams
            assert client.status().busy, "the reply was still being written"
    assert "".join(texts) == alone
    np.testing.assert_allclose(vectors[0], _in_process(BERT, ["during a reply"]), rtol=1e-5, atol=1e-6)
    client.unload("smol")
    assert client.status().embedding_model is not None, "unloading the chat model keeps the embedder"


def test_an_embedding_model_that_does_not_fit_is_refused_before_loading():
    from engine.embedder import Embedder

    embedder = Embedder()
    with pytest.raises(EmbeddingModelError, match="needs about .* MiB are free beside the chat model"):
        embedder.embed(BERT, ["x"], available=64 << 20)
    assert embedder.status() is None
    assert embedder.embed(BERT, ["x"]).shape == (1, 32) and embedder.status()["name"] == "bert-embed"
    assert embedder.nbytes > (BERT / "model.safetensors").stat().st_size
    embedder.drop()
    assert embedder.status() is None and embedder.nbytes == 0


def test_search_tasks_get_the_models_own_prompts(tmp_path):
    import json

    from engine.embed import task_prompt
    from engine.loader import load_model

    qwen = load_model(TINY / "qwen3-embed")  # sentence-transformers prompts: "query", and "document" empty
    assert task_prompt(qwen, "query") == "Instruct: find the answer\nQuery:"
    assert task_prompt(qwen, "document") == ""
    nomic = load_model(NOMIC)  # none named: nomic-bert's own task prefixes
    assert task_prompt(nomic, "query") == "search_query: "
    assert task_prompt(nomic, "document") == "search_document: "
    assert task_prompt(load_model(BERT), "query") == "", "no guessing for a model that names none"
    e5 = tmp_path / "e5-style"
    shutil.copytree(BERT, e5)
    (e5 / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "passage": "passage: "}})
    )
    e5_lm = load_model(e5)
    assert (task_prompt(e5_lm, "query"), task_prompt(e5_lm, "document")) == ("query: ", "passage: ")
    with pytest.raises(ValueError):
        task_prompt(e5_lm, "cluster")
