"""A randomly initialised Qwen3-Next folder (Qwen3-Next-80B-A3B's layer shapes, fewer layers and experts) for
`hearth bench`.

    .venv/bin/python scripts/bench_qwen3next.py OUT_DIR [--layers 8] [--experts 32] [--quant Q4_K_M]
    .venv/bin/hearth bench -m OUT_DIR/qwen3next-Q4_K_M.gguf -t 2 -p 512 -g 128

Writes OUT_DIR/folder (config.json, F16 safetensors one shard a layer, the tiny test checkpoint's tokenizer)
with the 80B-A3B's hidden size 2048, vocabulary 151936, DeltaNet of 16 key and 32 value heads of 128 in three
layers of four, gated attention of 16 query and 2 KV heads of 256 (a quarter rotated), 10 routed experts of
512 a token beside a gated shared expert of 512, then converts it with `hearth convert`'s code (llama.cpp's
qwen3next layout) to OUT_DIR/qwen3next-<quant>.gguf. `--layers` (48 in the real model) and `--experts` (512)
scale it down to fit a small machine; what a token reads per layer is the real model's either way.
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

TINY = ROOT / "tests" / "fixtures" / "tiny" / "qwen3_next"
SHAPE = dict(
    vocab_size=151936, hidden_size=2048, head_dim=256, num_attention_heads=16, num_key_value_heads=2,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_conv_kernel_dim=4, intermediate_size=5120, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts_per_tok=10, max_position_embeddings=262144,
    full_attention_interval=4, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_theta=10000000.0, partial_rotary_factor=0.25,
)


def layer_tensors(rng: np.random.Generator, i: int, c: dict) -> dict[str, np.ndarray]:
    """Layer i's HF tensors (F16): random matrices of std 0.02, norms around 1 (stored as 1 + w)."""
    d, p = c["hidden_size"], f"model.layers.{i}."

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)

    out = {p + "input_layernorm.weight": w(d), p + "post_attention_layernorm.weight": w(d)}
    if (i + 1) % c["full_attention_interval"]:
        kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
        v_heads = c["linear_num_value_heads"]
        a = p + "linear_attn."
        out |= {
            a + "in_proj_qkvz.weight": w(2 * kd + 2 * vd, d), a + "in_proj_ba.weight": w(2 * v_heads, d),
            a + "conv1d.weight": w(2 * kd + vd, 1, c["linear_conv_kernel_dim"]) * np.float16(10),
            a + "dt_bias": np.ones(v_heads, np.float16),
            a + "A_log": np.log(rng.uniform(1, 16, v_heads)).astype(np.float16),
            a + "norm.weight": np.ones(c["linear_value_head_dim"], np.float16),
            a + "out_proj.weight": w(d, vd),
        }
    else:
        q, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        a = p + "self_attn."
        out |= {
            a + "q_proj.weight": w(2 * q * hd, d), a + "k_proj.weight": w(kv * hd, d),
            a + "v_proj.weight": w(kv * hd, d), a + "o_proj.weight": w(d, q * hd),
            a + "q_norm.weight": w(hd), a + "k_norm.weight": w(hd),
        }
    ff, shared = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    m = p + "mlp."
    out |= {m + "gate.weight": w(c["num_experts"], d), m + "shared_expert_gate.weight": w(1, d)}
    out |= {m + f"shared_expert.{k}_proj.weight": w(shared, d) for k in ("gate", "up")}
    out[m + "shared_expert.down_proj.weight"] = w(d, shared)
    for e in range(c["num_experts"]):
        out |= {m + f"experts.{e}.{k}_proj.weight": w(ff, d) for k in ("gate", "up")}
        out[m + f"experts.{e}.down_proj.weight"] = w(d, ff)
    return out


def write_folder(folder: Path, layers: int, experts: int, seed: int = 0) -> None:
    """The random F16 folder (see the module docstring), one safetensors shard a layer."""
    rng = np.random.default_rng(seed)
    c = dict(SHAPE, num_hidden_layers=layers, num_experts=experts, model_type="qwen3_next",
             architectures=["Qwen3NextForCausalLM"], bos_token_id=1, eos_token_id=2)
    shards = ShardedFolder(folder, c, TINY)
    d, vocab = c["hidden_size"], c["vocab_size"]

    for i in range(layers):
        shards.write(f"model-{i:05d}.safetensors", layer_tensors(rng, i, c))
    embed = {k: (rng.standard_normal((vocab, d), np.float32) * 0.02).astype(np.float16)
             for k in ("model.embed_tokens.weight", "lm_head.weight")}
    shards.write("model-globals.safetensors", embed | {"model.norm.weight": np.zeros(d, np.float16)})
    shards.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--quant", default="Q4_K_M")
    args = parser.parse_args()
    write_folder(args.out / "folder", args.layers, args.experts)
    out = convert(args.out / "folder", args.quant, args.out / f"qwen3next-{args.quant}.gguf", overwrite=True)
    print(out.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
