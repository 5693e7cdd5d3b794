"""The "Convert…" dialog of the model library: pick a target format, watch the conversion, get the model.

The formats are the converter registry's (engine.quant.registry through app.quant_info, listed in a
background thread because the registry imports the quantizers). Each row shows bits per weight, the
estimated size for this model, the measured quality from the source's quant report when one exists
(`hearth quant-report`), and a plain-language hint. The conversion itself runs in a child process
(app.conversion.ConversionJob); the output is written into the library folder and indexed there.
Cancel, or closing the dialog, stops it and leaves no partial file.
"""

from __future__ import annotations

import threading
from pathlib import Path

from app import quant_info
from app.conversion import ConversionJob, ConversionResult
from app.qt import (
    QAbstractItemView,
    QDialog,
    QDoubleSpinBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QObject,
    QProgressBar,
    QPushButton,
    Qt,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    Signal,
    Slot,
)

COLUMNS = ("Format", "Bits/weight", "Size (est.)", "Measured quality", "What it means")


class _Relay(QObject):
    formats = Signal(object, object)  # list[QuantChoice], quant report | None


def output_path(source: Path, name: str, param: str | None, folder: Path, container: str = "gguf") -> Path:
    """Where the converted model goes: the library folder, named after the source and the format (a
    .gguf file, or a folder for the formats whose container is safetensors)."""
    stem = source.name[: -len(".gguf")] if source.name.endswith(".gguf") else source.name
    for old in ("Q4_1", "Q4_K_M", "Q8_0", "F16", "BF16", "F32", "Q4_0", "Q5_K_M", "Q6_K"):
        for sep in (".", "-"):
            if stem.upper().endswith(sep + old):
                stem = stem[: -len(old) - 1]
                break
    tag = name.replace(":", "-") + (f"-{param}" if param else "")
    if name.lower() == "safetensors":
        return folder / f"{stem}-hf"
    return folder / f"{stem}.{tag}{'.gguf' if container == 'gguf' else ''}"


def unique(path: Path) -> Path:
    """`path`, or `path` with -2, -3 ... before its suffix when that name is taken."""
    if not path.exists():
        return path
    stem, suffix = (
        (path.name[: -len(path.suffix)], path.suffix) if path.suffix == ".gguf" else (path.name, "")
    )
    n = 2
    while (candidate := path.with_name(f"{stem}-{n}{suffix}")).exists():
        n += 1
    return candidate


class ConvertDialog(QDialog):
    """Convert one local model.

    Args:
        source: the model file or folder.
        params: its parameter count (for size estimates), None when unknown.
        default_format: the format selected first (the settings' quantization).
        folder: where the output goes (the library folder).
        threads: CPU threads for the conversion (None: all cores).

    Signals:
        converted(path: str): a conversion finished and its output is in the library.
    """

    converted = Signal(str)

    def __init__(
        self,
        source: str | Path,
        params: int | None,
        default_format: str,
        folder: Path,
        threads: int | None = None,
        parent=None,
    ):
        super().__init__(parent)
        self.source = Path(source)
        self.params = params
        self.default_format = default_format
        self.folder = folder
        self.threads = threads
        self.job: ConversionJob | None = None
        self.choices: list[quant_info.QuantChoice] = []
        self.planned: dict[str, int] = {}  # format -> planned output bytes (quant_info.planned_sizes)
        self.last_result: ConversionResult | None = None
        self.setWindowTitle(f"Convert {self.source.name}")
        self.setAccessibleName("Convert a model")
        self.resize(760, 460)
        v = QVBoxLayout(self)
        size = f"{params / 1e6:,.0f} M parameters" if params else "parameter count unknown"
        v.addWidget(QLabel(f"<b>{self.source.name}</b> · {size}"))
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setAccessibleName("Target formats")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)
        v.addWidget(self.table, 1)
        row = QHBoxLayout()
        self.param_label = QLabel("Bits per weight:")
        self.param = QDoubleSpinBox()
        self.param.setRange(2.0, 8.5)
        self.param.setSingleStep(0.25)
        self.param.setValue(4.5)
        self.param.setAccessibleName("Bits per weight budget")
        row.addWidget(self.param_label)
        row.addWidget(self.param)
        row.addStretch(1)
        v.addLayout(row)
        self.target_label = QLabel("")
        self.target_label.setAccessibleName("Output file")
        self.target_label.setWordWrap(True)
        v.addWidget(self.target_label)
        self.bar = QProgressBar()
        self.bar.setAccessibleName("Conversion progress")
        self.bar.setRange(0, 1000)
        self.bar.setValue(0)
        v.addWidget(self.bar)
        self.status = QLabel("Loading the formats…")
        self.status.setAccessibleName("Conversion status")
        self.status.setWordWrap(True)
        v.addWidget(self.status)
        buttons = QHBoxLayout()
        self.convert_button = QPushButton("Convert")
        self.convert_button.setAccessibleName("Start the conversion")
        self.convert_button.setEnabled(False)
        self.cancel_button = QPushButton("Cancel conversion")
        self.cancel_button.setAccessibleName("Cancel the conversion")
        self.cancel_button.setEnabled(False)
        self.close_button = QPushButton("Close")
        self.close_button.setAccessibleName("Close")
        buttons.addStretch(1)
        for b in (self.convert_button, self.cancel_button, self.close_button):
            buttons.addWidget(b)
        v.addLayout(buttons)
        self.convert_button.clicked.connect(self.start)
        self.cancel_button.clicked.connect(self.cancel)
        self.close_button.clicked.connect(self.close)
        self.table.currentCellChanged.connect(self._on_selected)
        self.param.valueChanged.connect(self._on_param)
        self._relay = _Relay(self)
        self._relay.formats.connect(self._on_formats)
        threading.Thread(target=self._load_formats, daemon=True, name="hearth-formats").start()

    # ---- formats
    def _load_formats(self) -> None:
        choices = quant_info.choices()
        self.planned = quant_info.planned_sizes(self.source, [c.name for c in choices if not c.takes_param])
        self._relay.formats.emit(choices, quant_info.report_for(self.source))

    @Slot(object, object)
    def _on_formats(self, choices, report) -> None:
        self.choices = choices
        self.table.setRowCount(len(choices))
        for i, c in enumerate(choices):
            row = quant_info.measured(report, c.name)
            size = self._size(c, None)
            cells = (
                c.name + (":BPW" if c.takes_param else ""),
                f"{c.bits:.2f}",
                f"≈ {size / 2**20:,.0f} MiB" if size else "?",
                quant_info.measured_text(row) or "not measured",
                c.hint + (f" {c.description}." if c.description else ""),
            )
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                self.table.setItem(i, col, item)
        self.table.resizeColumnsToContents()
        pick = next((i for i, c in enumerate(choices) if c.name.lower() == self.default_format.lower()), 0)
        self.table.selectRow(pick)
        self.status.setText(
            "Pick a format."
            + ("" if report else " Measured quality appears after `hearth quant-report` on this model.")
        )
        self.convert_button.setEnabled(bool(choices))

    def _size(self, c: quant_info.QuantChoice, param: str | None) -> int | None:
        """The output size: planned per tensor for the GGUF presets, else bits x parameters."""
        planned = self.planned.get(c.name.upper())
        return planned if planned is not None else quant_info.size_estimate(self.params, c.bits_for(param))

    def select_format(self, name: str) -> None:
        """Select the row of format `name` (tests and keyboard users)."""
        for i, c in enumerate(self.choices):
            if c.name.lower() == name.lower():
                self.table.selectRow(i)
                return
        raise KeyError(name)

    def selected(self) -> quant_info.QuantChoice | None:
        row = self.table.currentRow()
        return self.choices[row] if 0 <= row < len(self.choices) else None

    def format_spec(self) -> tuple[str, str | None] | None:
        """The --to value of the selection and its parameter."""
        c = self.selected()
        if c is None:
            return None
        param = f"{self.param.value():g}" if c.takes_param else None
        return (c.name + (f":{param}" if param else "")), param

    def target(self) -> Path | None:
        c, spec = self.selected(), self.format_spec()
        if c is None or spec is None:
            return None
        return unique(output_path(self.source, c.name, spec[1], self.folder, c.container))

    @Slot(int, int, int, int)
    def _on_selected(self, *_args) -> None:
        c = self.selected()
        takes = bool(c and c.takes_param)
        self.param.setVisible(takes)
        self.param_label.setVisible(takes)
        self._show_target()

    @Slot(float)
    def _on_param(self, _value: float) -> None:
        self._show_target()

    def _show_target(self) -> None:
        target = self.target()
        c = self.selected()
        if target is None or c is None:
            self.target_label.setText("")
            return
        size = self._size(c, self.format_spec()[1])
        approx = f" (about {size / 2**20:,.0f} MiB)" if size else ""
        self.target_label.setText(f"Writes {target}{approx}")

    # ---- running
    @Slot()
    def start(self) -> None:
        """Start converting to the selected format."""
        spec, target = self.format_spec(), self.target()
        if spec is None or target is None or (self.job is not None and self.job.running):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.job = ConversionJob(self.source, spec[0], target, self.threads, self)
        self.job.progress.connect(self._on_progress)
        self.job.finished.connect(self._on_finished)
        self.bar.setValue(0)
        self.bar.setFormat("%p%")
        self.status.setText(f"Converting to {spec[0]}…")
        self.convert_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.table.setEnabled(False)
        self.job.start()

    @Slot()
    def cancel(self) -> None:
        if self.job is not None and self.job.running:
            self.status.setText("Cancelling…")
            self.job.cancel()

    @Slot(float, str)
    def _on_progress(self, fraction: float, message: str) -> None:
        self.bar.setValue(int(fraction * 1000))
        self.status.setText(message)

    @Slot(object)
    def _on_finished(self, result: ConversionResult) -> None:
        self.last_result = result
        self.cancel_button.setEnabled(False)
        self.convert_button.setEnabled(True)
        self.table.setEnabled(True)
        if result.state == "done":
            self.bar.setValue(1000)
            note = f" ({result.error})" if result.error else ""
            self.status.setText(
                f"Done in {result.seconds:.1f} s: {Path(result.output).name}, "
                f"{result.nbytes / 2**20:,.1f} MiB{note}"
            )
            self._show_target()
            if not result.error:
                self.converted.emit(result.output)
        elif result.state == "cancelled":
            self.bar.setValue(0)
            self.status.setText("Cancelled; nothing was written.")
        else:
            self.bar.setValue(0)
            self.status.setText(f"The conversion failed: {result.error}")

    @property
    def running(self) -> bool:
        return self.job is not None and self.job.running

    def shutdown(self) -> None:
        """Stop a running conversion and wait for it (no partial file stays)."""
        if self.job is not None:
            self.job.shutdown()

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt override
        self.shutdown()
        super().closeEvent(event)

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Esc cancels a running conversion first
        if event.key() == Qt.Key.Key_Escape and self.running:
            self.cancel()
            return
        super().keyPressEvent(event)
