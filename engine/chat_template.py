"""Chat templates: render a conversation into the prompt text a model was trained on.

Templates are Jinja2 source shipped with the model (`tokenizer.chat_template` in GGUF,
`chat_template` in tokenizer_config.json). They are untrusted input, so they run in Jinja's
immutable sandbox with the same options and helpers Hugging Face transformers provides
(`raise_exception`, `strftime_now`, a non-escaping `tojson`, `{% generation %}` blocks), which
is what template authors test against.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.errors import HearthError


class TemplateError(HearthError):
    """A chat template is malformed, rejected the conversation, or tried something forbidden."""


def _raise_exception(message: str) -> NoReturn:
    """Template helper: templates call this to reject a conversation (e.g. roles out of order)."""
    raise TemplateError(f"the chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    """Template helper: the local time formatted with `fmt` (templates that print today's date)."""
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Template filter: JSON without Jinja's HTML escaping, as transformers defines it."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks in HF.

    Rendering only needs the body, so the block renders its content unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, but a forbidden attribute fails at once.

    The stock sandbox returns an Undefined that only fails when used, so `{{ x.__class__ }}`
    would silently print nothing; a template probing the sandbox should be reported instead.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed"
        )


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: Jinja2 template text.
        bos_token: text of the model's BOS token (templates often print it), or None.
        eos_token: text of the model's EOS token, or None.

    Raises:
        TemplateError: the source is not valid Jinja2.
    """

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the chat template is empty")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"the chat template has a syntax error on line {exc.lineno}: {exc.message}"
            ) from exc

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> ChatTemplate | None:
        """The template stored in GGUF metadata (`tokenizer.chat_template`), or None if there is none.

        BOS/EOS texts come from the vocabulary and `tokenizer.ggml.{bos,eos}_token_id`.
        """
        source = metadata.get("tokenizer.chat_template")
        if not source:
            return None
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str | None:
            value = metadata.get(key)
            if value is None:
                return None
            i = int(value)
            return tokens[i] if 0 <= i < len(tokens) else None

        return cls(
            source,
            bos_token=token("tokenizer.ggml.bos_token_id"),
            eos_token=token("tokenizer.ggml.eos_token_id"),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render a conversation into prompt text.

        Args:
            messages: dicts with at least `role` and `content`, oldest first.
            add_generation_prompt: end with the header that starts the assistant's reply.
            **extra: further template variables (tools, documents, date_string, ...).

        Raises:
            TemplateError: bad messages, the template called raise_exception, used an undefined
                value in a way that fails, or tried to leave the sandbox.
        """
        for n, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise TemplateError(f"message {n} must be a dict with 'role' and 'content', got {message!r}")
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except SecurityError as exc:
            raise TemplateError(f"the chat template tried an operation the sandbox forbids: {exc}") from exc
        except jinja2.UndefinedError as exc:
            raise TemplateError(f"the chat template used an undefined value: {exc}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc
