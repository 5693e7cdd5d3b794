"""Prometheus text-format metrics: counters, gauges and histograms with labels, thread-safe.

Small on purpose (the server needs a handful of series); rendered in the text exposition format
version 0.0.4 that Prometheus scrapes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(str(labels.get(n, "")) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, name, help, labels=()):
        super().__init__(name, help, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name, help, buckets: Sequence[float], labels=()):
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._data: dict[tuple[str, ...], list[float]] = {}  # counts per bucket, then sum, then count

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            data = self._data.setdefault(key, [0.0] * (len(self.buckets) + 2))
            for i, upper in enumerate(self.buckets):
                if value <= upper:
                    data[i] += 1
            data[-2] += value
            data[-1] += 1

    def count(self, **labels: str) -> float:
        data = self._data.get(self._key(labels))
        return data[-1] if data else 0.0

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        lines = self.header()
        for key, data in items:
            for upper, n in zip(self.buckets, data):
                le = 'le="' + _num(upper) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {_num(n)}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(data[-2])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {_num(data[-1])}")
        return lines


class ServerMetrics:
    """The series `hearth serve` exports on /metrics."""

    def __init__(self):
        self.requests = Counter("hearth_requests_total", "HTTP requests answered", ("endpoint", "status"))
        self.prompt_tokens = Counter("hearth_prompt_tokens_total", "prompt tokens received")
        self.cached_tokens = Counter(
            "hearth_prompt_tokens_cached_total", "prompt tokens reused from KV caches, not prefilled"
        )
        self.generated_tokens = Counter("hearth_generated_tokens_total", "tokens generated")
        self.finished = Counter("hearth_generations_total", "generations ended, by reason", ("reason",))
        self.ttft = Histogram(
            "hearth_time_to_first_token_seconds",
            "time from a request's arrival to its first generated token",
            (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.decode_tps = Histogram(
            "hearth_decode_tokens_per_second",
            "decode speed of each generation (tokens after the first over their time)",
            (1, 2, 5, 10, 20, 40, 80, 160, 320),
        )
        self.batch_size = Histogram(
            "hearth_decode_batch_size", "sequences in each batched decode step", (1, 2, 4, 8, 16, 32)
        )
        self.running = Gauge("hearth_running_sequences", "sequences being prefilled or decoded")
        self.waiting = Gauge("hearth_waiting_requests", "requests queued for a free sequence slot")
        self.loaded = Gauge("hearth_loaded_models", "models loaded (each with its own engine)")
        self._load: dict[int, tuple[int, int]] = {}  # per engine: (running, waiting)
        self._load_lock = threading.Lock()

    def report_load(self, engine: object, running: int, waiting: int) -> None:
        """One engine's running and waiting sequences; the gauges show the sum over the loaded models."""
        with self._load_lock:
            self._load[id(engine)] = (running, waiting)
            self._set_load()

    def forget(self, engine: object) -> None:
        """An engine stopped (its model was unloaded)."""
        with self._load_lock:
            self._load.pop(id(engine), None)
            self._set_load()

    def _set_load(self) -> None:
        self.running.set(sum(r for r, _ in self._load.values()))
        self.waiting.set(sum(w for _, w in self._load.values()))

    def render(self) -> str:
        lines: list[str] = []
        for metric in (
            self.requests, self.prompt_tokens, self.cached_tokens, self.generated_tokens, self.finished,
            self.ttft, self.decode_tps, self.batch_size, self.running, self.waiting,
            self.loaded,
        ):
            lines += metric.render()
        return "\n".join(lines) + "\n"
