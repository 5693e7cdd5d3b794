"""Tokenizer built from GGUF metadata, and a streaming detokenizer.

The GGUF file carries the whole vocabulary (`tokenizer.ggml.*`); we rebuild the equivalent
Hugging Face `tokenizers.Tokenizer` from it (Rust BPE, fast) and keep our own byte table for
decoding, so decoding is byte-exact and the streaming decoder never depends on HF internals.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported for now; SentencePiece
(`"llama"`) raises `UnsupportedTokenizer`.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from models.errors import HearthError

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Texts of control tokens that end a turn in the chat formats we know of.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>")


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

_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    # llama.cpp's fallback for pre == "default" (and for a missing pre key).
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
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
}

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


class Tokenizer:
    """Text <-> token ids for one model.

    Build with `Tokenizer.from_gguf_metadata`. Attributes `bos_id`, `eos_id`, `pad_id`,
    `unk_id` are ids or None; `eot_ids` is the set of ids that end a generated turn.
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
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.pre = pre

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer described by a GGUF key/value dict.

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
        if kind != "gpt2":
            raise UnsupportedTokenizer(
                f"tokenizer model {kind!r} is not supported yet (only byte-level BPE, 'gpt2', is)"
            )
        pre = metadata.get("tokenizer.ggml.pre") or "default"
        if pre not in _PRE_ALIASES:
            raise UnsupportedTokenizer(
                f"pre-tokenizer {pre!r} is not supported; known: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
            )
        family, ignore_merges = _PRE_ALIASES[pre]

        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        if not tokens:
            raise TokenizerError("metadata tokenizer.ggml.tokens is missing or empty")
        if merges is None:
            raise TokenizerError("metadata tokenizer.ggml.merges is missing (required by BPE)")
        tokens = list(tokens)
        n_vocab = len(tokens)
        raw_types = metadata.get("tokenizer.ggml.token_type")
        if raw_types is None:
            types = [TOKEN_NORMAL] * n_vocab
        else:
            types = [int(t) for t in raw_types]
            if len(types) != n_vocab:
                raise TokenizerError(
                    f"tokenizer.ggml.token_type has {len(types)} entries but there are {n_vocab} tokens"
                )

        vocab = {tok: i for i, tok in enumerate(tokens)}
        merge_pairs = []
        for m in merges:
            # Search from index 1, as llama.cpp does, so a merge whose left side is " " still splits.
            cut = m.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"malformed BPE merge {m!r} (expected 'left right')")
            merge_pairs.append((m[:cut], m[cut + 1 :]))
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

        bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id", n_vocab)
        eot = {
            i
            for i in (
                eos_id,
                _optional_id(metadata, "tokenizer.ggml.eot_token_id", n_vocab),
                _optional_id(metadata, "tokenizer.ggml.eom_token_id", n_vocab),
            )
            if i is not None
        }
        for text in _END_OF_TURN_TEXTS:
            i = vocab.get(text)
            if i is not None and types[i] == TOKEN_CONTROL:
                eot.add(i)
        return cls(
            hf,
            tokens,
            types,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=_optional_id(metadata, "tokenizer.ggml.unknown_token_id", n_vocab),
            pad_id=_optional_id(metadata, "tokenizer.ggml.padding_token_id", n_vocab),
            eot_ids=eot,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            pre=pre,
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

    def is_control(self, token_id: int) -> bool:
        """True for control tokens (`<|im_end|>`, BOS, EOS, ...), which a chat view hides."""
        return self._types[self._check_id(token_id)] == TOKEN_CONTROL

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer splits `text` into before BPE (special tokens not matched)."""
        pieces = self._hf.pre_tokenizer.pre_tokenize_str(text)
        return [_byte_level_to_bytes(piece).decode("utf-8", errors="replace") for piece, _ in pieces]

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored (byte-level alphabet for normal tokens)."""
        return self._tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for; control and user-defined tokens give their text."""
        cached = self._bytes[self._check_id(token_id)]
        if cached is not None:
            return cached
        text = self._tokens[token_id]
        kind = self._types[token_id]
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            raw = text.encode("utf-8")
        elif kind == TOKEN_BYTE and (m := _BYTE_TOKEN_RE.fullmatch(text)):
            raw = bytes([int(m.group(1), 16)])
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

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text for `ids`. Invalid UTF-8 becomes U+FFFD; control tokens are dropped if skip_special."""
        parts = [
            self.token_bytes(int(i))
            for i in ids
            if not (skip_special and self._types[self._check_id(int(i))] == TOKEN_CONTROL)
        ]
        return b"".join(parts).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text, one token at a time.

    A multi-byte character split over several tokens is held back until it is complete, so
    the concatenated output of `push` calls and a final `flush` equals `Tokenizer.decode` of
    the same ids (with the same skip_special), and no piece ever contains half a character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        # Python's incremental decoder keeps incomplete trailing sequences and replaces bytes
        # that can never become valid, exactly like a one-shot decode with errors="replace".
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly '')."""
        if self.skip_special and self.tokenizer.is_control(token_id):
            return ""
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End the stream: return held-back bytes that never completed, as U+FFFD."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out

    def reset(self) -> None:
        """Drop any held-back bytes (e.g. when a generation is cancelled)."""
        self._decoder.reset()
