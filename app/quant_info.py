"""What the quantization picker shows: the target formats, their size per weight and a plain-language hint.

Formats come from engine.quant.registry (the formats `hearth convert` can write) when it imports, else
from the GGUF types the engine runs. Measured quality comes from a quant report (JSON written next to
a converted model) when one is there.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from models.fit import bits_per_weight

FALLBACK = (
    "Q4_K_M",
    "Q5_K_M",
    "Q6_K",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q3_K",
    "Q2_K",
    "IQ4_XS",
    "IQ4_NL",
    "F16",
    "BF16",
    "F32",
)
_HINTS = (
    (3.2, "Smallest and fastest; answers get noticeably worse. For tight memory only."),
    (4.0, "Small; answers get a little worse. When memory is tight."),
    (4.9, "Small and fast; a little less accurate. A good default for most machines."),
    (6.2, "Balanced: close to the original quality; larger and a bit slower than 4-bit."),
    (8.6, "Practically the original quality; twice the size of 4-bit formats."),
    (99.0, "Full precision: the largest and slowest; for reference or further conversion."),
)


@dataclass(frozen=True)
class QuantChoice:
    """One entry of the picker."""

    name: str
    description: str
    bits: float
    hint: str
    container: str = "gguf"
    takes_param: bool = False

    def bits_for(self, param: str | None = None) -> float:
        """Bits per weight, using the parameter of a parameterised format (mixed:4.5 -> 4.5)."""
        if self.takes_param and param:
            try:
                return float(param)
            except ValueError:
                return self.bits
        return self.bits


def hint_for(bits: float) -> str:
    """A plain-language description of a format with `bits` bits per weight."""
    return next(text for limit, text in _HINTS if bits <= limit)


def _from_registry() -> list[QuantChoice] | None:
    try:
        from engine.quant import registry
    except Exception:  # noqa: BLE001 - the picker falls back to the formats the engine runs
        return None
    try:
        formats = registry.formats()
    except Exception:  # noqa: BLE001
        return None
    out = []
    for f in formats:
        bits = _bits(f.name, f.takes_param)
        out.append(QuantChoice(f.name, f.description, bits, hint_for(bits), f.container, f.takes_param))
    return out or None


# formats whose names models.fit does not know (safetensors-side formats, parameterised mixes)
_EXTRA_BITS = {"safetensors": 16.0, "awq": 4.25, "awq-int4": 4.25, "nvfp4": 4.5, "fp8": 8.0, "mixed": 4.5}
# int4:gN: 4-bit codes plus a float16 scale and a 4-bit zero per group of N; awq:<gguf type>: that type's
# bits; fp8:block: a float32 scale per 128 x 128 block
_EXTRA_BITS |= {f"int4:g{g}": 4.0 + 20.0 / g for g in (32, 64, 128)}
_EXTRA_BITS |= {"awq:q4_0": 4.5, "awq:q4_k": 4.5, "fp8:block": 8.0 + 32.0 / (128 * 128)}


def _bits(name: str, takes_param: bool = False) -> float:
    key = name.lower()
    if key in _EXTRA_BITS:
        return _EXTRA_BITS[key]
    return bits_per_weight(name)


_cache: list[QuantChoice] | None = None
_lock = threading.Lock()


def choices() -> list[QuantChoice]:
    """The formats to pick from (the registry's when available). May import the quantizers: call it off the
    GUI thread the first time (prefetch())."""
    global _cache
    with _lock:
        if _cache is None:
            _cache = _from_registry() or [
                QuantChoice(n, "GGUF " + n, bits_per_weight(n), hint_for(bits_per_weight(n)))
                for n in FALLBACK
            ]
        return list(_cache)


def prefetch() -> None:
    """Fill the cache in a background thread."""
    threading.Thread(target=choices, daemon=True, name="hearth-quant-formats").start()


def from_registry() -> bool:
    """Whether the picker lists the converter registry's formats (else the fallback list)."""
    return bool(_cache) and _cache[0].description != "GGUF " + _cache[0].name


def report_for(model_path: str | Path) -> dict | None:
    """The quant report written next to a converted model (`<model>.quant-report.json`), if any."""
    p = Path(model_path)
    for candidate in (
        p.with_name(p.name + ".quant-report.json"),
        p.with_suffix(".quant-report.json"),
        p / "quant-report.json",
    ):
        try:
            return json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return None


def measured(report: dict | None, name: str) -> dict | None:
    """The quant report's row for format `name` (case-insensitive; "mixed:4.5" matches "mixed-4.5")."""
    if not report:
        return None
    want = name.lower().replace(":", "-")
    for row in report.get("rows", []):
        if isinstance(row, dict) and str(row.get("format", "")).lower().replace(":", "-") == want:
            return row
    return None


def measured_text(row: dict | None) -> str:
    """'ppl 14.21 (+2.3 %), 61 tok/s' for a report row ('' without one)."""
    if not row:
        return ""
    parts = []
    if isinstance(row.get("ppl"), (int, float)):
        delta = row.get("delta_ppl_pct")
        parts.append(
            f"ppl {row['ppl']:.2f}" + (f" ({delta:+.1f} %)" if isinstance(delta, (int, float)) else "")
        )
    if isinstance(row.get("decode_tps"), (int, float)):
        parts.append(f"{row['decode_tps']:.0f} tok/s")
    if isinstance(row.get("file_bytes"), int):
        parts.append(f"{row['file_bytes'] / 2**20:,.0f} MiB")
    return ", ".join(parts)


def size_estimate(params: int | None, bits: float) -> int | None:
    """Bytes of a model of `params` weights in a format of `bits` bits per weight."""
    return int(params * bits / 8) if params else None


def planned_sizes(source: str | Path, names: list[str]) -> dict[str, int]:
    """Format name (upper case) -> output bytes, for the formats whose per-tensor types are known
    in advance (the GGUF presets: which tensors get more bits, and the fallbacks of rows that do
    not split into 256-blocks), from the source's tensor shapes. Empty when the source cannot be
    read (the caller falls back to bits x parameters). Reads headers only: call it off the GUI thread."""
    from engine.convert import estimate_bytes
    from engine.quant.registry import lookup
    from engine.quant.source import open_source
    from models.errors import HearthError

    out: dict[str, int] = {}
    try:
        with open_source(source) as src:
            metadata = sum(_metadata_bytes(v) for v in src.metadata.values())  # tokenizer: a few MB
            for name in names:
                try:
                    size = estimate_bytes(lookup(name)[0], src)
                except (HearthError, KeyError, ValueError):
                    continue
                if size is not None:
                    out[name.upper()] = size + metadata
    except (HearthError, OSError, ValueError, KeyError):
        return {}
    return out


def _metadata_bytes(value) -> int:
    """About what a GGUF metadata value takes in the file."""
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, (list, tuple)):
        return sum(_metadata_bytes(v) for v in value)
    if isinstance(value, (str, bytes)):
        return 8 + len(value)
    return 8
