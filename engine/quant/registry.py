"""Target formats of `hearth convert`: one registry, format name -> converter.

Every format `hearth convert SRC --to NAME` can write is a `TargetFormat` registered here. The built-in
GGUF formats (F16, BF16, Q8_0, ..., Q4_K_M, mixed:BPW) register through `register` exactly as a new one
would (see engine/quant/gguf_formats.py); so can formats that live in safetensors folders.

How to add a format (e.g. "awq", "fp8", "nvfp4"):

    from engine.quant.registry import TargetFormat, register

    def _write_fp8(source, out_path, options, progress):
        # source:   engine.quant.source.SourceModel, the loaded model (tensors by canonical GGUF name,
        #           `source.tensor(name)` -> float32 ndarray in numpy shape; `source.metadata` is a
        #           GGUF-style key/value dict with architecture, hyper-parameters, tokenizer, template)
        # out_path: where to write. For container "gguf" a file path, for "safetensors" a folder path
        #           (not yet existing). It is a temporary name next to the final one: convert() renames
        #           it when the function returns, and deletes it if the function raises.
        # options:  dict of format options (from the CLI: {"calibration": path, ...}); ignore unknown keys
        # progress: progress(done, total, message) -> None; call it per tensor (it may raise
        #           KeyboardInterrupt/ConversionCancelled to stop: just let that propagate)
        # returns:  a ConvertResult (tensor types chosen, free-form report lines)
        ...
        return ConvertResult(report=["..."])

    register(TargetFormat("fp8", "safetensors", _write_fp8, "FP8 E4M3 weights, per-channel scale"))

Names are case-insensitive. A name with a parameter (``mixed:4.5``) is looked up by its prefix
(``mixed``) and the text after the colon is passed as ``options["param"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import HearthError

# progress(done, total, message)
ProgressFn = Callable[[int, int, str], None]


class UnknownFormatError(HearthError):
    """`--to` names a format no converter is registered for."""


@dataclass
class ConvertResult:
    """What a converter did.

    Attributes:
        tensor_types: tensor name -> type written ("Q4_K", "F32", "fp8", ...), for the report.
        report: extra lines for the user (e.g. the per-tensor choice of a mixed conversion).
        extra: anything else a caller may want as data (JSON-serialisable), e.g. mixed's bpw.
    """

    tensor_types: dict[str, str] = field(default_factory=dict)
    report: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TargetFormat:
    """One format `hearth convert` can produce.

    Attributes:
        name: what the user types after --to ("Q4_K_M", "mixed", "fp8"); matched case-insensitively.
        container: "gguf" (one .gguf file) or "safetensors" (a Hugging Face repo folder).
        write: write(source, out_path, options, progress) -> ConvertResult (see the module docstring).
        description: one line for `hearth convert --list`.
        takes_param: True when the name takes ":PARAM" (mixed:4.5).
    """

    name: str
    container: str
    write: Callable[..., ConvertResult]
    description: str = ""
    takes_param: bool = False

    def __post_init__(self):
        if self.container not in ("gguf", "safetensors"):
            raise ValueError(f"container must be 'gguf' or 'safetensors', got {self.container!r}")

    @property
    def suffix(self) -> str:
        """Ending of the default output name: ".gguf" for a file, "" for a folder."""
        return ".gguf" if self.container == "gguf" else ""


_FORMATS: dict[str, TargetFormat] = {}


def register(fmt: TargetFormat, *, replace: bool = False) -> TargetFormat:
    """Add a target format. Raises ValueError if the name is taken (unless replace)."""
    key = fmt.name.lower()
    if key in _FORMATS and not replace:
        raise ValueError(f"target format {fmt.name!r} is already registered")
    _FORMATS[key] = fmt
    return fmt


def _load_builtins() -> None:
    # Importing these modules registers their formats. Formats of other packages that are not there
    # (yet) are simply skipped.
    import importlib

    for module in (
        "engine.quant.gguf_formats",
        "engine.export",
        "engine.quant.awq",
        "engine.quant.fp8",
        "engine.quant.nvfp4",
    ):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def lookup(spec: str) -> tuple[TargetFormat, str | None]:
    """The format for a --to value and its parameter ("mixed:4.5" -> (mixed, "4.5")).

    Raises:
        UnknownFormatError: no such format (the message lists the known ones).
    """
    _load_builtins()
    exact = _FORMATS.get(spec.strip().lower())  # names with a colon of their own: "awq:q4_k"
    if exact is not None and not exact.takes_param:
        return exact, None
    name, _, param = spec.partition(":")
    fmt = _FORMATS.get(name.strip().lower())
    if fmt is None:
        raise UnknownFormatError(f"unknown target format {spec!r}; known formats: {', '.join(names())}")
    if fmt.takes_param and not param:
        raise UnknownFormatError(f"format {fmt.name} needs a parameter, e.g. {fmt.name}:4.5")
    if param and not fmt.takes_param:
        raise UnknownFormatError(f"format {fmt.name} takes no ':{param}' parameter")
    return fmt, (param or None)


def names() -> list[str]:
    """Registered format names, in registration order (parameterised ones shown as NAME:PARAM)."""
    _load_builtins()
    return [f.name + (":BPW" if f.takes_param else "") for f in _FORMATS.values()]


def formats() -> list[TargetFormat]:
    """All registered formats."""
    _load_builtins()
    return list(_FORMATS.values())


def default_output(source: Path, fmt: TargetFormat, param: str | None) -> Path:
    """Output path when -o is not given: next to the source, named after the format."""
    stem = source.name[: -len(".gguf")] if source.name.endswith(".gguf") else source.name
    for old in ("Q4_1", "Q4_K_M", "q4_k_m", "Q8_0", "F16", "f16", "BF16"):
        if stem.endswith("." + old) or stem.endswith("-" + old):
            stem = stem[: -len(old) - 1]
            break
    tag = fmt.name.replace(":", "-") + (f"-{param}" if param else "")
    if fmt.name.lower() == "safetensors":
        return source.parent / f"{stem}-hf"
    return source.parent / f"{stem}.{tag}{fmt.suffix}"
