"""`hearth search | pull | ls | rm | import` end to end against the loopback Hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from models.paths import models_dir
from tests.models.hubserver import HubServer, isolate_hf
from tests.models.test_library import write_gguf


@pytest.fixture
def server(monkeypatch, tmp_path):
    s = HubServer()
    isolate_hf(monkeypatch, tmp_path, s)
    q4 = write_gguf(tmp_path / "src" / "Tiny-Q4_K_M.gguf").read_bytes()
    q8 = write_gguf(tmp_path / "src" / "Tiny-Q8_0.gguf", n_layer=3).read_bytes()
    s.add_repo("org/Tiny-GGUF", {"Tiny-Q4_K_M.gguf": q4, "Tiny-Q8_0.gguf": q8}, tags=("gguf",), downloads=9)
    s.add_repo("org/gated-GGUF", {"m-Q4_0.gguf": q4}, gated=True, tags=("gguf",))
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
