"""GGUF -> Hugging Face folder export on the real starter models, loaded back through engine/hf_repo.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.loader import load_model
from tests.engine.quant_fixtures import cached_conversion

TEXT = "The lighthouse stood on a low island of black rock, and in winter the sea turned grey."


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    return cached_conversion(smollm2_path, "safetensors")


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_path):
    return cached_conversion(gemma3_path, "safetensors")


def _logits(path, text=TEXT):
    m = load_model(path)
    ids = m.tokenizer.encode(text, add_special=True)
    cache = m.model.new_cache(len(ids))
    return m, ids, m.model.forward(ids, cache, all_logits=True).copy()


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_export_loads_back_with_same_tokens_and_logits(which, request):
    src = request.getfixturevalue(f"{which}_path")
    folder = request.getfixturevalue(f"{which}_hf")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / f).is_file()
    m0, ids0, l0 = _logits(src)
    m1, ids1, l1 = _logits(folder)
    assert ids1 == ids0
    assert m1.tokenizer.decode(ids1) == m0.tokenizer.decode(ids0)
    # F16 export of already-quantized weights: only F16 rounding separates the two
    scale = np.abs(l0).max()
    assert np.abs(l1 - l0).max() < 0.01 * scale
    assert (l1.argmax(-1) == l0.argmax(-1)).mean() > 0.9


def test_export_keeps_chat_template_and_ties(smollm2_path, smollm2_hf):
    cfg = json.loads((smollm2_hf / "config.json").read_text())
    tok = json.loads((smollm2_hf / "tokenizer_config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert "im_start" in tok["chat_template"]
    m = load_model(smollm2_hf)
    assert m.template is not None
    rendered = m.template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert "<|im_start|>user" in rendered


def test_export_undoes_gguf_conventions(gemma3_path, gemma3_hf):
    from models.formats.gguf import open_gguf
    from models.formats.safetensors import open_safetensors_repo

    st = open_safetensors_repo(gemma3_hf)
    g = open_gguf(gemma3_path)
    hf_norm = np.array(st.array("model.layers.0.input_layernorm.weight"), np.float32)
    gguf_norm = g.tensors["blk.0.attn_norm.weight"].array()
    np.testing.assert_allclose(hf_norm + 1.0, gguf_norm, rtol=0, atol=1e-6)  # HF stores w, GGUF 1 + w
