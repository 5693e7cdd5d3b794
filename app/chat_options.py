"""A chat's own system prompt and sampling options, and presets: a name for a system prompt and options
over a model.

The dialog edits the current chat's system prompt and its overrides of the sampling settings (a field left at
"default" follows the settings). Its Preset row fills the fields from a preset, and "Save as preset…" stores
them as one over the loaded model. Presets are the library's (models.library.Preset), the same ones `hearth
serve` offers as Ollama models (`ollama create`) and `hearth chat -m NAME` runs: a preset made in one place is
usable in the others. The model picker lists them too (MainWindow.apply_preset: picking one loads its model
and opens a chat with its system prompt, options and opening messages).
"""

from __future__ import annotations

from pathlib import Path

from app.qt import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QInputDialog,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QWidget,
    Slot,
)
from app.settings import SAMPLING_KEYS, SCHEMA, Settings, preset_overrides
from models.library import PRESET_NAME, Library, Preset, preset_parameters


def _spin(key: str, settings: Settings, value) -> QSpinBox | QDoubleSpinBox:
    """A spin box for sampling setting `key` whose lowest value (one step under the setting's minimum) reads
    "default (the setting's value)" and means "follow the settings"."""
    meta = SCHEMA[key].metadata
    is_int = isinstance(SCHEMA[key].default, int)
    box = QSpinBox() if is_int else QDoubleSpinBox()
    step = 1 if is_int else 0.01
    if not is_int:
        box.setDecimals(2)
        box.setSingleStep(0.05)
    unset = meta["min"] - step
    box.setRange(unset, meta["max"])
    box.setSpecialValueText(f"default ({settings.get(key)})")
    box.setValue(unset if value is None else value)
    box.setAccessibleName(f"{meta['label']} for this chat")
    box.setToolTip(meta["description"])
    return box


class ChatOptionsDialog(QDialog):
    """Per-chat system prompt and sampling overrides (fields at "default" follow the settings), presets.

    Args:
        system_prompt, overrides: the chat's.
        settings: the app settings (the defaults shown).
        model_path: the loaded model's file, which "Save as preset…" makes the preset's model (None: no model
            is loaded, nothing to save a preset over).
    """

    def __init__(self, system_prompt: str, overrides: dict, settings: Settings, parent=None,
                 model_path: str | None = None):
        super().__init__(parent)
        self.setWindowTitle("Chat options")
        self.model_path = model_path
        self.saved: list[Preset] = []  # the presets saved from this dialog
        form = QFormLayout(self)
        self.preset_box = QComboBox()
        self.preset_box.setAccessibleName("Preset")
        self.preset_box.setToolTip("Fill the fields from a preset (presets are also served by hearth serve)")
        self.save_button = QPushButton("Save as preset…")
        self.save_button.setEnabled(model_path is not None)
        if model_path is None:
            self.save_button.setToolTip("Load a model first: a preset is saved over the loaded model")
        row = QHBoxLayout()
        row.addWidget(self.preset_box, 1)
        row.addWidget(self.save_button)
        holder = QWidget()
        holder.setLayout(row)
        form.addRow("Preset", holder)
        self.system = QPlainTextEdit(system_prompt)
        self.system.setAccessibleName("System prompt")
        form.addRow("System prompt", self.system)
        self.spins = {k: _spin(k, settings, overrides.get(k)) for k in SAMPLING_KEYS}
        for k, box in self.spins.items():
            form.addRow(SCHEMA[k].metadata["label"], box)
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.seed.setValue(overrides.get("seed", -1) if overrides.get("seed") is not None else -1)
        self.seed.setAccessibleName("Sampling seed for this chat")
        form.addRow("Seed", self.seed)
        self.stop = QPlainTextEdit("\n".join(overrides.get("stop") or ()))
        self.stop.setAccessibleName("Stop sequences for this chat")
        self.stop.setPlaceholderText("One per line: the reply ends before any of them")
        self.stop.setMaximumHeight(72)
        form.addRow("Stop sequences", self.stop)
        ok_cancel = QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        buttons = QDialogButtonBox(ok_cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self._fill_presets()
        self.preset_box.activated.connect(self._on_preset_picked)
        self.save_button.clicked.connect(self.save_preset)

    def _fill_presets(self, current: str | None = None) -> None:
        self.preset_box.clear()
        self.preset_box.addItem("Choose a preset to fill the fields…", None)
        try:
            presets = Library().presets()
        except Exception:  # noqa: BLE001 - an unreadable library leaves the list empty, the dialog usable
            presets = []
        for p in presets:
            self.preset_box.addItem(f"{p.name} (over {Path(p.base).name})", p.name)
        if current is not None and self.preset_box.findData(current) >= 0:
            self.preset_box.setCurrentIndex(self.preset_box.findData(current))

    @Slot(int)
    def _on_preset_picked(self, index: int) -> None:
        name = self.preset_box.itemData(index)
        preset = Library().find_preset(name) if name else None
        if preset is not None:
            self.fill(preset)

    def fill(self, preset: Preset) -> None:
        """The fields as the preset sets them (the others back to "default")."""
        values = preset_overrides(preset)
        self.system.setPlainText(preset.system or "")
        for k, box in self.spins.items():
            box.setValue(values.get(k, box.minimum()))
        self.seed.setValue(values.get("seed", -1))
        self.stop.setPlainText("\n".join(values.get("stop", ())))

    @Slot()
    def save_preset(self) -> Preset | None:
        """Ask a name and store the fields as a preset over the loaded model (asks before replacing one)."""
        if self.model_path is None:
            return None
        name, ok = QInputDialog.getText(self, "Save as preset", "Preset name:")
        name = name.strip().removesuffix(":latest")
        if not ok or not name:
            return None
        if not PRESET_NAME.match(name):
            QMessageBox.warning(
                self, "Save as preset", f"{name!r} cannot be a preset's name: use letters, digits, '_', '-' "
                "and '.' (API clients ask for it as a model name, e.g. mybot or mybot:v2).",
            )
            return None
        lib = Library()
        if lib.find_preset(name) is not None:
            answer = QMessageBox.question(self, "Save as preset", f"Replace the preset {name!r}?")
            if answer != QMessageBox.StandardButton.Yes:
                return None
        system, overrides = self.result_values()
        preset = lib.save_preset(Preset(name, self.model_path, system or None,
                                        parameters=preset_parameters(overrides)))
        self.saved.append(preset)
        self._fill_presets(current=preset.name)
        return preset

    def result_values(self) -> tuple[str, dict]:
        """(system prompt, overrides): the fields not at "default"."""
        overrides: dict = {}
        for k, box in self.spins.items():
            if box.value() > box.minimum():
                overrides[k] = round(box.value(), 2) if isinstance(box, QDoubleSpinBox) else box.value()
        if self.seed.value() >= 0:
            overrides["seed"] = self.seed.value()
        stop = [s for s in self.stop.toPlainText().split("\n") if s]
        if stop:
            overrides["stop"] = stop
        return self.system.toPlainText(), overrides
