"""Added tokens (special and user-defined) placed among a tokenizer.json's model vocabulary: the folder
tokenizer and the converted GGUF vocabulary keep the ids the `tokenizers` library encodes with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelFormatError
from engine.hf_repo import folder_tokenizer
from engine.quant.hf_meta import _tokenizer_metadata
from engine.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, Tokenizer, bytes_to_unicode

_BYTES = list(bytes_to_unicode().values())


def _added(i: int, content: str, special: bool, **flags) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special, **flags}


def _byte_level_folder(folder: Path, vocab: dict[str, int], added: list[dict]) -> Path:
    """A byte-level BPE tokenizer.json (GPT-2 style) with `added` as its added_tokens, as written by hand."""
    merges = [m for m in ("Ġ w", "Ġw o", "h i") if m.replace(" ", "") in vocab]
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": level, "post_processor": None, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return folder


def _vocab_with_added_in_middle() -> tuple[dict[str, int], list[dict]]:
    """Cohere / Gemma style: the added tokens' texts are model vocabulary entries too, at ids below
    ordinary tokens."""
    vocab = {b: i for i, b in enumerate(_BYTES)}
    added = [
        _added(256, "<|START_OF_TURN_TOKEN|>", True),
        _added(257, "<|END_OF_TURN_TOKEN|>", True, rstrip=True),
        _added(258, "<tool>", False, lstrip=True, normalized=True),
        _added(259, "<w>", False, single_word=True),
    ]
    for a in added:
        vocab[a["content"]] = a["id"]
    for piece in ("Ġw", "Ġwo", "hi"):  # ordinary vocabulary after the added tokens
        vocab[piece] = len(vocab)
    return vocab, added


TEXTS = [
    "<|START_OF_TURN_TOKEN|>hi<|END_OF_TURN_TOKEN|>",
    "hi <|START_OF_TURN_TOKEN|> wo <|END_OF_TURN_TOKEN|>  wo",
    "a<tool>b wo <tool> hi",
    "hi<w>wo <w> wo",
    "<|START_OF_TURN_TOKEN|><|END_OF_TURN_TOKEN|><tool><w>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_folder_tokenizer_matches_tokenizers_with_added_tokens_in_the_middle(tmp_path, text):
    folder = _byte_level_folder(tmp_path / "m", *_vocab_with_added_in_middle())
    reference = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok, _ = folder_tokenizer(folder)
    ids = tok.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False)
    assert tok.token_text(256) == "<|START_OF_TURN_TOKEN|>" and tok.token_text(len(_BYTES) + 4) == "Ġw"


def test_folder_and_converted_vocabularies_mark_the_added_tokens(tmp_path):
    folder = _byte_level_folder(tmp_path / "m", *_vocab_with_added_in_middle())
    tok, _ = folder_tokenizer(folder)
    md = _tokenizer_metadata(folder, {})
    gguf = Tokenizer.from_gguf_metadata(md)
    for t in (tok, gguf):
        texts = [t.token_text(i) for i in range(256, 260)]
        assert texts == ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<tool>", "<w>"]
        assert t.is_control(256) and t.is_control(257) and not t.is_control(258)
        assert t.is_special(258) and t.is_special(259) and not t.is_special(260)
    assert list(md["tokenizer.ggml.token_type"][255:261]) == [TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_CONTROL,
                                                               TOKEN_USER_DEFINED, TOKEN_USER_DEFINED,
                                                               TOKEN_NORMAL]
    assert md["tokenizer.ggml.tokens"] == [tok.token_text(i) for i in range(tok.vocab_size)]


@pytest.mark.parametrize("text", [TEXTS[0], TEXTS[4], "hi wo<|START_OF_TURN_TOKEN|> wo<|END_OF_TURN_TOKEN|>"])
def test_converted_vocabulary_encodes_as_the_folder(tmp_path, text):
    """GGUF keeps no lstrip/rstrip/single_word flags (nor does llama.cpp), so only texts where those flags
    change nothing are compared."""
    folder = _byte_level_folder(tmp_path / "m", *_vocab_with_added_in_middle())
    reference = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    gguf = Tokenizer.from_gguf_metadata(_tokenizer_metadata(folder, {}))
    expected = reference.encode(text, add_special_tokens=False).ids
    assert gguf.encode(text) == expected
    assert gguf.decode(expected) == reference.decode(expected, skip_special_tokens=False)


def test_added_token_declared_at_another_id_than_its_model_entry(tmp_path):
    """tokenizers encodes an added token with its model vocabulary id whatever the file's "id" says, so
    that is the id the types (control or not) go on, in the folder and in the GGUF."""
    vocab = {b: i for i, b in enumerate(_BYTES)}
    vocab.update({"<|im_end|>": 256, "hi": 257})
    folder = _byte_level_folder(tmp_path / "m", vocab, [_added(257, "<|im_end|>", True)])
    reference = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    assert reference.encode("hi<|im_end|>").ids == [257, 256]
    tok, _ = folder_tokenizer(folder)
    gguf = Tokenizer.from_gguf_metadata(_tokenizer_metadata(folder, {}))
    for t in (tok, gguf):
        assert t.is_control(256) and not t.is_control(257)
        assert 256 in t.eot_ids and 257 not in t.eot_ids
        assert t.encode("hi<|im_end|>") == [257, 256]
        assert t.decode([257, 256], skip_special=True) == "hi"


def test_added_tokens_whose_ids_tokenizers_moves_onto_model_tokens_are_refused(tmp_path):
    """Added ids 256 and 257 with model entries after them and none at 256, 257: tokenizers numbers the added
    tokens from the model vocabulary's size (258), onto "hi" and "Ġw", so one id stands for two tokens."""
    vocab = {b: i for i, b in enumerate(_BYTES)}
    vocab.update({"hi": 258, "Ġw": 259})
    added = [_added(256, "<|A|>", True), _added(257, "<u>", False)]
    folder = _byte_level_folder(tmp_path / "m", vocab, added)
    reference = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    assert reference.encode("<|A|>hi").ids == [258, 258]  # the library's own collision
    with pytest.raises(ModelFormatError, match=r"'<\|A\|>' \(id 256 in the file\)"):
        folder_tokenizer(folder)
    with pytest.raises(ModelFormatError, match="get id 258"):
        _tokenizer_metadata(folder, {})
