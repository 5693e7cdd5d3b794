"""Draft pairing (engine.draft_pairing): which local models can draft for a target.

On the real SmolLM2 files: the Q4_1 starter and its F16 copy draft for the F32 copy (the same model at
lower bit widths: self-speculation), smallest first; Gemma-3 (another vocabulary) never does; files
at least as large as the target, the target itself and unreadable files are not candidates.
"""

from __future__ import annotations

import pytest

from engine.draft_pairing import compatibility_problem, draft_candidates
from engine.tokenizer import Tokenizer
from models.formats.gguf import open_gguf
from tests.conftest import TEST_MODELS
from tests.engine.spec_models import float_copy
from tests.engine.tiny_models import TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def smollm2_family(smollm2_path):
    """(F32 copy, F16 copy, Q4_1 starter) of SmolLM2-135M-Instruct."""
    spec_dir = TEST_MODELS / "spec"
    return float_copy(smollm2_path, "F32", spec_dir), float_copy(smollm2_path, "F16", spec_dir), smollm2_path


def test_compatible_models_listed_smallest_first(smollm2_family, gemma3_path, tmp_path):
    f32, f16, q4_1 = smollm2_family
    junk = tmp_path / "broken.gguf"
    junk.write_bytes(b"GGUF" + bytes(64))  # a .gguf that does not parse
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    found = draft_candidates(f32, [f16, gemma3_path, f32, junk, notes, q4_1])
    assert [c.path for c in found] == [q4_1, f16]
    assert [c.quantization for c in found] == ["Q4_1", "F16"]
    assert all(c.same_model for c in found), "lower-bit quants of the target are self-speculation drafts"
    assert found[0].size_bytes == q4_1.stat().st_size < found[1].size_bytes == f16.stat().st_size
    assert gemma3_path.stat().st_size < f32.stat().st_size  # excluded for its vocabulary, not its size


def test_models_not_smaller_than_the_target_are_not_drafts(smollm2_family):
    f32, f16, q4_1 = smollm2_family
    assert draft_candidates(q4_1, [f16, f32]) == []
    assert [c.path for c in draft_candidates(f16, [f32, q4_1])] == [q4_1]


def test_unreadable_target_has_no_candidates(smollm2_family, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(100))
    assert draft_candidates(bad, [smollm2_family[2]]) == []


def test_other_vocabulary_is_a_problem(smollm2_path, tmp_path):
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny, TinySpec())
    smol = Tokenizer.from_gguf_metadata(open_gguf(smollm2_path).metadata)
    other = Tokenizer.from_gguf_metadata(open_gguf(tiny).metadata)
    problem = compatibility_problem(smol, other, 49152, other.vocab_size)
    assert problem is not None and "vocabulary" in problem
    assert compatibility_problem(smol, smol, 49152, 49152) is None


def test_same_size_vocabularies_must_match_token_by_token(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    md = open_gguf(path).metadata
    base = Tokenizer.from_gguf_metadata(md)
    rows = base.vocab_size

    swapped = dict(md)
    tokens = list(md["tokenizer.ggml.tokens"])
    tokens[65], tokens[66] = tokens[66], tokens[65]
    swapped["tokenizer.ggml.tokens"] = tokens
    problem = compatibility_problem(base, Tokenizer.from_gguf_metadata(swapped), rows, rows)
    assert problem is not None and "token texts differ" in problem

    other_eos = dict(md)
    other_eos["tokenizer.ggml.eos_token_id"] = 256
    problem = compatibility_problem(base, Tokenizer.from_gguf_metadata(other_eos), rows, rows)
    assert problem is not None and "special tokens" in problem

    problem = compatibility_problem(base, base, rows, rows + 64)  # padded embedding rows
    assert problem is not None and "scores" in problem


def test_tiny_draft_of_the_same_vocabulary_is_listed(tmp_path):
    target, draft, other = tmp_path / "target.gguf", tmp_path / "draft.gguf", tmp_path / "other.gguf"
    write_tiny_gguf(target, TinySpec(layers=4, seed=0))
    write_tiny_gguf(draft, TinySpec(layers=1, seed=1))
    write_tiny_gguf(other, TinySpec(layers=1, seed=2, hidden=32, ffn=48))
    found = draft_candidates(target, [draft, other])
    assert [c.path for c in found] == [other, draft]  # both smaller than the target, smallest first
    assert not any(c.same_model for c in found)  # different files of no shared model name


def test_hearth_ls_drafts_for_lists_the_library_pairs(
    smollm2_family, gemma3_path, tmp_path, monkeypatch, capsys
):
    import json

    from engine.cli import main
    from models.library import Library

    monkeypatch.setenv("HEARTH_HOME", str(tmp_path))
    f32, f16, q4_1 = smollm2_family
    for p in (f16, q4_1, gemma3_path):
        Library().import_path(p)
    assert main(["ls", "--no-scan", "--drafts-for", str(f32), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["path"] for d in out["drafts"]] == [str(q4_1), str(f16)]
    assert main(["ls", "--no-scan", "--drafts-for", str(q4_1)]) == 0
    assert "no local model can draft" in capsys.readouterr().out
