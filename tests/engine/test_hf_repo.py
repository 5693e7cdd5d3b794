"""Hugging Face safetensors folders, per family, against tiny checkpoints made by transformers.

tests/fixtures/tiny/<family>/ come from scripts/make_tiny_checkpoints.py (random weights written by
transformers, golden logits and greedy tokens computed by transformers on the folder as written).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.errors import MissingTensorError, ModelFormatError, UnsupportedArchitectureError
from engine.generate import GenerationParams, generate
from engine.loader import load_model
from models.resolve import resolve_model
from tests.engine.model_checks import greedy_tokens

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
FAMILIES = sorted(p.name for p in TINY.iterdir() if (p / "golden.json").is_file())


def _golden(family: str) -> dict:
    return json.loads((TINY / family / "golden.json").read_text())


def test_every_family_has_a_fixture():
    dense = {"llama", "llama3-scaled", "mistral", "smollm3", "granite", "granite4", "glm4", "olmo2", "qwen2"}
    dense |= {"granite4-h", "nemotron_h"}
    dense |= {"qwen3", "qwen3_5"}
    dense |= {"phi3", "ernie4_5", "olmo3", "exaone4", "seed_oss", "lfm2", "ministral3"}
    dense |= {"cohere", "cohere2"}
    dense |= {"gemma2", "gemma3", "gemma3-mm", "ministral3-mm", "gemma4", "gemma4-mm", "gemma3n"}
    moe = {"qwen2moe", "qwen3moe", "qwen3_5_moe", "qwen3_next", "glm4moe", "lfm2moe", "mixtral", "gpt-oss"}
    moe |= {"gpt-oss-bf16"}
    moe |= {"gemma4-moe", "granite4-h-moe"}
    moe |= {"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "ernie4_5_moe"}
    assert dense | moe <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(family):
    golden = _golden(family)
    lm = load_model(TINY / family)
    ref = np.array(golden["logits"])
    logits = lm.model.forward(golden["tokens"], lm.model.new_cache(64), all_logits=True)
    assert np.abs(logits - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    assert np.array_equal(logits.argmax(1), ref.argmax(1))
    # greedy through the decode path (one token per step through the KV cache); the reference
    # samples from all embedding rows, including those past the tiny tokenizer's vocabulary
    assert greedy_tokens(lm.model, golden["tokens"], len(golden["greedy"])) == golden["greedy"]


def test_padded_vocabulary_rows_are_never_sampled():
    lm = load_model(TINY / "qwen2")
    assert lm.model.cfg.vocab_size > lm.tokenizer.vocab_size
    params = GenerationParams(max_tokens=24, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    events = list(generate(lm.model, lm.tokenizer, [5, 17, 42], lm.model.new_cache(64), params))
    assert all(e.token < lm.tokenizer.vocab_size for e in events)


def test_tokenizer_and_chat_template_come_from_the_folder():
    lm = load_model(TINY / "qwen2")
    text = lm.template.render([{"role": "user", "content": "hi there"}])
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ids = lm.tokenizer.encode(text)
    assert lm.tokenizer.decode(ids) == text
    assert lm.tokenizer.encode("<|im_end|>")[0] in lm.tokenizer.eot_ids
    assert resolve_model(str(TINY / "qwen2")) == TINY / "qwen2"


def _copy(family: str, tmp_path: Path) -> Path:
    dest = tmp_path / family
    shutil.copytree(TINY / family, dest)
    return dest


@pytest.mark.parametrize("kind", ["jinja", "json"])
def test_a_chat_template_in_its_own_file_is_used(tmp_path, kind):
    """Folders saved by recent transformers (gpt-oss, Qwen3, Gemma 3 releases) keep the template in
    chat_template.jinja (or .json) and not in tokenizer_config.json; the file wins, as in transformers,
    for the model and for a GGUF conversion."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    folder = _copy("qwen2", tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "stale {{ messages[0]['content'] }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = "[{{ messages[0]['role'] }}] {{ messages[0]['content'] }}"
    if kind == "jinja":
        (folder / "chat_template.jinja").write_text(template)
    else:
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    lm = load_model(folder)
    assert lm.template.render([{"role": "user", "content": "hi"}]) == "[user] hi"
    out = convert(folder, "F16", tmp_path / "q.gguf")
    assert open_gguf(out.output).metadata["tokenizer.chat_template"] == template


def test_missing_shard(tmp_path):
    folder = _copy("phi3", tmp_path)
    (folder / "model-00003-of-00008.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="00003"):
        load_model(folder)


def test_mismatched_shapes(tmp_path):
    folder = _copy("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MissingTensorError, match="ffn_gate.weight.*expected"):
        load_model(folder)


def test_missing_tensor(tmp_path):
    folder = _copy("llama", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(MissingTensorError, match="blk.1.ffn_up.weight"):
        load_model(folder)


def test_unsupported_family(tmp_path):
    folder = _copy("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(config))
    match = "mamba.*supported: cohere, cohere2, deepseek_v2, deepseek_v3, ernie4_5, ernie4_5_moe, exaone4, "
    with pytest.raises(UnsupportedArchitectureError, match=match):
        load_model(folder)


def test_unsupported_dtype(tmp_path):
    folder = _copy("llama", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = np.zeros(tensors[name].shape, np.int8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelFormatError, match="I8.*F32, F16 and BF16"):
        load_model(folder)


def test_missing_tokenizer_and_bad_config(tmp_path):
    folder = _copy("llama", tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        load_model(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="config.json.*JSON"):
        load_model(folder)


def _spm_tokenizer_json(path: Path, prefix: bool) -> None:
    """A SentencePiece-style tokenizer.json as HF writes Llama 2 / Mistral ones: U+2581 for spaces,
    <0xXX> byte fallback, Replace/ByteFallback/Fuse decoders (written with the tokenizers library)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = [
        "▁",
        "H",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "ü",
        "ll",
        "He",
        "Hell",
        "Hello",
        "▁w",
        "▁wor",
        "▁world",
        "or",
    ]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = [
        ("l", "l"),
        ("H", "e"),
        ("He", "ll"),
        ("Hell", "o"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("▁wor", "l"),
        ("▁worl", "d"),
    ]
    vocab["▁worl"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    steps = [normalizers.Replace(" ", "▁")]
    if prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path))


@pytest.mark.parametrize("prefix", [False, True])
def test_sentencepiece_style_tokenizer_json(tmp_path, prefix):
    from tokenizers import Tokenizer as HFTokenizer

    from engine.tokenizer import StreamDecoder

    folder = _copy("llama", tmp_path)
    _spm_tokenizer_json(folder / "tokenizer.json", prefix)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    lm = load_model(folder)
    reference = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    text = "Hello world ü €"  # € is not in the vocabulary: three byte-fallback pieces
    ids = lm.tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert [lm.tokenizer.token_text(i) for i in ids[-3:]] == ["<0xE2>", "<0x82>", "<0xAC>"]
    assert lm.tokenizer.decode(ids) == text
    stream = StreamDecoder(lm.tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert lm.tokenizer.eos_id == 2 and 2 in lm.tokenizer.eot_ids


def test_unknown_tokenizer_kind(tmp_path):
    folder = _copy("llama", tmp_path)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    from engine.tokenizer import UnsupportedTokenizer

    with pytest.raises(UnsupportedTokenizer, match="WordPiece"):
        load_model(folder)


def test_completion_keeps_the_space_a_chat_reply_drops(tmp_path):
    """With add_space_prefix, "▁world" continues "Hello" as " world" but opens a reply as "world"."""
    from engine.kv_cache import KVCache

    folder = _copy("llama", tmp_path)
    _spm_tokenizer_json(folder / "tokenizer.json", prefix=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = load_model(folder).tokenizer
    world = tok.encode("world")[0]
    assert tok.token_text(world) == "▁world"

    class OneWord:
        def forward(self, tokens, cache, all_logits=False):
            cache.advance(tokens)
            logits = np.zeros((1, tok.vocab_size), np.float32)
            logits[0, world if cache.offset == len(prompt) else tok.eos_id] = 1.0
            return logits

    params = GenerationParams(max_tokens=4, temperature=0)
    prompt = tok.encode("Hello")
    text = "".join(e.text for e in generate(OneWord(), tok, prompt, KVCache(1, 1, 2, 16), params))
    assert text == " world"
    prompt = [*tok.encode("Hello"), tok.bos_id]  # ends on a control token: a new turn
    text = "".join(e.text for e in generate(OneWord(), tok, prompt, KVCache(1, 1, 2, 16), params))
    assert text == "world"


def test_yarn_scaling_survives_conversion_to_gguf(tmp_path):
    """A YaRN folder (qwen3-yarn: 4x over 64 trained positions) converts to a GGUF that carries llama.cpp's
    rope.scaling keys and gives transformers' logits again."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden("qwen3-yarn")
    out = convert(TINY / "qwen3-yarn", "F32", tmp_path / "yarn.gguf").output
    with open_gguf(out) as g:
        md = g.metadata
        assert md["qwen3.rope.scaling.type"] == "yarn" and md["qwen3.rope.scaling.factor"] == 4.0
        assert md["qwen3.rope.scaling.original_context_length"] == 64
        assert abs(md["qwen3.rope.scaling.attn_factor"] - (0.1 * np.log(4.0) + 1)) < 1e-6
    lm = load_model(out)
    ref = np.array(golden["logits"])
    logits = lm.model.forward(golden["tokens"], lm.model.new_cache(64), all_logits=True)
    assert np.abs(logits - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_gemma2_converts_to_a_llama_cpp_style_gguf(tmp_path):
    """Gemma 2 (soft-capped attention and logits, every other layer windowed, no q/k norms) converts to a
    GGUF with llama.cpp's gemma2 keys that gives transformers' logits and greedy tokens again."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden("gemma2")
    out = convert(TINY / "gemma2", "F32", tmp_path / "g2.gguf").output
    with open_gguf(out) as g:
        md = g.metadata
        assert g.architecture == "gemma2" and md["gemma2.attn_logit_softcapping"] == 50.0
        assert md["gemma2.final_logit_softcapping"] == 30.0 and md["gemma2.attention.sliding_window"] == 4
        assert "blk.0.attn_q_norm.weight" not in g.tensors
    m = load_model(out).model
    assert [layer.sliding for layer in m.layers] == [True, False] and m.layers[0].q_norm is None
    ref = np.array(golden["logits"])
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    assert np.abs(logits - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    assert greedy_tokens(m, golden["tokens"], len(golden["greedy"])) == golden["greedy"]


def test_longrope_past_the_original_context_and_from_gguf(tmp_path):
    """LongRoPE with partial rotary (the phi3-longrope fixture, Phi-4-mini's scheme): a cache past the 64
    trained positions takes the long factors, as transformers does for a sequence that long; a GGUF laid
    out as llama.cpp writes Phi-3 (fused qkv and gate|up, rope_factors_long/short tensors, the attention
    factor in rope.scaling.attn_factor) gives the same logits."""
    from engine.hf_repo import HFWeights, config_from_hf, read_json
    from engine.quant.gguf_writer import GGUFWriter
    from engine.quant.hf_meta import metadata_from_hf
    from models.formats.safetensors import open_safetensors_repo

    golden = _golden("phi3-longrope")
    folder = TINY / "phi3-longrope"
    m = load_model(folder).model
    assert m.cfg.rotary_dim == 12 and m.rope_mscale != 1
    long = m.forward(golden["long_tokens"], m.new_cache(96), all_logits=True)
    ref = np.array(golden["long_logits"])
    assert np.abs(long - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    # the same model as a GGUF
    config = read_json(folder / "config.json")
    cfg = config_from_hf(folder, config)
    st = open_safetensors_repo(folder)
    names = HFWeights(st, folder, "phi3").names
    md = metadata_from_hf(folder, config, cfg)
    s = cfg.rope_scaling
    tensors = {g: np.ascontiguousarray(st.array(hf), np.float32) for g, hf in names.items()}
    tensors["rope_factors_short.weight"] = np.array(s.short_factor, np.float32)
    tensors["rope_factors_long.weight"] = np.array(s.long_factor, np.float32)
    md.pop("phi3.rope.scaling.type", None)  # llama.cpp's Phi-3 files say LongRoPE with the tensors only
    path = tmp_path / "phi3.gguf"
    with open(path, "wb") as fh:
        w = GGUFWriter(fh, md, [(n, 0, t.shape) for n, t in tensors.items()])
        w.write_header()
        for n, t in tensors.items():
            w.write_tensor(n, t.view(np.uint8).reshape(-1))
        w.finish()
    st.close()
    g = load_model(path).model
    assert g.cfg.rope_scaling.kind == "longrope" and g.cfg.rotary_dim == 12
    short = g.forward(golden["tokens"], g.new_cache(64), all_logits=True)
    np.testing.assert_allclose(short, np.array(golden["logits"]), atol=1e-4 * max(1.0, np.abs(ref).max()))
    np.testing.assert_allclose(g.forward(golden["long_tokens"], g.new_cache(96), all_logits=True), long,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config,windows", [
    ({"model_type": "mistral", "sliding_window": 4096}, [4096, 4096, 4096]),  # Mistral v0.1: every layer
    ({"model_type": "mistral", "sliding_window": None}, [None, None, None]),  # v0.2 and later
    ({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}, [None, None, None]),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1},
     [None, 64, 64]),
    ({"model_type": "gpt_oss", "sliding_window": 128}, [128, None, 128]),
    ({"model_type": "gpt_oss", "sliding_window": 128,
      "layer_types": ["full_attention", "sliding_attention", "full_attention"]}, [None, 128, None]),
])
def test_sliding_windows_from_config_json(config, windows):
    from engine.hf_repo import config_from_hf

    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
            "vocab_size": 320}
    if config["model_type"] == "gpt_oss":
        base |= {"num_local_experts": 4, "num_experts_per_tok": 2}
    cfg = config_from_hf(Path("x"), base | config)
    assert [cfg.window(i) for i in range(3)] == windows


def test_a_sliding_window_survives_conversion_to_gguf(tmp_path):
    """Mistral v0.1's window (the mistral-swa fixture, 4 on every layer) in llama.attention.sliding_window."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden("mistral-swa")
    out = convert(TINY / "mistral-swa", "F32", tmp_path / "swa.gguf")
    assert open_gguf(out.output).metadata["llama.attention.sliding_window"] == 4
    m = load_model(out.output).model
    assert [m.cfg.window(i) for i in range(2)] == [4, 4]
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())


def test_smollm3_leaves_rope_out_of_every_fourth_layer_in_gguf_too(tmp_path):
    """SmolLM3 (the fixture: 4 layers, the last without RoPE) as llama.cpp converts it: a "smollm3" GGUF with
    q/k permuted for GGML's adjacent-pair RoPE and no key for the NoPE layers (llama.cpp fixes every
    fourth); a folder whose layers differ from that cannot be written."""
    from engine.convert import convert
    from engine.errors import ModelFormatError
    from models.formats.gguf import open_gguf

    golden = _golden("smollm3")
    folder = load_model(TINY / "smollm3").model
    assert folder.cfg.rope_layers == (True, True, True, False)
    out = convert(TINY / "smollm3", "F32", tmp_path / "s3.gguf").output
    assert open_gguf(out).architecture == "smollm3"
    m = load_model(out).model
    assert m.cfg.rope_layers == (True, True, True, False) and not m.cfg.rope_neox
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())
    # the fused draft step rotates every layer: it declines the model (the layered path drafts instead)
    from engine.backends.cpu.draft import DraftForward

    q8 = load_model(convert(TINY / "smollm3", "Q8_0", tmp_path / "s3q8.gguf").output).model
    assert DraftForward.build(q8) is None
    q8.cfg.rope_layers = None
    assert DraftForward.build(q8) is not None
    shutil.copytree(TINY / "smollm3", tmp_path / "odd")
    config = json.loads((tmp_path / "odd" / "config.json").read_text())
    config["no_rope_layers"] = [1, 0, 1, 1]
    (tmp_path / "odd" / "config.json").write_text(json.dumps(config))
    assert load_model(tmp_path / "odd").model.cfg.rope_layers == (True, False, True, True)
    with pytest.raises(ModelFormatError, match="RoPE on layers"):
        convert(tmp_path / "odd", "F16", tmp_path / "odd.gguf")


def test_granite_constants_survive_conversion_to_gguf(tmp_path):
    """Granite's four multipliers under llama.cpp's keys (granite.embedding_scale, residual_scale,
    attention.scale, logit_scale) in a "granite" GGUF with permuted q/k; CUDA and the fused draft step
    decline the model (CPU with a notice; the layered draft path)."""
    from engine.backends.cpu.draft import DraftForward
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden("granite")
    out = convert(TINY / "granite", "F32", tmp_path / "g.gguf").output
    md = open_gguf(out).metadata
    assert md["general.architecture"] == "granite"
    keys = ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")
    got = [md[f"granite.{k}"] for k in keys]
    assert got == pytest.approx([6.0, 0.3, 0.15, 4.0])  # float32 keys
    m = load_model(out).model
    assert m.cfg.scaled and not m.cfg.rope_neox
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())
    q8 = load_model(convert(TINY / "granite", "Q8_0", tmp_path / "q8.gguf").output).model
    assert DraftForward.build(q8) is None
    q8.cfg.embedding_multiplier = q8.cfg.residual_multiplier = q8.cfg.logits_scaling = 1.0
    q8.cfg.attention_multiplier = 0.0
    assert DraftForward.build(q8) is not None


def test_glm4_converts_to_llama_cpps_layout(tmp_path):
    """GLM-4 as llama.cpp writes it: post_attention_norm / post_ffw_norm for the branch outputs beside
    ffn_norm, a fused ffn_up of gate then up rows, q/k as HF keeps them (GLM-4 rotates adjacent pairs of
    the first half of each head itself), rope.dimension_count the rotated half. CUDA and the fused draft step
    decline the model."""
    from engine.backends.cpu.draft import DraftForward
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden("glm4")
    out = convert(TINY / "glm4", "F32", tmp_path / "glm4.gguf").output
    g = open_gguf(out)
    assert g.architecture == "glm4" and g.metadata["glm4.rope.dimension_count"] == 8
    names = set(g.tensors)
    assert {f"blk.1.{n}.weight" for n in ("post_attention_norm", "post_ffw_norm", "ffn_norm")} <= names
    assert tuple(g.tensors["blk.1.ffn_up.weight"].shape) == (2 * 96, 64)
    assert "blk.1.ffn_gate.weight" not in names
    m = load_model(out).model
    assert not m.cfg.rope_neox and m.cfg.rotary_dim == 8
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())
    q8 = load_model(convert(TINY / "glm4", "Q8_0", tmp_path / "q8.gguf").output).model
    assert DraftForward.build(q8) is None


def test_glm4_vocabularies_never_get_a_bos():
    """llama.cpp's "glm4" pre-tokenizer: Llama 3's split, and no BOS whatever add_bos_token says (the chat
    template writes [gMASK]<sop>)."""
    from engine.tokenizer import Tokenizer
    from tests.engine.test_tokenizer import synthetic_metadata

    tok = Tokenizer.from_gguf_metadata(synthetic_metadata("glm4", **{"tokenizer.ggml.add_bos_token": True}))
    assert not tok.add_bos
    assert tok.pre_tokenize("I'M 12345") == ["I", "'M", " ", "123", "45"]


def test_olmo2_norms_only_branch_outputs_also_in_gguf(tmp_path):
    """OLMo 2 as llama.cpp writes it: no attn_norm / ffn_norm, post_attention_norm and post_ffw_norm after
    the branches, attn_q_norm / attn_k_norm over the whole projections; AWQ (which folds into the missing
    norms) refuses it with a typed error."""
    from engine.convert import convert
    from engine.errors import UnsupportedArchitectureError
    from models.formats.gguf import open_gguf

    golden = _golden("olmo2")
    folder = load_model(TINY / "olmo2").model
    layer = folder.layers[0]
    assert layer.attn_norm is None and layer.ffn_norm is None and layer.post_ffn_norm is not None
    assert layer.q_norm.shape == (folder.cfg.q_dim,) and layer.k_norm.shape == (folder.cfg.kv_dim,)
    out = convert(TINY / "olmo2", "F32", tmp_path / "o2.gguf").output
    g = open_gguf(out)
    assert g.architecture == "olmo2" and "blk.0.attn_norm.weight" not in g.tensors
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(g.tensors)
    assert "olmo2.attention.sliding_window" not in g.metadata
    g.close()
    m = load_model(out).model
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())
    with pytest.raises(UnsupportedArchitectureError, match="AWQ folds"):
        convert(TINY / "olmo2", "awq", tmp_path / "awq.gguf")


def test_olmo3_windows_and_per_layer_rope_survive_conversion(tmp_path):
    """OLMo 3 (the fixture: a window of 4 on three layers of four, YaRN on the full layer only) as llama.cpp
    writes it: an olmo2 GGUF with attention.sliding_window, its layers implied (three of four windowed), the
    windowed layers rotating with plain RoPE. RoPE settings per layer type other than that are refused."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden("olmo3")
    out = convert(TINY / "olmo3", "F32", tmp_path / "o3.gguf").output
    md = open_gguf(out).metadata
    assert md["general.architecture"] == "olmo2" and md["olmo2.attention.sliding_window"] == 4
    assert md["olmo2.rope.scaling.type"] == "yarn"
    m = load_model(out).model
    assert [m.cfg.window(i) for i in range(4)] == [4, 4, 4, None] and m.cfg.window_rope_unscaled
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())
    folder = _copy("olmo3", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 10000.0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="per layer type"):
        load_model(folder)


def test_ernie4_5_in_gguf_and_ffn_biases_refused(tmp_path):
    """ERNIE 4.5 (dense) as llama.cpp writes it: an "ernie4_5" GGUF with q/k as HF keeps them (adjacent-pair
    RoPE); a config asking for biases on every linear (use_bias, or a llama's mlp_bias) is refused, not run
    without them."""
    from engine.convert import convert

    golden = _golden("ernie4_5")
    out = convert(TINY / "ernie4_5", "F32", tmp_path / "e.gguf").output
    m = load_model(out).model
    assert m.cfg.architecture == "ernie4_5" and not m.cfg.rope_neox
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())
    for family, key in (("ernie4_5", "use_bias"), ("llama", "mlp_bias")):
        folder = _copy(family, tmp_path / family)
        config = json.loads((folder / "config.json").read_text())
        config[key] = True
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedArchitectureError, match="FFN biases"):
            load_model(folder)


def test_exaone4_windows_and_rope_only_in_windowed_layers_in_gguf(tmp_path):
    """EXAONE 4 (the fixture: norms of the branch outputs only, per-head q/k norms, a window of 4 on three
    layers of four, RoPE only in those) as an exaone4 GGUF with attention.sliding_window; a config giving
    only sliding_window_pattern ("LLLG" or 4) reads the same."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden("exaone4")
    out = convert(TINY / "exaone4", "F32", tmp_path / "ex.gguf").output
    assert open_gguf(out).metadata["exaone4.attention.sliding_window"] == 4
    m = load_model(out).model
    assert m.cfg.rope_layers == (True, True, True, False) and m.layers[0].attn_norm is None
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())
    for pattern in ("LLLG", 4):
        folder = _copy("exaone4", tmp_path / str(pattern))
        config = json.loads((folder / "config.json").read_text())
        del config["layer_types"]
        (folder / "config.json").write_text(json.dumps(config | {"sliding_window_pattern": pattern}))
        cfg = load_model(folder).model.cfg
        assert cfg.rope_layers == (True, True, True, False) and cfg.window(3) is None and cfg.window(0) == 4


def test_seed_oss_biases_survive_conversion(tmp_path):
    """Seed-OSS (the fixture with QKV and output biases) as a seed_oss GGUF, q/k as HF keeps them (NeoX)."""
    from engine.convert import convert

    golden = _golden("seed_oss")
    m = load_model(convert(TINY / "seed_oss", "F32", tmp_path / "s.gguf").output).model
    assert m.cfg.architecture == "seed_oss" and m.cfg.rope_neox and m.layers[0].bo is not None
    logits = m.forward(golden["tokens"], m.new_cache(64), all_logits=True)
    np.testing.assert_allclose(logits, np.array(golden["logits"]), atol=1e-4 * np.abs(golden["logits"]).max())


def test_ministral3_temperature_and_yarn_in_llama_cpps_mistral3_gguf(tmp_path):
    """Ministral 3 as llama.cpp writes it: a mistral3 GGUF with q/k permuted for adjacent-pair RoPE, the
    queries' temperature (attention.temperature_scale over YaRN's original context) and YaRN's
    mscale_all_dim as rope.scaling.yarn_log_multiplier; the file's logits are the folder's. Without the
    temperature the golden is off by logits (the fixture's original context is 4 positions)."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf
    from tests.engine.model_checks import rewrite_gguf

    golden = _golden("ministral3")
    ref = np.array(golden["logits"])
    out = convert(TINY / "ministral3", "F16", tmp_path / "m3.gguf").output
    g = open_gguf(out)
    md = dict(g.metadata)
    assert md["general.architecture"] == "mistral3"
    assert md["mistral3.attention.temperature_scale"] == pytest.approx(0.5)
    assert md["mistral3.rope.scaling.yarn_log_multiplier"] == 1.0
    assert md["mistral3.rope.scaling.original_context_length"] == 4
    g.close()
    # llama.cpp's own files carry no attn_factor: it comes from the log multiplier
    rewrite_gguf(out, tmp_path / "llama-cpp.gguf", drop_keys={"mistral3.rope.scaling.attn_factor"})
    for path in (out, tmp_path / "llama-cpp.gguf"):
        m = load_model(path).model
        assert not m.cfg.rope_neox
        assert (m.cfg.attn_temperature_beta, m.cfg.attn_temperature_length) == (0.5, 4)
        logits = m.forward(golden["tokens"], m.new_cache(32), all_logits=True)
        assert np.abs(logits - ref).max() < 1e-3 * np.abs(ref).max()
    m.cfg.attn_temperature_beta = 0.0
    logits = m.forward(golden["tokens"], m.new_cache(32), all_logits=True)
    assert np.abs(logits - ref).max() > 0.1 * np.abs(ref).max()


@pytest.mark.parametrize("family", ["gemma3-mm", "ministral3-mm"])
def test_multimodal_folders_run_and_convert_their_language_model(family, tmp_path):
    """A multimodal folder (vision tower beside the language model, as Gemma 3 4B+ and Ministral 3 ship):
    its language model runs (the golden test covers it) and converts to a text GGUF without the vision
    tensors; Gemma 3's explicit window layout (here a window on layer 0 only) travels as per-layer flags."""
    from engine.convert import convert
    from models.formats.gguf import open_gguf

    golden = _golden(family)
    ref = np.array(golden["logits"])
    out = convert(TINY / family, "F16", tmp_path / "text.gguf").output
    g = open_gguf(out)
    assert not [n for n in g.tensors if "vision" in n or "mm_" in n or "projector" in n]
    if family == "gemma3-mm":
        assert [bool(f) for f in g.metadata["gemma3.attention.sliding_window_pattern"]] == [True, False]
    g.close()
    m = load_model(out).model
    logits = m.forward(golden["tokens"], m.new_cache(32), all_logits=True)
    assert np.abs(logits - ref).max() < 1e-3 * np.abs(ref).max()


def test_multimodal_text_config_defaults_and_what_gguf_cannot_hold(tmp_path):
    """Google's Gemma 3 4B config gives only what differs from transformers' defaults (8 heads, 4 KV heads of
    256, a vocabulary of 262208); a Gemma whose score scale differs from head_dim cannot become a GGUF."""
    from engine.convert import convert
    from engine.hf_repo import config_from_hf
    from models.fit import kv_bytes_per_token_config

    google = {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    cfg = config_from_hf(tmp_path, google)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 256)
    assert (cfg.vocab_size, cfg.query_pre_attn_scalar, cfg.sliding_window) == (262_208, 256, 1024)
    assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 8.0
    assert kv_bytes_per_token_config(google) == 34 * 4 * 256 * 2 * 4
    with pytest.raises(ModelFormatError, match="query_pre_attn_scalar"):
        convert(TINY / "gemma3", "F16", tmp_path / "g3.gguf")


def test_granite4_micro_and_its_gguf_as_llama_cpp_writes_it(tmp_path):
    """Granite 4.0 without Mamba layers or experts (Granite-4.0-Micro's layout): Granite's multipliers over a
    fused "shared MLP", also one token at a time; converted, it is llama.cpp's granite GGUF with gate and up
    split. MoE members are refused with a message (the hybrid ones: test_granite4h.py)."""
    from engine.convert import convert
    from engine.hf_repo import config_from_hf
    from models.formats.gguf import open_gguf

    golden = _golden("granite4")
    ref = np.array(golden["logits"])
    m = load_model(TINY / "granite4").model
    cache = m.new_cache(32)
    rows = np.array([m.forward([t], cache)[0].copy() for t in golden["tokens"]])
    assert np.abs(rows - ref).max() < 1e-4 * np.abs(ref).max()
    out = convert(TINY / "granite4", "F16", tmp_path / "g4.gguf").output
    g = open_gguf(out)
    assert g.architecture == "granite" and g.metadata["granite.logit_scale"] == 2.0
    assert tuple(g.tensors["blk.0.ffn_gate.weight"].shape) == tuple(g.tensors["blk.0.ffn_up.weight"].shape)
    assert tuple(g.tensors["blk.0.ffn_up.weight"].shape) == (96, 64)
    g.close()
    m = load_model(out).model
    logits = m.forward(golden["tokens"], m.new_cache(32), all_logits=True)
    assert np.abs(logits - ref).max() < 1e-3 * np.abs(ref).max()
    config = json.loads((TINY / "granite4" / "config.json").read_text())
    for change, message in (({"layer_types": ["conv", "full_attention"]}, "layer types"),
                            ({"num_local_experts": 4}, "experts")):
        with pytest.raises(UnsupportedArchitectureError, match=message):
            config_from_hf(tmp_path, config | change)
