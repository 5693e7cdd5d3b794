"""Hub browsing through huggingface_hub against the loopback Hub (tests/models/hubserver.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from models import hub
from tests.models.hubserver import TOKEN, HubServer, isolate_hf, payload


@pytest.fixture
def server(monkeypatch, tmp_path):
    s = HubServer()
    isolate_hf(monkeypatch, tmp_path, s)
    s.add_repo(
        "bartowski/Tiny-Llama-GGUF",
        {
            "README.md": b"---\nlicense: apache-2.0\n---\n# Tiny\n\n<img src=x>\n\n"
            b"A *tiny* [llama](http://x) for tests.\n",
            "Tiny-Q4_K_M.gguf": payload(3000, 1),
            "Tiny-Q8_0.gguf": payload(5000, 2),
            "big/Tiny-Q2_K-00001-of-00002.gguf": payload(700, 3),
            "big/Tiny-Q2_K-00002-of-00002.gguf": payload(600, 4),
            "half/Tiny-F16-00001-of-00003.gguf": payload(100, 5),
            "mmproj-Tiny-f16.gguf": payload(50, 6),
        },
        tags=("gguf", "llama", "license:apache-2.0"),
        downloads=500,
        likes=3,
        card_data={"license": "apache-2.0"},
        gguf={"total": 1_100_000_000, "architecture": "llama"},
        last_modified="2024-05-01T00:00:00.000Z",
    )
    s.add_repo(
        "org/tiny-st",
        {
            "config.json": b'{"model_type": "llama"}',
            "model-00001-of-00002.safetensors": payload(400, 7),
            "model-00002-of-00002.safetensors": payload(300, 8),
            "model.safetensors.index.json": b"{}",
            "tokenizer.json": b"{}",
            "pytorch_model.bin": payload(10, 9),
        },
        tags=("safetensors", "llama"),
        downloads=100,
        likes=50,
        safetensors={"parameters": {"BF16": 350}, "total": 350},
        last_modified="2025-01-01T00:00:00.000Z",
    )
    s.add_repo("org/gated-GGUF", {"m-Q4_0.gguf": payload(100, 10)}, gated=True, tags=("gguf",), downloads=1)
    yield s
    s.close()


def test_search_filters_and_sorts(server):
    assert [h.repo_id for h in hub.search()] == ["bartowski/Tiny-Llama-GGUF", "org/tiny-st", "org/gated-GGUF"]
    assert [h.repo_id for h in hub.search(sort="likes")][0] == "org/tiny-st"
    assert [h.repo_id for h in hub.search(sort="recent")][0] == "org/tiny-st"
    gguf = hub.search(fmt="gguf")
    assert {h.repo_id for h in gguf} == {"bartowski/Tiny-Llama-GGUF", "org/gated-GGUF"}
    assert [h.repo_id for h in hub.search("tiny", fmt="safetensors")] == ["org/tiny-st"]
    assert len(hub.search(limit=1)) == 1
    top = hub.search("llama")[0]
    assert (top.downloads, top.likes, top.gated) == (500, 3, False)
    assert any(h.gated for h in gguf)
    with pytest.raises(ValueError, match="sort"):
        hub.search(sort="stars")
    with pytest.raises(ValueError, match="format"):
        hub.search(fmt="onnx")


def test_repo_details_and_variants(server):
    d = hub.repo_details("bartowski/Tiny-Llama-GGUF")
    assert d.license == "apache-2.0" and not d.gated and d.params == 1_100_000_000
    assert d.summary == "A tiny llama for tests."
    assert d.commit == server.repos["bartowski/Tiny-Llama-GGUF"].commit
    files = {f.path: f for f in d.files}
    data = server.repos["bartowski/Tiny-Llama-GGUF"].files["Tiny-Q8_0.gguf"]
    assert files["Tiny-Q8_0.gguf"].size == 5000
    assert files["Tiny-Q8_0.gguf"].sha256 == hashlib.sha256(data).hexdigest()
    assert files["README.md"].sha256 is None and files["README.md"].blob_id

    variants = hub.gguf_variants(d.files)
    by_quant = {v.quant: v for v in variants if not v.mmproj}
    assert set(by_quant) == {"Q4_K_M", "Q8_0", "Q2_K", "F16"}
    assert by_quant["Q2_K"].size == 1300 and by_quant["Q2_K"].complete
    assert [f.path for f in by_quant["Q2_K"].files] == [
        "big/Tiny-Q2_K-00001-of-00002.gguf",
        "big/Tiny-Q2_K-00002-of-00002.gguf",
    ]
    assert not by_quant["F16"].complete, "a split set with a missing part is flagged"
    assert [v.mmproj for v in variants].count(True) == 1 and variants[-1].mmproj
    # the tree listing agrees with the model info
    assert {f.path: f.sha256 for f in hub.list_files("bartowski/Tiny-Llama-GGUF")} == {
        f.path: f.sha256 for f in d.files
    }


def test_pick_files(server):
    d = hub.repo_details("bartowski/Tiny-Llama-GGUF", with_card=False)
    assert d.summary == ""
    assert [f.path for f in hub.pick_files(d, "q8_0")] == ["Tiny-Q8_0.gguf"]
    assert [f.path for f in hub.pick_files(d, None)] == ["Tiny-Q4_K_M.gguf"]
    assert len(hub.pick_files(d, "Q2_K")) == 2
    assert [f.path for f in hub.pick_files(d, "README.md")] == ["README.md"]
    with pytest.raises(hub.RemoteNotFoundError, match="offers: .*Q4_K_M"):
        hub.pick_files(d, "Q3_K_S")
    with pytest.raises(hub.HubServerError, match="misses parts"):
        hub.pick_files(d, "F16")

    st = hub.repo_details("org/tiny-st")
    assert st.params == 350 and st.safetensors_dtypes == {"BF16": 350}
    chosen = [f.path for f in hub.pick_files(st, None)]
    assert chosen == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert hub.safetensors_set(st).size == 700


@pytest.mark.parametrize(
    "name, quant",
    [
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("qwen2.5-7b-instruct-q5_k_m-00001-of-00002.gguf", "Q5_K_M"),
        ("model.IQ2_XXS.gguf", "IQ2_XXS"),
        ("gemma-3-270m-it-BF16.gguf", "BF16"),
        ("phi-fp16.gguf", "F16"),
        ("Q8_0/model-Q8_0.gguf", "Q8_0"),
        ("llama.gguf", None),
        ("Qwen3-4B-Q4_0_4_4.gguf", "Q4_0_4_4"),
    ],
)
def test_quant_from_name(name, quant):
    assert hub.quant_from_name(name) == quant


def test_gated_repo_needs_a_token(server, monkeypatch):
    with pytest.raises(hub.GatedRepoError, match="HF_TOKEN|huggingface-cli login"):
        hub.repo_details("org/gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert [f.path for f in hub.repo_details("org/gated-GGUF").files] == ["m-Q4_0.gguf"]


def test_missing_repo_revision_offline(server, monkeypatch):
    with pytest.raises(hub.RemoteNotFoundError, match="no such repo"):
        hub.repo_details("nobody/nothing")
    with pytest.raises(hub.RemoteNotFoundError):
        hub.repo_details("org/tiny-st", revision="v9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.OfflineError, match="offline mode"):
        hub.search("x")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    # (search would retry for ~20 s inside huggingface_hub first: model info fails at once)
    with pytest.raises(hub.OfflineError, match="cannot reach"):
        hub.repo_details("org/tiny-st")


def test_server_listing_a_hostile_file_name_is_refused(server):
    server.add_repo("evil/repo", {"../../escape.gguf": b"x" * 10})
    with pytest.raises(hub.UnsafeNameError):
        hub.repo_details("evil/repo", with_card=False)
    with pytest.raises(hub.UnsafeNameError):
        hub.list_files("evil/repo")


@pytest.mark.parametrize(
    "repo_id", ["../x", "a/../b", "/abs/x", "a/b/c", "C:/x", "a\\b", "a/b..c", "", "a/-b", "a/b "]
)
def test_hostile_repo_ids(repo_id):
    with pytest.raises(hub.UnsafeNameError):
        hub.check_repo_id(repo_id)


@pytest.mark.parametrize(
    "name",
    [
        "../x.gguf",
        "a/../../x",
        "/etc/passwd",
        "C:\\x.gguf",
        "C:x.gguf",
        "a\\..\\b",
        "./x",
        "a//b",
        "",
        "x\0y",
        "a/",
    ],
)
def test_hostile_file_names(name, tmp_path):
    with pytest.raises(hub.UnsafeNameError):
        hub.check_filename(name)
    with pytest.raises(hub.UnsafeNameError):
        hub.library_path(tmp_path, "org/repo", name)


@pytest.mark.parametrize("rev", ["../main", "-x", "a\nb", "", "/x", "x" * 300])
def test_hostile_revisions(rev):
    with pytest.raises(hub.UnsafeNameError):
        hub.check_revision(rev)


def test_library_path_refuses_symlinks(tmp_path):
    root, outside = tmp_path / "lib", tmp_path / "outside"
    outside.mkdir()
    (root / "hub" / "org").mkdir(parents=True)
    assert (
        hub.library_path(root, "org/repo", "sub/m.gguf") == root / "hub" / "org" / "repo" / "sub" / "m.gguf"
    )
    (root / "hub" / "org" / "repo").symlink_to(outside)
    with pytest.raises(hub.UnsafeNameError, match="symbolic link"):
        hub.library_path(root, "org/repo", "m.gguf")
    assert hub.library_path(root, "legacy", "m.gguf") == root / "hub" / "_" / "legacy" / "m.gguf"
    assert not list(outside.iterdir())
    assert Path(hub.resolve_url("org/repo", "a b/m.gguf", "refs/pr/1")).name == "m.gguf"
    assert "refs%2Fpr%2F1/a%20b/m.gguf" in hub.resolve_url("org/repo", "a b/m.gguf", "refs/pr/1")


def test_card_summary():
    assert hub.card_summary("---\nlicense: x\n---\n\n# Title\n\n| a | b |\n\nHello **world**.\n\nMore.") == (
        "Hello world."
    )
    assert hub.card_summary("") == ""
    assert hub.card_summary("word " * 200).endswith("…")


def _files(*names_and_sizes) -> list[hub.RemoteFile]:
    return [hub.RemoteFile(name, size) for name, size in names_and_sizes]


def test_pick_mmproj_prefers_f16_then_bf16_then_f32_then_a_quantized_one():
    model = "gemma-3-4b-it-Q4_K_M.gguf"
    towers = [
        ("mmproj-Q8_0.gguf", 400),
        ("mmproj-gemma-3-4b-it-Q4_0.gguf", 300),
        ("mmproj-F32.gguf", 1600),
        ("mmproj-BF16.gguf", 800),
        ("mmproj-model-f16.gguf", 800),
    ]
    files = _files((model, 3000), ("README.md", 10), *towers)
    order = []
    while (tower := hub.pick_mmproj(files, model)) is not None:
        order.append(tower.path)
        files = [f for f in files if f.path != tower.path]
    assert order == [
        "mmproj-model-f16.gguf",
        "mmproj-BF16.gguf",
        "mmproj-F32.gguf",
        "mmproj-Q8_0.gguf",  # the larger of the quantized ones
        "mmproj-gemma-3-4b-it-Q4_0.gguf",
    ]


def test_pick_mmproj_none_for_towers_safetensors_and_repos_without_one():
    files = _files(("m-Q4_K_M.gguf", 30), ("mmproj-m-f16.gguf", 8), ("model.safetensors", 60))
    assert hub.pick_mmproj(files, "mmproj-m-f16.gguf") is None, "a tower brings no second tower"
    assert hub.pick_mmproj(files, "model.safetensors") is None
    assert hub.pick_mmproj(_files(("m-Q4_K_M.gguf", 30), ("m-Q8_0.gguf", 50)), "m-Q4_K_M.gguf") is None
    split_tower = _files(("m-Q4_K_M.gguf", 30), ("mmproj-f16-00001-of-00002.gguf", 8))
    assert hub.pick_mmproj(split_tower, "m-Q4_K_M.gguf") is None, "split towers are not fetched"


def test_pick_mmproj_prefers_the_models_folder_then_the_top():
    files = _files(
        ("BF16/m-BF16-00001-of-00002.gguf", 90),
        ("BF16/m-BF16-00002-of-00002.gguf", 90),
        ("other/mmproj-f16.gguf", 8),
        ("mmproj-F32.gguf", 16),
        ("BF16/mmproj-Q8_0.gguf", 4),
    )
    assert hub.pick_mmproj(files, "BF16/m-BF16-00001-of-00002.gguf").path == "BF16/mmproj-Q8_0.gguf"
    files = [f for f in files if f.path != "BF16/mmproj-Q8_0.gguf"]
    assert hub.pick_mmproj(files, "BF16/m-BF16-00001-of-00002.gguf").path == "mmproj-F32.gguf"


def test_towers_are_recognized_by_name_as_loaders_find_them(tmp_path):
    assert hub.is_mmproj("mmproj-BF16.gguf") and hub.is_mmproj("sub/gemma3-4b-MMPROJ-f16.gguf")
    assert not hub.is_mmproj("gemma-3-4b-it-Q4_K_M.gguf") and not hub.is_mmproj("mmproj.safetensors")
    variants = hub.gguf_variants(_files(("m-Q4_K_M.gguf", 30), ("gemma3-4b-mmproj-f16.gguf", 8)))
    assert [(v.quant, v.mmproj) for v in variants] == [("Q4_K_M", False), ("F16", True)]
    (tmp_path / "m-Q4_K_M.gguf").write_bytes(b"x")
    (tmp_path / "mmproj-f16.gguf").write_bytes(b"x")
    (tmp_path / "mmproj-bf16.gguf.hearth-partial").write_bytes(b"x")
    assert hub.mmprojs_in(tmp_path) == [tmp_path / "mmproj-f16.gguf"]
    assert hub.mmprojs_in(tmp_path / "absent") == []


def test_the_projector_types_a_download_fetches_are_the_ones_the_engine_reads():
    """models/ names the mmproj projector types (models/ cannot import engine/); a tower of any other type is
    not downloaded. A reader added to engine.vision.load.GGUF_READERS needs its name in
    models.hub.VISION_PROJECTOR_TYPES too, and this test says so."""
    from engine.vision.load import GGUF_READERS

    missing = sorted(set(GGUF_READERS) - set(hub.VISION_PROJECTOR_TYPES))
    extra = sorted(set(hub.VISION_PROJECTOR_TYPES) - set(GGUF_READERS))
    assert not missing, f"add {missing} to models.hub.VISION_PROJECTOR_TYPES (the engine reads them)"
    assert not extra, f"models.hub.VISION_PROJECTOR_TYPES names {extra}, which the engine has no reader for"
    assert hub.TowerHeader("gemma3", True).unsupported is None
    assert "projector llava is not one Hearth reads" in hub.TowerHeader("llava", True).unsupported
    assert "no vision encoder" in hub.TowerHeader("ultravox", False).unsupported
    assert hub.tower_header({"clip.vision.projector_type": "pixtral", "clip.projector_type": "x"}) == (
        hub.TowerHeader("pixtral", True)
    )
