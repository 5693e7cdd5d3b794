"""SentencePiece-BPE tokenizer ("llama" GGUF vocabulary): Gemma 3's real vocabulary and synthetic ones."""

from __future__ import annotations

import functools
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest

from engine.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    UnsupportedTokenizer,
    spm_merges,
)
from models.errors import HearthError
from models.formats.gguf import open_gguf

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "gemma3_tokens.json"
SPACE = "\u2581"


@functools.lru_cache(maxsize=1)
def read_metadata(path: str) -> dict:
    with open_gguf(path) as gguf_file:
        return dict(gguf_file.metadata)


@pytest.fixture(scope="module")
def gemma3_metadata(gemma3_path) -> dict:
    return read_metadata(str(gemma3_path))


@pytest.fixture(scope="module")
def gemma3(gemma3_metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma3_metadata)


# --- a from-scratch reference: llama.cpp's SentencePiece BPE, written plainly and slowly -------------


class ReferenceSPM:
    """Special tokens cut out longest-first, " " -> U+2581 (plus a leading one per span when
    add_space_prefix), then repeatedly merge the adjacent pair forming the highest-scoring normal
    token (leftmost on ties); characters left without a token become <0xXX> byte tokens."""

    def __init__(self, metadata: dict):
        tokens = metadata["tokenizer.ggml.tokens"]
        types = [int(t) for t in metadata["tokenizer.ggml.token_type"]]
        scores = [float(s) for s in metadata["tokenizer.ggml.scores"]]
        self.normal = {t: (scores[i], i) for i, t in enumerate(tokens) if types[i] == TOKEN_NORMAL}
        self.byte = {int(t[3:5], 16): i for i, t in enumerate(tokens) if types[i] == TOKEN_BYTE}
        kinds = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
        self.special = {t: i for i, t in enumerate(tokens) if types[i] in kinds and t}
        alternatives = sorted(self.special, key=len, reverse=True)
        self.special_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self.prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))

    def span(self, text: str) -> list[int]:
        parts = list((SPACE if self.prefix else "") + text.replace(" ", SPACE))
        while True:
            best = None
            for i in range(len(parts) - 1):
                hit = self.normal.get(parts[i] + parts[i + 1])
                if hit is not None and (best is None or hit[0] > best[0]):
                    best = (hit[0], i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids = []
        for p in parts:
            if p in self.normal:
                ids.append(self.normal[p][1])
            else:
                ids.extend(self.byte[b] for b in p.encode("utf-8"))
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, chunk in enumerate(self.special_re.split(text)):
            if i % 2:
                ids.append(self.special[chunk])
            elif chunk:
                ids.extend(self.span(chunk))
        return ids


def generated_texts(metadata: dict, n: int, seed: int) -> list[str]:
    """Texts that stress merging: runs of real vocabulary pieces glued together (so merges cross
    piece boundaries), rare characters (byte fallback), spaces, tabs, newlines and special tokens."""
    rng = random.Random(seed)
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"]
    normal = [t.replace(SPACE, " ") for t, k in zip(tokens, types, strict=True) if k == TOKEN_NORMAL]
    specials = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<table>", "</td>"]
    odd = ["𠜎", "ꙮ", "🧌", "é", "ß", "\u200b", "\u00a0", "\t", "\n", "  ", "     ", "0", "۱", "€", "ǅ"]
    texts = []
    for _ in range(n):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.7:
                pieces.append(rng.choice(normal))
            elif r < 0.95:
                pieces.append(rng.choice(odd))
            else:
                pieces.append(rng.choice(specials))
        texts.append("".join(pieces))
    return texts


# --- Gemma 3 --------------------------------------------------------------------------------------


def test_gemma3_matches_transformers_golden(gemma3):
    """Ids from HF transformers (tests/goldens/gemma3_tokens.json) must match exactly, and round-trip."""
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing; regenerate it with the golden script")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert golden["tokenizer"]["ggml_model"] == "llama"
    assert len(golden["texts"]) == len(golden["ids"]) > 30
    for text, expected in zip(golden["texts"], golden["ids"], strict=True):
        ids = gemma3.encode(text)
        assert ids == expected, f"mismatch for {text!r}"
        assert gemma3.decode(ids) == text


def test_gemma3_matches_reference_on_generated_texts(gemma3, gemma3_metadata):
    """Beyond the golden corpus: 300 generated texts against the plain score-ordered reference."""
    reference = ReferenceSPM(gemma3_metadata)
    for text in generated_texts(gemma3_metadata, 300, seed=7):
        ids = gemma3.encode(text)
        assert ids == reference.encode(text), f"mismatch for {text!r}"
        assert gemma3.decode(ids) == text


def test_gemma3_basics(gemma3):
    assert gemma3.kind == "llama"
    assert gemma3.vocab_size == 262144
    assert (gemma3.bos_id, gemma3.bos_token) == (2, "<bos>")
    assert (gemma3.eos_id, gemma3.eos_token) == (1, "<eos>")
    assert gemma3.unk_id == 3 and gemma3.pad_id == 0
    end_of_turn = gemma3.encode("<end_of_turn>")
    assert end_of_turn == [106]
    assert gemma3.eot_ids == {1, 106}
    # Gemma asks for BOS, no EOS, and no space prefix.
    assert gemma3.add_bos and not gemma3.add_eos and not gemma3.add_space_prefix
    assert gemma3.encode("Hi", add_special=True) == [2, *gemma3.encode("Hi")]
    assert gemma3.encode("", add_special=True) == [2]
    assert gemma3.decode(gemma3.encode("<bos>Hi<end_of_turn>"), skip_special=True) == "Hi"


def test_gemma3_space_runs_are_user_defined_tokens(gemma3):
    # 40 spaces: the 31-space token then the 9-space one, cut before BPE (not 16 + 24 by merges).
    assert gemma3.encode("a" + " " * 40 + "b")[1:3] == [167, 145]
    assert gemma3.token_bytes(167) == b" " * 31
    assert gemma3.encode("\t\t") == [255969]


def test_gemma3_token_bytes(gemma3):
    (one,) = gemma3.encode(" one")
    assert gemma3.token_text(one) == SPACE + "one"
    assert gemma3.token_bytes(one) == b" one"
    assert gemma3.token_bytes(238) == b"\x00"  # <0x00>
    assert gemma3.token_bytes(493) == b"\xff"  # <0xFF>
    assert gemma3.token_bytes(106) == b"<end_of_turn>"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        gemma3.token_bytes(262144)


def test_gemma3_stream_decoder_holds_back_byte_fallback(gemma3):
    text = "rare 𠜎 and ꙮ, troll 🧌, 日本語 and 👍🏽!"
    ids = gemma3.encode(text)
    byte_ids = [i for i in ids if gemma3.token_text(i).startswith("<0x")]
    # The rare characters really go through byte fallback, one token per byte.
    assert len(byte_ids) >= 4 + 3 + 4
    stream = StreamDecoder(gemma3)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == gemma3.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3 + 2 + 3  # every byte but the last of each character waits


def test_merge_derivation_matches_plain_enumeration(gemma3_metadata):
    """The vectorized split search finds exactly the splits a plain loop finds, in score order."""
    tokens = gemma3_metadata["tokenizer.ggml.tokens"]
    types = np.asarray(gemma3_metadata["tokenizer.ggml.token_type"])
    scores = np.asarray(gemma3_metadata["tokenizer.ggml.scores"], dtype=np.float64)
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_NORMAL}
    # Distinct scores make score order the whole rank order (ties would be ranked by id), and every
    # character of a token is a token (HF's BPE starts from those, the rest go to byte fallback).
    assert len(set(scores[list(normal.values())].tolist())) == len(normal)
    assert all(ch in normal for t in normal for ch in t)
    merges = spm_merges(tokens, types.tolist(), scores)
    plain = {(t[:k], t[k:]) for t in normal for k in range(1, len(t)) if t[:k] in normal and t[k:] in normal}
    assert len(merges) == len(set(merges)) == len(plain) > 400_000
    assert set(merges) == plain
    ranks = [scores[normal[a + b]] for a, b in merges]
    assert all(x >= y for x, y in zip(ranks, ranks[1:]))


def test_gemma3_build_time(gemma3_metadata):
    # ~1.3 s on an idle core; a bound that only an O(n^2) derivation (tens of seconds) can break,
    # even with the test machine shared.
    best = math.inf
    for _ in range(2):
        start = time.process_time()
        Tokenizer.from_gguf_metadata(gemma3_metadata)
        best = min(best, time.process_time() - start)
    assert best < 6.0, f"building Gemma 3's 262k-token tokenizer took {best:.2f} s of CPU"


# --- a small synthetic vocabulary with hand-computed ids ------------------------------------------

BYTES = [f"<0x{b:02X}>" for b in range(256)]
# ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 bytes, then the pieces below.
PIECES = [
    (SPACE, 0.0),  # 259
    ("a", 0.0),  # 260
    ("b", 0.0),  # 261
    ("c", 0.0),  # 262
    ("ab", -1.0),  # 263
    ("bc", -0.5),  # 264: outranks "ab"
    (SPACE + "a", -3.0),  # 265
    ("abc", -4.0),  # 266
    (SPACE + "ab", -5.0),  # 267
]
TAG, TWO_SPACES = 268, 269


def byte_id(b: int) -> int:
    return 3 + b


def spm_metadata(**overrides) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *BYTES, *(p for p, _ in PIECES), "<tag>", "  "]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL, *[TOKEN_BYTE] * 256, *[TOKEN_NORMAL] * len(PIECES)]
    types += [TOKEN_USER_DEFINED, TOKEN_USER_DEFINED]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(s for _, s in PIECES), 0.0, 0.0]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.asarray(scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.asarray(types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    metadata.update(overrides)
    return metadata


# Hand-derived (highest score merges first; "bc" (-0.5) beats "ab" (-1)).
WITHOUT_PREFIX = {
    "abc": [266],  # a b c -> a bc -> abc
    "ab": [263],
    "ab c": [263, 259, 262],  # a b ▁ c: only "ab" can merge
    "a<tag>b": [260, TAG, 261],
    "a  b": [260, TWO_SPACES, 261],  # the user-defined raw-space token is cut out first
    "xé": [byte_id(0x78), byte_id(0xC3), byte_id(0xA9)],  # not in the vocabulary: byte fallback
    "<s>a</s>": [1, 260, 2],
    " a": [265],
}
WITH_PREFIX = {
    "abc": [265, 264],  # ▁ a b c -> ▁ a bc -> ▁a bc (▁a at -3 beats abc at -4); "▁abc" is no token
    "ab": [267],  # ▁ a b -> ▁ ab -> ▁ab
    "a b": [265, 259, 261],  # ▁ a ▁ b: "▁b" is no token
    "a<tag>b": [265, TAG, 259, 261],  # a space prefix after each special token too, as llama.cpp does
    "a  b": [265, TWO_SPACES, 259, 261],
    "<s>a": [1, 265],
    "": [],
}


@pytest.mark.parametrize(("text", "expected"), sorted(WITHOUT_PREFIX.items()))
def test_synthetic_without_space_prefix(text, expected):
    tok = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text
    assert ReferenceSPM(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False})).encode(text) == expected


@pytest.mark.parametrize(("text", "expected"), sorted(WITH_PREFIX.items()))
def test_synthetic_with_space_prefix(text, expected):
    # add_space_prefix defaults to true for a "llama" vocabulary when the key is absent.
    tok = Tokenizer.from_gguf_metadata(spm_metadata())
    assert tok.add_space_prefix
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text
    assert ReferenceSPM(spm_metadata()).encode(text) == expected


def test_space_prefix_in_stream_decoder():
    tok = Tokenizer.from_gguf_metadata(spm_metadata())
    ids = tok.encode("a<tag>b")
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "a<tag>b"
    # A continuation keeps the space of its first token: "ab" continuing some prompt.
    continuation = StreamDecoder(tok, text_start=False)
    assert continuation.push(267) == " ab"
    # flush() ends a text: the next one starts fresh, without its prefix space.
    assert stream.push(267) == "ab"
    # A space written as a byte token is text, never the prefix.
    assert StreamDecoder(tok).push(byte_id(0x20)) == " "


def test_bos_eos_flags():
    tok = Tokenizer.from_gguf_metadata(
        spm_metadata(**{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_eos_token": True})
    )
    assert tok.encode("ab", add_special=True) == [1, 263, 2]
    assert tok.encode("ab") == [263]
    no_bos = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.encode("ab", add_special=True) == [267]
    assert no_bos.eot_ids == {2}


def test_unknown_characters_fall_back_to_bytes():
    tok = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    text = "a🙂b"
    ids = tok.encode(text)
    assert ids == [260, *(byte_id(b) for b in "🙂".encode()), 261]
    stream = StreamDecoder(tok)
    assert [stream.push(i) for i in ids] == ["a", "", "", "", "🙂", "b"]


def test_without_byte_tokens_unknown_characters_become_unk():
    metadata = spm_metadata(**{"tokenizer.ggml.add_space_prefix": False})
    # Turn the byte tokens into unused placeholders: only <unk> is left for "é".
    metadata["tokenizer.ggml.tokens"] = [
        f"<unused{i}>" if 3 <= i < 259 else t for i, t in enumerate(metadata["tokenizer.ggml.tokens"])
    ]
    types = metadata["tokenizer.ggml.token_type"].copy()
    types[3:259] = 5
    metadata["tokenizer.ggml.token_type"] = types
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.encode("aéb") == [260, 0, 261]


def test_explicit_merges_are_used_when_present():
    # With tokenizer.ggml.merges the scores are not consulted: here "ab" is listed first.
    tok = Tokenizer.from_gguf_metadata(
        spm_metadata(
            **{
                "tokenizer.ggml.add_space_prefix": False,
                "tokenizer.ggml.merges": ["a b", "ab c", "b c"],
            }
        )
    )
    assert tok.encode("abc") == [266]
    assert tok.encode("bc") == [264]
    assert tok.encode("ba") == [261, 260]


def test_long_tokens_and_duplicates_take_the_plain_path():
    long_token = "x" * 40  # longer than the vectorized search handles
    tokens = ["x", "x" * 20, long_token, "y", "y", "yy"]
    types = [TOKEN_NORMAL] * len(tokens)
    scores = np.asarray([0, -1, -2, 0, 0, -3], dtype=np.float64)
    assert spm_merges(tokens, types, scores) == [("x" * 20, "x" * 20), ("y", "y")]
    assert spm_merges(tokens[:3], types[:3], scores[:3]) == [("x" * 20, "x" * 20)]


def test_bad_metadata_is_a_typed_error():
    with pytest.raises(TokenizerError, match="scores is missing"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.scores": None}))
    with pytest.raises(TokenizerError, match="scores has 3 entries"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.scores": np.zeros(3)}))
    bad_scores = spm_metadata()["tokenizer.ggml.scores"].copy()
    bad_scores[263] = np.nan
    with pytest.raises(TokenizerError, match="NaN"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.scores": bad_scores}))
    with pytest.raises(TokenizerError, match="token_type has 2 entries"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.token_type": [1, 1]}))
    tokens = spm_metadata()["tokenizer.ggml.tokens"].copy()
    tokens[3] = "<0xZZ>"
    with pytest.raises(TokenizerError, match="byte type"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.tokens": tokens}))
    types = spm_metadata()["tokenizer.ggml.token_type"].copy()
    types[3:259] = TOKEN_NORMAL  # no byte tokens left, and no <unk> either
    no_fallback = spm_metadata(
        **{"tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": None}
    )
    with pytest.raises(TokenizerError, match="no unknown token"):
        Tokenizer.from_gguf_metadata(no_fallback)
    with pytest.raises(TokenizerError, match="inconsistent"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.merges": ["a q"]}))
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.bos_token_id": 270}))
    with pytest.raises(UnsupportedTokenizer, match="'rwkv'") as info:
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.model": "rwkv"}))
    assert isinstance(info.value, HearthError)
