"""The SQLite library index: import in place/copy, delete, HF cache discovery, starters, partial files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from models import library
from models.errors import ModelFormatError, ModelNotFoundError
from models.library import Library, inspect_model
from tests.models.hubserver import HubServer, isolate_hf


def write_gguf(path: Path, arch: str = "llama", n_layer: int = 2, ctx: int = 256, kv_heads=2) -> Path:
    """A tiny valid GGUF model file (two F32 tensors) written with the gguf package."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(ctx)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(kv_heads)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def lib(tmp_path):
    return Library(tmp_path / "db" / "library.sqlite3", root=tmp_path / "models")


def test_real_model_facts_and_wal(lib, smollm2_path):
    facts = inspect_model(smollm2_path)
    assert (facts.format, facts.architecture, facts.context_length, facts.quant) == (
        "gguf",
        "llama",
        8192,
        "Q4_1",
    )
    assert 130e6 < facts.params < 140e6 and facts.size == smollm2_path.stat().st_size
    (entry,) = lib.import_path(smollm2_path)
    assert entry.path == str(smollm2_path) and entry.source == "import", "imported in place, not copied"
    assert entry.exists and lib.get(entry.id) == entry and lib.get(str(smollm2_path)) == entry
    with sqlite3.connect(lib.db_path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    removed = lib.remove(entry.id)
    assert removed.id == entry.id and smollm2_path.exists(), "an in-place import is only unindexed"
    assert lib.entries() == []


def test_import_folder_skips_partials_hidden_and_later_split_parts(lib, tmp_path):
    folder = tmp_path / "incoming"
    write_gguf(folder / "a-Q8_0.gguf")
    write_gguf(folder / "sub" / "b-00001-of-00002.gguf", arch="qwen2")
    write_gguf(folder / "sub" / "b-00002-of-00002.gguf", arch="qwen2")
    write_gguf(folder / ".hidden.gguf")
    (folder / "c.gguf.hearth-partial").write_bytes(b"GGUF partial")
    (folder / "d.gguf.hearth-partial.gguf").write_bytes(b"not a model")
    with pytest.raises(ModelFormatError):
        lib.import_path(folder)  # a bogus .gguf is refused, not indexed half-read
    (folder / "d.gguf.hearth-partial.gguf").unlink()
    entries = lib.import_path(folder)
    assert sorted(Path(e.path).name for e in entries) == ["a-Q8_0.gguf", "b-00001-of-00002.gguf"]
    split = next(e for e in entries if e.architecture == "qwen2")
    assert split.size == sum(p.stat().st_size for p in (folder / "sub").iterdir())
    assert next(e for e in entries if e.quant == "Q8_0").context_length == 256
    with pytest.raises(ModelFormatError, match="partial"):
        lib.add(folder / "c.gguf.hearth-partial")
    with pytest.raises(ModelNotFoundError):
        lib.import_path(tmp_path / "nothing")


def test_copy_import_and_delete(lib, tmp_path):
    src = write_gguf(tmp_path / "src" / "m.gguf")
    (entry,) = lib.import_path(src, copy=True)
    assert Path(entry.path) == lib.root / "imported" / "m.gguf" and src.exists()
    with pytest.raises(library.HearthError, match="already exists"):
        lib.import_path(src, copy=True)
    lib.remove(entry.path)
    assert not Path(entry.path).exists(), "a copy inside the library is deleted with its entry"
    (inplace,) = lib.import_path(src)
    lib.remove(inplace.id, delete_files=True)
    assert not src.exists()
    with pytest.raises(ModelNotFoundError, match="hearth ls"):
        lib.remove(12345)


def test_download_entries_find_and_used(lib):
    path = write_gguf(lib.root / "hub" / "org" / "m" / "m-Q4_0.gguf")
    entry = lib.add(
        path, repo="org/m", revision="a" * 40, file="m-Q4_0.gguf", sha256="b" * 64, source="download"
    )
    assert lib.find("org/m", "m-Q4_0.gguf", "b" * 64) == entry
    assert lib.find("org/m", "m-Q4_0.gguf", "c" * 64) is None
    assert lib.get("org/m:m-Q4_0.gguf").id == entry.id and entry.name == "org/m:m-Q4_0.gguf"
    other = lib.add(write_gguf(lib.root / "x.gguf"))
    assert lib.entries()[0].id == other.id
    lib.mark_used(path)
    assert lib.entries()[0].id == entry.id and lib.get(entry.id).used_at
    again = lib.add(path, source="download")
    assert again.id == entry.id and again.repo == "org/m", "re-adding keeps what was known"
    with pytest.raises(ValueError):
        lib.add(path, source="elsewhere")
    path.unlink()
    assert not lib.get(entry.id).exists and lib.find("org/m", "m-Q4_0.gguf") is None


def test_starters_are_registered(smollm2_path):
    lib = Library(root=smollm2_path.parent.parent)
    names = {e.file for e in lib.register_starters()}
    assert "smollm2-135m-instruct" in names
    assert lib.get(str(smollm2_path)).source == "starter"


def test_hf_cache_discovery_and_no_duplicate_download(lib, tmp_path, monkeypatch):
    """A real HF cache, filled by huggingface_hub itself from the loopback Hub."""
    from huggingface_hub import hf_hub_download

    server = HubServer()
    try:
        isolate_hf(monkeypatch, tmp_path, server)
        model = write_gguf(tmp_path / "m-Q4_0.gguf").read_bytes()
        tower = write_gguf(tmp_path / "mmproj-f16.gguf", arch="clip").read_bytes()
        server.add_repo(
            "org/cached-GGUF", {"m-Q4_0.gguf": model, "README.md": b"hi", "mmproj-f16.gguf": tower}
        )
        cache = tmp_path / "hf-cache"
        got = hf_hub_download("org/cached-GGUF", "m-Q4_0.gguf", cache_dir=cache, endpoint=server.url)
        for name in ("README.md", "mmproj-f16.gguf"):  # a vision tower in the cache is no model
            hf_hub_download("org/cached-GGUF", name, cache_dir=cache, endpoint=server.url)
    finally:
        server.close()
    import hashlib

    sha = hashlib.sha256(model).hexdigest()
    assert library.hf_cached_file("org/cached-GGUF", "m-Q4_0.gguf", sha, cache_dir=cache) == Path(got)
    assert library.hf_cached_file("org/cached-GGUF", "m-Q4_0.gguf", "0" * 64, cache_dir=cache) is None
    assert library.hf_cached_file("org/other", "m-Q4_0.gguf", cache_dir=cache) is None
    (entry,) = lib.discover_hf_cache(cache)
    assert (entry.repo, entry.file, entry.source, entry.sha256) == (
        "org/cached-GGUF",
        "m-Q4_0.gguf",
        "hf-cache",
        sha,
    )
    assert lib.find("org/cached-GGUF", "m-Q4_0.gguf", sha) == entry
    lib.remove(entry.id)
    assert Path(got).exists(), "the Hugging Face cache is never deleted from"
    assert lib.discover_hf_cache(tmp_path / "no-cache-here") == []


def test_wal_switch_waits_for_a_reader_of_a_new_database(tmp_path):
    """A new file (rollback journal) that another connection is reading cannot switch to WAL until the
    reader is done; use_wal retries instead of failing with "database is locked" (two Library() calls
    racing on a new file, the app's window and its library thread, hit that)."""
    import threading

    from models.library import use_wal

    path = tmp_path / "new.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x)")
    reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    reader.execute("BEGIN")
    reader.execute("SELECT * FROM t").fetchall()
    threading.Timer(0.3, reader.execute, ("COMMIT",)).start()
    switcher = sqlite3.connect(path, timeout=0)  # no busy wait: "locked" at once while the reader reads
    use_wal(switcher)
    assert switcher.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(sqlite3.OperationalError, match="locked"):  # gives up after its attempts
        other = tmp_path / "other.sqlite3"
        sqlite3.connect(other).execute("CREATE TABLE t (x)")
        held = sqlite3.connect(other, isolation_level=None)
        held.execute("BEGIN")
        held.execute("SELECT * FROM t").fetchall()
        use_wal(sqlite3.connect(other, timeout=0), attempts=3)
    switcher.close()
    reader.close()


def test_vision_towers_are_never_chat_models(lib, tmp_path):
    """llama.cpp's mmproj files (architecture "clip") belong to the model in their folder: importing one is
    refused with a message, a folder's import skips them (by name or by header), and the model is the one
    that shows them."""
    from models.errors import VisionTowerError

    folder = tmp_path / "gemma"
    model = write_gguf(folder / "gemma-3-4b-it-Q4_K_M.gguf", arch="gemma3")
    tower = write_gguf(folder / "mmproj-gemma-3-4b-it-f16.gguf", arch="clip")
    unnamed = write_gguf(folder / "vision-f16.gguf", arch="clip")  # a tower whose name does not say so
    assert inspect_model(tower).architecture == "clip"
    for path in (tower, unnamed):
        with pytest.raises(VisionTowerError, match="vision tower"):
            lib.add(path)
    with pytest.raises(ModelFormatError, match="open that model"):
        lib.import_path(tower)
    (entry,) = lib.import_path(folder)
    assert entry.path == str(model) and entry.vision_towers == [tower]
    assert [e.path for e in lib.entries()] == [str(model)]
    lonely = tmp_path / "only-a-tower"
    write_gguf(lonely / "mmproj-f16.gguf", arch="clip")
    with pytest.raises(ModelNotFoundError, match="no .gguf"):
        lib.import_path(lonely)


def test_a_tower_indexed_by_an_older_version_is_not_listed(lib, tmp_path):
    tower = write_gguf(tmp_path / "m" / "mmproj-f16.gguf", arch="clip")
    with sqlite3.connect(lib.db_path) as db:  # what `hearth pull` of a repo's mmproj file used to leave
        db.execute(
            "INSERT INTO models (path, repo, file, format, size, architecture, source, added_at) "
            "VALUES (?, 'org/m', 'mmproj-f16.gguf', 'gguf', 1, 'clip', 'download', '2024-01-01')",
            (str(tower),),
        )
    assert lib.entries() == [] and lib.find("org/m", "mmproj-f16.gguf") is None
    lib.remove(str(tower), delete_files=False)  # still removable by path


def test_deleting_the_last_downloaded_model_of_a_folder_deletes_its_tower(lib, tmp_path):
    folder = lib.root / "hub" / "org" / "gemma-GGUF"
    q4 = lib.add(
        write_gguf(folder / "g-Q4_K_M.gguf", arch="gemma3"), repo="org/gemma-GGUF", source="download"
    )
    q8 = lib.add(write_gguf(folder / "g-Q8_0.gguf", arch="gemma3"), repo="org/gemma-GGUF", source="download")
    tower = write_gguf(folder / "mmproj-g-f16.gguf", arch="clip")
    lib.remove(q4.id)
    assert tower.exists(), "the other model still reads images with it"
    lib.remove(q8.id)
    assert not tower.exists() and not list(folder.iterdir())

    outside = tmp_path / "mine"
    imported = lib.add(write_gguf(outside / "g-Q4_K_M.gguf", arch="gemma3"))
    own_tower = write_gguf(outside / "mmproj-f16.gguf", arch="clip")
    lib.remove(imported.id)
    assert own_tower.exists(), "a user's own files are left alone"


def test_resolve_a_folder_with_a_model_and_its_tower(tmp_path):
    from models.resolve import resolve_model

    model = write_gguf(tmp_path / "g" / "g-Q4_K_M.gguf", arch="gemma3")
    write_gguf(tmp_path / "g" / "mmproj-f16.gguf", arch="clip")
    assert resolve_model(str(tmp_path / "g")) == model


def test_vision_folders_are_marked_as_reading_images(lib):
    """A Hugging Face folder of a vision family with its vision config reads images; a text folder does not.
    The list of families is the engine's (models/ cannot import engine/)."""
    from engine.vision.load import VISION_MODEL_TYPES

    assert library.VISION_MODEL_TYPES == VISION_MODEL_TYPES
    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
    (vision,) = lib.import_path(tiny / "gemma3-vision")
    (text,) = lib.import_path(tiny / "gemma3")
    assert vision.reads_images and not text.reads_images
