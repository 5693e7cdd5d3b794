"""Tokenizer built from GGUF metadata, and a streaming detokenizer.

The GGUF file carries the whole vocabulary (`tokenizer.ggml.*`); we rebuild the equivalent
Hugging Face `tokenizers.Tokenizer` from it (Rust BPE, fast) and keep our own byte table for
decoding, so decoding is byte-exact and the streaming decoder never depends on HF internals.

Two kinds are supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, Llama 3, Qwen2,
SmolLM) and SentencePiece BPE (`"llama"`: Llama 2, Mistral, Gemma, whose merges are derived from
the token scores; `"gemma4"`: Gemma 4, the same with its merges stored) and WordPiece (`"bert"`: BERT
encoders, whose vocabulary llama.cpp stores with a U+2581 "phantom space" before word-initial pieces and
"##" stripped from the others) and SentencePiece unigram (`"t5"`: XLM-RoBERTa encoders;
engine/tokenizer_ugm.py); other kinds raise `UnsupportedTokenizer`.
"""

from __future__ import annotations

import codecs
import contextlib
import gc
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.harmony import harmony_ids, harmony_stop_ids
from models.errors import HearthError

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# control tokens that open a tool call (Mistral, Llama 3.1) or wrap one (Hermes, Qwen): kept in chat text
TOOL_CALL_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<tool_call>", "</tool_call>")
# Texts of control tokens that end a turn in the chat formats we know of.
_END_OF_TURN_TEXTS = (
    "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>", "<turn|>",  # Gemma 4
    "<|END_OF_TURN_TOKEN|>",  # Cohere's Command R, R7B, A
)


class TokenizerError(HearthError):
    """The tokenizer metadata of a model is missing, inconsistent, or a token id is out of range."""


class UnsupportedTokenizer(TokenizerError):
    """The model uses a tokenizer kind or pre-tokenizer that Hearth does not implement yet."""


# --- pre-tokenizer regexes ------------------------------------------------------------------------
# The splits llama.cpp applies per `tokenizer.ggml.pre` (llama-vocab.cpp), written as the
# original tokenizer.json patterns. Each list is applied in order: every regex splits the
# pieces left by the previous one, with matched and unmatched spans both kept ("isolated").
# llama.cpp's GPT-2 style pattern omits the final `|\s+`; it only ever catches a single
# whitespace char before a non-space, which llama.cpp keeps as its own piece anyway, so
# the two are equivalent.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama-3's pattern with every digit its own piece.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# OpenAI's o200k (GPT-4o, gpt-oss, Llama 4): case-aware letter runs with a contraction suffix, digits in
# threes, punctuation runs that take trailing newlines and slashes.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's Tekken (Mistral Nemo, Mistral Small 3, Devstral, Magistral, Pixtral): o200k's letter runs without
# the contraction suffix, every digit its own piece.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ByteDance's Seed-Coder / Seed-OSS: Llama 3's split with single digits and punctuation runs that stop at
# line breaks.
_SEED_CODER = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# DeepSeek's pre-tokenizers as llama.cpp's llama-vocab.cpp spells them (llm_tokenizer_bpe), which are
# DeepSeek's tokenizer.json patterns: control characters as themselves, so a folder's patterns compare equal
# (code points escaped: NFC would fold some range ends, U+1F7D to U+03CE, into other letters).
# DeepSeek LLM / V2: line breaks alone, Latin-script letter runs, ASCII and full-width punctuation, CJK
# runs, digit runs.
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
# DeepSeek-V3 (and R1): up to three digits, CJK and kana runs, then a GPT-4-like split over letters and marks
_DEEPSEEK_V3 = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
# DeepSeek Coder: line breaks, letter runs, punctuation runs, CJK runs, single digits
_DEEPSEEK_CODER = (
    "[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}"
)

_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    # llama.cpp's fallback for pre == "default" (and for a missing pre key).
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "gpt4o": (_GPT4O,),
    "tekken": (_TEKKEN,),
    "seed-coder": (_SEED_CODER,),
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-coder": _DEEPSEEK_CODER,
    # StarCoder family (SmolLM included): every digit isolated first, then GPT-2 splitting.
    "starcoder": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
}

# `tokenizer.ggml.pre` names -> (regex family, BPE ignore_merges). llama.cpp sets ignore_merges
# for the Llama-3 family: a word that is itself a vocabulary entry is never merged piecewise.
_PRE_ALIASES: dict[str, tuple[str, bool]] = {
    "default": ("default", False),
    "gpt2": ("gpt2", False),
    "gpt-2": ("gpt2", False),
    "mpt": ("gpt2", False),
    "olmo": ("gpt2", False),
    "jais": ("gpt2", False),
    "phi-2": ("gpt2", False),
    "llama3": ("llama3", True),
    "llama-v3": ("llama3", True),
    "llama-bpe": ("llama3", True),
    "falcon3": ("llama3", True),
    "lfm2": ("llama3", True),  # Liquid's LFM2 (llama.cpp: Llama 3's split and ignore_merges)
    "dbrx": ("llama3", False),
    "smaug-bpe": ("llama3", False),
    "qwen2": ("qwen2", False),
    "deepseek-r1-qwen": ("qwen2", False),
    "stablelm2": ("qwen2", False),
    "smollm": ("starcoder", False),
    "starcoder": ("starcoder", False),
    "refact": ("starcoder", False),
    "command-r": ("starcoder", False),
    "codeshell": ("starcoder", False),
    "falcon": ("falcon", False),
    "gpt-4o": ("gpt4o", False),
    "llama4": ("gpt4o", False),
    "tekken": ("tekken", True),  # llama.cpp: ignore_merges, as for Llama 3
    "exaone4": ("gpt2", False),
    "seed-coder": ("seed-coder", False),
    "glm4": ("llama3", False),  # GLM-4: Llama 3's split, merges applied (and never a BOS: below)
    "chatglm-bpe": ("llama3", False),
    "deepseek-llm": ("deepseek-llm", False),  # DeepSeek LLM, DeepSeek-V2(-Lite)
    "deepseek-v3": ("deepseek-v3", False),  # DeepSeek-V3 / R1, Moonlight
    "deepseek-coder": ("deepseek-coder", False),
}
# pre-tokenizers after which llama.cpp adds no BOS token whatever the metadata says (GLM-4's templates
# write [gMASK]<sop> themselves)
_NO_BOS_PRE = frozenset({"glm4", "chatglm-bpe"})

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_ALIASES))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to
    chr(256 + n) in byte order, so every vocabulary entry is a printable string.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_ENCODER = bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}
_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_to_bytes(text: str) -> bytes:
    """Raw bytes of a byte-level BPE vocabulary entry (e.g. 'Ġthe' -> b' the')."""
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is None:
            # Not from the byte alphabet (a malformed entry): keep the character itself.
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _optional_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        token_id = int(value)
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"metadata {key} = {value!r} is not a token id") from exc
    if token_id < 0:  # llama.cpp writes -1 (as uint32 0xFFFFFFFF sometimes) for "none"
        return None
    if token_id >= n_vocab:
        if token_id >= 0xFFFFFFFF:
            return None
        raise TokenizerError(f"metadata {key} = {token_id} is outside the vocabulary of {n_vocab} tokens")
    return token_id


def _find(tokens: list[str], text: str) -> int | None:
    """The id of the vocabulary entry `text`, None without one."""
    try:
        return tokens.index(text)
    except ValueError:
        return None


def _per_token(metadata: Mapping[str, Any], key: str, n_vocab: int) -> np.ndarray | None:
    """A per-token numeric array from the metadata (None when absent), checked against the vocabulary size."""
    value = metadata.get(key)
    if value is None:
        return None
    try:
        array = np.asarray(value, dtype=np.float64 if key.endswith("scores") else np.int64)
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"metadata {key} is not a numeric array") from exc
    if array.shape != (n_vocab,):
        raise TokenizerError(f"{key} has {array.size} entries but there are {n_vocab} tokens")
    return array


def _parse_merges(merges: Iterable[str]) -> list[tuple[str, str]]:
    pairs = []
    for m in merges:
        # Search from index 1, as llama.cpp does, so a merge whose left side is " " still splits.
        cut = m.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"malformed BPE merge {m!r} (expected 'left right')")
        pairs.append((m[:cut], m[cut + 1 :]))
    return pairs


def _byte_level_bpe(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int], merge_pairs: list[tuple[str, str]]
) -> tuple[HFTokenizer, str]:
    """HF tokenizer for a byte-level BPE vocabulary (`gpt2`); returns it and the `pre` name."""
    pre = metadata.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_ALIASES:
        raise UnsupportedTokenizer(
            f"pre-tokenizer {pre!r} is not supported; known: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    family, ignore_merges = _PRE_ALIASES[pre]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        model = models.BPE(vocab, merge_pairs, ignore_merges=ignore_merges)
    except Exception as exc:  # the Rust side reports merges that name unknown tokens
        raise TokenizerError(f"the BPE vocabulary and merges are inconsistent: {exc}") from exc

    hf = HFTokenizer(model)
    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        for pattern in _PRE_REGEXES[family]
    ]
    # Regex splitting happens above; ByteLevel only maps bytes to the printable alphabet.
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
    hf.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched verbatim in the input before splitting.
    specials = [
        AddedToken(tokens[i], special=True, normalized=False, lstrip=False, rstrip=False)
        for i, t in enumerate(types)
        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    if specials:
        hf.add_special_tokens(specials)
    return hf, pre


# --- SentencePiece BPE ----------------------------------------------------------------------------
# llama.cpp's "llama" vocabulary (SentencePiece BPE): control, user-defined and unknown-type tokens are
# cut out of the raw text first (longest match); every other span has " " replaced by U+2581 (and one
# U+2581 prepended when add_space_prefix), starts as single characters, and repeatedly merges the
# adjacent pair whose concatenation is the normal token with the highest score (leftmost on ties);
# characters left without a token become their UTF-8 bytes as <0xXX> tokens.

_SPM_SPACE = "\u2581"
_SPM_SPLIT_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
# Tokens up to this many characters go through the vectorized split search; longer ones (rare) through
# a Python loop. The table costs n_tokens * width * 4 bytes.
_VECTOR_MAX_CHARS = 32
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd, so multiplication mod 2**64 is invertible
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _sentencepiece_bpe(
    metadata: Mapping[str, Any],
    tokens: list[str],
    types: list[int],
    merge_pairs: list[tuple[str, str]] | None,
    unk_id: int | None,
    add_space_prefix: bool,
) -> HFTokenizer:
    """HF tokenizer equivalent to llama.cpp's SentencePiece-BPE ("llama") tokenizer for this vocabulary."""
    n_vocab = len(tokens)
    # GGUF strings with invalid UTF-8 arrive as lone surrogates, which the Rust side cannot take. No valid
    # text can produce such a token, so it gets a placeholder key nothing will ever match.
    invalid = set()
    if _SURROGATE_RE.search("".join(tokens)):
        invalid = {i for i, text in enumerate(tokens) if _SURROGATE_RE.search(text)}
    if merge_pairs is None:
        scores = _per_token(metadata, "tokenizer.ggml.scores", n_vocab)
        if scores is None:
            raise TokenizerError(
                "metadata tokenizer.ggml.scores is missing (needed by a SentencePiece vocabulary "
                "without tokenizer.ggml.merges)"
            )
        if not np.isfinite(scores).all():
            raise TokenizerError("tokenizer.ggml.scores contains NaN or infinite values")
        merge_pairs = spm_merges(tokens, types, scores, exclude=invalid)

    vocab = dict(zip(tokens, range(n_vocab)))  # duplicate texts: the last id wins, as in llama.cpp
    for i in invalid:
        vocab.pop(tokens[i], None)
        vocab[f"\x00hearth-invalid-token-{i}"] = i
    # HF's byte fallback looks bytes up as "<0xXX>" (upper-case hex), whatever the file's spelling.
    kinds = np.asarray(types)
    n_bytes = 0
    for i in np.flatnonzero(kinds == TOKEN_BYTE).tolist():
        m = _BYTE_TOKEN_RE.fullmatch(tokens[i])
        if m is None:
            raise TokenizerError(f"token {i} has the byte type but its text {tokens[i]!r} is not <0xXX>")
        vocab.pop(tokens[i], None)
        vocab[f"<0x{int(m.group(1), 16):02X}>"] = i
        n_bytes += 1
    if n_bytes < 256 and unk_id is None:
        raise TokenizerError(
            f"the SentencePiece vocabulary has {n_bytes} of the 256 <0xXX> byte tokens and no unknown "
            "token, so it cannot encode characters outside its vocabulary"
        )
    try:
        model = models.BPE(
            vocab,
            merge_pairs,
            unk_token=None if unk_id is None else tokens[unk_id],
            byte_fallback=True,
            fuse_unk=True,
        )
    except Exception as exc:  # the Rust side reports merges that name unknown tokens
        raise TokenizerError(f"the BPE vocabulary and merges are inconsistent: {exc}") from exc
    hf = HFTokenizer(model)
    # No pre-tokenizer: SentencePiece merges across the whole span between special tokens. The
    # normalizer runs on each such span separately, so Prepend adds the space after every special
    # token too, exactly where llama.cpp adds it.
    replace = normalizers.Replace(" ", _SPM_SPACE)
    hf.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace]) if add_space_prefix else replace
    )
    # Matched on the raw text (normalized=False): Gemma stores its space-run tokens as raw spaces.
    # HF matches leftmost-longest, which for these vocabularies cuts the same pieces as llama.cpp's
    # longest-token-first partition (space runs: 40 spaces -> 31 + 9).
    specials = [
        AddedToken(tokens[i], special=True, normalized=False, lstrip=False, rstrip=False)
        for i in np.flatnonzero(np.isin(kinds, _SPM_SPLIT_TYPES)).tolist()
        if tokens[i] and i not in invalid
    ]
    if specials:
        hf.add_special_tokens(specials)
    return hf


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building a vocabulary allocates millions of small
    objects, none cyclic, and the collections they trigger would otherwise cost about a third of
    the build time (measured on Gemma 3's 262k vocabulary)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def spm_merges(
    tokens: Sequence[str], types: Sequence[int], scores: np.ndarray, exclude: Iterable[int] = ()
) -> list[tuple[str, str]]:
    """BPE merges that make HF's rank-ordered BPE behave as SentencePiece's score-ordered BPE.

    SentencePiece merges the adjacent pair whose concatenation is the highest-scoring normal token.
    Listing, for every normal token t, each split t = a + b into two normal tokens as the merge
    (a, b), ranked by t's score (highest first), makes "lowest rank first" pick the same pair:
    a pair is mergeable exactly when it is listed, and its rank orders as its score does. The
    splits of one token get neighbouring ranks, which cannot matter: until a token forms, the
    merges inside its span run exactly as they would on the span alone, so a token is always
    built from the same split and no other split of it is ever adjacent. Ties between different
    tokens of equal score are ranked by id (SentencePiece prefers the leftmost pair instead; real
    vocabularies have distinct scores, Gemma 3's included). HF starts from the characters that are
    in the vocabulary and sends the others to byte fallback at once; SentencePiece training puts
    every character of every piece in the vocabulary, so nothing mergeable is lost that way.

    Args:
        tokens: vocabulary texts (U+2581 for spaces).
        types: GGUF token types; only TOKEN_NORMAL entries take part.
        scores: (n_tokens,) float scores.
        exclude: ids to leave out (tokens no text can produce).

    Returns:
        (left, right) text pairs in rank order.
    """
    skip = set(exclude)
    normal = np.flatnonzero(np.asarray(types) == TOKEN_NORMAL).tolist()
    if skip:
        normal = [i for i in normal if i not in skip]
    texts = [tokens[i] for i in normal]
    lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    if not lens.all():  # empty texts take no part
        normal = [i for i, n in zip(normal, lens.tolist(), strict=True) if n]
        texts = [tokens[i] for i in normal]
        lens = lens[lens > 0]
    short = np.flatnonzero(lens <= _VECTOR_MAX_CHARS)
    found = _splits_vectorized([texts[i] for i in short], lens[short]) if len(short) else None
    if found is None:  # duplicate texts or a hash collision: do everything the slow, plain way
        long_rows = range(len(texts))
        merged, left, right, cut = (np.zeros(0, np.int64),) * 4
    else:
        long_rows = np.flatnonzero(lens > _VECTOR_MAX_CHARS).tolist()
        merged, left, right, cut = short[found[0]], short[found[1]], short[found[2]], found[3]
    if len(long_rows):
        row_of = {text: r for r, text in enumerate(texts)}
        extra = [
            (r, row_of[t[:k]], row_of[t[k:]], k)
            for r in long_rows
            for t in (texts[r],)
            for k in range(1, len(t))
            if t[:k] in row_of and t[k:] in row_of
        ]
        if extra:
            cols = np.asarray(extra, dtype=np.int64).T
            merged, left, right, cut = (
                np.concatenate([a, b]) for a, b in zip((merged, left, right, cut), cols, strict=True)
            )
    ids = np.asarray(normal, dtype=np.int64)
    merged, left, right = ids[merged], ids[left], ids[right]
    order = np.lexsort((cut, merged, -np.asarray(scores, dtype=np.float64)[merged]))
    texts_by_id = np.array(tokens, dtype=object)
    return list(zip(texts_by_id[left[order]].tolist(), texts_by_id[right[order]].tolist(), strict=True))


def _splits_vectorized(texts: list[str], lens: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """All splits text[r] = text[p] + text[s] among `texts`, as arrays (r, p, s, k) with k = len(text[p]).

    Rolling polynomial hashes (mod 2**64) of every prefix and suffix are looked up among the
    hashes of the whole texts; each hit is then confirmed by comparing the characters, so the
    result is exact. Returns None when two texts share a hash (duplicate texts), for the
    caller's plain fallback.
    """
    n = len(texts)
    order = np.argsort(-lens, kind="stable")  # longest first: the rows longer than k are a prefix
    length = lens[order]
    width = int(length[0]) if n else 0
    if width < 2:
        return (np.zeros(0, np.int64),) * 4
    joined = "".join(texts)
    if "\x00" in joined:  # NUL would be indistinguishable from the padding below
        return None
    # (n, width) code points, zero-padded, rows in `order`; columns (width, n) for the hash loops.
    flat = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    starts = np.cumsum(lens) - lens
    codes = np.zeros((n, width), dtype=np.uint32)
    codes[np.repeat(np.arange(n), lens), np.arange(len(flat)) - np.repeat(starts, lens)] = flat
    codes = codes[order]
    columns = np.ascontiguousarray(codes.T)
    n_longer = np.searchsorted(-length, -np.arange(width + 1), side="left")  # [k]: rows with len > k
    h = np.zeros(n, dtype=np.uint64)
    full = np.zeros(n, dtype=np.uint64)
    for k in range(width):
        m = n_longer[k]
        h[:m] = h[:m] * _HASH_MUL + columns[k, :m]
        full[n_longer[k + 1] : m] = h[n_longer[k + 1] : m]  # rows of exactly k + 1 chars are complete
    table = _HashTable(full)
    if table.has_duplicates:
        return None
    # [j] = MUL**j; array arithmetic wraps mod 2**64 silently (scalar arithmetic would warn).
    powers = np.ones(width + 1, dtype=np.uint64)
    powers[1:] = np.cumprod(np.full(width, _HASH_MUL, dtype=np.uint64))
    found = []
    h[:] = 0
    for k in range(1, width):
        m = n_longer[k]  # rows with more than k chars can be split after k chars
        h[:m] = h[:m] * _HASH_MUL + columns[k - 1, :m]
        p = table.find(h[:m])
        rows = np.flatnonzero(p >= 0)
        p = p[rows]
        suffix = full[rows] - h[rows] * powers[length[rows] - k]
        s = table.find(suffix)
        hit = s >= 0
        rows, p, s = rows[hit], p[hit], s[hit]
        exact = (
            (length[p] == k)
            & (length[s] == length[rows] - k)
            & (codes[rows, :k] == codes[p, :k]).all(axis=1)
            & (codes[rows, k:] == codes[s, : width - k]).all(axis=1)
        )
        rows, p, s = rows[exact], p[exact], s[exact]
        found.append((order[rows], order[p], order[s], np.full(len(rows), k, dtype=np.int64)))
    return tuple(np.concatenate([f[j] for f in found]) for j in range(4))


class _HashTable:
    """Vectorized exact lookup of uint64 keys: row index of each query key, or -1.

    Keys are scrambled (times an odd constant: a bijection that spreads small keys, such as the
    hash of one character, over the top bits), sorted and bucketed by their top bits, about two
    buckets per key, so a lookup is a couple of gathers instead of a binary search.
    """

    def __init__(self, keys: np.ndarray):
        keys = keys * _HASH_MUL
        self._rows = np.argsort(keys, kind="stable")
        self._keys = keys[self._rows]
        bits = max(1, int(len(keys)).bit_length() + 1)
        self._shift = np.uint64(64 - bits)
        counts = np.bincount((self._keys >> self._shift).astype(np.int64), minlength=1 << bits)
        self._start = np.concatenate([[0], np.cumsum(counts)])
        self.has_duplicates = bool(len(keys) > 1 and np.any(self._keys[1:] == self._keys[:-1]))

    def find(self, queries: np.ndarray) -> np.ndarray:
        queries = queries * _HASH_MUL
        bucket = (queries >> self._shift).astype(np.int64)
        pos, end = self._start[bucket], self._start[bucket + 1]
        out = np.full(len(queries), -1, dtype=np.int64)
        active = np.flatnonzero(pos < end)
        pos, end = pos[active], end[active]
        while len(active):
            hit = self._keys[pos] == queries[active]
            out[active[hit]] = self._rows[pos[hit]]
            more = ~hit & (pos + 1 < end)
            active, pos, end = active[more], pos[more] + 1, end[more]
        return out


def wordpiece_vocab(tokens: Sequence[str], types: Sequence[int]) -> dict[str, int]:
    """BERT's WordPiece vocabulary (word-initial pieces bare, continuations with "##") from llama.cpp's GGUF
    form of it (convert_hf_to_gguf.py BertModel.set_vocab's phantom(): "\u2581" + word-initial piece, a
    continuation without its "##", CONTROL tokens as they are; converters before 2025 kept every "[...]"
    token as it is, which this reads too)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t.startswith(_SPM_SPACE):
            piece = t[1:]
        elif types[i] == TOKEN_CONTROL or t.startswith("[") and t.endswith("]"):
            piece = t
        else:
            piece = "##" + t
        vocab.setdefault(piece, i)
    return vocab


def _wordpiece(tokens: list[str], types: list[int], unk_id: int | None) -> HFTokenizer:
    """The Hugging Face WordPiece tokenizer of a `bert` GGUF vocabulary: BERT's normalizer (clean text,
    CJK characters split, lowercase with accents stripped: the uncased models' tokenizer.json; llama.cpp's
    WPM tokenizer lowercases too), its pre-tokenizer (whitespace and punctuation) and greedy longest-match
    WordPiece with "[UNK]" for a word it cannot spell."""
    if unk_id is None:
        raise TokenizerError("metadata tokenizer.ggml.unknown_token_id is missing (required by 'bert')")
    vocab = wordpiece_vocab(tokens, types)
    hf = HFTokenizer(models.WordPiece(vocab, unk_token=tokens[unk_id], max_input_chars_per_word=100))
    hf.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, k in enumerate(types) if k == TOKEN_CONTROL])
    return hf


class Tokenizer:
    """Text <-> token ids for one model.

    Build with `Tokenizer.from_gguf_metadata`. Attributes `bos_id`, `eos_id`, `pad_id`,
    `unk_id` are ids or None; `eot_ids` is the set of ids that end a generated turn; `kind` is
    the GGUF tokenizer model ("gpt2" or "llama"); `add_space_prefix` says whether encode puts a
    space before the text and after each special token (SentencePiece), which decode removes again.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        tokens: list[str],
        token_types: list[int],
        *,
        bos_id: int | None,
        eos_id: int | None,
        unk_id: int | None,
        pad_id: int | None,
        eot_ids: Iterable[int],
        add_bos: bool,
        add_eos: bool,
        pre: str,
        kind: str = "gpt2",
        add_space_prefix: bool = False,
        split_types: tuple[int, ...] = (TOKEN_CONTROL, TOKEN_USER_DEFINED),
    ):
        self._hf = hf
        self._tokens = tokens
        self._types = token_types
        self._bytes: list[bytes | None] = [None] * len(tokens)  # filled lazily by token_bytes
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.eot_ids: frozenset[int] = frozenset(eot_ids)
        # gpt-oss's harmony format: its special tokens' ids (None for other vocabularies); its turns end
        # at <|return|> / <|call|>, not at <|end|> (engine.harmony)
        controls: dict[str, int] = {}
        for i, (piece, piece_type) in enumerate(zip(tokens, token_types)):
            if piece_type == TOKEN_CONTROL:
                controls.setdefault(piece, i)
        self.harmony = harmony_ids(controls)
        # control tokens that mark a tool call (engine.tools): a chat reply keeps them, so its calls are found
        self._kept_controls = frozenset(controls[t] for t in TOOL_CALL_MARKERS if t in controls)
        if self.harmony is not None:
            self.eot_ids = harmony_stop_ids(self.eot_ids, self.harmony)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.pre = pre
        self.kind = kind
        self.add_space_prefix = add_space_prefix
        # Token types encode cuts out of the text verbatim; a space prefix follows each of them.
        self._split_types = frozenset(split_types)

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer described by a GGUF key/value dict.

        Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and SentencePiece BPE (`"llama"`: Llama 2,
        Mistral, Gemma) are supported.

        Args:
            metadata: GGUF metadata; strings as str, string arrays as list[str], numeric arrays
                as numpy arrays or lists.

        Raises:
            UnsupportedTokenizer: the tokenizer model or pre-tokenizer is not implemented.
            TokenizerError: required keys are missing or inconsistent.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind is None:
            raise TokenizerError("the model has no tokenizer (metadata tokenizer.ggml.model is missing)")
        if kind not in ("gpt2", "llama", "gemma4", "bert", "t5"):
            raise UnsupportedTokenizer(
                f"tokenizer model {kind!r} is not supported yet (only byte-level BPE, 'gpt2', "
                "SentencePiece BPE, 'llama' and 'gemma4', WordPiece, 'bert', and SentencePiece unigram, "
                "'t5', are)"
            )
        gemma4 = kind == "gemma4"
        if gemma4:  # SentencePiece-style BPE ranked by its stored merges, no space prefix by default
            if metadata.get("tokenizer.ggml.merges") is None:
                raise TokenizerError("metadata tokenizer.ggml.merges is missing (required by 'gemma4')")
            kind = "llama"
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("metadata tokenizer.ggml.tokens is missing or empty")
        tokens = list(tokens)
        n_vocab = len(tokens)
        types = _per_token(metadata, "tokenizer.ggml.token_type", n_vocab)
        types = [TOKEN_NORMAL] * n_vocab if types is None else types.tolist()
        bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id", n_vocab)
        unk_id = _optional_id(metadata, "tokenizer.ggml.unknown_token_id", n_vocab)
        eot = {
            i
            for i in (
                eos_id,
                _optional_id(metadata, "tokenizer.ggml.eot_token_id", n_vocab),
                _optional_id(metadata, "tokenizer.ggml.eom_token_id", n_vocab),
            )
            if i is not None
        }
        wanted = set(_END_OF_TURN_TEXTS)
        controls = np.flatnonzero(np.asarray(types) == TOKEN_CONTROL).tolist()
        eot.update(i for i in controls if tokens[i] in wanted)
        merges = metadata.get("tokenizer.ggml.merges")
        merge_pairs = None if merges is None else _parse_merges(merges)
        if kind == "bert":  # [CLS] text [SEP], as llama.cpp's WPM tokenizer adds them
            sep_id = _optional_id(metadata, "tokenizer.ggml.seperator_token_id", n_vocab)
            bos_id = bos_id if bos_id is not None else _find(tokens, "[CLS]")
            eos_id = next((i for i in (sep_id, eos_id) if i is not None), _find(tokens, "[SEP]"))
            return cls(
                _wordpiece(tokens, types, unk_id), tokens, types, bos_id=bos_id, eos_id=eos_id, unk_id=unk_id,
                pad_id=_optional_id(metadata, "tokenizer.ggml.padding_token_id", n_vocab), eot_ids=(),
                add_bos=bos_id is not None, add_eos=eos_id is not None, pre="bert", kind="bert",
            )
        if kind == "t5":  # SentencePiece unigram (XLM-RoBERTa encoders): <s> text </s> as the metadata asks
            from engine.tokenizer_ugm import unigram_tokenizer

            return cls(
                unigram_tokenizer(metadata, tokens, types, unk_id), tokens, types, bos_id=bos_id,
                eos_id=eos_id, unk_id=unk_id,
                pad_id=_optional_id(metadata, "tokenizer.ggml.padding_token_id", n_vocab), eot_ids=(),
                add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)), pre="t5", kind="t5",
                add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
                split_types=_SPM_SPLIT_TYPES,
            )
        if kind == "gpt2":
            if merge_pairs is None:
                raise TokenizerError("metadata tokenizer.ggml.merges is missing (required by BPE)")
            hf, pre = _byte_level_bpe(metadata, tokens, types, merge_pairs)
            add_space_prefix = False
            split_types = (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        else:
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", not gemma4))
            with _gc_paused():
                hf = _sentencepiece_bpe(metadata, tokens, types, merge_pairs, unk_id, add_space_prefix)
            pre = "sentencepiece"
            split_types = _SPM_SPLIT_TYPES
        return cls(
            hf,
            tokens,
            types,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=unk_id,
            pad_id=_optional_id(metadata, "tokenizer.ggml.padding_token_id", n_vocab),
            eot_ids=eot,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and pre not in _NO_BOS_PRE,
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            pre=pre,
            kind=kind,
            add_space_prefix=add_space_prefix,
            split_types=split_types,
        )

    # --- properties -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the embedding/logit rows the model needs)."""
        return len(self._tokens)

    @property
    def bos_token(self) -> str | None:
        """Text of the beginning-of-sequence token, or None when the model has none."""
        return None if self.bos_id is None else self._tokens[self.bos_id]

    @property
    def eos_token(self) -> str | None:
        """Text of the end-of-sequence token, or None when the model has none."""
        return None if self.eos_id is None else self._tokens[self.eos_id]

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary of {len(self._tokens)} tokens"
            )
        return token_id

    def is_special(self, token_id: int) -> bool:
        """True for tokens encode cuts out of the text verbatim (control and user-defined tokens)."""
        return self._types[self._check_id(token_id)] in self._split_types

    def is_control(self, token_id: int) -> bool:
        """True for control tokens (`<|im_end|>`, BOS, EOS, ...), which a chat view hides."""
        return self._types[self._check_id(token_id)] == TOKEN_CONTROL

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer splits `text` into before BPE (special tokens not matched).

        SentencePiece does not pre-split: the whole text is one piece.
        """
        if self._hf.pre_tokenizer is None:
            return [text] if text else []
        pieces = self._hf.pre_tokenizer.pre_tokenize_str(text)
        return [_byte_level_to_bytes(piece).decode("utf-8", errors="replace") for piece, _ in pieces]

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored (byte-level alphabet or U+2581 for spaces in normal tokens)."""
        return self._tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for; control and user-defined tokens give their text.

        `<0xXX>` byte tokens give their byte; SentencePiece normal tokens their text with U+2581
        turned back into spaces (the space prefix is kept; `decode` is what removes it).
        """
        cached = self._bytes[self._check_id(token_id)]
        if cached is not None:
            return cached
        text = self._tokens[token_id]
        kind = self._types[token_id]
        if kind == TOKEN_BYTE and (m := _BYTE_TOKEN_RE.fullmatch(text)):
            raw = bytes([int(m.group(1), 16)])
        elif self.kind == "bert":  # WordPiece: a continuation joins its word, a word-initial piece starts one
            if kind == TOKEN_NORMAL:
                text = text[2:] if text.startswith("##") else " " + text.removeprefix(_SPM_SPACE)
            raw = text.encode("utf-8", "surrogateescape")
        elif kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) or self.kind in ("llama", "t5"):
            if self.kind in ("llama", "t5") and kind in (TOKEN_NORMAL, TOKEN_UNUSED):
                text = text.replace(_SPM_SPACE, " ")  # special tokens match the raw text, so stay raw
            # Invalid UTF-8 in the file arrives as lone surrogates; surrogateescape restores the bytes.
            raw = text.encode("utf-8", "surrogateescape")
        else:
            raw = _byte_level_to_bytes(text)
        self._bytes[token_id] = raw
        return raw

    # --- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids for `text`. Special-token texts in `text` (e.g. `<|im_start|>`) become their ids.

        Args:
            text: input text.
            add_special: add BOS (and EOS) where the model's metadata asks for them.
        """
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def encode_embedding(self, text: str) -> list[int]:
        """Token ids of one input to embed, with the special tokens the model's own tokenizer adds: a
        Hugging Face folder's tokenizer.json post-processor (BERT's [CLS] .. [SEP], Qwen3-Embedding's
        closing <|endoftext|>), else BOS / EOS as the GGUF metadata asks (tokenizer.ggml.add_eos_token)."""
        if self.pre == "hf" and self._hf.post_processor is not None:
            return self._hf.encode(text, add_special_tokens=True).ids
        return self.encode(text, add_special=True)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text for `ids`. Invalid UTF-8 becomes U+FFFD; control tokens are dropped if skip_special.

        With `add_space_prefix` the space encode put at the start and after each special token is
        removed, so `decode(encode(text)) == text`.
        """
        parts = []
        strip = self.add_space_prefix
        for i in ids:
            raw, strip = self.piece(int(i), strip, skip_special)
            parts.append(raw)
        return b"".join(parts).decode("utf-8", errors="replace")

    def piece(self, token_id: int, strip_space: bool, skip_special: bool = False) -> tuple[bytes, bool]:
        """One step of decoding: the bytes `token_id` adds to the text, and the next `strip_space`.

        Args:
            token_id: the token.
            strip_space: drop a leading space of this token (the space prefix SentencePiece added).
            skip_special: give b"" for control tokens.

        Returns:
            (bytes, whether the following token starts a span that encode gave a space prefix).
        """
        kind = self._types[self._check_id(token_id)]
        if kind in self._split_types:
            skip = skip_special and kind == TOKEN_CONTROL and token_id not in self._kept_controls
            raw = b"" if skip else self.token_bytes(token_id)
            return raw, self.add_space_prefix
        raw = self.token_bytes(token_id)
        if strip_space and kind == TOKEN_NORMAL and raw[:1] == b" ":
            raw = raw[1:]
        return raw, False


class StreamDecoder:
    """Turns a stream of token ids into text, one token at a time.

    A multi-byte character split over several tokens (byte-level pieces, or SentencePiece
    <0xXX> byte-fallback tokens) is held back until it is complete, so the concatenated output
    of `push` calls and a final `flush` equals `Tokenizer.decode` of the same ids (with the same
    skip_special), and no piece ever contains half a character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, *, text_start: bool = True):
        """
        Args:
            tokenizer: the model's tokenizer.
            skip_special: drop control tokens, as `decode(skip_special=True)` does.
            text_start: the first token begins a text, so the space SentencePiece's add_space_prefix
                put before it is dropped, as `decode` does. Pass False when the tokens continue a
                text decoded elsewhere (a completion after its prompt); no effect without the prefix.
        """
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._strip_at_start = text_start and tokenizer.add_space_prefix
        self._strip = self._strip_at_start
        # Python's incremental decoder keeps incomplete trailing sequences and replaces bytes
        # that can never become valid, exactly like a one-shot decode with errors="replace".
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly '')."""
        raw, self._strip = self.tokenizer.piece(token_id, self._strip, self.skip_special)
        return self._decoder.decode(raw)

    def flush(self) -> str:
        """End the stream: return held-back bytes that never completed, as U+FFFD.

        The decoder is then ready for a new text.
        """
        out = self._decoder.decode(b"", final=True)
        self.reset()
        return out

    def reset(self) -> None:
        """Drop any held-back bytes (e.g. when a generation is cancelled) and start a new text."""
        self._decoder.reset()
        self._strip = self._strip_at_start
