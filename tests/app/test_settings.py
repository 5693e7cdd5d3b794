"""The settings schema and its file: round trip, validation, bad files, notifications."""

from __future__ import annotations

import json

import pytest

from app.settings import SCHEMA, Settings, SettingsError, default, settings_path, validate


def test_every_field_has_label_description_and_a_valid_default():
    for key, f in SCHEMA.items():
        if not f.metadata.get("hidden"):
            assert f.metadata["label"] and f.metadata["description"] and f.metadata["section"], key
        assert validate(key, default(key)) == default(key)


def test_round_trip_and_notifications(tmp_path):
    path = tmp_path / "settings.json"
    s = Settings(path)
    heard = []
    unsubscribe = s.subscribe(lambda k, v: heard.append((k, v)))
    assert s.set("temperature", 0) is True  # an int for a float field is converted
    assert s.get("temperature") == 0.0 and isinstance(s.get("temperature"), float)
    assert s.update({"theme": "dark", "n_ctx": 2048, "quant_format": "Q8_0"}) == [
        "theme",
        "n_ctx",
        "quant_format",
    ]
    assert s.set("theme", "dark") is False  # unchanged: no write, no notification
    unsubscribe()
    s.set("threads", 2)
    assert heard == [("temperature", 0.0), ("theme", "dark"), ("n_ctx", 2048), ("quant_format", "Q8_0")]
    again = Settings(path)
    assert again.as_dict() == s.as_dict()
    assert not list(tmp_path.glob(".*tmp")), "no temp file left behind"


@pytest.mark.parametrize(
    "key, value",
    [
        ("theme", "purple"),
        ("n_ctx", 10),
        ("temperature", "hot"),
        ("threads", 1.5),
        ("first_run_done", 1),
        ("nope", 1),
    ],
)
def test_bad_values_are_refused_with_a_clear_error(tmp_path, key, value):
    s = Settings(tmp_path / "s.json")
    with pytest.raises(SettingsError):
        s.set(key, value)
    assert not (tmp_path / "s.json").exists()


def test_bad_file_falls_back_to_defaults_and_keeps_unknown_keys(tmp_path):
    path = settings_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "values": {"theme": "purple", "n_ctx": 8192, "future": 3}}))
    s = Settings()
    assert s.get("theme") == "system" and s.get("n_ctx") == 8192
    assert any("Theme" in w for w in s.warnings)
    s.set("font_size", 14)
    assert json.loads(path.read_text())["values"]["future"] == 3
    path.write_text("{not json")
    broken = Settings()
    assert broken.get("n_ctx") == default("n_ctx") and broken.warnings


@pytest.mark.gui
def test_settings_offer_the_library_drafts_for_the_loaded_model(
    qtbot, smollm2_path, gemma3_path, monkeypatch, tmp_path
):
    # the loaded model is the F16 SmolLM2; the library has its Q4_1 starter (a draft) and Gemma (not one)
    from app.settings_dialog import SettingsDialog
    from models.library import Library
    from tests.conftest import TEST_MODELS
    from tests.engine.spec_models import float_copy

    monkeypatch.setenv("HEARTH_HOME", str(tmp_path))
    target = float_copy(smollm2_path, "F16", TEST_MODELS / "spec")
    for p in (smollm2_path, gemma3_path):
        Library().import_path(p)
    dialog = SettingsDialog(Settings(), model_path=str(target))
    qtbot.addWidget(dialog)
    box = dialog.draft_suggestions
    qtbot.waitUntil(box.isEnabled, timeout=30000)
    assert [box.itemData(i) for i in range(box.count())] == ["", str(smollm2_path)]
    box.activated.emit(1)
    assert dialog.editors["draft_model"].text() == str(smollm2_path)
    none = SettingsDialog(Settings(), model_path=str(smollm2_path))  # nothing in the library is smaller
    qtbot.addWidget(none)
    qtbot.waitUntil(lambda: "no compatible" in none.draft_suggestions.itemText(0), timeout=30000)


@pytest.mark.gui
def test_document_search_offers_the_library_embedding_models(qtbot, smollm2_path, monkeypatch, tmp_path):
    from pathlib import Path

    from app.controller import search_model
    from app.settings_dialog import SettingsDialog
    from models.library import Library

    monkeypatch.setenv("HEARTH_HOME", str(tmp_path))
    bert = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "bert-embed"
    Library().import_path(smollm2_path)  # a chat model: not offered
    assert search_model("auto") is None and search_model("keywords") is None, "no embedding model yet"
    (entry,) = Library().import_path(bert)
    assert entry.embedding and not Library().get(str(smollm2_path)).embedding
    assert search_model("auto") == (str(bert), "bert-embed")
    assert search_model("/elsewhere/e5.gguf") == ("/elsewhere/e5.gguf", "e5")

    s = Settings()
    assert s.get("document_search") == "auto"
    dialog = SettingsDialog(s)
    qtbot.addWidget(dialog)
    box = dialog.editors["document_search"]
    assert [box.itemData(i) for i in range(box.count())] == ["auto", "keywords", str(bert)]
    assert box.currentData() == "auto" and "bert-embed" in box.itemText(2)
    box.setCurrentIndex(2)
    dialog.accept()
    assert Settings().get("document_search") == str(bert)
    s.set("document_search", "/gone/model.gguf")  # a saved model no longer in the library stays shown
    again = SettingsDialog(s)
    qtbot.addWidget(again)
    assert again.editors["document_search"].currentData() == "/gone/model.gguf"
    again.restore_defaults()
    assert again.editors["document_search"].currentData() == "auto"
