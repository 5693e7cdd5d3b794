"""Tokenizer from GGUF metadata: SmolLM2's real vocabulary plus small synthetic vocabularies."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from engine.tokenizer import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    UnsupportedTokenizer,
    bytes_to_unicode,
)
from models.errors import HearthError
from models.formats.gguf import open_gguf

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "smollm2_tokens.json"


@functools.lru_cache(maxsize=2)
def read_metadata(path: str) -> dict:
    """GGUF key/value metadata: str, list[str] for string arrays, numpy arrays for numbers."""
    with open_gguf(path) as gguf_file:
        return dict(gguf_file.metadata)


@pytest.fixture
def smollm2_metadata(smollm2_path) -> dict:
    return read_metadata(str(smollm2_path))


@pytest.fixture
def smollm2(smollm2_metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_metadata)


def _byte_alphabet() -> list[str]:
    """The 256 single-byte tokens of a byte-level vocabulary, in byte order (no merges)."""
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def synthetic_metadata(pre: str = "gpt2", **overrides) -> dict:
    tokens = [*_byte_alphabet(), "<s>", "</s>", "<|eot_id|>"]
    types = [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL] * 3
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.asarray(types, dtype=np.int32),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
        "tokenizer.ggml.add_bos_token": True,
    }
    metadata.update(overrides)
    return metadata


CORPUS = [
    "Hello, world!",
    "It's, we're, they've, I'm, you'll, he'd, don't, CAN'T",
    "naïve café — déjà vu, Straße, Ωμέγα, привет мир",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 🙂👍🏽👨‍👩‍👧‍👦🇫🇷 and a flag",
    "def f(x):\n    return {'a': [1, 2, 3]} if x else None  # comment\n",
    "  leading and trailing spaces   ",
    "\n\n\n",
    "\ttabs\tbetween\t\twords\t",
    "digits 12345 and 3.14159 and 1,000,000",
    "mixed\r\nline\rendings\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "a" * 300,
]


# --- SmolLM2 ------------------------------------------------------------------------------------


def test_build_is_fast(smollm2_metadata):
    best = min(_timed_build(smollm2_metadata) for _ in range(3))
    assert best < 0.5, f"building the 49k-token tokenizer took {best:.3f} s of CPU"


def _timed_build(metadata: dict) -> float:
    # CPU time of this process: wall time swings with whatever else the (shared) test machine runs.
    start = time.process_time()
    Tokenizer.from_gguf_metadata(metadata)
    return time.process_time() - start


def test_smollm2_basics(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_id == 1 and smollm2.bos_token == "<|im_start|>"
    assert smollm2.eos_id == 2 and smollm2.eos_token == "<|im_end|>"
    # eos plus the <|endoftext|> control token.
    assert smollm2.eot_ids == {0, 2}
    assert smollm2.is_control(2) and not smollm2.is_control(100)
    # SmolLM2 does not ask for BOS.
    assert smollm2.encode("Hi", add_special=True) == smollm2.encode("Hi")


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(smollm2, text):
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text
    assert all(0 <= i < smollm2.vocab_size for i in ids)


def test_special_tokens_recognised(smollm2):
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == 1
    assert 2 in ids
    assert smollm2.decode(ids, skip_special=True) == "user\nHi\n"
    # Without the markers the same characters are ordinary text, never a control id.
    plain = smollm2.encode("<|im_start")
    assert not any(smollm2.is_control(i) for i in plain)


def test_smollm_digits_split_individually(smollm2):
    ids = smollm2.encode("12345")
    assert [smollm2.token_bytes(i) for i in ids] == [b"1", b"2", b"3", b"4", b"5"]
    assert smollm2.pre_tokenize("abc 2024!") == ["abc", " ", "2", "0", "2", "4", "!"]


def test_token_bytes(smollm2):
    (space_the,) = smollm2.encode(" the")
    assert smollm2.token_bytes(space_the) == b" the"
    assert smollm2.token_bytes(1) == b"<|im_start|>"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        smollm2.token_bytes(49152)


def test_stream_decoder_holds_back_split_characters(smollm2):
    text = "Thumbs 👍🏽 up, 日本語, family 👨‍👩‍👧‍👦!"
    ids = smollm2.encode(text)
    # The emoji really is split across tokens, otherwise this test proves nothing.
    assert any(_is_partial_utf8(smollm2.token_bytes(i)) for i in ids)
    stream = StreamDecoder(smollm2)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == smollm2.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # at least one token completed no character


def _is_partial_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_stream_decoder_flushes_incomplete_bytes(smollm2):
    lone = next(i for i in range(smollm2.vocab_size) if smollm2.token_bytes(i) == b"\xf0")
    stream = StreamDecoder(smollm2)
    assert stream.push(lone) == ""
    assert stream.flush() == "\ufffd"
    assert smollm2.decode([lone]) == "\ufffd"
    # A broken sequence followed by ordinary text is replaced at once, like decode() does.
    a = smollm2.encode("a")
    assert stream.push(lone) + stream.push(a[0]) + stream.flush() == smollm2.decode([lone, *a]) == "\ufffda"


def test_stream_decoder_skip_special(smollm2):
    ids = smollm2.encode("<|im_start|>assistant\nHello<|im_end|>")
    stream = StreamDecoder(smollm2, skip_special=True)
    out = "".join(stream.push(i) for i in ids) + stream.flush()
    assert out == "assistant\nHello" == smollm2.decode(ids, skip_special=True)
    verbatim = StreamDecoder(smollm2)
    assert "".join(verbatim.push(i) for i in ids) == "<|im_start|>assistant\nHello<|im_end|>"


def test_matches_transformers_golden(smollm2):
    """Ids from HF transformers (tests/goldens/smollm2_tokens.json) must match exactly."""
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing; regenerate it with the golden script")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert len(golden["texts"]) == len(golden["ids"]) > 0
    for text, expected in zip(golden["texts"], golden["ids"], strict=True):
        assert smollm2.encode(text) == expected, f"mismatch for {text!r}"


# --- pre-tokenizers and errors on synthetic vocabularies -----------------------------------------

SAMPLE = "I'M 12345 abc\n\n  x"
# Pieces derived by hand from llama.cpp's regexes for each pre type.
EXPECTED_PIECES = {
    "gpt2": ["I", "'", "M", " 12345", " abc", "\n\n ", " x"],
    "smollm": ["I", "'", "M", " ", "1", "2", "3", "4", "5", " abc", "\n\n ", " x"],
    "llama3": ["I", "'M", " ", "123", "45", " abc", "\n\n", " ", " x"],
    "llama-bpe": ["I", "'M", " ", "123", "45", " abc", "\n\n", " ", " x"],
    "qwen2": ["I", "'M", " ", "1", "2", "3", "4", "5", " abc", "\n\n", " ", " x"],
    "default": ["I", "'", "M", " ", "123", "45", " abc", "\n\n ", " x"],
    "tekken": ["I", "'M", " ", "1", "2", "3", "4", "5", " abc", "\n\n", " ", " x"],
    "seed-coder": ["I", "'M", " ", "1", "2", "3", "4", "5", " abc", "\n\n", " ", " x"],
    "exaone4": ["I", "'", "M", " 12345", " abc", "\n\n ", " x"],
    "deepseek-llm": ["I", "'", "M", " ", "12345", " abc", "\n", "\n", " ", " x"],
    "deepseek-v3": ["I", "'M", " ", "123", "45", " abc", "\n\n", " ", " x"],
    "deepseek-coder": ["I", "'", "M", " ", "1", "2", "3", "4", "5", " abc", "\n", "\n", " ", " x"],
}


@pytest.mark.parametrize("pre", sorted(EXPECTED_PIECES))
def test_pre_tokenizer_splits(pre):
    tok = Tokenizer.from_gguf_metadata(synthetic_metadata(pre))
    assert tok.pre_tokenize(SAMPLE) == EXPECTED_PIECES[pre]
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == text


def test_llama3_contractions_ignore_case_and_newlines():
    tok = Tokenizer.from_gguf_metadata(synthetic_metadata("llama3"))
    assert tok.pre_tokenize("YOU'LL  go;\n\nok") == ["YOU", "'LL", " ", " go", ";\n\n", "ok"]


def test_tekken_splits_case_runs_and_keeps_no_contractions():
    """Mistral's Tekken: an upper-case run splits from a capitalised word, an apostrophe starts its own
    piece (o200k would keep "'re" on "they"), digits one by one; the pre name round-trips through
    conversion's tokenizer.json matching."""
    from engine.quant.hf_meta import _pre_name
    from engine.tokenizer import _TEKKEN

    tok = Tokenizer.from_gguf_metadata(synthetic_metadata("tekken"))
    pieces = ["Hello", "WORLD", " they", "'re", " ", "4", "2", "/", "7"]
    assert tok.pre_tokenize("HelloWORLD they're 42/7") == pieces
    gpt4o = Tokenizer.from_gguf_metadata(synthetic_metadata("gpt-4o"))
    assert gpt4o.pre_tokenize("they're 42") == ["they're", " ", "42"]

    spec = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _TEKKEN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}}
    assert _pre_name(spec) == "tekken"


def test_deepseek_pre_tokenizers_split_scripts_and_round_trip_through_conversion():
    """DeepSeek LLM's letter class ends where Greek extended letters do (U+1F7D: NFC would fold it into
    U+03CE), CJK runs split from Latin ones; DeepSeek-V3 keeps a punctuation mark on the word after it and
    digits in threes. Conversion names a folder with DeepSeek's patterns by them."""
    from engine.quant.hf_meta import _pre_name
    from engine.tokenizer import _DEEPSEEK_LLM, _DEEPSEEK_V3

    llm = Tokenizer.from_gguf_metadata(synthetic_metadata("deepseek-llm"))
    assert llm.pre_tokenize("\u1f70\u1f7d 你好abc") == ["\u1f70\u1f7d", " ", "你好", "abc"]
    v3 = Tokenizer.from_gguf_metadata(synthetic_metadata("deepseek-v3"))
    assert v3.pre_tokenize("x.y 1234567 日本語") == ["x", ".y", " ", "123", "456", "7", " ", "日本語"]
    for name, patterns in (("deepseek-llm", _DEEPSEEK_LLM), ("deepseek-v3", _DEEPSEEK_V3)):
        splits = [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
                  for p in patterns]
        spec = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *splits,
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}}
        assert _pre_name(spec) == name


def test_merges_apply():
    alphabet = _byte_alphabet()
    metadata = synthetic_metadata("gpt2")
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], "\u0120t", "\u0120th", "he"]
    metadata["tokenizer.ggml.token_type"] = np.asarray([*metadata["tokenizer.ggml.token_type"], 1, 1, 1])
    metadata["tokenizer.ggml.merges"] = ["\u0120 t", "\u0120t h", "h e"]
    tok = Tokenizer.from_gguf_metadata(metadata)
    # " the": Ġ+t first (rank 0), then Ġt+h, then e stays alone; "he" never forms.
    assert tok.encode(" the") == [260, alphabet.index("e")]
    assert tok.encode("he") == [261]


def test_add_bos_and_eot():
    tok = Tokenizer.from_gguf_metadata(synthetic_metadata("gpt2", **{"tokenizer.ggml.eot_token_id": 258}))
    assert tok.encode("a", add_special=True) == [256, tok.encode("a")[0]]
    assert tok.eot_ids == {257, 258}
    assert tok.encode("<s>x</s>") == [256, tok.encode("x")[0], 257]


def test_unknown_pre_is_a_typed_error():
    with pytest.raises(UnsupportedTokenizer, match="no-such-pre"):
        Tokenizer.from_gguf_metadata(synthetic_metadata("no-such-pre"))


def test_unknown_tokenizer_model_is_a_typed_error():
    # SentencePiece ("llama") is covered in test_tokenizer_spm.py; other kinds are refused clearly.
    # (WordPiece, "bert", is covered in test_embeddings.py, unigram, "t5", in test_embeddings_xlmr.py)
    with pytest.raises(UnsupportedTokenizer, match="'rwkv'") as info:
        Tokenizer.from_gguf_metadata(synthetic_metadata(**{"tokenizer.ggml.model": "rwkv"}))
    assert isinstance(info.value, HearthError)


def test_inconsistent_metadata_is_a_typed_error():
    with pytest.raises(TokenizerError, match="token_type"):
        Tokenizer.from_gguf_metadata(synthetic_metadata(**{"tokenizer.ggml.token_type": np.ones(3)}))
    with pytest.raises(TokenizerError, match="merge"):
        Tokenizer.from_gguf_metadata(synthetic_metadata(**{"tokenizer.ggml.merges": ["nospace"]}))
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        Tokenizer.from_gguf_metadata(synthetic_metadata(**{"tokenizer.ggml.eos_token_id": 9999}))
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({})


def test_tool_call_markers_survive_skip_special():
    """Mistral's [TOOL_CALLS]/[ARGS] and Llama's <|python_tag|> are control tokens; a chat reply keeps them,
    so engine.tools finds the calls (other control tokens are still dropped)."""
    markers = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]
    tokens = [*_byte_alphabet(), "<s>", "</s>", "<|eot_id|>", *markers]
    types = np.asarray([TOKEN_NORMAL] * 256 + [TOKEN_CONTROL] * 6, dtype=np.int32)
    tok = Tokenizer.from_gguf_metadata(
        synthetic_metadata(**{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    )
    ids = tok.encode('<s>[TOOL_CALLS]add[ARGS]{"a": 1}</s>')
    assert tok.decode(ids, skip_special=True) == '[TOOL_CALLS]add[ARGS]{"a": 1}'
    stream = StreamDecoder(tok, skip_special=True)
    assert "".join(stream.push(i) for i in tok.encode("<|python_tag|>{}<|eot_id|>")) + stream.flush() == (
        "<|python_tag|>{}"
    )
