"""The app's settings: one typed schema, one object that reads/writes it, change notifications per key.

Qt-free on purpose (the settings dialog is generated from SCHEMA; tests check the round trip without
a display). The file is JSON in the user config dir, written to a temp file and renamed; unknown keys
in it are kept (a newer version's settings survive a downgrade) and invalid values fall back to the
default with a warning instead of refusing to start.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from models.errors import HearthError
from models.library import preset_sampling
from models.paths import config_dir

SETTINGS_VERSION = 1


class SettingsError(HearthError):
    """A value does not fit its setting (wrong type, out of range, not one of the choices)."""


def _opt(default, label: str, description: str, section: str, **extra) -> Any:
    meta = {"label": label, "description": description, "section": section, **extra}
    return field(default=default, metadata=meta)


@dataclass
class Schema:
    """Every setting with its default, label, description, section and limits (metadata)."""

    # -- model and engine
    default_model: str = _opt(
        "smollm2-135m-instruct",
        "Default model",
        "Loaded at start: a starter model's name or a model file.",
        "Model",
        kind="model",
    )
    quant_format: str = _opt(
        "Q4_K_M",
        "Quantization",
        "Target format when Hearth converts or re-quantizes a model.",
        "Model",
        kind="quant",
    )
    device: str = _opt("cpu", "Device", "Where the model runs.", "Model", choices=("cpu", "cuda"))
    gpu_layers: int = _opt(
        -1,
        "GPU layers",
        "With Device: cuda, how many layers go to the GPU (-1: all). Fewer when the model does not fit "
        "in GPU memory: the rest run on the CPU.",
        "Model",
        min=-1,
        max=1024,
    )
    threads: int = _opt(0, "CPU threads", "Threads for the engine (0: all cores).", "Model", min=0, max=256)
    n_ctx: int = _opt(4096, "Context length", "Tokens the model sees at once.", "Model", min=256, max=131072)
    kv_dtype: str = _opt(
        "f16",
        "KV cache precision",
        "f16 takes half the memory per token of context of f32, and decodes long contexts faster.",
        "Model",
        choices=("f32", "f16"),
    )
    prefix_cache_mb: int = _opt(
        512,
        "KV reuse memory (MiB)",
        "RAM kept for other chats' states so returning to a chat is instant.",
        "Model",
        min=0,
        max=65536,
    )
    speculation: str = _opt(
        "off",
        "Speculative decoding",
        "A small draft model or prompt lookup can speed up replies.",
        "Model",
        choices=("off", "draft", "prompt-lookup"),
    )
    draft_model: str = _opt(
        "", "Draft model", "Model file used for drafting (speculation: draft).", "Model", kind="path"
    )
    context_policy: str = _opt(
        "truncate-middle",
        "When the chat outgrows the context",
        "truncate-middle keeps the start and the latest turns; rolling-window the latest; stop refuses.",
        "Model",
        choices=("truncate-middle", "rolling-window", "stop"),
    )
    document_search: str = _opt(
        "auto",
        "Document search model",
        "How the parts of long documents that answer a question are found: by keywords and an embedding "
        "model's sense of meaning (Automatic: the first embedding model in the library; or the one chosen), "
        "or by keywords only.",
        "Model",
        kind="embedding_model",
    )
    # -- sampling defaults (a chat can override them)
    temperature: float = _opt(
        0.7, "Temperature", "0 always picks the likeliest word.", "Sampling", min=0.0, max=2.0
    )
    top_k: int = _opt(
        40, "Top-k", "Sample among this many likeliest tokens (0: all).", "Sampling", min=0, max=1000
    )
    top_p: float = _opt(0.95, "Top-p", "Nucleus sampling mass.", "Sampling", min=0.0, max=1.0)
    min_p: float = _opt(
        0.05, "Min-p", "Drop tokens below this share of the best one.", "Sampling", min=0.0, max=1.0
    )
    repetition_penalty: float = _opt(
        1.0, "Repetition penalty", "Above 1 discourages repeats.", "Sampling", min=0.5, max=2.0
    )
    max_tokens: int = _opt(
        1024, "Reply length limit", "Most tokens in one reply.", "Sampling", min=1, max=32768
    )
    thinking: bool = _opt(
        True,
        "Let reasoning models think",
        "Off asks templates that support it (Qwen3's enable_thinking) to skip the thinking block, and "
        "gpt-oss to think briefly (reasoning effort low): "
        "faster replies, less careful ones.",
        "Sampling",
    )
    # -- appearance and folders
    theme: str = _opt(
        "system",
        "Theme",
        "Follow the system, or force light or dark.",
        "Appearance",
        choices=("system", "light", "dark"),
    )
    font_size: int = _opt(0, "Font size", "Points (0: the system's size).", "Appearance", min=0, max=48)
    models_folder: str = _opt(
        "", "Models folder", "Where downloads go (empty: Hearth's data folder).", "Folders", kind="dir"
    )
    export_folder: str = _opt(
        "", "Export folder", "Default folder for exported chats.", "Folders", kind="dir"
    )
    # -- the local API server (the Serve toggle)
    serve_host: str = _opt(
        "127.0.0.1",
        "Server address",
        "Where `hearth serve` listens; 127.0.0.1 keeps it to this computer.",
        "Server",
    )
    serve_port: int = _opt(
        8080, "Server port", "TCP port of the local API server.", "Server", min=1, max=65535
    )
    # -- tool use: MCP servers of mcp.json (the dialog's Tools tab lists them with their own toggles)
    tools_enabled: bool = _opt(
        False,
        "Use tools (MCP)",
        "Offer the tools of the MCP servers in mcp.json to models whose chat template takes tools. Each call "
        "asks first (Allow once, Always allow for this tool, Deny).",
        "Tools",
    )
    tool_timeout_s: int = _opt(
        120, "Tool call time limit (s)", "A tool call that takes longer is stopped.", "Tools", min=1, max=3600
    )
    tool_max_rounds: int = _opt(
        8,
        "Tool rounds per message",
        "Rounds of tool calls the model may make for one message before Hearth stops and asks you.",
        "Tools",
        min=1,
        max=100,
    )
    mcp_disabled: str = _opt(
        "[]", "", "mcp.json servers switched off (a JSON list of names): the Tools tab.", "", hidden=True
    )
    # -- internal state, not shown in the dialog
    first_run_done: bool = _opt(False, "", "", "", hidden=True)


SCHEMA = {f.name: f for f in fields(Schema)}
# settings the loaded model is reloaded for when they change
ENGINE_KEYS = ("n_ctx", "kv_dtype", "prefix_cache_mb", "threads", "device", "gpu_layers")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_tokens")

# the overrides a chat keeps: the sampling settings', a seed and stop sequences
CHAT_KEYS = SAMPLING_KEYS + ("seed", "stop")


def clean_overrides(overrides: dict) -> dict:
    """A chat's overrides: the sampling settings' keys, seed and stop (a list of strings), unset ones
    dropped."""
    out = {k: v for k, v in overrides.items() if k in CHAT_KEYS and v is not None}
    if "stop" in out:
        out["stop"] = [s for s in out["stop"] if isinstance(s, str) and s]
        if not out["stop"]:
            del out["stop"]
    return out


def preset_overrides(preset) -> dict:
    """A preset's parameters as a chat's overrides (what Hearth does not apply, e.g. num_ctx, left out)."""
    values = preset_sampling(preset.parameters)
    if "stop" in values:
        values["stop"] = list(values["stop"])
    return clean_overrides(values)


def default(key: str) -> Any:
    """The default value of a setting."""
    f = SCHEMA[key]
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


def validate(key: str, value: Any) -> Any:
    """The value converted to the setting's type.

    Raises:
        SettingsError: unknown key, wrong type, out of range or not one of the choices.
    """
    if key not in SCHEMA:
        raise SettingsError(f"unknown setting {key!r}")
    f = SCHEMA[key]
    kind = type(default(key))
    label = f.metadata.get("label") or key
    try:
        if kind is bool:
            if not isinstance(value, bool):
                raise TypeError
            out: Any = value
        elif kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            out = int(value)
        elif kind is float:
            if isinstance(value, bool):
                raise TypeError
            out = float(value)
        else:
            if not isinstance(value, str):
                raise TypeError
            out = value
    except (TypeError, ValueError):
        raise SettingsError(f"{label}: expected {kind.__name__}, got {value!r}") from None
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and out < lo or hi is not None and out > hi:
        raise SettingsError(f"{label}: {out} is outside {lo}..{hi}")
    choices = f.metadata.get("choices")
    if choices and out not in choices:
        raise SettingsError(f"{label}: {out!r} is not one of {', '.join(choices)}")
    return out


# document_search values besides a model's path
SEARCH_AUTO, SEARCH_KEYWORDS = "auto", "keywords"


def cuda_status() -> tuple[bool, str]:
    """Whether models can run on CUDA here, and the reason when not (for the Device setting).

    The engine's own probe: CuPy, a driver, a GPU and NVRTC (which compiles the kernels at load).
    """
    from engine.backends.cuda.device import probe  # imports CuPy only inside the probe

    reason = probe(0)
    if reason is None:
        return True, ""
    return False, f"{reason[0].upper()}{reason[1:]} - models run on the CPU."


def settings_path() -> Path:
    """The settings file (config dir)."""
    return config_dir() / "settings.json"


class Settings:
    """The values of SCHEMA, persisted to `path`; thread-safe.

    Args:
        path: the JSON file (default settings_path()).

    Attributes:
        warnings: problems met while reading the file (bad values replaced by defaults).
    """

    def __init__(self, path: Path | None = None):
        self.path = path or settings_path()
        self._lock = threading.Lock()
        self._values = {k: default(k) for k in SCHEMA}
        self._extra: dict[str, Any] = {}
        self._listeners: list[Callable[[str, Any], None]] = []
        self.warnings: list[str] = []
        self._read()

    def _read(self) -> None:
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            self.warnings.append(f"{self.path}: unreadable ({e}); using the defaults")
            return
        values = saved.get("values", {}) if isinstance(saved, dict) else {}
        for key, value in values.items() if isinstance(values, dict) else ():
            if key not in SCHEMA:
                self._extra[key] = value
                continue
            try:
                self._values[key] = validate(key, value)
            except SettingsError as e:
                self.warnings.append(f"{e}; using the default")

    def get(self, key: str) -> Any:
        """A setting's value (KeyError for an unknown key)."""
        if key not in SCHEMA:
            raise KeyError(key)
        with self._lock:
            return self._values[key]

    def __getitem__(self, key: str) -> Any:
        return self.get(key)

    def as_dict(self) -> dict[str, Any]:
        """All values."""
        with self._lock:
            return dict(self._values)

    def set(self, key: str, value: Any) -> bool:
        """Validate, store and persist one value; listeners hear about it if it changed.

        Returns:
            whether the value changed.

        Raises:
            SettingsError: see validate().
        """
        return bool(self.update({key: value}))

    def update(self, values: dict[str, Any]) -> list[str]:
        """Set several values at once (all validated first, one write). Returns the keys that changed."""
        checked = {k: validate(k, v) for k, v in values.items()}
        with self._lock:
            changed = [k for k, v in checked.items() if self._values[k] != v]
            self._values.update(checked)
            if changed:
                self._write()
        for key in changed:
            for listener in list(self._listeners):
                listener(key, checked[key])
        return changed

    def reset(self, key: str) -> bool:
        """Back to the default."""
        return self.set(key, default(key))

    def subscribe(self, listener: Callable[[str, Any], None]) -> Callable[[], None]:
        """Call listener(key, value) after each change; returns a function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": SETTINGS_VERSION, "values": {**self._extra, **self._values}}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
