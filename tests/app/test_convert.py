"""Convert… in the library window: the starter model to Q8_0 through a real `hearth convert` child process,
cancel and close mid-conversion (nothing partial left), a bad source reported."""

from __future__ import annotations

import json

import pytest

from app.convert_dialog import ConvertDialog, output_path
from app.library_window import LibraryWindow
from app.settings import Settings
from models.formats.gguf import open_gguf
from models.library import Library
from models.paths import models_dir

pytestmark = pytest.mark.gui


def _leftovers(folder):
    return sorted(p.name for p in folder.glob(".*part*"))


@pytest.fixture
def library_window(qtbot, smollm2_path):
    Library().import_path(smollm2_path)
    win = LibraryWindow(Settings())
    qtbot.addWidget(win)
    win.show()
    qtbot.waitUntil(lambda: win.local.count() >= 1, timeout=5000)
    yield win
    win.shutdown()


def _dialog(qtbot, win, name: str) -> ConvertDialog:
    row = next(i for i in range(win.local.count()) if name in win.local.item(i).text())
    win.local.setCurrentRow(row)
    dialog = win.convert_selected()
    qtbot.waitUntil(lambda: dialog.table.rowCount() > 0, timeout=30000)
    return dialog


def test_convert_the_starter_to_q8_0_lands_in_the_library(qtbot, library_window):
    win = library_window
    dialog = _dialog(qtbot, win, "SmolLM2")
    names = [c.name for c in dialog.choices]
    assert {"Q8_0", "Q4_K_M", "F16"} <= set(names), "the converter registry's formats are listed"
    assert dialog.selected().name == Settings().get("quant_format"), "the settings' format is preselected"
    dialog.select_format("Q8_0")
    row = dialog.table.currentRow()
    assert dialog.table.item(row, 1).text() == "8.50"
    assert "MiB" in dialog.table.item(row, 2).text(), "a size estimate"
    assert dialog.table.item(row, 4).text(), "a plain-language hint"
    target = dialog.target()
    assert target.parent == models_dir() and target.name == "SmolLM2-135M-Instruct.Q8_0.gguf"
    fractions = []
    with qtbot.waitSignal(win.modelsChanged, timeout=120000):
        dialog.start()
        dialog.job.progress.connect(lambda f, _m: fractions.append(f))
    result = dialog.last_result
    assert result.state == "done", result.error
    assert fractions and fractions == sorted(fractions) and 0 < fractions[-1] <= 1.0
    assert dialog.bar.value() == 1000 and "Done" in dialog.status.text()
    with open_gguf(target) as g:
        types = {t.type_name for t in g.tensors.values()}
    assert types == {"Q8_0", "F32"}, types
    entry = next(e for e in Library().entries() if e.path == str(target))
    assert entry.quant == "Q8_0" and entry.size == target.stat().st_size
    # the size shown was planned per tensor (576-wide rows, the tied embedding): within 2% of the file
    assert abs(dialog.planned["Q8_0"] - entry.size) < 0.02 * entry.size, (dialog.planned["Q8_0"], entry.size)
    qtbot.waitUntil(lambda: any("Q8_0.gguf" in win.local.item(i).text() for i in range(win.local.count())))
    assert _leftovers(target.parent) == []
    # a second conversion to the same format gets a fresh name instead of failing
    assert dialog.target().name == "SmolLM2-135M-Instruct.Q8_0-2.gguf"
    dialog.close()


def test_cancel_and_close_mid_conversion_leave_nothing_behind(qtbot, library_window):
    win = library_window
    dialog = _dialog(qtbot, win, "SmolLM2")
    dialog.select_format("Q4_K_M")
    target = dialog.target()
    dialog.start()
    job = dialog.job
    with qtbot.waitSignal(job.finished, timeout=120000):
        qtbot.waitUntil(lambda: job.fraction > 0, timeout=60000)
        assert dialog.cancel_button.isEnabled()
        dialog.cancel_button.click()
    assert dialog.last_result.state == "cancelled" and "Cancelled" in dialog.status.text()
    assert not target.exists() and _leftovers(target.parent) == []
    assert dialog.convert_button.isEnabled()

    # closing the library window while converting stops the child process and cleans up
    dialog.start()
    job = dialog.job
    qtbot.waitUntil(lambda: job.fraction > 0, timeout=60000)
    pid = job.pid
    win.shutdown()
    assert not job.running and job.result.state == "cancelled"
    assert not target.exists() and _leftovers(target.parent) == []
    import os

    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_cancel_that_lands_after_the_rename_leaves_nothing(qtbot, tmp_path, smollm2_path):
    # the CLI renamed its file to OUT (it had just finished) when Cancel's SIGINT came: the job, cancelled,
    # deletes OUT; an OUT that was there before the job is never touched
    from app.conversion import ConversionJob

    target = tmp_path / "out.gguf"
    job = ConversionJob(smollm2_path, "Q8_0", target)
    job.start()
    assert job.proc.waitForFinished(120000)  # the conversion ran to its end ...
    qtbot.waitUntil(lambda: job.result is not None, timeout=60000)
    assert job.result.state == "done" and target.exists()
    job.result, job._cancelled = None, True  # ... and the cancel is seen at the finish
    job._output_existed = False
    job._on_finished(0, None)
    assert job.result.state == "cancelled" and not target.exists()
    target.write_bytes(b"kept")
    job.result, job._output_existed = None, True
    job._on_finished(0, None)
    assert job.result.state == "cancelled" and target.read_bytes() == b"kept"


def test_a_bad_source_is_reported(qtbot, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    row = {
        "format": "Q8_0",
        "file_bytes": 144811136,
        "bits_per_weight": 8.5,
        "ppl": 14.213,
        "delta_ppl_pct": 0.42,
        "decode_tps": 61.0,
    }
    (tmp_path / "junk.gguf.quant-report.json").write_text(json.dumps({"version": 1, "rows": [row]}))
    dialog = ConvertDialog(junk, 135_000_000, "Q8_0", tmp_path / "out")
    qtbot.addWidget(dialog)
    qtbot.waitUntil(lambda: dialog.table.rowCount() > 0, timeout=30000)
    dialog.select_format("Q8_0")
    measured = dialog.table.item(dialog.table.currentRow(), 3).text()
    assert measured == "ppl 14.21 (+0.4 %), 61 tok/s, 138 MiB", "the quant report's figures are shown"
    dialog.select_format("Q4_0")
    assert dialog.table.item(dialog.table.currentRow(), 3).text() == "not measured"
    dialog.select_format("Q8_0")
    dialog.start()
    with qtbot.waitSignal(dialog.job.finished, timeout=60000):
        pass
    assert dialog.last_result.state == "failed"
    assert "junk.gguf" in dialog.status.text() and "failed" in dialog.status.text()
    assert not list((tmp_path / "out").iterdir())


def test_output_names():
    from pathlib import Path

    folder = Path("/lib")
    assert output_path(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf"), "Q8_0", None, folder) == Path(
        "/lib/SmolLM2-135M-Instruct.Q8_0.gguf"
    )
    assert output_path(Path("/x/m-F16.gguf"), "mixed", "4.5", folder) == Path("/lib/m.mixed-4.5.gguf")
    assert output_path(Path("/x/m.gguf"), "safetensors", None, folder) == Path("/lib/m-hf")
    # safetensors-container formats are folders; a colon in the format's name does not reach the file name
    assert output_path(Path("/x/m"), "fp8:block", None, folder, "safetensors") == Path("/lib/m.fp8-block")
    assert output_path(Path("/x/m.gguf"), "int4:g64", None, folder, "safetensors") == Path("/lib/m.int4-g64")
    assert output_path(Path("/x/m.gguf"), "awq:q4_0", None, folder, "gguf") == Path("/lib/m.awq-q4_0.gguf")


def test_every_registered_format_has_its_own_bits_per_weight():
    """The picker's size estimate: every quantized format the converter registers has a figure below
    16 bits (a name the table lacked fell back to 16, so int4:g64 or fp8:block showed an F16 size)."""
    from app import quant_info
    from engine.quant.registry import formats

    for f in formats():
        bits = quant_info._bits(f.name, f.takes_param)
        if f.name.upper() in ("F32", "F16", "BF16", "SAFETENSORS"):
            assert bits >= 16, f.name
        else:
            assert 2 < bits < 16, f.name
