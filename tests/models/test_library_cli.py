"""`hearth search | pull | ls | rm | import` end to end against the loopback Hub."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engine.cli import main
from models.paths import models_dir
from tests.models.hubserver import HubServer, isolate_hf, mmproj_bytes
from tests.models.test_library import write_gguf


def tiny_gguf_hub(monkeypatch, tmp_path) -> HubServer:
    """A loopback Hub (HF_ENDPOINT set to it) with org/Tiny-GGUF (Q4_K_M and Q8_0) and a gated repo."""
    s = HubServer()
    isolate_hf(monkeypatch, tmp_path, s)
    q4 = write_gguf(tmp_path / "src" / "Tiny-Q4_K_M.gguf").read_bytes()
    q8 = write_gguf(tmp_path / "src" / "Tiny-Q8_0.gguf", n_layer=3).read_bytes()
    s.add_repo("org/Tiny-GGUF", {"Tiny-Q4_K_M.gguf": q4, "Tiny-Q8_0.gguf": q8}, tags=("gguf",), downloads=9)
    s.add_repo("org/gated-GGUF", {"m-Q4_0.gguf": q4}, gated=True, tags=("gguf",))
    return s


@pytest.fixture
def server(monkeypatch, tmp_path):
    s = tiny_gguf_hub(monkeypatch, tmp_path)
    yield s
    s.close()


def test_search_pull_ls_rm(server, capsys):
    assert main(["search", "tiny", "--format", "gguf"]) == 0
    assert "org/Tiny-GGUF" in capsys.readouterr().out

    assert main(["pull", "org/Tiny-GGUF:Q8_0"]) == 0
    out, err = capsys.readouterr()
    path = Path(out.strip())
    assert path == models_dir() / "hub" / "org" / "Tiny-GGUF" / "Tiny-Q8_0.gguf" and path.is_file()
    assert "fits" in err or "tight" in err or "too large" in err
    cdn = len([e for e in server.log if e["path"].startswith("/cdn/")])
    assert main(["pull", "org/Tiny-GGUF:Q8_0"]) == 0, "pulling again is a no-op"
    assert len([e for e in server.log if e["path"].startswith("/cdn/")]) == cdn
    assert Path(capsys.readouterr().out.strip()) == path

    assert main(["ls", "--json", "--no-scan"]) == 0
    listing = json.loads(capsys.readouterr().out)
    (model,) = listing["models"]
    assert (model["repo"], model["quant"], model["source"], model["architecture"]) == (
        "org/Tiny-GGUF",
        "Q8_0",
        "download",
        "llama",
    )
    assert set(listing["starters"]) >= {"smollm2-135m-instruct"}
    assert main(["ls", "--no-scan"]) == 0
    assert "org/Tiny-GGUF:Tiny-Q8_0.gguf" in capsys.readouterr().out

    assert main(["rm", "org/Tiny-GGUF:Tiny-Q8_0.gguf"]) == 0
    assert not path.exists()
    assert main(["rm", "org/Tiny-GGUF:Tiny-Q8_0.gguf"]) == 1


def test_pull_errors_and_import(server, capsys, tmp_path):
    assert main(["pull", "org/gated-GGUF"]) == 1
    assert "huggingface-cli login" in capsys.readouterr().err
    assert main(["pull", "org/Tiny-GGUF:Q2_K"]) == 1
    assert "offers: Q4_K_M, Q8_0" in capsys.readouterr().err
    assert main(["pull", "../etc:x"]) == 1
    server.faults = ["404"]
    assert main(["pull", "org/Tiny-GGUF:Q4_K_M"]) == 1
    assert "404" in capsys.readouterr().err
    assert not list(models_dir().rglob("*.hearth-partial"))

    src = write_gguf(tmp_path / "mine" / "own.gguf")
    assert main(["import", str(src.parent)]) == 0
    assert str(src) in capsys.readouterr().out
    assert main(["rm", str(src)]) == 0 and src.exists()


@pytest.fixture
def vision(server, tmp_path):
    """A Gemma-like repo: one model and two vision towers (F16, Q8_0, projector gemma3); returns their bytes
    by name."""
    files = {
        "model-Q4_K_M.gguf": write_gguf(tmp_path / "src" / "model-Q4_K_M.gguf", arch="gemma3").read_bytes(),
        "mmproj-model-f16.gguf": mmproj_bytes(tmp_path / "src" / "mmproj-f16.gguf", "gemma3", 100_000),
        "mmproj-model-Q8_0.gguf": mmproj_bytes(tmp_path / "src" / "mmproj-q8.gguf", "gemma3", 50_000),
    }
    server.add_repo("org/Vision-GGUF", files, tags=("gguf",))
    return files


def _cdn_hits(server, data: bytes) -> int:
    sha = hashlib.sha256(data).hexdigest()
    return len([e for e in server.log if e["path"] == f"/cdn/{sha}"])


def _folder() -> Path:
    return models_dir() / "hub" / "org" / "Vision-GGUF"


def test_pull_brings_the_f16_vision_tower_beside_the_model(server, vision, capsys):
    assert main(["pull", "org/Vision-GGUF"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()) == _folder() / "model-Q4_K_M.gguf", "stdout: the model to load, only"
    assert "mmproj-model-f16.gguf: the model's vision tower" in err and "vision tower: " in err
    assert sorted(p.name for p in _folder().iterdir()) == ["mmproj-model-f16.gguf", "model-Q4_K_M.gguf"]
    assert (_folder() / "mmproj-model-f16.gguf").read_bytes() == vision["mmproj-model-f16.gguf"]
    assert _cdn_hits(server, vision["mmproj-model-Q8_0.gguf"]) == 0, "one tower, the F16 one"

    assert main(["ls", "--json", "--no-scan"]) == 0
    (model,) = json.loads(capsys.readouterr().out)["models"]
    assert model["file"] == "model-Q4_K_M.gguf" and model["architecture"] == "gemma3"
    assert model["vision_towers"] == [str(_folder() / "mmproj-model-f16.gguf")]
    assert main(["ls", "--no-scan"]) == 0
    listing = capsys.readouterr().out
    assert "mmproj" not in listing and "+ vision tower" in listing

    n = len(server.log)
    assert main(["pull", "org/Vision-GGUF:Q4_K_M"]) == 0, "pulling again fetches nothing"
    assert not [e for e in server.log[n:] if e["path"].startswith("/cdn/")]


def test_pull_without_a_tower_in_the_repo_or_with_one_in_the_folder(server, vision, capsys):
    assert main(["pull", "org/Tiny-GGUF:Q4_K_M"]) == 0
    assert "vision tower" not in capsys.readouterr().err
    assert [p.name for p in (models_dir() / "hub" / "org" / "Tiny-GGUF").iterdir()] == ["Tiny-Q4_K_M.gguf"]

    own = write_gguf(_folder() / "mmproj-mine-bf16.gguf", arch="clip")
    assert main(["pull", "org/Vision-GGUF"]) == 0
    assert "vision tower" not in capsys.readouterr().err
    assert sorted(p.name for p in _folder().iterdir()) == [own.name, "model-Q4_K_M.gguf"]
    assert _cdn_hits(server, vision["mmproj-model-f16.gguf"]) == 0


def test_pulling_a_tower_itself_brings_nothing_else_and_indexes_nothing(server, vision, capsys):
    assert main(["pull", "org/Vision-GGUF:mmproj-model-Q8_0.gguf"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()) == _folder() / "mmproj-model-Q8_0.gguf" and "is a vision tower" in err
    assert [p.name for p in _folder().iterdir()] == ["mmproj-model-Q8_0.gguf"]
    n = len(server.log)
    assert main(["pull", "org/Vision-GGUF:mmproj-model-Q8_0.gguf"]) == 0
    assert not [e for e in server.log[n:] if e["path"].startswith("/cdn/")], (
        "a tower on disk is not fetched again"
    )
    assert Path(capsys.readouterr().out.strip()) == _folder() / "mmproj-model-Q8_0.gguf"
    assert main(["ls", "--json", "--no-scan"]) == 0
    assert json.loads(capsys.readouterr().out)["models"] == []


def test_a_failed_tower_leaves_the_model_usable_and_says_so(server, vision, capsys):
    good = vision["mmproj-model-f16.gguf"]
    sha = hashlib.sha256(good).hexdigest()
    server.blobs[sha] = good[: len(good) // 2]  # the CDN serves a truncated file
    assert main(["pull", "org/Vision-GGUF"]) == 1, "never a silent success"
    out, err = capsys.readouterr()
    assert Path(out.strip()) == _folder() / "model-Q4_K_M.gguf"
    assert "the vision tower failed" in err and "works for text" in err and "mmproj-model-f16.gguf" in err
    assert [p.name for p in _folder().iterdir()] == ["model-Q4_K_M.gguf"], "no tower, no partial"
    assert main(["ls", "--json", "--no-scan"]) == 0
    listing = json.loads(capsys.readouterr().out)
    (model,) = listing["models"]
    assert model["exists"] and model["vision_towers"] == []
    assert [(j["filename"], j["state"]) for j in listing["downloads"]] == [
        ("mmproj-model-f16.gguf", "failed")
    ]

    server.blobs[sha] = good
    model_fetches = _cdn_hits(server, vision["model-Q4_K_M.gguf"])
    assert main(["pull", "org/Vision-GGUF"]) == 0, "the same command fetches the tower"
    assert (_folder() / "mmproj-model-f16.gguf").read_bytes() == good
    assert _cdn_hits(server, vision["model-Q4_K_M.gguf"]) == model_fetches, "the model is not fetched again"


def test_a_model_from_the_hf_cache_gets_a_note_not_a_tower(server, vision, capsys):
    from huggingface_hub import hf_hub_download

    hf_hub_download("org/Vision-GGUF", "model-Q4_K_M.gguf", endpoint=server.url)
    assert main(["pull", "org/Vision-GGUF"]) == 0
    err = capsys.readouterr().err
    assert "is used from" in err and "put its vision tower mmproj-model-f16.gguf" in err
    assert _cdn_hits(server, vision["mmproj-model-f16.gguf"]) == 0 and not _folder().exists()


def test_pull_skips_a_tower_hearth_cannot_read_and_says_why(server, tmp_path, capsys):
    model = write_gguf(tmp_path / "src" / "llava-Q4_K_M.gguf").read_bytes()
    tower = mmproj_bytes(tmp_path / "src" / "mmproj-llava.gguf", "llava", 300_000)
    server.add_repo("org/Llava-GGUF", {"llava-Q4_K_M.gguf": model, "mmproj-llava-f16.gguf": tower})
    assert main(["pull", "org/Llava-GGUF"]) == 0
    out, err = capsys.readouterr()
    folder = models_dir() / "hub" / "org" / "Llava-GGUF"
    assert Path(out.strip()) == folder / "llava-Q4_K_M.gguf"
    assert "vision tower not fetched: projector llava is not one Hearth reads" in err
    assert [p.name for p in folder.iterdir()] == ["llava-Q4_K_M.gguf"]
    sha = hashlib.sha256(tower).hexdigest()
    assert [e["range"] for e in server.log if e["path"] == f"/cdn/{sha}"] == ["bytes=0-65535"]


def test_pull_checks_the_free_space_of_the_model_and_its_tower_together(server, vision, capsys, monkeypatch):
    from collections import namedtuple

    from models import downloads

    model, tower = len(vision["model-Q4_K_M.gguf"]), len(vision["mmproj-model-f16.gguf"])
    free = model + tower + downloads.DownloadSettings().disk_margin - 1  # each would fit alone
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(downloads.shutil, "disk_usage", lambda p: usage(10**12, 0, free))
    assert main(["pull", "org/Vision-GGUF"]) == 1
    err = capsys.readouterr().err
    assert f"the model needs {model / 2**20:,.1f} MiB and its vision tower {tower / 2**20:,.1f} MiB" in err
    assert f"has {free / 2**20:,.1f} MiB free" in err and "free space" in err
    assert not _folder().exists(), "nothing started"


def test_ls_shows_presets_and_rm_removes_one_leaving_its_model(tmp_path, capsys):
    """Presets (made by `hearth serve`'s /api/create or /api/copy) are listed by `hearth ls` and removed by
    `hearth rm NAME`; their model stays."""
    from models.library import Library, Preset

    lib = Library()
    (entry,) = lib.import_path(write_gguf(tmp_path / "Tiny-Q8_0.gguf"))
    preset = Preset("pirate", entry.path, system="Talk like a pirate.", parameters={"temperature": 0.0})
    lib.save_preset(preset)
    assert main(["ls", "--no-scan"]) == 0
    out = capsys.readouterr().out
    assert "pirate  preset of Tiny-Q8_0.gguf: system prompt, 1 parameter(s)" in out
    assert main(["ls", "--no-scan", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed["presets"]] == ["pirate"]
    assert main(["rm", "pirate:latest"]) == 0
    assert "removed the preset pirate:latest (its model stays)" in capsys.readouterr().out
    assert lib.presets() == [] and Path(entry.path).is_file() and lib.get(entry.id)
    assert main(["rm", "pirate"]) == 1
    assert "'pirate' is not in the library" in capsys.readouterr().err
