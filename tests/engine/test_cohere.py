"""Cohere's Command R7B / Command A (cohere2) and Command R (llama.cpp's command-r) against transformers.

The fixtures (tests/fixtures/tiny/cohere2, cohere) come from scripts/make_tiny_checkpoints.py: cohere2 has
four layers, a window of 4 on the first three (shorter than the golden's 16 tokens) which alone rotate, and a
logit_scale of 0.25; cohere norms q and k per head (Command R+'s use_qk_norm). Both split digits one by one
before their byte-level BPE (llama.cpp's command-r pre-tokenizer). test_hf_repo.py's golden test runs the
folders themselves; here the GGUF side.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.convert import convert
from engine.loader import load_model
from models.formats.gguf import open_gguf
from tests.engine.model_checks import greedy_tokens

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


def _golden(family: str) -> dict:
    return json.loads((TINY / family / "golden.json").read_text())


def _check_logits(model, golden: dict, atol_share: float = 1e-4) -> None:
    """Logits at every position within the golden tests' tolerance; the 8 greedy tokens through the cache."""
    ref = np.array(golden["logits"])
    logits = model.forward(golden["tokens"], model.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, ref, atol=atol_share * np.abs(ref).max())
    assert greedy_tokens(model, golden["tokens"], len(golden["greedy"])) == golden["greedy"]


def test_cohere2_folder_reads_transformers_config():
    """A window on three layers of four, RoPE (adjacent pairs) only there, one LayerNorm a layer (no FFN
    norm), layer_norm_eps (not the rms_norm_eps transformers leaves in the file), logit_scale, tied output."""
    m = load_model(TINY / "cohere2").model
    cfg = m.cfg
    assert cfg.architecture == "cohere2" and cfg.parallel_block and not cfg.rope_neox
    assert [cfg.window(i) for i in range(4)] == [4, 4, 4, None]
    assert cfg.rope_layers == (True, True, True, False)
    assert cfg.logit_scale == 0.25 and cfg.logits_scaling == 1.0 and cfg.rms_norm_eps == 1e-5
    assert all(layer.ffn_norm is None and layer.attn_norm is not None for layer in m.layers)
    assert m.output is m.token_embd


def test_cohere2_without_layer_types_takes_every_fourth_layer_global(tmp_path):
    folder = tmp_path / "c2"
    shutil.copytree(TINY / "cohere2", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["layer_types"]
    (folder / "config.json").write_text(json.dumps(config))
    cfg = load_model(folder).model.cfg
    assert cfg.rope_layers == (True, True, True, False)
    assert [cfg.window(i) for i in range(4)] == [4, 4, 4, None]


@pytest.mark.parametrize("family, arch", [("cohere2", "cohere2"), ("cohere", "command-r")])
def test_gguf_round_trip_matches_transformers(family, arch, tmp_path):
    """hearth convert writes llama.cpp's layout (its keys: layer_norm_epsilon, logit_scale, cohere2's
    attention.sliding_window with the layers implied; q/k as HF keeps them; no output.weight when tied; the
    command-r pre-tokenizer) and the GGUF reads back to transformers' logits and greedy tokens."""
    golden = _golden(family)
    out = convert(TINY / family, "F32", tmp_path / f"{family}.gguf").output
    gguf = open_gguf(out)
    md = gguf.metadata
    assert md["general.architecture"] == arch
    assert md[f"{arch}.logit_scale"] == pytest.approx(0.25 if family == "cohere2" else 0.125)
    assert md[f"{arch}.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert f"{arch}.attention.layer_norm_rms_epsilon" not in md
    assert md["tokenizer.ggml.pre"] == "command-r"
    assert "output.weight" not in gguf.tensors
    assert not any(".ffn_norm." in name for name in gguf.tensors)
    if family == "cohere2":
        assert md["cohere2.attention.sliding_window"] == 4
    else:
        assert "command-r.attention.sliding_window" not in md
    lm = load_model(out)
    folder = load_model(TINY / family).model.cfg
    cfg = lm.model.cfg
    for field in ("rope_layers", "sliding_window", "layer_types", "rope_neox", "head_dim", "rotary_dim"):
        assert getattr(cfg, field) == getattr(folder, field), field
    for field in ("logit_scale", "rms_norm_eps"):  # float32 keys
        assert getattr(cfg, field) == pytest.approx(getattr(folder, field)), field
    _check_logits(lm.model, golden)


def test_gguf_tokenizer_splits_digits_as_the_folders(tmp_path):
    """The GGUF's command-r pre-tokenizer (llama.cpp: each digit alone, then GPT-2's split) encodes as the
    folder's tokenizer.json (Digits(individual_digits) + ByteLevel) does. Merges of " 1" and "12" are added
    to the fixture's vocabulary so that GPT-2's split alone would encode differently."""
    folder = tmp_path / "c2"
    shutil.copytree(TINY / "cohere2", folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for piece in ("\u01201", "12"):  # the two added chat tokens move up past them
        vocab[piece] = len(vocab)
    for token in spec["added_tokens"]:
        token["id"] += 2
    spec["model"]["merges"] += [["\u0120", "1"], ["1", "2"]]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    hf_tok = load_model(folder).tokenizer
    gguf_tok = load_model(convert(folder, "F16", tmp_path / "t.gguf").output).tokenizer
    assert hf_tok.encode(" 12") == [vocab["\u0120"], vocab["1"], vocab["2"]]
    for text in ("I'M 12345 abc\n\n x", "the 2024 the3 9x 10.5% 12", "  in  the\tend 0012 <|im_end|>"):
        ids = hf_tok.encode(text)
        assert gguf_tok.encode(text) == ids
        assert gguf_tok.decode(ids) == text


def test_cohere2_quantized_gguf_stays_close(tmp_path):
    """Q8_0 (the matrices quantized, norms kept F32): logits within 3% of the range of transformers', the same
    argmax at most positions; the quantized file is smaller than the F32 one."""
    golden = _golden("cohere2")
    ref = np.array(golden["logits"])
    f32 = convert(TINY / "cohere2", "F32", tmp_path / "f32.gguf").output
    q8 = convert(TINY / "cohere2", "Q8_0", tmp_path / "q8.gguf").output
    types = {name: t.type_name for name, t in open_gguf(q8).tensors.items()}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.3.ffn_down.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert q8.stat().st_size < f32.stat().st_size
    m = load_model(q8).model
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    assert np.abs(logits - ref).max() < 0.03 * np.abs(ref).max()
    assert (logits.argmax(1) == ref.argmax(1)).mean() >= 0.8


def test_command_r_plus_norms_q_and_k_per_head_with_weights_per_head(tmp_path):
    """The cohere fixture has Command R+'s use_qk_norm: a LayerNorm of each head of q and k, with weights of
    (heads, head_dim), kept 2-D and F32 in the GGUF (llama.cpp's attn_q_norm / attn_k_norm), even at Q8_0."""
    m = load_model(TINY / "cohere").model
    assert m.layers[0].q_norm.shape == (m.cfg.q_dim,) and m.layers[0].k_norm.shape == (m.cfg.kv_dim,)
    out = convert(TINY / "cohere", "Q8_0", tmp_path / "q8.gguf").output
    info = open_gguf(out).tensors["blk.0.attn_q_norm.weight"]
    assert info.type_name == "F32" and info.shape == (4, 16)  # numpy order: (heads, head_dim)


def test_fused_draft_step_declines_cohere(tmp_path):
    """The fused approximate draft step has RMSNorm and sequential blocks only: it declines the model (the
    layered path drafts instead)."""
    from engine.backends.cpu.draft import DraftForward

    m = load_model(convert(TINY / "cohere", "Q8_0", tmp_path / "q8.gguf").output).model
    assert DraftForward.build(m) is None
