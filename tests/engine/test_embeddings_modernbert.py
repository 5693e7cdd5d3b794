"""ModernBERT encoders (engine/arch/modernbert.py) against goldens from transformers' ModernBertModel.

tests/fixtures/tiny/modernbert-embed (scripts/make_tiny_checkpoints.py modernbert-embed) is a 3-layer
ModernBertModel (layer 0 global, layers 1 and 2 windowed to 4 tokens either side, two rotary bases, GeGLU)
with a byte-level BPE tokenizer.json ([CLS] $A [SEP]) and mean pooling; embedding_golden.json holds each
text's ids and pools, one text longer than the window.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import embed
from engine.errors import EmbeddingOnlyModelError, ModelFormatError, UnsupportedArchitectureError
from engine.loader import load_model

MODERNBERT = Path(__file__).parents[1] / "fixtures" / "tiny" / "modernbert-embed"
TOL = 2e-5


def golden() -> dict:
    return json.loads((MODERNBERT / "embedding_golden.json").read_text())


def unit(rows) -> np.ndarray:
    x = np.asarray(rows, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def max_error(model, pooling: str = "mean") -> float:
    g = golden()
    return max(np.abs(embed.pool(model.hidden_states(ids), pooling) - np.asarray(want)).max()
               for ids, want in zip(g["ids"], g[pooling]))


@pytest.fixture(scope="module")
def modernbert():
    return load_model(MODERNBERT)


def test_modernbert_folder_matches_transformers(modernbert):
    g = golden()
    cfg = modernbert.model.cfg
    assert cfg.sliding == (False, True, True) and cfg.window == 4
    assert modernbert.embedding.pooling == "mean" and modernbert.embedding.encoder_only
    assert [modernbert.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    assert max(len(x) for x in g["ids"]) > 2 * cfg.window + 1  # the window cuts the longer texts
    assert max_error(modernbert.model, "mean") < TOL and max_error(modernbert.model, "cls") < TOL
    vectors, _ = embed.embed_texts(modernbert, g["texts"])
    assert np.abs(vectors - unit(g["mean"])).max() < TOL
    with pytest.raises(EmbeddingOnlyModelError):
        modernbert.model.forward([1, 2], modernbert.model.new_cache(8))


def test_window_and_geglu_mutations_miss_the_golden(modernbert, monkeypatch):
    from engine.arch import modernbert as arch
    from engine.arch.encoder import attend_segments

    def no_window(q, k, v, starts, window=0):
        return attend_segments(q, k, v, starts)

    monkeypatch.setattr(arch, "attend_segments", no_window)  # every layer global
    assert max_error(modernbert.model) > 0.05
    monkeypatch.undo()
    monkeypatch.setattr(arch, "gelu_erf_fast", lambda x: np.maximum(x, 0, out=x))  # ReGLU for GeGLU
    assert max_error(modernbert.model) > 0.05
    monkeypatch.undo()
    assert max_error(modernbert.model) < TOL


def test_batched_modernbert_pass_equals_one_at_a_time(modernbert):
    g = golden()
    for ids, rows in zip(g["ids"], modernbert.model.hidden_states_batch(g["ids"])):
        assert np.abs(rows - modernbert.model.hidden_states(ids)).max() < 1e-5


@pytest.mark.parametrize("change", [{"hidden_activation": "silu"}, {"mlp_bias": True}, {"norm_bias": True}])
def test_modernbert_variants_hearth_does_not_compute_are_refused(change, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(MODERNBERT, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelFormatError, match=next(iter(change))):
        load_model(folder)


def test_modernbert_conversion_is_refused_and_fit_knows_it(tmp_path):
    from engine.cli import main
    from engine.convert import convert
    from models.fit import local_sizes
    from models.library import inspect_model

    with pytest.raises(UnsupportedArchitectureError):
        convert(MODERNBERT, "F32", tmp_path / "m.gguf")
    assert main(["convert", str(MODERNBERT), "--to", "F32", "-o", str(tmp_path / "m.gguf")]) == 1
    assert inspect_model(MODERNBERT).architecture == "modernbert"
    assert local_sizes(MODERNBERT)[1] == 0
