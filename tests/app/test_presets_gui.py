"""Presets in the app: the model picker lists the library's presets and picking one opens a chat set up by it;
the chat options dialog edits every sampling override, fills its fields from a preset and saves them as one
(the same presets `hearth serve` offers as Ollama models)."""

from __future__ import annotations

from pathlib import Path

from app.chat_options import ChatOptionsDialog
from app.main_window import PRESET_ITEM
from app.qt import QInputDialog, QMessageBox
from app.settings import Settings, clean_overrides, preset_overrides
from models.library import Library, Preset, preset_parameters, preset_sampling
from tests.app.windows import open_window, record_replies

PIRATE = {"temperature": 0, "num_predict": 5, "stop": ["\n\n"], "top_k": 7, "repeat_penalty": 1.1,
          "num_ctx": 2048, "mirostat": 1}
OPENING = [{"role": "user", "content": "Ahoy"}, {"role": "assistant", "content": "Arr!"}]


def test_preset_parameters_map_to_hearths_sampling_names_and_back():
    sampling = preset_sampling(PIRATE)
    # num_ctx and mirostat are Ollama's, not applied; num_predict is the reply limit
    assert sampling == {"temperature": 0, "top_k": 7, "repetition_penalty": 1.1, "stop": ("\n\n",),
                        "max_tokens": 5}
    applied = {k: v for k, v in PIRATE.items() if k not in ("num_ctx", "mirostat")}
    assert preset_parameters(sampling) == applied
    assert "max_tokens" not in preset_sampling({"num_predict": -1})  # Ollama's "no limit"
    assert preset_parameters({"temperature": None, "stop": []}) == {}
    overrides = preset_overrides(Preset("pirate", "/m.gguf", parameters=PIRATE))
    assert overrides["stop"] == ["\n\n"] and overrides == clean_overrides(overrides)


def test_picking_a_preset_opens_a_chat_set_up_by_it(qtbot, engine, monkeypatch, smollm2_path):
    lib = Library()
    lib.save_preset(Preset("pirate", str(smollm2_path), "You are a pirate.", parameters=PIRATE,
                           messages=OPENING))
    lib.save_preset(Preset("orphan", str(Path(smollm2_path).with_name("gone.gguf")), "x"))
    params: list = []
    calls = record_replies(engine, monkeypatch, "Arr, it be buried.", params)
    w, store = open_window(qtbot, engine)
    w.refresh_models()
    index = w.model_box.findData(PRESET_ITEM + "pirate")
    assert index >= 0 and w.model_box.itemText(index) == f"pirate (preset of {Path(smollm2_path).name})"
    assert w.model_box.findData(PRESET_ITEM + "orphan") < 0  # its model file is gone

    w.composer.setPlainText("Hello")  # the current chat has a message: the preset opens a new one
    with qtbot.waitSignal(w.controller.messageDone, timeout=30000):
        w.send()
    first = w.controller.chat.id
    w.model_box.activated.emit(index)
    chat = w.controller.chat
    assert chat.id != first and len(store.messages(first)) == 2
    assert w.model_box.currentData() == PRESET_ITEM + "pirate"
    assert w.model_info.path == str(smollm2_path)  # its model was loaded already: no reload
    assert chat.system_prompt == "You are a pirate."
    assert chat.overrides == {"temperature": 0, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 5,
                              "stop": ["\n\n"]}
    assert [(m.role, m.content) for m in store.messages(chat.id)] == [("user", "Ahoy"), ("assistant", "Arr!")]
    assert store.get_chat(chat.id).overrides == chat.overrides  # stored, so it survives a restart

    w.composer.setPlainText("Where is the treasure?")
    with qtbot.waitSignal(w.controller.messageDone, timeout=30000):
        w.send()
    assert calls[-1] == [{"role": "system", "content": "You are a pirate."}, *OPENING,
                         {"role": "user", "content": "Where is the treasure?"}]
    p = params[-1]
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens, p.stop) == (0, 7, 1.1, 5, ("\n\n",))
    assert p.top_p == w.settings.get("top_p")  # what the preset leaves out follows the settings

    # an empty current chat is set up in place; a preset deleted meanwhile is refused with a message
    w.controller.new_chat()
    empty = w.controller.chat.id
    w.model_box.activated.emit(index)
    assert w.controller.chat.id == empty and w.controller.chat.system_prompt == "You are a pirate."
    lib.remove_preset("pirate")
    w.apply_preset("pirate")
    assert "gone" in w.statusBar().currentMessage() and w.model_box.findData(PRESET_ITEM + "pirate") < 0
    w.close()
    store.close()


def test_chat_options_edit_every_override_and_save_them_as_a_preset(qtbot, monkeypatch, tmp_path):
    settings = Settings()
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    overrides = {"top_k": 5, "stop": ["END", "###"], "seed": 3}
    dialog = ChatOptionsDialog("Be brief.", overrides, settings, model_path=str(model))
    qtbot.addWidget(dialog)
    assert dialog.result_values() == ("Be brief.", overrides)  # the others stay at "default"
    assert dialog.spins["top_p"].text() == f"default ({settings.get('top_p')})"
    dialog.spins["temperature"].setValue(0.3)
    dialog.spins["repetition_penalty"].setValue(1.15)
    system, values = dialog.result_values()
    assert values == {**overrides, "temperature": 0.3, "repetition_penalty": 1.15}

    names = iter([("my bot", True), ("mybot", True), ("mybot", True), ("mybot", True)])
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: next(names))
    warned: list[str] = []
    monkeypatch.setattr(QMessageBox, "warning", lambda _p, _t, text: warned.append(text))
    assert dialog.save_preset() is None and "cannot be a preset's name" in warned[0]
    saved = dialog.save_preset()
    assert saved is not None and saved.base == str(model) and saved.system == "Be brief."
    assert Library().find_preset("mybot").parameters == {"top_k": 5, "stop": ["END", "###"], "seed": 3,
                                                          "temperature": 0.3, "repeat_penalty": 1.15}
    # saving under a taken name asks first
    dialog.spins["top_k"].setValue(dialog.spins["top_k"].minimum())  # back to "default"
    answers = iter([QMessageBox.StandardButton.No, QMessageBox.StandardButton.Yes])
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: next(answers))
    assert dialog.save_preset() is None and Library().find_preset("mybot").parameters["top_k"] == 5
    assert dialog.save_preset() is not None and "top_k" not in Library().find_preset("mybot").parameters
    assert [p.name for p in dialog.saved] == ["mybot", "mybot"]

    # a new dialog's preset list fills every field from the preset, the ones it leaves out to "default"
    other = ChatOptionsDialog("", {"min_p": 0.2}, settings, model_path=None)
    qtbot.addWidget(other)
    assert not other.save_button.isEnabled()  # no model loaded: nothing to save a preset over
    index = other.preset_box.findData("mybot")
    assert index > 0
    other.preset_box.activated.emit(index)
    assert other.result_values() == ("Be brief.", {"stop": ["END", "###"], "seed": 3, "temperature": 0.3,
                                                   "repetition_penalty": 1.15})


def test_a_preset_saved_from_the_chat_options_joins_the_picker(qtbot, engine, monkeypatch, smollm2_path):
    w, store = open_window(qtbot, engine)
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("terse", True))

    def run(dialog):  # what a user does in the modal dialog: a system prompt, then Save as preset…
        assert dialog.model_path == w.model_info.path
        dialog.system.setPlainText("Answer in one word.")
        dialog.save_preset()
        return False  # then Cancel: the chat keeps its options, the preset stays

    monkeypatch.setattr(ChatOptionsDialog, "exec", run)
    w.chat_options()
    assert w.model_box.findData(PRESET_ITEM + "terse") >= 0
    assert Library().find_preset("terse").base == str(smollm2_path)
    assert w.controller.chat is None or w.controller.chat.system_prompt == ""
    w.close()
    store.close()
