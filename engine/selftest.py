"""`hearth --self-test`: is this installation able to chat?

Checks, in order: the user data/config/cache folders are writable (the chat store is an SQLite
database in the data dir, opened in WAL mode; settings are a file in the config dir written by
temp-file-and-rename; the Numba JIT cache lives under the cache dir), the packaged chat templates
can be read, and the starter model (fetched first if it is not there yet) loads and generates a
few tokens in the engine worker process, the spawned process the GUI talks to, so a frozen
bundle's multiprocessing start-up is checked too.

Prints exactly one line on stdout, `hearth VERSION self-test PASS: ...` with timings, or
`... FAIL: <step>: <problem>`, and returns 0 or 1. Timings count from the launch of the process,
so "first token" is the cold start a user sees (interpreter, imports, worker, kernels, model load).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from models import paths
from models.errors import HearthError
from models.version import VERSION

SELF_TEST_PROMPT = "Say hello in one short sentence."


class SelfTestFailure(HearthError):
    """One check failed; the message says which and why."""


@dataclass
class SelfTestReport:
    """What the self-test measured. Times are seconds; `*_at_s` count from process launch."""

    version: str = VERSION
    model: str = ""
    kernels: str = ""  # "cached" (machine code loaded from the JIT cache) or "compiled"
    loaded_at_s: float = 0.0
    load_s: float = 0.0
    first_token_at_s: float = 0.0
    ttft_s: float = 0.0
    tokens: int = 0
    decode_tps: float = 0.0
    text: str = ""
    folders: dict[str, str] = field(default_factory=dict)

    def pass_line(self) -> str:
        return (
            f"hearth {self.version} self-test PASS: {self.model} first token {self.first_token_at_s:.2f} s "
            f"after launch (model loaded at {self.loaded_at_s:.2f} s, load {self.load_s:.2f} s, "
            f"TTFT {self.ttft_s:.2f} s, kernels {self.kernels}), {self.tokens} tokens at "
            f"{self.decode_tps:.1f} tok/s; chat store, settings and cache folders writable"
        )


def launched_at() -> float:
    """time.time() when this process started (psutil's process creation time), else now."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - any failure here only costs the launch offset
        return time.time()


def _writable_dir(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hearth-selftest-") as f:
            f.write(b"ok")
            f.flush()
    except OSError as e:
        raise SelfTestFailure(f"the {what} folder {folder} is not writable ({e})") from e


def check_chat_store(folder: Path) -> None:
    """An SQLite database in WAL mode can be created, written and read back in `folder`."""
    _writable_dir(folder, "chat store")
    fd, name = tempfile.mkstemp(prefix=".hearth-selftest-", suffix=".sqlite3", dir=folder)
    os.close(fd)
    db = Path(name)
    try:
        con = sqlite3.connect(db)
        try:
            mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            con.execute("CREATE TABLE t (x TEXT)")
            con.execute("INSERT INTO t VALUES ('ok')")
            con.commit()
            row = con.execute("SELECT x FROM t").fetchone()
        finally:
            con.close()
        if mode.lower() != "wal" or row != ("ok",):
            raise SelfTestFailure(f"SQLite in {folder} gave journal mode {mode!r}, row {row!r}")
    except sqlite3.Error as e:
        raise SelfTestFailure(f"the chat store folder {folder} cannot hold an SQLite database ({e})") from e
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(name + suffix).unlink(missing_ok=True)


def check_settings(folder: Path) -> None:
    """A settings file can be written next to where the real one lives (temp file, then rename)."""
    _writable_dir(folder, "settings")
    target = folder / ".hearth-selftest-settings.json"
    fd, tmp = tempfile.mkstemp(prefix=".hearth-selftest-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write('{"self_test": true}\n')
        os.replace(tmp, target)
        if target.read_text(encoding="utf-8") != '{"self_test": true}\n':
            raise SelfTestFailure(f"the settings file {target} did not read back")
    except OSError as e:
        raise SelfTestFailure(f"the settings folder {folder} is not writable ({e})") from e
    finally:
        Path(tmp).unlink(missing_ok=True)
        target.unlink(missing_ok=True)


def kernel_cache_dir() -> Path:
    """The folder Numba writes compiled kernels to (engine/__init__ sets NUMBA_CACHE_DIR)."""
    import engine  # noqa: F401 - sets NUMBA_CACHE_DIR

    return Path(os.environ["NUMBA_CACHE_DIR"])


def _has_cached_kernels(folder: Path) -> bool:
    return folder.is_dir() and any(folder.rglob("*.nbi"))


def _check_folders(report: SelfTestReport) -> Path:
    check_chat_store(paths.data_dir())
    check_settings(paths.config_dir())
    _writable_dir(paths.models_dir(), "models")
    jit = kernel_cache_dir()
    _writable_dir(jit, "kernel cache")
    report.folders = {
        "data": str(paths.data_dir()),
        "config": str(paths.config_dir()),
        "cache": str(paths.cache_dir()),
        "kernels": str(jit),
    }
    return jit


def _check_templates() -> None:
    from engine.chat_template import TemplateError
    from engine.templates import fallback_template

    try:
        for arch in ("llama", "gemma3"):
            fallback_template(arch)
    except TemplateError as e:
        raise SelfTestFailure(str(e)) from e


def _generate(report: SelfTestReport, model: str, n_tokens: int, t_launch: float) -> None:
    """Load `model` in the engine worker process and stream a short greedy reply, as the GUI does."""
    from engine.client import EngineClient, LoadOptions
    from engine.generate import GenerationParams

    with EngineClient() as client:
        info = client.load_and_wait(model, LoadOptions(n_ctx=512, batch_size=64, prefix_cache_mb=0))
        report.model = model if not Path(model).exists() else info.name
        report.load_s = info.load_s
        report.loaded_at_s = time.time() - t_launch
        pieces, last = [], None
        params = GenerationParams(max_tokens=n_tokens, temperature=0.0)
        for event in client.generate([{"role": "user", "content": SELF_TEST_PROMPT}], params):
            if event.token is not None and not report.first_token_at_s:
                report.first_token_at_s = time.time() - t_launch
            pieces.append(event.text)
            last = event
    if last is None or last.generated_tokens < 1:
        raise SelfTestFailure(f"{model} generated no token")
    report.text = "".join(pieces)
    report.tokens = last.generated_tokens
    report.ttft_s = last.ttft_s
    report.decode_tps = last.generation_tps
    if not report.text.strip() and last.finish_reason != "stop":
        raise SelfTestFailure(f"{model} generated {report.tokens} tokens but no text")


def run_self_test(
    model: str = "smollm2-135m-instruct", n_tokens: int = 8
) -> tuple[bool, str, SelfTestReport]:
    """Run every check; never raises.

    Args:
        model: a starter model name or a model path.
        n_tokens: how many tokens to generate (greedy).

    Returns:
        (passed, the one summary line, the measurements).
    """
    t_launch = launched_at()
    report = SelfTestReport()
    step = "folders"
    try:
        jit = _check_folders(report)
        step = "chat templates"
        _check_templates()
        step = "model"
        was_cached = _has_cached_kernels(jit)
        _generate(report, model, n_tokens, t_launch)
        report.kernels = "cached" if was_cached else "compiled"
        step = "kernel cache"
        if not _has_cached_kernels(jit):
            raise SelfTestFailure(f"no compiled kernel was cached in {jit}")
    except HearthError as e:
        return False, f"hearth {VERSION} self-test FAIL: {step}: {e}", report
    except Exception as e:  # noqa: BLE001 - a broken installation shows up as any error; report it
        traceback.print_exc(file=sys.stderr)
        return False, f"hearth {VERSION} self-test FAIL: {step}: {type(e).__name__}: {e}", report
    return True, report.pass_line(), report


def main() -> int:
    """Print the summary line; exit status 0 on PASS, 1 on FAIL."""
    passed, line, _ = run_self_test()
    print(line, flush=True)
    return 0 if passed else 1
