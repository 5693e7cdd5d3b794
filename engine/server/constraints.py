"""Structured output: token masks that keep a reply valid JSON (or valid for a JSON schema).

Constrained decoding is llguidance's (a maintained Rust grammar engine with Python bindings): it gets
our vocabulary as raw token bytes, compiles a JSON schema into a grammar and, at every step, gives
the set of tokens that keep the output a prefix of some valid document. The sampler then only sees
those tokens, so the reply always parses (and validates) once the grammar accepts it.
"""

from __future__ import annotations

import json
import threading

import llguidance as llg
import numpy as np

from engine.server.errors import invalid
from engine.tokenizer import Tokenizer

# Bounds on what a request may ask the grammar compiler for (a schema is untrusted input).
MAX_SCHEMA_BYTES = 64 << 10
_LIMITS = llg.LLParserLimits()  # llguidance defaults: bounded fuel per mask step


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer: ids, token bytes, encode."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eot_ids)
        self.bos_token_id = tokenizer.bos_id
        n = tokenizer.vocab_size
        # padded embedding rows (n_vocab > n) stand for no text: empty byte strings, never allowed
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * max(0, n_vocab - n)
        self.special_token_ids = [i for i in range(n) if tokenizer.is_control(i)]

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", "surrogateescape")
        return self._tok.encode(text)


_CACHE: dict[int, llg.LLTokenizer] = {}
_CACHE_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> llg.LLTokenizer:
    """llguidance's view of `tokenizer` (built once per tokenizer: ~1 s for a 50k vocabulary)."""
    with _CACHE_LOCK:
        key = id(tokenizer)
        if key not in _CACHE:
            wrapper = llg.TokenizerWrapper(_Vocabulary(tokenizer, n_vocab))
            _CACHE[key] = llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=sorted(tokenizer.eot_ids))
        return _CACHE[key]


def grammar_for(response_format: dict) -> str | None:
    """The llguidance grammar for an OpenAI `response_format`, or None for plain text.

    Raises:
        APIError (400): an unknown type or a schema that cannot be compiled.
    """
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema: dict | bool = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format.json_schema must be an object with a 'schema'", "response_format")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise invalid(
                "response_format.json_schema.schema must be a JSON schema object", "response_format"
            )
    else:
        raise invalid(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format",
        )
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise invalid(f"the JSON schema is over {MAX_SCHEMA_BYTES >> 10} KiB", "response_format")
    try:
        # compact separators: the model cannot wander off into endless whitespace
        grammar = llg.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
    except (ValueError, TypeError) as e:
        raise invalid(f"the JSON schema cannot be used: {e}", "response_format") from e
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=_LIMITS)
    if is_error:
        raise invalid(
            f"the JSON schema cannot be used: {messages[0] if messages else 'invalid'}", "response_format"
        )
    return grammar


class Constraint:
    """One reply's grammar state: masks logits, then follows the sampled tokens.

    Args:
        tokenizer: the model's tokenizer.
        n_vocab: logit rows of the model (may exceed the tokenizer's vocabulary).
        grammar: from grammar_for.
    """

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, grammar: str):
        self.n_vocab = n_vocab
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer, n_vocab), grammar, log_level=0, limits=_LIMITS)
        if self.matcher.is_error():
            raise invalid(f"the JSON schema cannot be used: {self.matcher.get_error()}", "response_format")
        self._mask = np.empty((n_vocab + 31) // 32, np.int32)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """Set the logits of every token the grammar forbids now to -inf (in place); returns logits."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: len(logits)]
        logits[allowed == 0] = -np.inf
        return logits

    def consume(self, token: int) -> None:
        """Advance past the sampled token (which apply() allowed)."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(
                f"structured output: grammar rejected token {token}: {self.matcher.get_error()}"
            )

    @property
    def done(self) -> bool:
        """The document is complete: only end-of-turn may follow."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()
