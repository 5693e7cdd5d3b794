"""DeepSeek-V2/V3 family (llama.cpp's `deepseek2`): multi-head latent attention (MLA) and DeepSeek's mixture
of experts. DeepSeek-V2(-Lite), DeepSeek-V3-architecture models (Moonlight) and GLM-4.7-Flash (transformers'
glm4_moe_lite) are this family.

Attention. Queries come from q_proj, or from a low-rank pair q_a_proj -> RMSNorm -> q_b_proj ("q LoRA"), as
heads of qk_nope_head_dim unrotated then qk_rope_head_dim rotated dims. kv_a_proj_with_mqa gives each token
a latent c (kv_lora_rank, RMS-normed) and one rotated key part k_pe shared by all heads; kv_b_proj turns c
into each head's unrotated key (W_k[h] c) and value (W_v[h] c). The cache keeps only [c, k_pe] per token
(engine.kv_cache.LatentKVCache, as llama.cpp's MLA does): a head's score q_nope . W_k[h] c + q_pe . k_pe is
(W_k[h]^T q_nope) . c + q_pe . k_pe, so the queries are moved into the latent space ("absorbed") and every
head attends over the cached rows as over one key-value head whose values are the rows themselves; its
output's latent part times W_v[h] is the head's value sum. Scores are scaled by 1/sqrt(qk_nope + qk_rope)
times, with YaRN, DeepSeek's mscale(factor, mscale_all_dim) squared; the rotated dims carry YaRN's own
attention factor. RoPE turns adjacent pairs (DeepSeek's interleaved layout; a V3 config may ask for the
half-split one with rope_interleave false).

Experts (engine/arch/moe.py): the first first_k_dense_replace layers keep a dense FFN; the others route
n_routed_experts by softmax (V2) or by sigmoid scores plus e_score_correction_bias (V3, GLM-4.7-Flash;
topk_method noaux_tc), optionally among the best topk_group of n_group groups, renormalized when
norm_topk_prob, times routed_scaling_factor, beside n_shared_experts ungated shared experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from engine.arch import register
from engine.arch.base import Scratch, gguf_key
from engine.arch.llama import LlamaConfig, LlamaLayer, LlamaModel
from engine.arch.moe import load_moe
from engine.backends import cpu as ops
from engine.errors import UnsupportedArchitectureError
from engine.kv_cache import KVCache, LatentKVCache
from engine.rope import (
    RopeScaling,
    rope_attention_factor,
    rope_inv_freq,
    rope_scaling_from_gguf,
    yarn_mscale,
)
from engine.weights import Weight

F32, F16, BF16 = 0, 1, 30  # ggml type ids


@dataclass
class DeepSeek2Config(LlamaConfig):
    """LlamaConfig plus the MLA sizes, named as in config.json. The inherited head_dim is the cache row (
    kv_lora_rank + qk_rope_head_dim) and num_key_value_heads 1: the absorbed attention's shape."""

    q_lora_rank: int = 0  # 0: a plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # YaRN's mscale_all_dim: the softmax scale is multiplied by mscale(factor, mscale_all_dim) squared (0: no)
    mscale_all_dim: float = 0.0
    # derived: a head's query/key width (qk_nope_head_dim + qk_rope_head_dim)
    qk_head_dim: int = field(init=False)

    def __post_init__(self):
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.rotary_dim = self.qk_rope_head_dim
        self.num_key_value_heads = 1
        super().__post_init__()
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla(self) -> bool:
        return True

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> DeepSeek2Config:
        """llama.cpp's deepseek2 keys: MLA sizes (attention.q_lora_rank, kv_lora_rank, key_length_mla,
        value_length_mla, rope.dimension_count; files from before the _mla keys give the per-head sizes in
        key_length / value_length), the MoE keys of llama.cpp's graph, YaRN's mscale_all_dim as
        rope.scaling.yarn_log_multiplier / 0.1."""
        key = gguf_key(metadata)
        rope = int(key("rope.dimension_count"))
        r = int(key("attention.kv_lora_rank"))
        k_len = int(key("attention.key_length_mla", 0) or key("attention.key_length"))
        v_len = int(key("attention.value_length_mla", 0) or key("attention.value_length"))
        scaling = rope_scaling_from_gguf(metadata, "deepseek2")
        log_mul = float(key("rope.scaling.yarn_log_multiplier", 0.0))
        if scaling.kind == "yarn":
            # llama.cpp cancels YaRN's factor on cos and sin (mscale = mscale_all_dim in DeepSeek's configs);
            # Hearth's converter writes the factor as attn_factor
            factor = 1.0 if scaling.attention_factor is None else scaling.attention_factor
            scaling = RopeScaling(
                "yarn", scaling.factor, original_max_position=scaling.original_max_position,
                beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, attention_factor=factor,
            )
        elif scaling.kind != "none":
            raise UnsupportedArchitectureError(
                f"deepseek2 with RoPE scaling {scaling.kind!r} is not supported (none or yarn are)"
            )
        n_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
        experts = int(key("expert_count", 0))
        expert_ff = int(key("expert_feed_forward_length", 0))
        return cls(
            hidden_size=int(key("embedding_length")),
            intermediate_size=expert_ff if experts else int(key("feed_forward_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(key("attention.head_count")),
            num_key_value_heads=1,
            vocab_size=vocab_size,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            rope_scaling=scaling,
            architecture="deepseek2",
            num_experts=experts,
            num_experts_per_tok=int(key("expert_used_count")) if experts else 0,
            norm_topk_prob=bool(key("expert_weights_norm", False)),
            shared_expert_intermediate_size=expert_ff * int(key("expert_shared_count", 0)) if experts else 0,
            # llama.cpp's expert_gating_func: 1 softmax (the default of V2 files without the key), 2 sigmoid
            expert_gating="sigmoid" if int(key("expert_gating_func", 1)) == 2 else "softmax",
            expert_weights_scale=float(key("expert_weights_scale", 1.0)),
            expert_groups=int(key("expert_group_count", 1)),
            expert_groups_used=int(key("expert_group_used_count", 0)),
            first_dense_layers=int(key("leading_dense_block_count", 0)) if experts else 0,
            dense_intermediate_size=int(key("feed_forward_length", 0)) if experts else 0,
            q_lora_rank=int(key("attention.q_lora_rank", 0)),
            kv_lora_rank=r,
            qk_nope_head_dim=k_len - rope,
            qk_rope_head_dim=rope,
            v_head_dim=v_len,
            mscale_all_dim=log_mul / 0.1 if scaling.kind == "yarn" else 0.0,
        )

    @classmethod
    def from_hf(cls, config: dict, rope_theta: float, scaling: RopeScaling) -> DeepSeek2Config:
        """A deepseek_v2, deepseek_v3 or glm4_moe_lite config.json (rope_theta and scaling as
        hf_repo._rope_scaling reads them)."""
        model_type = config.get("model_type")
        n = int(config["num_hidden_layers"])
        experts = int(config.get("n_routed_experts") or 0)
        dense = int(config.get("first_k_dense_replace") or 0)
        kinds = config.get("mlp_layer_types")  # GLM-4.7-Flash: "dense" then "sparse" layers
        if kinds is not None:
            dense = next((j for j, kind in enumerate(kinds) if kind != "dense"), len(kinds))
            if list(kinds) != ["dense"] * dense + ["sparse"] * (n - dense):
                raise UnsupportedArchitectureError(
                    f"mlp_layer_types {kinds} are not supported (dense layers must come first)"
                )
        if int(config.get("moe_layer_freq") or 1) != 1:
            raise UnsupportedArchitectureError(
                f"{model_type} with moe_layer_freq {config['moe_layer_freq']} (dense layers between the "
                "sparse ones) is not supported yet"
            )
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise UnsupportedArchitectureError(
                f"{model_type} models with linear biases (attention_bias, mlp_bias) are not supported yet"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"{model_type} with activation {config['hidden_act']!r}")
        sigmoid = model_type != "deepseek_v2" or config.get("scoring_func") == "sigmoid"
        method = config.get("topk_method") or ("noaux_tc" if sigmoid else "greedy")
        groups = int(config.get("n_group") or 1)
        used = int(config.get("topk_group") or 0)
        if method == "greedy":
            groups, used = 1, 0
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise UnsupportedArchitectureError(f"{model_type} expert routing {method!r} is not supported")
        moe_ff = int(config.get("moe_intermediate_size") or 0)
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        all_dim = float(params.get("mscale_all_dim") or 0.0) if scaling.kind == "yarn" else 0.0
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=moe_ff if experts else int(config["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=1,
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            # DeepSeek turns adjacent pairs; V3 and GLM configs may ask for the half-split layout
            rope_neox=not bool(config.get("rope_interleave", True)),
            rope_scaling=scaling,
            architecture="deepseek2",
            num_experts=experts,
            num_experts_per_tok=int(config["num_experts_per_tok"]) if experts else 0,
            norm_topk_prob=bool(config.get("norm_topk_prob", model_type != "deepseek_v2")),
            shared_expert_intermediate_size=moe_ff * int(config.get("n_shared_experts") or 0),
            expert_gating="sigmoid" if sigmoid else "softmax",
            expert_weights_scale=float(config.get("routed_scaling_factor") or 1.0),
            expert_groups=groups,
            expert_groups_used=used,
            first_dense_layers=dense if experts else 0,
            dense_intermediate_size=int(config["intermediate_size"]) if experts else 0,
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            mscale_all_dim=all_dim,
        )


@dataclass
class MLA:
    """A layer's latent attention weights (GGUF names in comments)."""

    wq: Weight | None  # attn_q (heads * qk_head_dim, hidden); None with a q LoRA
    wq_a: Weight | None  # attn_q_a (q_lora_rank, hidden)
    q_a_norm: np.ndarray | None  # attn_q_a_norm (q_lora_rank,)
    wq_b: Weight | None  # attn_q_b (heads * qk_head_dim, q_lora_rank)
    wkv_a: Weight  # attn_kv_a_mqa (kv_lora_rank + qk_rope_head_dim, hidden)
    kv_a_norm: np.ndarray  # attn_kv_a_norm (kv_lora_rank,)
    k_b: Weight  # attn_k_b: per head W_k[h]^T, (heads * kv_lora_rank, qk_nope_head_dim)
    v_b: Weight  # attn_v_b, or attn_kv_b whose value rows v_starts[h].. are head h's W_v[h] (v_head_dim, r)
    v_starts: np.ndarray  # (heads,) int64

    def weights(self) -> list[Weight]:
        return [w for w in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.k_b, self.v_b) if w is not None]


@dataclass
class MLALayer(LlamaLayer):
    """A LlamaLayer (norms, FFN or experts, wo) whose attention is `mla` (wq, wk, wv stay None)."""

    mla: MLA | None = None


def _transposed_heads(w: Weight, heads: int, first: int, rows: int, per_head: int) -> Weight:
    """Rows first..first+rows of each head's per_head-row block of w, transposed per head: a
    (heads * w.cols, rows) weight (llama.cpp's attn_k_b from kv_b_proj). Float types keep their type; a
    quantized legacy attn_kv_b is dequantized to float32 (its key rows only)."""
    if w.ggml_type in (F32, F16, BF16):  # the stored elements, moved (F16 and BF16 as their 16 bits)
        values = w.raw.view(np.float32 if w.ggml_type == F32 else np.uint16).reshape(heads, per_head, w.cols)
        ggml_type = w.ggml_type
    else:
        values = np.empty((w.rows, w.cols), np.float32)
        ops.get_rows(values, w, np.arange(w.rows))
        values, ggml_type = values.reshape(heads, per_head, w.cols), F32
    t = np.ascontiguousarray(values[:, first : first + rows, :].transpose(0, 2, 1))
    return Weight(ggml_type, t.reshape(heads * w.cols, rows).view(np.uint8), heads * w.cols, rows)


def load_mla(weights, p: str, cfg: DeepSeek2Config) -> MLA:
    """Layer prefix p's MLA weights: llama.cpp's split attn_k_b / attn_v_b, or one attn_kv_b (HF's
    kv_b_proj; llama.cpp's files from before the split), its key rows transposed per head here."""
    d, heads, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_rows = heads * (nope + rope)
    lora = cfg.q_lora_rank
    if weights.has(p + "attn_k_b.weight"):
        k_b = weights.expert_stack(p + "attn_k_b.weight", heads, r, nope)
        v_b = weights.expert_stack(p + "attn_v_b.weight", heads, v, r)
        v_starts = np.arange(heads, dtype=np.int64) * v
    else:
        kv_b = weights.matrix(p + "attn_kv_b.weight", heads * (nope + v), r)
        k_b = _transposed_heads(kv_b, heads, 0, nope, nope + v)
        v_b, v_starts = kv_b, np.arange(heads, dtype=np.int64) * (nope + v) + nope
    return MLA(
        wq=None if lora else weights.matrix(p + "attn_q.weight", q_rows, d),
        wq_a=weights.matrix(p + "attn_q_a.weight", lora, d) if lora else None,
        q_a_norm=weights.vector(p + "attn_q_a_norm.weight", lora) if lora else None,
        wq_b=weights.matrix(p + "attn_q_b.weight", q_rows, lora) if lora else None,
        wkv_a=weights.matrix(p + "attn_kv_a_mqa.weight", r + rope, d),
        kv_a_norm=weights.vector(p + "attn_kv_a_norm.weight", r),
        k_b=k_b,
        v_b=v_b,
        v_starts=v_starts,
    )


class MLABuffers:
    """Activation buffers of the latent attention for n rows, allocated once per scratch (the decode step's
    are reused; see Scratch)."""

    def __init__(self, cfg: DeepSeek2Config, n: int):
        f32, heads, r = np.float32, cfg.num_attention_heads, cfg.kv_lora_rank
        self.q = np.empty((n, heads * cfg.qk_head_dim), f32)
        self.qa = np.empty((n, cfg.q_lora_rank), f32)
        self.latent = np.empty((n, r), f32)
        self.q_pe = np.empty((n, heads, cfg.qk_rope_head_dim), f32)
        self.k_pe = np.empty((n, 1, cfg.qk_rope_head_dim), f32)
        self.q_nope = np.empty((n, heads, cfg.qk_nope_head_dim), f32)
        self.q_lat = np.empty((n, heads, r), f32)
        self.o_lat = np.empty((n, heads, r), f32)
        self.values = np.empty((n, heads, cfg.v_head_dim), f32)
        self.k_starts = np.arange(heads, dtype=np.int64) * r  # head h's rows of attn_k_b


def _per_head(out: np.ndarray, w: Weight, x: np.ndarray, starts: np.ndarray, rows: int) -> None:
    """out (n, heads, rows) = per head h the rows starts[h].. of w @ x[:, h] (x (n, heads, w.cols)): one
    gathered pass for one token over a block-quantized w, a linear per head otherwise."""
    n, heads, _ = x.shape
    if n == 1 and ops.gathers_experts(w):
        ops.linear_experts(out[0], w, np.ascontiguousarray(x[0]), starts, rows)
        return
    y = np.empty((n, rows), np.float32)
    for h in range(heads):
        ops.linear(y, w.row_block(int(starts[h]), int(starts[h]) + rows), np.ascontiguousarray(x[:, h]))
        out[:, h] = y


def _kv_b_float(m: MLA, heads: int, r: int, nope: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj's key and value halves dequantized to float32, as right operands of the latent rows:
    W_k[h]^T (heads, r, nope) and W_v[h]^T (heads, r, v). Made per pass rather than kept, so the weights stay
    the file's pages: 3 ms a layer on V2-Lite's sizes (Q5_0 / Q4_K, 1 thread) beside the ~150 ms of the
    layer's attention over a 512-token pass."""
    w_k = np.empty((heads * r, nope), np.float32)
    ops.get_rows(w_k, m.k_b, np.arange(heads * r))
    w_v = np.empty((heads * v, r), np.float32)
    ops.get_rows(w_v, m.v_b, (m.v_starts[:, None] + np.arange(v)).reshape(-1))
    return w_k.reshape(heads, r, nope), w_v.reshape(heads, v, r).transpose(0, 2, 1)


@register("deepseek2")
class DeepSeek2Model(LlamaModel):
    """DeepSeek-V2/V3 and GLM-4.7-Flash: LlamaModel's layer loop (norms, residuals, the MoE FFN, batched
    decode, chunked prefill) with latent attention in place of its attention branch."""

    config_class = DeepSeek2Config
    mla = True
    # Single-sequence passes of at least this many tokens (prefill chunks) attend decompressed
    # (_decompressed); shorter ones (decode, speculative verify passes, short prompts) and batched decode
    # absorbed. One layer's attention branch (projections included) of a DeepSeek-V2-Lite-shaped Q4_K_M
    # model, 1 thread, absorbed / decompressed time, median of 5 alternated runs
    # (scripts/bench_mla_attention.py), for n tokens after P cached ones: n 512: 1.52 (P 0), 1.38 (512),
    # 1.24 (2048), 1.39 (4096); n 256: 1.12, 1.12, 1.14, 1.11; n 128: 0.88, 0.94, 0.80, 0.77; n 64: 0.98,
    # 0.56, 0.61, 0.46. Decompressing costs every cached row heads x (nope + v) x r multiply-adds a pass,
    # so short passes over a long cache lose.
    decompress_min_tokens = 256

    def __init__(self, cfg: DeepSeek2Config, weights):
        """Args: cfg; weights: a weight source (has/matrix/vector/experts; expert_stack for split k_b/v_b)."""
        self.cfg = cfg
        d = cfg.hidden_size
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        self.output_norm = weights.vector("output_norm.weight", d)
        has_output = weights.has("output.weight")
        self.output = weights.matrix("output.weight", cfg.vocab_size, d) if has_output else self.token_embd
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"blk.{i}."
            moe = None
            if cfg.has_experts(i):
                ff = cfg.intermediate_size
                moe = load_moe(weights, p, cfg.num_experts, ff, d, cfg.shared_expert_intermediate_size)
            ff = cfg.dense_intermediate_size or cfg.intermediate_size
            dense = moe is None
            self.layers.append(MLALayer(
                attn_norm=weights.vector(p + "attn_norm.weight", d),
                wq=None, wk=None, wv=None,
                wo=weights.matrix(p + "attn_output.weight", d, cfg.num_attention_heads * cfg.v_head_dim),
                ffn_norm=weights.vector(p + "ffn_norm.weight", d),
                w_gate=weights.matrix(p + "ffn_gate.weight", ff, d) if dense else None,
                w_up=weights.matrix(p + "ffn_up.weight", ff, d) if dense else None,
                w_down=weights.matrix(p + "ffn_down.weight", d, ff) if dense else None,
                moe=moe,
                mla=load_mla(weights, p, cfg),
            ))
        self.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._long_freq = None
        self._plain_rope = None
        # YaRN's factor on cos and sin scales the rotated dims (rope_mscale); DeepSeek's mscale_all_dim the
        # softmax
        self.rope_mscale = np.float32(rope_attention_factor(cfg.rope_scaling))
        all_dim = yarn_mscale(cfg.rope_scaling.factor, cfg.mscale_all_dim) if cfg.mscale_all_dim else 1.0
        self.scale = np.float32(all_dim * all_dim / np.sqrt(cfg.qk_head_dim))
        self._decode = Scratch(cfg, 1)
        self._logits = np.empty((1, cfg.vocab_size), np.float32)
        self._pass = None  # (cache, first layer) of a single-sequence pass (_run), for _decompressed

    @functools.cached_property
    def small_batch_max(self) -> int:
        weights = [w for layer in self.layers for w in layer.mla.weights()]
        weights += [w for layer in self.layers for w in vars(layer).values() if isinstance(w, Weight)]
        for layer in self.layers:
            weights += layer.moe.weights() if layer.moe is not None else []
        return ops.small_batch_limit(weights)

    def new_cache(self, n_ctx: int, dtype=np.float32) -> KVCache:
        """A latent cache for n_ctx positions: kv_lora_rank + qk_rope_head_dim values per layer and token."""
        return LatentKVCache(self.cfg.num_hidden_layers, self.cfg.head_dim, n_ctx, dtype)

    def _buffers(self, s: Scratch) -> MLABuffers:
        """The latent attention's buffers for s's rows, kept on s (decode steps reuse theirs)."""
        if getattr(s, "mla", None) is None:
            s.mla = MLABuffers(self.cfg, len(s.h))
        return s.mla

    def _run(self, tokens: np.ndarray, cache: KVCache, first: int = 0, hidden=None) -> Scratch:
        """LlamaModel._run, with the pass's cache at hand for the decompressed attention of long passes."""
        self._pass = (cache, first) if len(tokens) >= self.decompress_min_tokens else None
        try:
            return super()._run(tokens, cache, first, hidden)
        finally:
            self._pass = None

    def _attention(self, s: Scratch, i: int, layer: MLALayer, attend, inv_freq) -> None:
        """Layer i's latent attention: s.h, the normed input, -> s.o (see the module docstring)."""
        cfg, m, capture, b = self.cfg, layer.mla, self.capture, self._buffers(s)
        n, heads = len(s.h), cfg.num_attention_heads
        r, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if capture is not None:
            capture(i, "attn_q", s.h)
        if m.wq_a is not None:  # the q LoRA: down, RMSNorm, up
            ops.linear(b.qa, m.wq_a, s.h)
            ops.rmsnorm(b.qa, b.qa, m.q_a_norm, cfg.rms_norm_eps)
            ops.linear(b.q, m.wq_b, b.qa)
        else:
            ops.linear(b.q, m.wq, s.h)
        q3 = b.q.reshape(n, heads, nope + rope)
        kv = s.k  # (n, r + rope): the latent, then the shared rotated key part
        ops.linear(kv, m.wkv_a, s.h)
        b.latent[:] = kv[:, :r]
        ops.rmsnorm(b.latent, b.latent, m.kv_a_norm, cfg.rms_norm_eps)
        b.q_pe[:] = q3[:, :, nope:]
        b.k_pe[:, 0] = kv[:, r:]
        ops.rope(b.q_pe, s.positions, inv_freq, rope, cfg.rope_neox)
        ops.rope(b.k_pe, s.positions, inv_freq, rope, cfg.rope_neox)
        if self.rope_mscale != 1:
            b.q_pe *= self.rope_mscale
            b.k_pe *= self.rope_mscale
        kv[:, :r] = b.latent  # the rows the cache keeps
        kv[:, r:] = b.k_pe[:, 0]
        if self._pass is not None:
            self._decompressed(i, m, q3, b, kv)
        else:
            self._absorbed(i, m, q3, b, kv, s, attend)
        values = b.values.reshape(n, heads * v)
        if capture is not None:
            capture(i, "attn_output", values)
        ops.linear(s.o, layer.wo, values)

    def _absorbed(self, i: int, m: MLA, q3: np.ndarray, b: MLABuffers, kv: np.ndarray, s: Scratch,
                  attend) -> None:
        """Attention over the latent rows as one key-value head: q3 (n, heads, nope + rope) with b.q_pe
        rotated, kv (n, r + rope) the pass's latent rows -> b.values (n, heads, v_head_dim)."""
        cfg = self.cfg
        n, heads = len(kv), cfg.num_attention_heads
        r, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        # the absorbed queries (n, heads, r + rope): W_k[h]^T q_nope, then q_pe
        b.q_nope[:] = q3[:, :, :nope]
        _per_head(b.q_lat, m.k_b, b.q_nope, b.k_starts, r)
        qa3 = s.q.reshape(n, heads, r + rope)
        qa3[:, :, :r] = b.q_lat
        qa3[:, :, r:] = b.q_pe
        rows = kv.reshape(n, 1, r + rope)
        out3 = s.attn.reshape(n, heads, r + rope)
        attend(i, out3, qa3, rows, rows)
        b.o_lat[:] = out3[:, :, :r]
        _per_head(b.values, m.v_b, b.o_lat, m.v_starts, v)

    def _decompressed(self, i: int, m: MLA, q3: np.ndarray, b: MLABuffers, kv: np.ndarray) -> None:
        """Ordinary attention with per-head keys and values decompressed from the latent rows (the pass's,
        stored first, and the cached ones before them): q3 (n, heads, nope + rope) with b.q_pe rotated,
        kv (n, r + rope) -> b.values (n, heads, v_head_dim).

        kv_b_proj turns each of the ctx rows into heads x (nope + v) numbers once per pass, where the
        absorbed form has every (query, key) pair of a head go through r + rope key and r value dims instead
        of nope + rope and v: on a long pass (prefill) this is the cheaper one (decompress_min_tokens)."""
        cfg = self.cfg
        n, heads = len(kv), cfg.num_attention_heads
        r, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        cache, first = self._pass
        pos0 = cache.offset
        rows, _ = cache.update_and_fetch(cfg.cache_slot(i, first), kv.reshape(n, 1, r + rope))
        ctx = rows[0, : pos0 + n]  # (ctx, r + rope) as the cache holds them (float16 widened below)
        latent = np.ascontiguousarray(ctx[:, :r], np.float32)
        w_k, w_v = _kv_b_float(m, heads, r, nope, v)
        queries = np.empty((n, heads, nope + rope), np.float32)
        queries[:, :, :nope] = q3[:, :, :nope]
        queries[:, :, nope:] = b.q_pe
        # one head at a time: only its keys and values (ctx rows each) are alive, no larger than a block of
        # the absorbed form's scores (every head decompressed at once: 1.3 GiB at 32k tokens on V2-Lite)
        keys = np.empty((1, pos0 + n, nope + rope), np.float32)
        keys[0, :, nope:] = ctx[:, r:]  # the rotated part every head shares
        for h in range(heads):
            np.matmul(latent, w_k[h], out=keys[0, :, :nope])
            values = np.matmul(latent, w_v[h])[None]  # (1, ctx, v)
            ops.attention(b.values[:, h : h + 1], queries[:, h : h + 1], keys, values, pos0, self.scale)
