"""quant-report on the real SmolLM2: rows, deltas, JSON saved next to the model."""

from __future__ import annotations

import json

from engine.perplexity import load_text
from engine.quant_report import format_table, quant_report, report_path


def test_quant_report_small(smollm2_path, tmp_path):
    model = tmp_path / smollm2_path.name
    model.symlink_to(smollm2_path)
    text = tmp_path / "t.txt"
    text.write_text(load_text(None)[:2500], encoding="utf-8")
    report = quant_report(
        model, ("Q8_0", "Q4_0", "fp8"), text, ctx=128, stride=64, keep_dir=tmp_path / "keep"
    )
    saved = json.loads(report_path(model).read_text())
    assert saved["rows"] == report["rows"]
    rows = {r["format"]: r for r in report["rows"]}
    assert set(rows) == {"source", "Q8_0", "Q4_0", "fp8"}
    assert rows["source"]["delta_ppl_pct"] is None
    assert abs(rows["Q8_0"]["delta_ppl_pct"]) < abs(rows["Q4_0"]["delta_ppl_pct"])
    assert 8.4 < rows["Q8_0"]["bits_per_weight"] < 8.6  # every matrix Q8_0 (8.5 bits), norms F32
    assert rows["Q4_0"]["file_bytes"] < rows["Q8_0"]["file_bytes"]
    assert all(r["decode_tps"] > 0 for r in report["rows"])
    assert (tmp_path / "keep").is_dir() and len(list((tmp_path / "keep").glob("*.gguf"))) == 2
    # a safetensors format is measured from its folder: 8 bits per matrix weight + a scale per row,
    # the F16 embedding (tied) and F32 norms
    assert (tmp_path / "keep" / f"{model.name[:-5]}.fp8" / "config.json").is_file()
    assert 8.0 < rows["fp8"]["bits_per_weight"] < 11.0, rows["fp8"]
    assert abs(rows["fp8"]["delta_ppl_pct"]) < abs(rows["Q4_0"]["delta_ppl_pct"])
    assert "Q4_0" in format_table(report)
