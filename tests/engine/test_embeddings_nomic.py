"""nomic-bert encoders (engine/arch/nomic_bert.py) against goldens from transformers' NomicBertModel, and the
batched encoder pass (engine/arch/encoder.py) against one sequence at a time.

tests/fixtures/tiny/nomic-embed (scripts/make_tiny_checkpoints.py nomic-embed) is a 2-layer NomicBertModel
as transformers 5.25 saves it (nomic's own tensor names: Wqkv, fc11/fc12/fc2, norm1/norm2; transformers'
config.json), with a WordPiece tokenizer, a vocabulary padded past the tokenizer's and nomic-embed-text-v1.5's
sentence-transformers files (mean pooling). embedding_golden.json holds each text's ids and the mean, CLS and
last-token pools of last_hidden_state. The folder is also rewritten here in the other two layouts Hearth
reads (nomic's GPT-2-style config.json, transformers' q/k/v_proj names) and converted to llama.cpp's
nomic-bert GGUF (F32, Q8_0).
"""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine import embed
from engine.errors import EmbeddingOnlyModelError, ModelFormatError
from engine.loader import load_model

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"
NOMIC, BERT = TINY / "nomic-embed", TINY / "bert-embed"
TOL = 2e-5  # float32 sums in another order than PyTorch's


def golden(folder: Path = NOMIC) -> dict:
    return json.loads((folder / "embedding_golden.json").read_text())


def unit(rows) -> np.ndarray:
    x = np.asarray(rows, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def max_error(lm, pooling: str = "mean") -> float:
    g = golden()
    return max(np.abs(embed.pool(lm.model.hidden_states(ids), pooling) - np.asarray(want)).max()
               for ids, want in zip(g["ids"], g[pooling]))


@pytest.fixture(scope="module")
def nomic():
    return load_model(NOMIC)


@pytest.fixture(scope="module")
def nomic_gguf(tmp_path_factory):
    from engine.cli import main

    out = tmp_path_factory.mktemp("nomic") / "nomic-embed-F32.gguf"
    assert main(["convert", str(NOMIC), "--to", "F32", "-o", str(out)]) == 0
    return out


def nomic_layout(out: Path) -> Path:
    """The fixture as nomic-ai's repositories hold it: its GPT-2-style config.json (n_embd, n_layer, ...)
    beside the same tensors."""
    shutil.copytree(NOMIC, out)
    c = json.loads((NOMIC / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "model_type": "nomic_bert", "architectures": ["NomicBertModel"], "activation_function": "swiglu",
        "n_embd": c["hidden_size"], "n_head": c["num_attention_heads"], "n_inner": c["intermediate_size"],
        "n_layer": c["num_hidden_layers"], "n_positions": 8192, "max_trained_positions": 2048,
        "vocab_size": c["vocab_size"], "type_vocab_size": 2, "layer_norm_epsilon": c["layer_norm_eps"],
        "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None, "rotary_scaling_factor": None, "qkv_proj_bias": False,
        "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False, "causal": False,
    }))
    return out


def transformers_layout(out: Path) -> Path:
    """The fixture with transformers' own tensor names (self_attn.q/k/v/o_proj, mlp.gate/up/down_proj,
    post_attention_layernorm, post_mlp_layernorm, embeddings.LayerNorm)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(NOMIC, out)
    tensors = {}
    for name, t in load_file(str(NOMIC / "model.safetensors")).items():
        name = name.replace("encoder.layers.", "layers.").replace("emb_ln", "embeddings.LayerNorm")
        if name.endswith("attn.Wqkv.weight"):
            for part, rows in zip("qkv", np.split(t, 3)):
                tensors[name.replace("attn.Wqkv", f"self_attn.{part}_proj")] = np.ascontiguousarray(rows)
            continue
        for old, new in (("attn.out_proj", "self_attn.o_proj"), ("fc11", "up_proj"), ("fc12", "gate_proj"),
                         ("fc2", "down_proj"), ("norm1", "post_attention_layernorm"),
                         ("norm2", "post_mlp_layernorm")):
            name = name.replace(old, new)
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_nomic_folder_matches_transformers(nomic):
    g = golden()
    spec = nomic.embedding
    assert spec.pooling == "mean" and spec.encoder_only and spec.dedicated
    assert nomic.model.cfg.rope_theta == 1000.0 and nomic.model.cfg.max_position_embeddings == 2048
    assert [nomic.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    assert max(len(x) for x in g["ids"]) > 30  # rotary angles well past the first few positions
    assert max_error(nomic, "mean") < TOL and max_error(nomic, "cls") < TOL
    vectors, counts = embed.embed_texts(nomic, g["texts"])
    assert counts == [len(x) for x in g["ids"]]
    assert np.abs(vectors - unit(g["mean"])).max() < TOL
    assert embed.context_limit(nomic) == 2048  # max_seq_length 8192, but 2048 trained positions
    with pytest.raises(EmbeddingOnlyModelError):
        nomic.model.forward([2, 3], nomic.model.new_cache(8))


def test_rotary_and_swiglu_mutations_miss_the_golden(nomic, monkeypatch):
    from engine.arch import nomic_bert
    from engine.backends import cpu

    monkeypatch.setattr(nomic_bert.ops, "rope", lambda *args: None)  # no rotary embedding
    assert max_error(nomic) > 0.05
    monkeypatch.undo()

    def gelu_glu(out, gate, up):  # GELU in place of SiLU on the gate
        cpu.gelu_tanh_mul(out, gate, up)

    monkeypatch.setattr(nomic_bert.ops, "silu_mul", gelu_glu)
    assert max_error(nomic) > 0.05
    monkeypatch.undo()
    assert max_error(nomic) < TOL


@pytest.mark.parametrize("layout", [nomic_layout, transformers_layout])
def test_nomic_folder_layouts(layout, tmp_path):
    folder = layout(tmp_path / "nomic")
    lm = load_model(folder)
    assert lm.model.cfg.max_position_embeddings == 2048 and max_error(lm) < TOL


def test_converted_nomic_gguf_is_llama_cpp_layout(nomic_gguf):
    from gguf import GGUFReader

    g = golden()
    lm = load_model(nomic_gguf)
    assert lm.metadata["general.architecture"] == "nomic-bert" and lm.tokenizer.kind == "bert"
    assert lm.embedding.pooling == "mean" and lm.embedding.source == "nomic-bert.pooling_type"
    assert [lm.tokenizer.encode_embedding(t) for t in g["texts"]] == g["ids"]
    vectors, _ = embed.embed_texts(lm, g["texts"])
    assert np.abs(vectors - unit(g["mean"])).max() < TOL
    reader = GGUFReader(nomic_gguf)
    fields = reader.fields

    def value(key):
        return fields[key].parts[-1][0]

    assert int(value("nomic-bert.pooling_type")) == 1 and int(value("nomic-bert.context_length")) == 2048
    assert float(value("nomic-bert.rope.freq_base")) == 1000.0
    assert bool(value("nomic-bert.attention.causal")) is False
    assert int(value("tokenizer.ggml.token_type_count")) == 2
    vocab_field = fields["tokenizer.ggml.tokens"]
    tokens = [bytes(vocab_field.parts[i]).decode() for i in vocab_field.data]
    tensors = {t.name: t for t in reader.tensors}
    # llama.cpp reads the vocabulary's size as the embedding's rows: the converter pads it
    vocab = json.loads((NOMIC / "config.json").read_text())["vocab_size"]
    assert len(tokens) == vocab == int(tensors["token_embd.weight"].shape[-1])
    assert tokens[-1] == f"\u2581[PAD{vocab - 1}]" and tokens[2] == "[CLS]"
    assert {"token_embd.weight", "token_types.weight", "token_embd_norm.weight", "token_embd_norm.bias",
            "blk.1.attn_qkv.weight", "blk.1.attn_output.weight", "blk.1.attn_output_norm.bias",
            "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight", "blk.1.ffn_down.weight",
            "blk.1.layer_output_norm.weight"} <= set(tensors)
    assert not any("position_embd" in n or n.endswith("attn_q.weight") for n in tensors)
    assert list(tensors["blk.0.attn_qkv.weight"].shape) == [32, 96]  # gguf-py: (cols, rows)


def test_transformers_layout_converts_to_a_fused_qkv(tmp_path):
    from engine.cli import main

    out = tmp_path / "nomic.gguf"
    assert main(["convert", str(transformers_layout(tmp_path / "hf")), "--to", "F32", "-o", str(out)]) == 0
    lm = load_model(out)
    assert len(lm.model.layers[0].wqkv) == 1 and max_error(lm) < TOL


def test_quantized_nomic_gguf_stays_close(tmp_path):
    from engine.cli import main

    out = tmp_path / "nomic-Q8_0.gguf"
    assert main(["convert", str(NOMIC), "--to", "Q8_0", "-o", str(out)]) == 0
    g = golden()
    vectors, _ = embed.embed_texts(load_model(out), g["texts"])
    assert (vectors * unit(g["mean"])).sum(axis=1).min() > 0.999


@pytest.mark.parametrize("change", [
    {"activation_function": "gelu"}, {"prenorm": True}, {"rotary_emb_fraction": 0.5},
    {"moe_every_n_layers": 2}, {"qkv_proj_bias": True},
])
def test_nomic_variants_hearth_does_not_compute_are_refused(change, tmp_path):
    folder = nomic_layout(tmp_path / "nomic")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelFormatError) as e:
        load_model(folder)
    assert next(iter(change)) in str(e.value) or "mixture" in str(e.value)


@pytest.mark.parametrize("folder", [NOMIC, BERT])
def test_a_batched_pass_equals_one_sequence_at_a_time(folder):
    lm = load_model(folder)
    g = golden(folder)
    together = lm.model.hidden_states_batch(g["ids"])
    for ids, rows in zip(g["ids"], together):
        assert rows.shape == (len(ids), lm.model.cfg.hidden_size)
        assert np.abs(rows - lm.model.hidden_states(ids)).max() < 1e-5
    with pytest.raises(ValueError):
        lm.model.hidden_states_batch([g["ids"][0], []])


def test_inputs_are_batched_by_token_budget():
    ids = [[1] * 5, [1] * 3, [1] * 9, [1], [1] * 2]
    assert [[len(x) for x in group] for group in embed.batches(ids, 8)] == [[5, 3], [9], [1, 2]]
    assert [len(group) for group in embed.batches(ids, 0)] == [1, 1, 1, 1, 1]
    assert embed.batches([], 8) == []


def test_library_and_memory_estimates_know_encoders(nomic_gguf, tmp_path):
    from engine.hf_repo import config_from_hf
    from engine.memory_guard import kv_shape_from_config, kv_shape_from_gguf
    from models.fit import local_sizes
    from models.formats.gguf import open_gguf
    from models.library import inspect_model

    facts = inspect_model(nomic_gguf)
    assert facts.architecture == "nomic-bert" and facts.context_length == 2048
    assert inspect_model(NOMIC).architecture == "nomic_bert"
    original = nomic_layout(tmp_path / "nomic")
    for path in (nomic_gguf, NOMIC, original):
        weights, kv, _ = local_sizes(path)
        assert weights > 0 and kv == 0  # an encoder keeps no keys and values
    with open_gguf(nomic_gguf) as g:
        assert kv_shape_from_gguf(g.metadata).kv_bytes_per_token == 0
    cfg = config_from_hf(original, json.loads((original / "config.json").read_text()))
    assert kv_shape_from_config(cfg).kv_bytes_per_token == 0


def test_nomic_gguf_is_served_as_an_embedding_model(nomic_gguf):
    from engine.server.scheduler import Engine
    from tests.engine.server_harness import LiveServer

    g = golden()
    lm = load_model(nomic_gguf)
    engine = Engine(lm.model, lm.tokenizer, n_ctx=128, max_seqs=4, prefill_chunk=64, prefix_cache_bytes=0)
    engine.start()
    server = LiveServer(engine, lm)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("GET", "/v1/models")
        [entry] = json.loads(conn.getresponse().read())["data"]
        assert entry["capabilities"] == ["embedding"]  # no "completion": it cannot chat
        body = {"model": entry["id"], "input": g["texts"], "encoding_format": "float"}
        conn.request("POST", "/v1/embeddings", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        reply = json.loads(r.read())
        conn.close()
        assert r.status == 200
        vectors = np.array([d["embedding"] for d in reply["data"]])
        assert np.abs(vectors - unit(g["mean"])).max() < TOL
        assert reply["usage"]["prompt_tokens"] == sum(map(len, g["ids"]))
    finally:
        server.close()
        engine.stop()
