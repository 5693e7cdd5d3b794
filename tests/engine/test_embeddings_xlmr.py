"""XLM-RoBERTa encoders (bge-m3, multilingual-e5: engine/arch/bert.py with RoBERTa's position offset, the
SentencePiece unigram tokenizer of engine/tokenizer_ugm.py) against goldens from transformers.

tests/fixtures/tiny/xlmr-embed (scripts/make_tiny_checkpoints.py xlmr-embed) is a 2-layer XLMRobertaModel
(positions from pad_token_id + 1, one token type) with a unigram tokenizer.json trained by sentencepiece on a
multilingual text (nmt_nfkc normalization: its precompiled charsmap), fairseq's id layout, and bge-m3's
sentence-transformers files (CLS pooling). embedding_golden.json holds each text's ids and pools. The folder
is converted to llama.cpp's layout (a `bert` GGUF with a `t5` tokenizer) and checked the same way, and the
GGUF's rebuilt tokenizer is checked against tokenizer.json on multilingual strings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from engine import embed
from engine.loader import load_model

XLMR = Path(__file__).parents[1] / "fixtures" / "tiny" / "xlmr-embed"
TOL = 2e-5

STRINGS = [
    "Hello, World!", "Hello  world ", "  leading spaces", "tabs\tand\nnewlines", "Straße und Mädchen",
    "naïve café résumé", "¿Dónde está la biblioteca?", "Привет, мир!", "你好，世界。", "日本語のテキストです",
    "Γειά σου κόσμε", "مرحبا بالعالم", "नमस्ते दुनिया", "ﬁne ＡＢＣ １２３ ①", "emoji 😀 and ™ ½",
    "query: what is the capital of France?", "<mask> and </s> as text", "x" * 40, "",
]


def golden() -> dict:
    return json.loads((XLMR / "embedding_golden.json").read_text())


def unit(rows) -> np.ndarray:
    x = np.asarray(rows, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def max_error(model, pooling: str = "cls") -> float:
    g = golden()
    return max(np.abs(embed.pool(model.hidden_states(ids), pooling) - np.asarray(want)).max()
               for ids, want in zip(g["ids"], g[pooling]))


@pytest.fixture(scope="module")
def xlmr():
    return load_model(XLMR)


@pytest.fixture(scope="module")
def xlmr_gguf(tmp_path_factory):
    from engine.cli import main

    out = tmp_path_factory.mktemp("xlmr") / "xlmr-embed-F32.gguf"
    assert main(["convert", str(XLMR), "--to", "F32", "-o", str(out)]) == 0
    return out


def test_xlmr_folder_matches_transformers(xlmr):
    g = golden()
    assert xlmr.tokenizer.kind == "t5" and xlmr.embedding.pooling == "cls" and xlmr.embedding.encoder_only
    cfg = xlmr.model.cfg
    assert cfg.position_offset == 2 and cfg.max_position_embeddings == 64 and cfg.type_vocab_size == 1
    assert [xlmr.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    assert max_error(xlmr.model, "cls") < TOL and max_error(xlmr.model, "mean") < TOL
    vectors, _ = embed.embed_texts(xlmr, g["texts"])
    assert np.abs(vectors - unit(g["cls"])).max() < TOL


def test_positions_from_zero_miss_the_golden():
    # RoBERTa's offset is what the goldens need: BERT's positions (0..n-1 over the whole table) miss them
    from engine.arch.bert import BertModel
    from engine.hf_repo import open_hf_repo

    cfg, weights, *_ = open_hf_repo(XLMR)
    plain = BertModel(dataclasses.replace(cfg, position_offset=0, max_position_embeddings=66), weights)
    assert max_error(plain) > 0.05


def test_converted_xlmr_gguf_is_llama_cpp_layout(xlmr_gguf):
    from gguf import GGUFReader

    g = golden()
    lm = load_model(xlmr_gguf)
    assert lm.tokenizer.kind == "t5" and lm.model.cfg.position_offset == 0
    assert lm.embedding.pooling == "cls" and lm.embedding.source == "bert.pooling_type"
    assert [lm.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    vectors, _ = embed.embed_texts(lm, g["texts"])
    assert np.abs(vectors - unit(g["cls"])).max() < TOL
    reader = GGUFReader(xlmr_gguf)
    fields = reader.fields

    def value(key):
        return fields[key].parts[-1][0]

    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "t5"
    assert int(value("tokenizer.ggml.token_type_count")) == 1 and int(value("bert.context_length")) == 64
    assert bool(value("tokenizer.ggml.add_bos_token")) and bool(value("tokenizer.ggml.add_eos_token"))
    assert bool(value("tokenizer.ggml.add_space_prefix"))
    spec = json.loads((XLMR / "tokenizer.json").read_text())
    import base64

    charsmap = base64.b64decode(spec["normalizer"]["precompiled_charsmap"])
    stored = fields["tokenizer.ggml.precompiled_charsmap"]
    assert bytes(np.concatenate([stored.parts[i] for i in stored.data]).astype(np.uint8)) == charsmap
    vocab = fields["tokenizer.ggml.tokens"]
    tokens = [bytes(vocab.parts[i]).decode() for i in vocab.data]
    assert tokens[:4] == ["<s>", "<pad>", "</s>", "<unk>"] and tokens[-1] == "<mask>"
    assert len(fields["tokenizer.ggml.scores"].data) == len(tokens)
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors["position_embd.weight"].shape) == [32, 64]  # the two unused rows dropped
    assert list(tensors["token_types.weight"].shape) == [32, 1]


def test_quantized_xlmr_gguf_stays_close(tmp_path):
    from engine.cli import main

    out = tmp_path / "xlmr-Q8_0.gguf"
    assert main(["convert", str(XLMR), "--to", "Q8_0", "-o", str(out)]) == 0
    g = golden()
    vectors, _ = embed.embed_texts(load_model(out), g["texts"])
    assert (vectors * unit(g["cls"])).sum(axis=1).min() > 0.999


@pytest.mark.parametrize("text", STRINGS)
def test_gguf_unigram_tokenizer_matches_tokenizer_json(xlmr, xlmr_gguf, text):
    lm = load_model(xlmr_gguf)
    assert lm.tokenizer.encode_embedding(text) == xlmr.tokenizer.encode_embedding(text)


def test_a_t5_gguf_without_scores_is_a_tokenizer_error():
    from engine.tokenizer import Tokenizer, TokenizerError

    md = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["<s>", "<pad>", "</s>", "<unk>", "\u2581a"]}
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf_metadata(md)
    md["tokenizer.ggml.scores"] = np.zeros(5, np.float32)
    md["tokenizer.ggml.token_type"] = np.array([3, 3, 3, 2, 1], np.int32)
    # "\u2581b" is not in the vocabulary: one <unk> for it, as SentencePiece fuses an unknown run
    assert Tokenizer.from_gguf_metadata(md).encode("a b") == [4, 3]


def test_library_and_memory_know_xlmr(xlmr_gguf):
    from models.fit import local_sizes
    from models.library import inspect_model

    assert inspect_model(XLMR).architecture == "xlm-roberta"
    facts = inspect_model(xlmr_gguf)
    assert facts.architecture == "bert" and facts.context_length == 64
    for path in (XLMR, xlmr_gguf):
        assert local_sizes(path)[1] == 0
