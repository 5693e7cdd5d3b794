"""A randomly initialised Gemma 3n folder (gemma-3n-E2B's language model shapes) for `hearth bench`.

    .venv/bin/python scripts/bench_gemma3n.py OUT_DIR [--layers 30] [--pl-vocab 262144] [--quant Q4_K_M]
    .venv/bin/hearth bench -m OUT_DIR/gemma3n-Q4_K_M.gguf -t 2 -p 512 -g 128

Writes OUT_DIR/folder (config.json, F16 safetensors one shard a layer, the tiny test checkpoint's tokenizer)
with E2B's hidden size 2048, vocabulary 262400, 8 query and 2 KV heads of 256, FFN 8192, four windowed
layers then a global one, the last third of the layers reusing earlier keys and values, the first third
sparsifying their gate activations, 4 AltUp streams, LAuReL of rank 64 and per-layer inputs of 256, then
converts it with `hearth convert`'s code (llama.cpp's gemma3n layout) to OUT_DIR/gemma3n-<quant>.gguf.
`--pl-vocab` (262144 in the real model) shrinks the per-layer embedding table, of which a token reads one
row: the file gets smaller, not what a token computes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from random_folder import ShardedFolder  # noqa: E402 - scripts/random_folder.py

from engine.convert import convert  # noqa: E402

TINY = ROOT / "tests" / "fixtures" / "tiny" / "gemma3n"
SHAPE = dict(
    vocab_size=262400, hidden_size=2048, intermediate_size=8192, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, hidden_size_per_layer_input=256, laurel_rank=64, altup_num_inputs=4, sliding_window=512,
    max_position_embeddings=32768, final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def layer_tensors(rng: np.random.Generator, i: int, c: dict, shared: bool) -> dict[str, np.ndarray]:
    """Layer i's HF tensors (F16): random matrices of std 0.02, norms and scales around 1."""
    d, ff, p = c["hidden_size"], c["intermediate_size"], f"model.layers.{i}."
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    a, r, pl = c["altup_num_inputs"], c["laurel_rank"], c["hidden_size_per_layer_input"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)

    def one(n: int) -> np.ndarray:
        return (1 + rng.standard_normal(n, np.float32) * 0.02).astype(np.float16)

    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "post_per_layer_input_norm", "altup.router_norm",
             "laurel.post_laurel_norm")
    out = {p + name + ".weight": one(d) for name in norms}
    out[p + "altup.correct_output_scale"] = one(d)
    out |= {p + "self_attn.q_proj.weight": w(q, d), p + "self_attn.o_proj.weight": w(d, q),
            p + "self_attn.q_norm.weight": one(hd)}
    if not shared:
        out |= {p + "self_attn.k_proj.weight": w(kv, d), p + "self_attn.v_proj.weight": w(kv, d),
                p + "self_attn.k_norm.weight": one(hd)}
    out |= {p + "mlp.gate_proj.weight": w(ff, d), p + "mlp.up_proj.weight": w(ff, d),
            p + "mlp.down_proj.weight": w(d, ff)}
    out |= {p + "altup.correction_coefs.weight": w(a, a), p + "altup.prediction_coefs.weight": w(a * a, a),
            p + "altup.modality_router.weight": w(a, d)}
    out |= {p + "laurel.linear_left.weight": w(r, d), p + "laurel.linear_right.weight": w(d, r)}
    out |= {p + "per_layer_input_gate.weight": w(pl, d), p + "per_layer_projection.weight": w(d, pl)}
    return out


def write_folder(folder: Path, layers: int, pl_vocab: int, seed: int = 0) -> None:
    """The random F16 folder (see the module docstring), one safetensors shard a layer."""
    rng = np.random.default_rng(seed)
    shared, sparse = layers // 3, layers // 3
    c = dict(SHAPE, num_hidden_layers=layers, num_kv_shared_layers=shared,
             vocab_size_per_layer_input=pl_vocab,
             activation_sparsity_pattern=[0.95] * sparse + [0.0] * (layers - sparse),
             layer_types=[("sliding_attention", "full_attention")[(i + 1) % 5 == 0] for i in range(layers)],
             model_type="gemma3n_text", architectures=["Gemma3nForCausalLM"], bos_token_id=2,
             eos_token_id=1)
    shards = ShardedFolder(folder, c, TINY)
    d, n_pl = c["hidden_size"], layers * c["hidden_size_per_layer_input"]

    for i in range(layers):
        shards.write(f"model-{i:05d}.safetensors", layer_tensors(rng, i, c, i >= layers - shared))

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)

    globals_ = {"model.embed_tokens.weight": w(c["vocab_size"], d),
                "model.norm.weight": np.ones(d, np.float16),
                "model.embed_tokens_per_layer.weight": w(pl_vocab, n_pl),
                "model.per_layer_model_projection.weight": w(n_pl, d),
                "model.per_layer_projection_norm.weight": np.ones(n_pl // layers, np.float16)}
    for k in range(c["altup_num_inputs"] - 1):
        globals_ |= {f"model.altup_projections.{k}.weight": w(d, d),
                     f"model.altup_unembed_projections.{k}.weight": w(d, d)}
    shards.write("model-globals.safetensors", globals_)
    shards.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--pl-vocab", type=int, default=262144)
    parser.add_argument("--quant", default="Q4_K_M")
    args = parser.parse_args()
    write_folder(args.out / "folder", args.layers, args.pl_vocab)
    out = convert(args.out / "folder", args.quant, args.out / f"gemma3n-{args.quant}.gguf", overwrite=True)
    print(out.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
