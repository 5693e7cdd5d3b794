"""Ollama's Modelfiles and created models (presets) on `hearth serve`.

`ollama create NAME -f Modelfile` makes a model out of one the server has: the Modelfile's FROM names it,
and SYSTEM, PARAMETER, TEMPLATE, MESSAGE and LICENSE set what the new name adds. Hearth keeps such a model
as a preset (models.library.Preset): a row in the library, no file copied. Served, it runs on its base
model's engine (loaded once for both) with:

- its system prompt before a conversation that has none, its MESSAGE lines after that system prompt;
- its parameters as defaults that a request's own options override (`stop` included);
- its template, which must be a Jinja2 chat template (as a GGUF's `tokenizer.chat_template` is written):
  Ollama's Go templates (`{{ .Prompt }}`, `{{ range .Messages }}`) are refused, not translated.

This module parses Modelfiles and /api/create bodies into presets (every error a 400 that says what to
do), applies a preset to a request, and writes a preset back as /api/show shows a model.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from engine.server.errors import APIError, invalid
from models.library import PRESET_NAME

# Ollama's options (api.Options and api.Runner) by type; the ones Hearth applies are APPLIED, the others are
# kept and shown but, as in a request's options, ignored
INT_PARAMS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "seed", "num_predict",
              "top_k", "repeat_last_n", "mirostat")
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "typical_p", "tfs_z", "repeat_penalty", "presence_penalty",
                "frequency_penalty", "mirostat_tau", "mirostat_eta")
BOOL_PARAMS = ("numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock",
               "embedding_only", "penalize_newline")
APPLIED = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "num_predict")
COMMANDS = ("from", "parameter", "template", "system", "adapter", "message", "license")
ROLES = ("system", "user", "assistant")
_GO_ACTION = re.compile(r"\{\{-?\s*(?:[.$]|(?:if|range|with|else|end|template|block|define)\b)")
NO_BLOBS = ("Hearth does not take uploaded model files (Ollama's `files` and /api/blobs; the ollama CLI "
            "uploads a FROM that is a file): add the file to the library (hearth import PATH, or /api/pull), "
            "then write FROM with its name as GET /api/tags lists it, or post the Modelfile's text as "
            "/api/create's `modelfile` with FROM the file's path on the server's machine")


def model_name(name: Any, what: str = "model") -> str:
    """A valid name for a created model, without Ollama's default tag ':latest'.

    Raises:
        APIError (400): not a name Ollama would take.
    """
    if not isinstance(name, str) or not PRESET_NAME.match(name.strip()):
        raise invalid(
            f"{what} {name!r} is invalid: a model name is letters, digits, '_', '-' and '.', optionally "
            "with a ':tag' (for example mybot or mybot:v2)", what,
        )
    return name.strip().removesuffix(":latest")


# --- Modelfiles ---------------------------------------------------------------------------------


def parse_modelfile(text: str) -> dict:
    """A Modelfile as the fields of an /api/create body: from, parameters, template, system, messages,
    license, adapters (as Ollama's client sends them after parsing one).

    Raises:
        APIError (400): an unknown instruction, an unclosed quote, a bad PARAMETER or MESSAGE line, no FROM.
    """
    out: dict[str, Any] = {"parameters": {}, "messages": [], "license": []}
    pos, n = 0, len(text)
    line_no = 1
    while pos < n:
        end = text.find("\n", pos)
        end = n if end < 0 else end
        line = text[pos:end].strip()
        start_line = line_no
        if not line or line.startswith("#"):
            pos, line_no = end + 1, line_no + 1
            continue
        word, rest = (line.split(None, 1) + [""])[:2]
        command = word.lower()
        if command not in COMMANDS:
            raise invalid(f"Modelfile line {start_line}: unknown instruction {word!r}; a Modelfile's lines "
                          f"start with one of {', '.join(c.upper() for c in COMMANDS)}", "modelfile")
        key = ""
        if command in ("parameter", "message"):
            key, rest = (rest.split(None, 1) + [""])[:2]
        rest = rest.strip()
        if rest.startswith('"""'):  # a value in triple quotes may span lines
            opened = text.find('"""', pos)
            close = text.find('"""', opened + 3)
            if close < 0:
                raise invalid(f'Modelfile line {start_line}: the """ opened here is never closed',
                              "modelfile")
            value = text[opened + 3:close]
            line_no += text.count("\n", pos, close)
            end = text.find("\n", close)
            end = n if end < 0 else end
        else:
            value = rest[1:-1] if len(rest) >= 2 and rest[0] == rest[-1] == '"' else rest
        pos, line_no = end + 1, line_no + 1
        if command == "from":
            out["from"] = value
        elif command == "parameter":
            if not key or not value:
                raise invalid(f"Modelfile line {start_line}: PARAMETER takes a name and a value, such as "
                              "PARAMETER temperature 0.7", "modelfile")
            key = key.lower()
            value = parameter_value(key, value)
            if key == "stop":
                out["parameters"].setdefault("stop", []).extend(value)
            else:
                out["parameters"][key] = value
        elif command == "message":
            if key.lower() not in ROLES or not value:
                raise invalid(f"Modelfile line {start_line}: MESSAGE takes a role (system, user or "
                              "assistant) and its text, such as MESSAGE user Hello", "modelfile")
            out["messages"].append({"role": key.lower(), "content": value})
        elif command == "license":
            out["license"].append(value)
        elif command == "adapter":
            out.setdefault("adapters", {})[value] = value
        else:  # template, system
            out[command] = value
    if not out.get("from"):
        raise invalid("the Modelfile has no FROM line: start it with FROM and a model this server has "
                      "(GET /api/tags) or a GGUF file's path", "modelfile")
    return out


# --- parameters ---------------------------------------------------------------------------------


def parameter_value(name: str, value: Any) -> Any:
    """One parameter's value typed as Ollama types it (from a Modelfile's text or a JSON value); stop is a
    list of strings.

    Raises:
        APIError (400): an unknown name or a value of the wrong type.
    """
    where = "parameters"
    if name == "stop":
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) and v for v in values):
            raise invalid(f"parameter 'stop' takes strings, got {value!r}", where)
        return list(values)
    if isinstance(value, list) and len(value) == 1:  # a client that sends a Modelfile's lines as they were
        value = value[0]
    if name in INT_PARAMS:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = int(value.strip())
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise invalid(f"invalid int value {value!r} for parameter '{name}': it takes a whole number", where)
    if name in FLOAT_PARAMS:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value.strip())
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            return value
        raise invalid(f"invalid float value {value!r} for parameter '{name}': it takes a number", where)
    if name in BOOL_PARAMS:
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if isinstance(value, bool):
            return value
        raise invalid(f"invalid bool value {value!r} for parameter '{name}': it takes true or false", where)
    known = ", ".join(sorted((*INT_PARAMS, *FLOAT_PARAMS, *BOOL_PARAMS, "stop")))
    raise invalid(f"unknown parameter {name!r}; Ollama's parameters are {known}", where)


def parameters(spec: Any) -> dict:
    """/api/create's `parameters` typed and checked: names, types, and the applied ones' ranges (as a
    request's options would be checked).

    Raises:
        APIError (400): what is wrong, naming the parameter.
    """
    from engine.server import ollama

    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise invalid("'parameters' must be an object such as {\"temperature\": 0.7}", "parameters")
    out = {str(k).lower(): parameter_value(str(k).lower(), v) for k, v in spec.items() if v is not None}
    try:  # the ranges a request's options are held to
        ollama.parse_chat({"model": "preset", "options": {k: v for k, v in out.items() if k in APPLIED},
                           "messages": [{"role": "user", "content": "x"}]}, 1 << 30)
    except APIError as e:
        message = e.message.replace("'options.", "'")
        raise invalid(f"bad parameter: {message}", "parameters") from e
    return out


def parameters_text(params: dict) -> str:
    """Parameters as /api/show writes them: one `name value` line each (a line per stop string)."""
    lines = []
    for k, v in params.items():
        for item in v if isinstance(v, list) else [v]:
            lines.append(f"{k:<30} {json.dumps(item) if isinstance(item, str) else _scalar(item)}")
    return "\n".join(lines)


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if not v.is_integer() else str(int(v))
    return str(v)


# --- templates and messages ------------------------------------------------------------------------


def template(source: Any) -> str | None:
    """A TEMPLATE checked: a Jinja2 chat template that compiles and renders a one-message conversation.

    Raises:
        APIError (400): not a string, an Ollama Go template, or a template that fails.
    """
    from engine.chat_template import ChatTemplate, TemplateError

    if source is None or source == "":
        return None
    if not isinstance(source, str):
        raise invalid("'template' must be a string", "template")
    if "{%" not in source or _GO_ACTION.search(source):
        raise invalid(
            "TEMPLATE looks like an Ollama Go template ({{ .Prompt }}, {{ range .Messages }}): Hearth "
            "renders chat templates with Jinja2, as a GGUF's tokenizer.chat_template is written, and does "
            "not translate Go templates; leave TEMPLATE out to use the model's own template, or give a "
            "Jinja2 one ({% for message in messages %}...)", "template",
        )
    try:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except TemplateError as e:
        raise invalid(f"TEMPLATE: {e}", "template") from e
    return source


def messages(spec: Any) -> list[dict]:
    """MESSAGE lines (or /api/create's `messages`) as {role, content} dicts.

    Raises:
        APIError (400): not a list of messages with a known role and text content.
    """
    if spec is None:
        return []
    if not isinstance(spec, list):
        raise invalid("'messages' must be a list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(spec):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise invalid(f"messages[{i}] must have a role (system, user or assistant) and text content",
                          "messages")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def license_text(spec: Any) -> str | None:
    if spec is None or spec == [] or spec == "":
        return None
    if isinstance(spec, str):
        return spec
    if isinstance(spec, list) and all(isinstance(s, str) for s in spec):
        return "\n\n".join(spec)
    raise invalid("'license' must be a string or a list of strings", "license")


# --- serving a preset -----------------------------------------------------------------------------


def conversation(preset, chat: list[dict]) -> list[dict]:
    """A request's messages with the preset's: its system prompt first unless the request opens with its
    own, then its MESSAGE lines, then the request's conversation."""
    lead = 0
    while lead < len(chat) and chat[lead].get("role") in ("system", "developer"):
        lead += 1
    system = chat[:lead] or ([{"role": "system", "content": preset.system}] if preset.system else [])
    return [*system, *(dict(m) for m in preset.messages), *chat[lead:]]


_EMBEDDINGS = ("/api/embed", "/api/embeddings", "/v1/embeddings")  # no sampling there
_OPENAI = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "stop": "stop", "num_predict": "max_tokens"}
_ANTHROPIC = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop": "stop_sequences"}


def apply_parameters(path: str, body: Any, params: dict) -> None:
    """Put a preset's parameters into a request body (in place) where the request sets none: Ollama's
    `options`, the OpenAI and Anthropic routes' own fields."""
    if not params or not isinstance(body, dict) or path in _EMBEDDINGS:
        return
    if path.startswith("/api/"):
        options = body.get("options")
        if options is None or isinstance(options, dict):
            given = {k: v for k, v in (options or {}).items() if v is not None}
            body["options"] = {**params, **given}
        return
    names = _ANTHROPIC if path.startswith("/v1/messages") else _OPENAI
    for key, field in names.items():
        if key not in params or body.get(field) is not None:
            continue
        if field == "max_tokens" and (body.get("max_completion_tokens") is not None or params[key] <= 0):
            continue
        body[field] = params[key]


# --- showing a preset ------------------------------------------------------------------------------


def modelfile_text(preset, base_id: str, base_path: Path) -> str:
    """A preset as Ollama's /api/show writes a model's Modelfile."""
    lines = [
        '# Modelfile generated by "ollama show"',
        "# To build a new Modelfile based on this, replace FROM with:",
        f"# FROM {preset.name}",
        "",
        f"FROM {base_id}",
        f"# ({base_path})",
    ]
    if preset.template:
        lines.append(f'TEMPLATE """{preset.template}"""')
    if preset.system:
        lines.append(f'SYSTEM """{preset.system}"""')
    for k, v in preset.parameters.items():
        for item in v if isinstance(v, list) else [v]:
            lines.append(f"PARAMETER {k} {item if isinstance(item, str) else _scalar(item)}")
    for m in preset.messages:
        lines.append(f'MESSAGE {m["role"]} """{m["content"]}"""')
    if preset.license:
        lines.append(f'LICENSE """{preset.license}"""')
    return "\n".join(lines) + "\n"
