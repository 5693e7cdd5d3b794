"""Embeddings (engine.embed, engine/arch/bert.py) against goldens from transformers.

tests/fixtures/tiny/bert-embed (a BertModel with a WordPiece tokenizer.json and bge-style
sentence-transformers files: CLS pooling, Normalize, max_seq_length 24) and qwen3-embed (a Qwen3Model laid
out as Qwen3-Embedding: <|endoftext|> appended, last-token pooling, a "query" prompt) hold
embedding_golden.json: each text's token ids and its mean, CLS and last-token pools of last_hidden_state,
computed by transformers (scripts/make_tiny_checkpoints.py bert-embed qwen3-embed). The BERT folder is
also converted with `hearth convert` to llama.cpp's bert GGUF layout and checked the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import embed
from engine.errors import EmbeddingInputError, EmbeddingOnlyModelError
from engine.loader import load_model

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"
BERT, QWEN3 = TINY / "bert-embed", TINY / "qwen3-embed"
TOL = 2e-5  # float32 sums in another order than PyTorch's


def causal_attention(attend_segments):
    """A mutation of engine.arch.encoder.attend_segments: each query sees only the keys up to its own."""

    def causal(q, k, v, starts):
        heads, n, hd = q.shape
        out = np.empty((n, heads * hd), np.float32)
        for i in range(n):
            a = starts[starts <= i].max()
            out[i] = attend_segments(q[:, a : i + 1], k[:, a : i + 1], v[:, a : i + 1],
                                     np.array([0, i + 1 - a]))[-1]
        return out

    return causal


def golden(folder: Path) -> dict:
    return json.loads((folder / "embedding_golden.json").read_text())


def unit(rows) -> np.ndarray:
    x = np.asarray(rows, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def bert():
    return load_model(BERT)


@pytest.fixture(scope="module")
def bert_gguf(tmp_path_factory):
    from engine.cli import main

    out = tmp_path_factory.mktemp("bert") / "bert-embed-F32.gguf"
    assert main(["convert", str(BERT), "--to", "F32", "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def qwen3():
    return load_model(QWEN3)


def test_bert_folder_matches_transformers(bert):
    g = golden(BERT)
    assert bert.embedding.pooling == "cls" and bert.embedding.encoder_only and bert.embedding.max_tokens == 24
    assert [bert.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    for ids, mean, cls in zip(g["ids"], g["mean"], g["cls"]):
        hidden = bert.model.hidden_states(ids)
        assert np.abs(embed.pool(hidden, "mean") - mean).max() < TOL
        assert np.abs(embed.pool(hidden, "cls") - cls).max() < TOL
    vectors, counts = embed.embed_texts(bert, g["texts"])
    assert counts == [len(x) for x in g["ids"]]
    assert np.abs(vectors - unit(g["cls"])).max() < TOL
    raw, _ = embed.embed_texts(bert, g["texts"], normalize=False)
    assert np.abs(raw - np.asarray(g["cls"])).max() < TOL


def test_pooling_and_attention_mutations_miss_the_golden(bert, monkeypatch):
    # the goldens can tell a wrong pooling and one-way attention from the real thing
    g = golden(BERT)
    ids = g["ids"][0]
    hidden = bert.model.hidden_states(ids)
    assert np.abs(embed.pool(hidden, "mean") - g["cls"][0]).max() > 0.1
    from engine.arch import bert as bert_arch
    from engine.arch.encoder import attend_segments

    monkeypatch.setattr(bert_arch, "attend_segments", causal_attention(attend_segments))
    assert np.abs(embed.pool(bert.model.hidden_states(ids), "cls") - g["cls"][0]).max() > 0.1


def test_converted_bert_gguf_matches_transformers(bert_gguf):
    from gguf import GGUFReader

    g = golden(BERT)
    lm = load_model(bert_gguf)
    assert lm.tokenizer.kind == "bert" and lm.embedding.pooling == "cls" and lm.embedding.encoder_only
    assert [lm.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    vectors, _ = embed.embed_texts(lm, g["texts"])
    assert np.abs(vectors - unit(g["cls"])).max() < TOL
    # the keys as llama.cpp reads them (gguf-py's own reader and constants)
    reader = GGUFReader(bert_gguf)
    fields = reader.fields
    assert int(fields["bert.pooling_type"].parts[-1][0]) == 2
    assert bool(fields["bert.attention.causal"].parts[-1][0]) is False
    vocab = fields["tokenizer.ggml.tokens"]
    tokens = [bytes(vocab.parts[i]).decode() for i in vocab.data]
    assert tokens[:3] == ["[PAD]", "[UNK]", "[CLS]"] and "\u2581hello" in tokens and "ding" in tokens
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "position_embd.weight", "token_types.weight", "token_embd_norm.bias",
            "blk.1.attn_output_norm.weight", "blk.1.layer_output_norm.bias", "blk.0.ffn_up.bias"} <= names


def test_quantized_bert_gguf_stays_close(bert_gguf, tmp_path):
    from engine.cli import main

    out = tmp_path / "bert-Q8_0.gguf"
    assert main(["convert", str(BERT), "--to", "Q8_0", "-o", str(out)]) == 0
    g = golden(BERT)
    vectors, _ = embed.embed_texts(load_model(out), g["texts"])
    cosine = (vectors * unit(g["cls"])).sum(axis=1)
    assert cosine.min() > 0.999


@pytest.mark.parametrize(
    "text",
    ["Hello, World!", "naïve café résumé", "embeddings of the worlds", "qwerty zzz", "日本 語", "a\tb\n  c",
     "it's 3.14", ""],
)
def test_gguf_wordpiece_tokenizer_matches_tokenizer_json(bert, bert_gguf, text):
    lm = load_model(bert_gguf)
    assert lm.tokenizer.encode_embedding(text) == bert.tokenizer.encode_embedding(text)


def test_inputs_past_the_context_are_refused_or_truncated(bert):
    g = golden(BERT)
    text = " ".join(["hello world"] * 20)
    with pytest.raises(EmbeddingInputError) as e:
        embed.embed_texts(bert, [text])
    assert e.value.code == "context_length_exceeded" and "24" in str(e.value)
    [ids] = embed.tokenize(bert, [text], limit=24, truncate=True)
    assert ids == g["long_ids"][:23] + [g["long_ids"][-1]] and ids[-1] == bert.tokenizer.eos_id


def test_matryoshka_dimensions_are_renormalised(bert):
    g = golden(BERT)
    vectors, _ = embed.embed_texts(bert, g["texts"][:2], dims=8)
    assert vectors.shape == (2, 8)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    assert np.abs(vectors - unit(np.asarray(g["cls"])[:2, :8])).max() < TOL
    for bad in (0, 33):
        with pytest.raises(EmbeddingInputError) as e:
            embed.embed_texts(bert, ["a"], dims=bad)
        assert e.value.field == "dimensions"


def test_an_encoder_cannot_chat(bert):
    with pytest.raises(EmbeddingOnlyModelError):
        bert.model.forward([2, 3], bert.model.new_cache(8))


def test_qwen3_embedding_pools_the_closing_token(qwen3):
    g = golden(QWEN3)
    spec = qwen3.embedding
    assert spec.pooling == "last" and spec.dedicated and not spec.encoder_only
    ids = [qwen3.tokenizer.encode_embedding(t) for t in g["texts"]]
    assert ids == g["ids"] and all(x[-1] == qwen3.tokenizer._hf.token_to_id("<|endoftext|>") for x in ids)
    vectors, _ = embed.embed_texts(qwen3, g["texts"])
    assert np.abs(vectors - unit(g["last"])).max() < TOL
    assert np.abs(vectors - unit(g["mean"])).max() > 0.05  # mean pooling would miss it
    query, _ = embed.embed_texts(qwen3, g["query"]["texts"], prompt_name="query")
    assert np.abs(query - unit(g["query"]["last"])).max() < TOL
    with pytest.raises(EmbeddingInputError):
        embed.embed_texts(qwen3, ["x"], prompt_name="passage")


def test_hidden_states_leave_decoding_alone(qwen3):
    # the final-hidden-states path and the logits path share the layers: logits still match after it
    ids = golden(QWEN3)["ids"][0]
    before = qwen3.model.forward(ids, qwen3.model.new_cache(64)).copy()
    qwen3.model.hidden_states(ids)
    after = qwen3.model.forward(ids, qwen3.model.new_cache(64))
    assert np.array_equal(before, after)


def test_a_chat_model_embeds_by_mean_pooling():
    lm = load_model(TINY / "qwen3")
    assert lm.embedding.pooling == "mean" and not lm.embedding.dedicated
    ids = lm.tokenizer.encode_embedding("the cat")
    vectors, counts = embed.embed_texts(lm, ["the cat"])
    expected = lm.model.hidden_states(ids).mean(axis=0)
    assert counts == [len(ids)] and np.abs(vectors[0] - expected / np.linalg.norm(expected)).max() < 1e-6


def test_gguf_pooling_types():
    class Model:
        encoder_only = False

    md = {"general.architecture": "qwen3"}
    assert embed.embedding_spec(Path("m.gguf"), {**md, "qwen3.pooling_type": 3}, Model()).pooling == "last"
    assert embed.embedding_spec(Path("m.gguf"), {**md, "qwen3.pooling_type": 2}, Model()).pooling == "cls"
    assert embed.embedding_spec(Path("m.gguf"), md, Model()).pooling == "mean"
    from engine.errors import EmbeddingUnsupportedError

    with pytest.raises(EmbeddingUnsupportedError):
        embed.embedding_spec(Path("m.gguf"), {**md, "qwen3.pooling_type": 4}, Model())


def test_hearth_embed_prints_one_json_vector_per_input(capsys, monkeypatch):
    import io

    from engine.cli import main

    g = golden(BERT)
    assert main(["embed", "-m", str(BERT), *g["texts"][:2]]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert np.abs(np.asarray(rows) - unit(g["cls"][:2])).max() < TOL
    monkeypatch.setattr("sys.stdin", io.StringIO(g["texts"][2] + "\n\n" + g["texts"][3] + "\n"))
    assert main(["embed", "-m", str(BERT), "--no-normalize", "--dims", "5"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert np.abs(np.asarray(rows) - np.asarray(g["cls"])[2:, :5]).max() < TOL
    assert main(["embed", "-m", str(BERT), " ".join(["hello"] * 40)]) == 1
    assert "at most 24" in capsys.readouterr().err
    assert main(["embed", "-m", str(BERT), "--truncate", " ".join(["hello"] * 40)]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 32


def test_converted_qwen3_embedding_gguf_closes_inputs_as_the_folder_does(tmp_path):
    # llama.cpp's keys for a Qwen3-Embedding GGUF: qwen3.pooling_type 3 and <|endoftext|> as an added EOS
    from engine.cli import main

    out = tmp_path / "qwen3-embed.gguf"
    assert main(["convert", str(QWEN3), "--to", "F32", "-o", str(out)]) == 0
    lm = load_model(out)
    g = golden(QWEN3)
    assert lm.embedding.pooling == "last" and lm.embedding.source == "qwen3.pooling_type"
    assert lm.tokenizer.add_eos and lm.tokenizer.token_text(lm.tokenizer.eos_id) == "<|endoftext|>"
    assert [lm.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    vectors, _ = embed.embed_texts(lm, g["texts"])
    assert np.abs(vectors - unit(g["last"])).max() < TOL
