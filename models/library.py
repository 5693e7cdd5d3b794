"""The local model library: a SQLite index (WAL) of model files on this machine.

Rows come from four sources: "download" (fetched by models.downloads into the library folder),
"import" (a file or folder the user pointed at, indexed in place unless a copy is asked for),
"hf-cache" (models already in the Hugging Face cache, so they are never downloaded twice) and
"starter" (the starter models of models.starter). Each row records what the file itself says
(format, architecture, parameter count, context length, quantization), read from its header.

Presets (Ollama's `create`/`cp`: a name over a model of the library with its own system prompt,
sampling parameters, chat template and opening messages) live in the `presets` table beside the models;
they copy no file. The table is created when a library from before presets is opened.

Partial downloads (`*.hearth-partial`) and hidden files are never indexed, nor are vision towers
(llama.cpp's mmproj GGUFs, architecture "clip"): they belong to the model in their folder, which the
engine loads them with, and are deleted with the last model of that folder that Hearth downloaded.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import math
import os
import re
import shutil
import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from models.downloads import PARTIAL_SUFFIX, drop_orphan_towers
from models.errors import HearthError, ModelFormatError, ModelNotFoundError, VisionTowerError
from models.formats.gguf import open_gguf
from models.formats.safetensors import open_safetensors, open_safetensors_repo
from models.hub import is_mmproj, mmprojs_in
from models.paths import data_dir, models_dir
from models.starter import STARTERS, starter_path

SOURCES = ("download", "import", "hf-cache", "starter")
_VISION_TOWER = "clip"  # general.architecture of llama.cpp's mmproj files

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    repo TEXT,
    revision TEXT,
    file TEXT,
    format TEXT NOT NULL,
    quant TEXT,
    size INTEGER NOT NULL,
    architecture TEXT,
    params INTEGER,
    context_length INTEGER,
    sha256 TEXT,
    source TEXT NOT NULL,
    added_at TEXT NOT NULL,
    used_at TEXT
);
CREATE INDEX IF NOT EXISTS models_repo_file ON models (repo, file);
CREATE TABLE IF NOT EXISTS presets (
    name TEXT PRIMARY KEY COLLATE NOCASE,
    base TEXT NOT NULL,
    system TEXT,
    template TEXT,
    parameters TEXT NOT NULL DEFAULT '{}',
    messages TEXT NOT NULL DEFAULT '[]',
    license TEXT,
    created_at TEXT NOT NULL
);
"""


# Hugging Face model types whose folders carry a vision tower the engine runs (engine.vision.load's
# VISION_MODEL_TYPES; a test keeps the two the same, as models/ never imports engine/)
VISION_MODEL_TYPES = (
    "gemma3", "gemma4", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl",
    "qwen3_vl_moe",
)

@dataclass(frozen=True)
class ModelEntry:
    """One indexed model: a .gguf file (first part of a split set) or a safetensors folder/file."""

    id: int
    path: str
    repo: str | None
    revision: str | None
    file: str | None
    format: str  # "gguf" or "safetensors"
    quant: str | None  # "Q4_K_M", "BF16", ...
    size: int  # bytes on disk (all parts/shards)
    architecture: str | None
    params: int | None
    context_length: int | None
    sha256: str | None
    source: str
    added_at: str
    used_at: str | None

    @property
    def exists(self) -> bool:
        """Whether the file or folder is still there."""
        return os.path.exists(self.path)

    @property
    def vision_towers(self) -> list[Path]:
        """The vision towers (mmproj GGUFs) beside a GGUF model; the engine reads images with one of them."""
        return mmprojs_in(Path(self.path).parent) if self.format == "gguf" else []

    @property
    def reads_images(self) -> bool:
        """Whether the engine can read images with this model: a GGUF with a vision tower beside it, or a
        Hugging Face folder of a vision family (VISION_MODEL_TYPES) with its vision config."""
        if self.format == "gguf":
            return bool(self.vision_towers)
        try:
            config = json.loads((Path(self.path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return (isinstance(config, dict) and config.get("model_type") in VISION_MODEL_TYPES
                and isinstance(config.get("vision_config"), dict))

    @property
    def embedding(self) -> bool:
        """Whether it is an embedding model (is_embedding_model), the kind documents are searched with."""
        return self.exists and is_embedding_model(self.path)

    @property
    def name(self) -> str:
        """A short display name: repo/file for Hub models, else the file name."""
        if self.repo and self.file:
            return f"{self.repo}:{self.file}"
        return Path(self.path).name


@dataclass(frozen=True, eq=False)
class Preset:
    """A named preset over a library model (Ollama's created model): the base model's path and what it
    sets. parameters: Ollama's option names with typed values (stop: a list); messages: {role, content}
    dicts that open every conversation."""

    name: str
    base: str
    system: str | None = None
    template: str | None = None
    parameters: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    license: str | None = None
    created_at: str = ""


# a preset's name: what Ollama takes as a model name (letters, digits, '_', '-' and '.', up to two
# 'namespace/' parts, an optional ':tag')
PRESET_NAME = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,79}/){0,2}[A-Za-z0-9][A-Za-z0-9_.-]{0,79}"
                         r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,79})?$")

# Ollama's parameter names and Hearth's sampling options (GenerationParams, the app's chat overrides)
_SAMPLING_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty", "seed": "seed", "stop": "stop"}


def preset_sampling(parameters: dict) -> dict:
    """A preset's parameters (Ollama's names) as Hearth's sampling options: temperature, top_k, top_p,
    min_p, repetition_penalty, seed, stop (a tuple) and max_tokens (num_predict when positive: Ollama's -1
    and -2 mean no limit and fill the context). Parameters Hearth does not apply (num_ctx, mirostat...) are
    left out."""
    out = {ours: parameters[theirs] for theirs, ours in _SAMPLING_NAMES.items() if theirs in parameters}
    if "stop" in out:
        out["stop"] = tuple(out["stop"])
    n = parameters.get("num_predict")
    if isinstance(n, int) and n > 0:
        out["max_tokens"] = n
    return out


def preset_parameters(sampling: dict) -> dict:
    """Hearth's sampling options (preset_sampling's names; None or an empty stop list: unset) as a preset's
    Ollama parameters."""
    names = {ours: theirs for theirs, ours in _SAMPLING_NAMES.items()} | {"max_tokens": "num_predict"}
    out = {names[k]: v for k, v in sampling.items() if k in names and v is not None}
    if "stop" in out:
        out["stop"] = list(out["stop"])
        if not out["stop"]:
            del out["stop"]
    return out


@dataclass(frozen=True)
class ModelFacts:
    """What a model file says about itself."""

    format: str
    quant: str | None
    size: int
    architecture: str | None
    params: int | None
    context_length: int | None


def is_embedding_model(path: str | Path) -> bool:
    """Whether a model says it is an embedding model: an encoder (BERT, nomic-bert, XLM-R, ModernBERT), a
    GGUF with a pooling type (Qwen3-Embedding's), or a folder whose sentence-transformers modules.json has a
    Pooling module. Read from the file's header or the folder's configs; False for what cannot be read."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return False
    return _is_embedding_model(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _is_embedding_model(path: str, mtime_ns: int, size: int) -> bool:
    from models.fit import ENCODER_ARCHS, ENCODER_MODEL_TYPES

    p = Path(path)
    try:
        if p.is_dir():
            config = json.loads((p / "config.json").read_text(encoding="utf-8"))
            if isinstance(config, dict) and config.get("model_type") in ENCODER_MODEL_TYPES:
                return True
            modules = json.loads((p / "modules.json").read_text(encoding="utf-8"))
            return isinstance(modules, list) and any(
                isinstance(m, dict) and str(m.get("type", "")).endswith("models.Pooling") for m in modules
            )
        if p.suffix.lower() != ".gguf":
            return False
        with open_gguf(p) as g:
            arch = g.get("general.architecture")
            return arch in ENCODER_ARCHS or g.get(f"{arch}.pooling_type") is not None
    except (OSError, ValueError, HearthError):
        return False


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds")


def _is_hidden_or_partial(path: Path) -> bool:
    return path.name.startswith(".") or path.name.endswith(PARTIAL_SUFFIX)


def _split_parts(first: Path) -> list[Path]:
    """All parts of a split GGUF set given its first part (or [first] for a single file)."""
    m = re.match(r"^(.+)-00001-of-(\d{5})\.gguf$", first.name, re.IGNORECASE)
    if not m:
        return [first]
    count = int(m.group(2))
    return [first.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def inspect_model(path: str | Path) -> ModelFacts:
    """Read format, architecture, parameter count, context length and quantization from a model's header.

    Args:
        path: a .gguf file, a .safetensors file, or a folder of safetensors shards (with config.json).

    Raises:
        ModelNotFoundError: nothing there.
        ModelFormatError: not a model we can read.
    """
    from models.hub import quant_from_name

    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or folder")
    if _is_hidden_or_partial(path):
        raise ModelFormatError(path, "a partial download or hidden file is not a model")
    if path.is_file() and path.suffix.lower() == ".gguf":
        with open_gguf(path) as g:
            arch = g.get("general.architecture")
            ctx = g.get(f"{arch}.context_length") if isinstance(arch, str) else None
            params = sum(math.prod(t.dims) for t in g.tensors.values())
            quant = quant_from_name(path.name) or _gguf_file_type(g.get("general.file_type"))
            if quant is None and g.tensors:
                by_bytes = Counter()
                for t in g.tensors.values():
                    by_bytes[t.type_name] += t.nbytes
                quant = by_bytes.most_common(1)[0][0]
        parts = _split_parts(path)
        size = sum(p.stat().st_size for p in parts if p.exists())
        return ModelFacts(
            "gguf",
            quant,
            size,
            arch if isinstance(arch, str) else None,
            params,
            int(ctx) if isinstance(ctx, int) else None,
        )
    if path.is_dir() or path.suffix.lower() == ".safetensors":
        folder = path if path.is_dir() else path.parent
        with open_safetensors_repo(path) if path.is_dir() else open_safetensors(path) as st:
            params = sum(math.prod(t.shape) for t in st.tensors.values())
            dtypes = Counter()
            for t in st.tensors.values():
                dtypes[t.dtype] += t.nbytes
            size = sum(f.stat().st_size for f in st.files)
        arch, ctx = None, None
        config = folder / "config.json"
        if config.is_file():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                cfg = json.loads(config.read_text())
                archs = cfg.get("architectures") or []
                arch = cfg.get("model_type") or (archs[0] if archs else None)
                text = cfg.get("text_config") or {}
                ctx = cfg.get("max_position_embeddings") or text.get("max_position_embeddings")
        quant = dtypes.most_common(1)[0][0] if dtypes else None
        return ModelFacts(
            "safetensors", quant, size, arch, params, int(ctx) if isinstance(ctx, int) else None
        )
    raise ModelFormatError(
        path, "not a model: expected a .gguf file, a .safetensors file or a folder of them"
    )


def _gguf_file_type(value) -> str | None:
    if not isinstance(value, int):
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except (ImportError, ValueError):
        return None


def use_wal(db: sqlite3.Connection, attempts: int = 100) -> None:
    """Put the database in WAL mode unless it is already (the mode is kept in the file).

    Switching needs the database to itself. Another connection reading it makes the switch wait out the
    busy timeout, and two connections switching a new file at once (the app's window and its library
    thread) can be told "database is locked" at once, without waiting: SQLite's way out of a deadlock.
    So the switch is retried (every 50 ms) until it is done or the other connection did it.

    Raises:
        sqlite3.OperationalError: still locked after `attempts` tries, or another error.
    """
    for attempt in range(attempts):
        if db.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
            return
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.05)


class Library:
    """The index. Thread-safe; one connection per call, WAL so readers never block the writer.

    Args:
        db_path: the SQLite file (default data_dir()/library.sqlite3).
        root: the library folder models are downloaded/copied into (default models_dir()).
    """

    def __init__(self, db_path: Path | None = None, root: Path | None = None):
        self.db_path = db_path or data_dir() / "library.sqlite3"
        self.root = root or models_dir()
        self._lock = threading.Lock()
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            use_wal(db)
            db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self):
        db = sqlite3.connect(self.db_path, timeout=30)
        db.row_factory = sqlite3.Row
        try:
            with db:  # commits or rolls back
                yield db
        finally:
            db.close()

    def _row(self, row: sqlite3.Row) -> ModelEntry:
        return ModelEntry(**{f.name: row[f.name] for f in fields(ModelEntry)})

    # ---- writing
    def add(
        self,
        path: str | Path,
        *,
        repo: str | None = None,
        revision: str | None = None,
        file: str | None = None,
        sha256: str | None = None,
        source: str = "import",
    ) -> ModelEntry:
        """Index one model (file or safetensors folder), reading its facts from its header.

        Re-adding a path updates its row (keeping added_at).

        Raises:
            ModelNotFoundError, ModelFormatError: see inspect_model.
            VisionTowerError: the file is a vision tower (mmproj), which belongs to a model.
            ValueError: unknown source.
        """
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        path = Path(path).absolute()
        facts = inspect_model(path)
        if facts.format == "gguf" and facts.architecture == _VISION_TOWER:
            raise VisionTowerError(path)
        values = {
            "path": str(path),
            "repo": repo,
            "revision": revision,
            "file": file,
            "format": facts.format,
            "quant": facts.quant,
            "size": facts.size,
            "architecture": facts.architecture,
            "params": facts.params,
            "context_length": facts.context_length,
            "sha256": sha256,
            "source": source,
            "added_at": _now(),
        }
        with self._lock, self._connect() as db:
            cols = ", ".join(values)
            marks = ", ".join("?" for _ in values)
            update = ", ".join(
                f"{k}=COALESCE(excluded.{k}, {k})" for k in values if k not in ("path", "added_at")
            )
            db.execute(
                f"INSERT INTO models ({cols}) VALUES ({marks}) ON CONFLICT(path) DO UPDATE SET {update}",
                tuple(values.values()),
            )
            row = db.execute("SELECT * FROM models WHERE path = ?", (str(path),)).fetchone()
        return self._row(row)

    def import_path(self, path: str | Path, copy: bool = False) -> list[ModelEntry]:
        """Index a model file, or every model in a folder, in place (or copied into the library: copy=True).

        A folder holding safetensors is one model; otherwise each .gguf in it (recursively) is one,
        with split sets indexed once by their first part, and vision towers (mmproj files) left to the
        model beside them.

        Raises:
            ModelNotFoundError: the path does not exist or holds no model.
            ModelFormatError: a file is not a readable model.
        """
        path = Path(path).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"{path}: no such file or folder")
        if copy:
            path = self._copy_in(path)
        if path.is_file():
            return [self.add(path, source="import")]
        if any(path.glob("*.safetensors")):
            return [self.add(path, source="import")]
        ggufs = [
            p
            for p in sorted(path.rglob("*.gguf"))
            if not _is_hidden_or_partial(p)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        ggufs = [p for p in ggufs if not is_later_split_part(p) and not is_mmproj(p.name)]
        entries = []
        for p in ggufs:
            with contextlib.suppress(VisionTowerError):  # a tower whose name does not say so
                entries.append(self.add(p, source="import"))
        if not entries:
            raise ModelNotFoundError(f"{path}: no .gguf or .safetensors model in this folder")
        return entries

    def _copy_in(self, path: Path) -> Path:
        dest = self.root / "imported" / path.name
        if dest.exists():
            raise HearthError(f"{dest} already exists in the library; remove it first or import in place")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.copying")
        try:
            if path.is_dir():
                shutil.copytree(path, tmp, symlinks=False)
            else:
                shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        finally:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        return dest

    def remove(self, key: int | str, delete_files: bool | None = None) -> ModelEntry:
        """Remove a model from the index, and its files when they are ours.

        Args:
            key: the row id, the path, or the display name (repo:file).
            delete_files: None (default) deletes files inside the library folder only (downloads, copies)
                and leaves imports in place and the Hugging Face cache alone; True deletes imported
                files too; False never deletes.

        Raises:
            ModelNotFoundError: no such entry.
        """
        entry = self.get(key)
        path = Path(entry.path)
        ours = path.absolute().is_relative_to(self.root.absolute())
        if entry.source == "hf-cache" and delete_files is None:
            delete = False
        else:
            delete = ours if delete_files is None else delete_files
        with self._lock, self._connect() as db:
            db.execute("DELETE FROM models WHERE id = ?", (entry.id,))
        if delete:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                for p in _split_parts(path) if entry.format == "gguf" else [path]:
                    p.unlink(missing_ok=True)
                    Path(str(p) + PARTIAL_SUFFIX).unlink(missing_ok=True)
                if ours and entry.format == "gguf":
                    drop_orphan_towers(path.parent)
        return entry

    def mark_used(self, path: str | Path) -> None:
        """Record that a model was just loaded (sorts recently used models first)."""
        with self._lock, self._connect() as db:
            db.execute("UPDATE models SET used_at = ? WHERE path = ?", (_now(), str(Path(path).absolute())))

    # ---- presets
    def save_preset(self, preset: Preset) -> Preset:
        """Store a preset, replacing one of the same name (any case). Returns it with its time set."""
        preset = Preset(**{**{f.name: getattr(preset, f.name) for f in fields(Preset)}, "created_at": _now()})
        with self._lock, self._connect() as db:
            db.execute("DELETE FROM presets WHERE name = ?", (preset.name,))
            db.execute(
                "INSERT INTO presets (name, base, system, template, parameters, messages, license, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (preset.name, preset.base, preset.system, preset.template, json.dumps(preset.parameters),
                 json.dumps(preset.messages), preset.license, preset.created_at),
            )
        return preset

    def presets(self) -> list[Preset]:
        """Every preset, oldest first."""
        with self._connect() as db:
            rows = db.execute("SELECT * FROM presets ORDER BY created_at, name").fetchall()
        return [
            Preset(r["name"], r["base"], r["system"], r["template"], json.loads(r["parameters"] or "{}"),
                   json.loads(r["messages"] or "[]"), r["license"], r["created_at"])
            for r in rows
        ]

    def find_preset(self, name: str) -> Preset | None:
        """The preset called `name` (any case; a ':latest' tag is ignored), else None."""
        name = name.removesuffix(":latest").casefold()
        return next((p for p in self.presets() if p.name.casefold() == name), None)

    def remove_preset(self, name: str) -> bool:
        """Remove the preset `name` (any case); its base model stays. Returns whether there was one."""
        with self._lock, self._connect() as db:
            return db.execute("DELETE FROM presets WHERE name = ?", (name,)).rowcount > 0

    # ---- reading
    def entries(self) -> list[ModelEntry]:
        """Every indexed model, most recently used/added first (no vision tower an older version indexed)."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT * FROM models WHERE architecture IS NOT ? "
                "ORDER BY COALESCE(used_at, added_at) DESC, id DESC",
                (_VISION_TOWER,),
            ).fetchall()
        return [self._row(r) for r in rows]

    def embedding_models(self) -> list[ModelEntry]:
        """The present embedding models (ModelEntry.embedding), in entries() order."""
        return [e for e in self.entries() if e.embedding]

    def get(self, key: int | str) -> ModelEntry:
        """One entry by id, path or display name (repo:file).

        Raises:
            ModelNotFoundError: no such entry.
        """
        with self._connect() as db:
            if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
                row = db.execute("SELECT * FROM models WHERE id = ?", (int(key),)).fetchone()
            else:
                row = db.execute(
                    "SELECT * FROM models WHERE path = ?", (str(Path(key).absolute()),)
                ).fetchone()
                if row is None and ":" in key:
                    repo, _, file = key.partition(":")
                    row = db.execute(
                        "SELECT * FROM models WHERE repo = ? AND file = ? ORDER BY id DESC", (repo, file)
                    ).fetchone()
        if row is None:
            raise ModelNotFoundError(f"{key!r} is not in the library (see `hearth ls`)")
        return self._row(row)

    def find(self, repo: str, file: str, sha256: str | None = None) -> ModelEntry | None:
        """A present, indexed copy of `file` from `repo` (matching sha256 when given), else None."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT * FROM models WHERE repo = ? AND file = ? AND architecture IS NOT ?",
                (repo, file, _VISION_TOWER),
            ).fetchall()
        for row in rows:
            entry = self._row(row)
            if entry.exists and (sha256 is None or entry.sha256 in (None, sha256)):
                return entry
        return None

    # ---- discovery
    def discover_hf_cache(self, cache_dir: str | Path | None = None) -> list[ModelEntry]:
        """Index the models already in the Hugging Face cache (GGUF files, safetensors snapshots).

        Unreadable files are skipped: the cache may hold anything.
        """
        from huggingface_hub import scan_cache_dir
        from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

        try:
            info = scan_cache_dir(cache_dir)
        except (CacheNotFound, CorruptedCacheException, OSError):
            return []
        found = []
        for repo in info.repos:
            if repo.repo_type != "model":
                continue
            for rev in repo.revisions:
                files = {f.file_name: f for f in rev.files}
                rels = {str(f.file_path.relative_to(rev.snapshot_path)): f for f in rev.files}
                for rel, f in sorted(rels.items()):
                    if (
                        rel.lower().endswith(".gguf")
                        and not is_later_split_part(Path(rel))
                        and not is_mmproj(rel)
                    ):
                        # an LFS blob's file name in the cache is its sha256
                        sha = f.blob_path.name if len(f.blob_path.name) == 64 else None
                        with contextlib.suppress(HearthError, OSError):
                            found.append(
                                self.add(
                                    f.file_path,
                                    repo=repo.repo_id,
                                    revision=rev.commit_hash,
                                    file=rel,
                                    sha256=sha,
                                    source="hf-cache",
                                )
                            )
                if any(n.endswith(".safetensors") for n in files) and "config.json" in files:
                    with contextlib.suppress(HearthError, OSError):
                        found.append(
                            self.add(
                                rev.snapshot_path,
                                repo=repo.repo_id,
                                revision=rev.commit_hash,
                                file=None,
                                source="hf-cache",
                            )
                        )
        return found

    def register_starters(self) -> list[ModelEntry]:
        """Index the starter models that are present in the library folder."""
        found = []
        for name in STARTERS:
            path = starter_path(name, self.root)
            if path.is_file():
                with contextlib.suppress(HearthError, OSError):
                    found.append(self.add(path, file=name, source="starter"))
        return found


def is_later_split_part(path: Path) -> bool:
    """True for parts 2..N of a split GGUF set (indexed through their first part)."""
    m = re.search(r"-(\d{5})-of-\d{5}\.gguf$", path.name, re.IGNORECASE)
    return bool(m) and int(m.group(1)) != 1


def hf_cached_file(
    repo_id: str,
    filename: str,
    sha256: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
) -> Path | None:
    """The Hugging Face cache's copy of a repo file when it is there (and has this sha256), else None.

    The cache names LFS blobs by their sha256, so a match is checked without reading the file.
    """
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
    except Exception:  # noqa: BLE001 - a broken cache means "not cached"
        return None
    if not isinstance(hit, str):
        return None
    path = Path(hit)
    if sha256 is not None and path.resolve().name != sha256:
        return None
    return path if path.is_file() else None
