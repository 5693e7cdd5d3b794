"""Write a random DeepSeek-V2-Lite-shaped Hugging Face folder, fewer layers deep, for benchmarks.

    .venv/bin/python scripts/make_random_deepseek2.py OUT_FOLDER [--layers 4] [--seed 0]
    .venv/bin/hearth convert OUT_FOLDER --to Q4_K_M -o model.gguf
    .venv/bin/hearth bench -m model.gguf --threads 2 --json

DeepSeek-V2-Lite's layer shape (config.json of deepseek-ai/DeepSeek-V2-Lite-Chat): hidden 2048, 16 heads,
no q LoRA, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, YaRN (factor 40, mscale 0.707), a dense first
layer of 10944, then 64 routed experts of 1408 (6 a token, softmax) beside 2 shared ones, vocabulary 102400.
Weights are BF16 normal(0, 0.02) (norms 1), written one layer a shard; the tokenizer is the tiny test
checkpoint's (its 320 tokens address the first rows of the larger embedding).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny" / "deepseek_v2"

CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": False, "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "vocab_size": 102400, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def _bf16(rng: np.random.Generator, *shape: int, ones: bool = False) -> np.ndarray:
    """BF16 bits (uint16 viewed as the safetensors writer wants them) of normal(0, 0.02), or of ones."""
    x = np.ones(shape, np.float32) if ones else rng.standard_normal(shape, np.float32) * np.float32(0.02)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def _save(tensors: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file of BF16 tensors given as their uint16 bits (numpy has no bfloat16)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little") + text)
        for t in tensors.values():
            fh.write(np.ascontiguousarray(t).tobytes())


def write(out: Path, layers: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    c = dict(CONFIG, num_hidden_layers=layers)
    d, heads, r = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    out.mkdir(parents=True, exist_ok=True)
    vocab = c["vocab_size"]
    shards = [{"model.embed_tokens.weight": _bf16(rng, vocab, d), "lm_head.weight": _bf16(rng, vocab, d),
               "model.norm.weight": _bf16(rng, d, ones=True)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {
            p + "input_layernorm.weight": _bf16(rng, d, ones=True),
            p + "post_attention_layernorm.weight": _bf16(rng, d, ones=True),
            p + "self_attn.q_proj.weight": _bf16(rng, heads * (nope + rope), d),
            p + "self_attn.kv_a_proj_with_mqa.weight": _bf16(rng, r + rope, d),
            p + "self_attn.kv_a_layernorm.weight": _bf16(rng, r, ones=True),
            p + "self_attn.kv_b_proj.weight": _bf16(rng, heads * (nope + v), r),
            p + "self_attn.o_proj.weight": _bf16(rng, d, heads * v),
        }
        if i < c["first_k_dense_replace"]:
            ff = c["intermediate_size"]
            t |= {p + "mlp.gate_proj.weight": _bf16(rng, ff, d), p + "mlp.up_proj.weight": _bf16(rng, ff, d),
                  p + "mlp.down_proj.weight": _bf16(rng, d, ff)}
        else:
            ff, shared = c["moe_intermediate_size"], c["moe_intermediate_size"] * c["n_shared_experts"]
            t[p + "mlp.gate.weight"] = _bf16(rng, c["n_routed_experts"], d)
            for e in range(c["n_routed_experts"]):
                q = f"{p}mlp.experts.{e}."
                t |= {q + "gate_proj.weight": _bf16(rng, ff, d), q + "up_proj.weight": _bf16(rng, ff, d),
                      q + "down_proj.weight": _bf16(rng, d, ff)}
            t |= {p + "mlp.shared_experts.gate_proj.weight": _bf16(rng, shared, d),
                  p + "mlp.shared_experts.up_proj.weight": _bf16(rng, shared, d),
                  p + "mlp.shared_experts.down_proj.weight": _bf16(rng, d, shared)}
        shards.append(t)
    index = {}
    for k, t in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(t, out / name)
        index |= dict.fromkeys(t, name)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(c, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / f, out / f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, args.layers, args.seed)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
